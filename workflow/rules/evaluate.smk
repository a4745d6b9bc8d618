# Held-out evaluation of each run and, once per (model, eval set), of its base model.


rule evaluate_base:
    input:
        script=f"{SCRIPTS}/evaluate.py",
        model=base_eval_model,
        eval=base_eval_set,
    output:
        metrics="results/base_eval/{key}/metrics.json",
        samples="results/base_eval/{key}/samples.jsonl",
        provenance="results/base_eval/{key}/provenance.json",
    log:
        "logs/evaluate_base/{key}.log",
    benchmark:
        "benchmarks/evaluate_base/{key}.tsv"
    conda:
        "../../envs/snaketune.yaml"
    threads: eval_resource("threads")
    # eval.nodes x eval.gpus_per_node (auto: the fewest GPUs that hold the model; over one,
    # the weights sharded across them: snaketune.evaluation.sharded). Resources, not params:
    # they change how, not what, so a new layout does not rerun an evaluation.
    resources:
        mem_mb=planned_mem_mb("evaluate_base"),
        runtime=240,
        nodes=eval_resource("nodes"),
        tasks=eval_resource("nodes"),
        mpi=eval_resource("mpi"),
        gres=eval_resource("gres"),
        tasks_per_gpu=0,
        workers_per_node=eval_resource("gpus"),
        timeout_minutes=eval_timeout,
    params:
        settings=base_eval_settings,
        out="results/base_eval/{key}",
    shell:
        "python {input.script} --model {input.model} --eval {input.eval} --out {params.out}"
        " {params.settings} --nodes {resources.nodes}"
        " --gpus-per-node {resources.workers_per_node}"
        " --timeout-minutes {resources.timeout_minutes} > {log} 2>&1"


# A run that starts from another (init_from) but is scored on its own eval set or settings:
# the model it starts from, on that set, is its base.
rule evaluate_start:
    input:
        script=f"{SCRIPTS}/evaluate.py",
        model=run_model,
        eval=run_eval_tokenized,
        train=run_tokenized,
    output:
        metrics="results/{run}/start_eval/metrics.json",
        samples="results/{run}/start_eval/samples.jsonl",
        provenance="results/{run}/start_eval/provenance.json",
    log:
        "logs/evaluate_start/{run}.log",
    benchmark:
        "benchmarks/evaluate_start/{run}.tsv"
    conda:
        "../../envs/snaketune.yaml"
    threads: eval_resource("threads")
    # eval.nodes x eval.gpus_per_node (auto: the fewest GPUs that hold the model; over one,
    # the weights sharded across them: snaketune.evaluation.sharded). Resources, not params:
    # they change how, not what, so a new layout does not rerun an evaluation.
    resources:
        mem_mb=planned_mem_mb("evaluate_start"),
        runtime=240,
        nodes=eval_resource("nodes"),
        tasks=eval_resource("nodes"),
        mpi=eval_resource("mpi"),
        gres=eval_resource("gres"),
        tasks_per_gpu=0,
        workers_per_node=eval_resource("gpus"),
        timeout_minutes=eval_timeout,
    params:
        settings=start_eval_settings,
        out="results/{run}/start_eval",
    shell:
        "python {input.script} --model {input.model} --eval {input.eval} --train {input.train}"
        " --out {params.out} {params.settings} --nodes {resources.nodes}"
        " --gpus-per-node {resources.workers_per_node}"
        " --timeout-minutes {resources.timeout_minutes} > {log} 2>&1"


rule evaluate:
    input:
        unpack(eval_adapter_inputs),
        unpack(eval_metric_inputs),
        unpack(eval_teacher_inputs),
        script=f"{SCRIPTS}/evaluate.py",
        model=run_final_model,
        eval=run_eval_tokenized,
        train=run_tokenized,
        base=run_base_metrics,
    output:
        metrics="results/{run}/eval/metrics.json",
        samples=report(
            "results/{run}/eval/samples.jsonl",
            caption="../report/samples.rst",
            category="Evaluation samples",
            labels={"run": "{run}"},
        ),
        provenance="results/{run}/eval/provenance.json",
    log:
        "logs/evaluate/{run}.log",
    benchmark:
        "benchmarks/evaluate/{run}.tsv"
    conda:
        "../../envs/snaketune.yaml"
    threads: eval_resource("threads", final=True)
    # eval.nodes x eval.gpus_per_node (auto: the fewest GPUs that hold the model; over one,
    # the weights sharded across them: snaketune.evaluation.sharded). Resources, not params:
    # they change how, not what, so a new layout does not rerun an evaluation.
    resources:
        mem_mb=planned_mem_mb("evaluate"),
        runtime=240,
        nodes=eval_resource("nodes", final=True),
        tasks=eval_resource("nodes", final=True),
        mpi=eval_resource("mpi", final=True),
        gres=eval_resource("gres", final=True),
        tasks_per_gpu=0,
        workers_per_node=eval_resource("gpus", final=True),
        timeout_minutes=eval_timeout,
    params:
        settings=run_eval_settings,
        adapter=eval_adapter_arg,
        teacher=eval_teacher_arg,
        out="results/{run}/eval",
    shell:
        "python {input.script} --model {input.model} --eval {input.eval} --train {input.train}"
        " --base-metrics {input.base} --out {params.out} {params.settings} {params.adapter}"
        " {params.teacher} --nodes {resources.nodes}"
        " --gpus-per-node {resources.workers_per_node}"
        " --timeout-minutes {resources.timeout_minutes} > {log} 2>&1"
