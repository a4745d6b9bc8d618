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
    # nodes); a rerun after a kill computes only the chunks not written yet.
    resources:
        mem_mb=16000,
        runtime=240,
        nodes=reference_nodes,
        tasks=reference_nodes,
        mpi=reference_mpi,
        gres=reference_gres,
        tasks_per_gpu=0,
    params:
        settings=reference_settings,
    shell:
        "python {input.script} --tokenized {input.tokenized} --model {input.model}"
        " {params.settings} --out {output.logps} > {log} 2>&1"
