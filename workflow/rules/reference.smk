# The reference model's log-probs of every training pair of a DPO run, computed once per
# (reference model, tokenized pairs) and read by every run and sweep member that shares them.


rule reference_logps:
    input:
        unpack(reference_inputs),
        script=f"{SCRIPTS}/reference_logps.py",
    output:
        logps="results/reference_logps/{ref}/logps.parquet",
    log:
        "logs/reference_logps/{ref}.log",
    benchmark:
        "benchmarks/reference_logps/{ref}.tsv"
    conda:
        "../../envs/snaketune.yaml"
    threads: reference_threads
    # On the GPUs of the run it serves (data parallel: one worker per GPU, on each of its
    # nodes); a rerun after a kill computes only the chunks not written yet. The layout and
    # batch are resources, not params: they change how fast, not what (the output's key), so
    # a run continued on another node count reuses the log-probs.
    resources:
        mem_mb=16000,
        runtime=240,
        nodes=reference_nodes,
        tasks=reference_nodes,
        mpi=reference_mpi,
        gres=reference_gres,
        tasks_per_gpu=0,
        workers_per_node=reference_gpus,
        batch_pairs=reference_batch,
        timeout_minutes=reference_timeout,
    params:
        settings=reference_settings,
    shell:
        "python {input.script} --tokenized {input.tokenized} --model {input.model}"
        " --nodes {resources.nodes} --gpus-per-node {resources.workers_per_node}"
        " --batch-pairs {resources.batch_pairs} --timeout-minutes {resources.timeout_minutes}"
        " {params.settings} --out {output.logps}"
        " > {log} 2>&1"
