# Multi-node DeepSpeed training of one run on its per-node shards.


rule train:
    input:
        unpack(train_extras),
        script=f"{SCRIPTS}/train.py",
        shard_manifest=run_shards,
        model=run_model,
        deepspeed=run_deepspeed,
    output:
        checkpoint=directory("results/{run}/train/final_checkpoint"),
        model=directory("results/{run}/train/model"),
        metrics="results/{run}/train/metrics.jsonl",
        config="results/{run}/train/run_config.json",
        provenance="results/{run}/train/provenance.json",
        probe="results/{run}/train/probe.safetensors",
    log:
        "logs/train/{run}.log",
    benchmark:
        "benchmarks/train/{run}.tsv"
    # A failed or killed job resumes from its newest complete checkpoint when retried: twice,
    # by the submitting Snakemake only (TRAIN_RETRIES, common.smk).
    retries: TRAIN_RETRIES
    conda:
        "../../envs/snaketune.yaml"
    threads: train_threads
    # nodes x gpus_per_node from the run; tasks_per_gpu=0 keeps the plugin from adding
    # --ntasks-per-gpu (a job that asks for it never starts). Partition, account and memory
    # come from the profile.
    resources:
        mem_mb=16000,
        runtime=1440,
        nodes=train_nodes,
        tasks=train_nodes,
        mpi=train_mpi,
        gres=train_gres,
        tasks_per_gpu=0,
    params:
        spec=run_spec,
        shards=shards_folder,
        out="results/{run}/train",
        margin=config["stop_margin_seconds"],
        flags=train_flags,
        stage_inputs=stage_inputs,
    # Every attempt (a retry, a requeue, the next invocation) also keeps its whole log in
    # results/{run}/train/logs/attempt-<n>.log; fd 3 (the job's own stderr) gets one line
    # naming it.
    # Ahead of the time limit (runtime; on SLURM the job's end time) the job saves and
    # continues: on SLURM it requeues itself (docs/slurm.md), locally it trains on.
    shell:
        "python {input.script} --run-spec {params.spec:q} --shards {params.shards}"
        " --model {input.model} --deepspeed {input.deepspeed} --out {params.out}"
        " --time-limit {resources.runtime} --stop-margin {params.margin} {params.flags}"
        " {params.stage_inputs}"
        " --announce-fd 3 3>&2 > {log} 2>&1"
