# A distillation run's teacher: its top-k log-probs of every label token of the run's
# tokenized rows (its training rows, and its eval set for the held-out KL), computed once
# per (teacher, tokenized rows, k, precision, attention) and read by every run that shares
# them; the teacher is never in a training job's memory.


rule teacher_logps:
    input:
        unpack(teacher_inputs),
        script=f"{SCRIPTS}/teacher_logps.py",
    output:
        topk="results/teacher_logps/{ref}/topk.parquet",
    log:
        "logs/teacher_logps/{ref}.log",
    benchmark:
        "benchmarks/teacher_logps/{ref}.tsv"
    conda:
        "../../envs/snaketune.yaml"
    threads: teacher_threads
    # On the GPUs of the run it serves (data parallel: one worker per GPU, on each of its
    # nodes); a rerun after a kill computes only the chunks not written yet. The layout and
    # batch are resources, not params: they change how fast, not what (the output's key).
    # A teacher the plan finds larger than one GPU is sharded over them (sharded=1).
    resources:
        mem_mb=16000,
        runtime=240,
        nodes=teacher_nodes,
        tasks=teacher_nodes,
        mpi=teacher_mpi,
        gres=teacher_gres,
        tasks_per_gpu=0,
        workers_per_node=teacher_gpus,
        batch_rows=teacher_batch,
        sharded=teacher_sharded,
        timeout_minutes=teacher_timeout,
    params:
        settings=teacher_settings,
    shell:
        "python {input.script} --tokenized {input.tokenized} --model {input.model}"
        " --student-model {input.student}"
        " --nodes {resources.nodes} --gpus-per-node {resources.workers_per_node}"
        " --batch-rows {resources.batch_rows} --sharded {resources.sharded}"
        " --timeout-minutes {resources.timeout_minutes}"
        " {params.settings} --out {output.topk}"
        " > {log} 2>&1"
