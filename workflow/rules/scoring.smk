# Scoring stages (snaketune.budget.scoring: one record each): work that depends only on a
# model and tokenized rows, computed once per key and read by every run and sweep member
# that shares it; on the GPUs of the run it serves (data parallel: one worker per GPU, on
# each of its nodes; a model larger than one GPU sharded over them), a rerun after a kill
# computing only the chunks not written yet. The layout and batch are resources, not
# params: they change how fast, not what (the output's key), so a run continued on another
# node count reuses the output. One rule body; each further stage `use`s it.


# A DPO-like run's precomputed reference: the log-probs of every training pair.
rule reference_logps:
    input:
        unpack(scoring_inputs),
        script=f"{SCRIPTS}/reference_logps.py",
    output:
        out="results/reference_logps/{ref}/logps.parquet",
    log:
        "logs/reference_logps/{ref}.log",
    benchmark:
        "benchmarks/reference_logps/{ref}.tsv"
    conda:
        "../../envs/snaketune.yaml"
    threads: scoring_threads
    resources:
        mem_mb=scoring_mem_mb,
        runtime=240,
        nodes=scoring_nodes,
        tasks=scoring_nodes,
        mpi=scoring_mpi,
        gres=scoring_gres,
        tasks_per_gpu=0,
        workers_per_node=scoring_gpus,
        batch=scoring_batch,
        sharded=scoring_sharded,
        timeout_minutes=scoring_timeout,
    params:
        settings=scoring_settings,
        inputs=scoring_input_flags,
    shell:
        "python {input.script} --tokenized {input.tokenized} --model {input.model}"
        " {params.inputs} --nodes {resources.nodes}"
        " --gpus-per-node {resources.workers_per_node} --batch {resources.batch}"
        " --sharded {resources.sharded} --timeout-minutes {resources.timeout_minutes}"
        " {params.settings} --out {output.out}"
        " > {log} 2>&1"


# A distillation run's teacher: its top-k log-probs of every label token of the run's
# tokenized rows (its training rows, and its eval set for the held-out KL); the teacher is
# never in a training job's memory.
use rule reference_logps as teacher_logps with:
    input:
        unpack(scoring_inputs),
        script=f"{SCRIPTS}/teacher_logps.py",
    output:
        out="results/teacher_logps/{ref}/topk.parquet",
    log:
        "logs/teacher_logps/{ref}.log",
    benchmark:
        "benchmarks/teacher_logps/{ref}.tsv"
