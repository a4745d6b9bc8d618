# Plain helpers for the rules (no rules here). Logic lives in scripts/snaketune/.
import json
import os
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

from snaketune.config import resolve_deepspeed
from snaketune.sweep import sweeps_of
from snaketune.vocabulary import adapter_kind, components, final_model_dir
from snaketune.plan import (
    evaluates_its_start,
    run_eval_tokenize_spec,
    run_tokenize_spec,
    tokenize_key,
)

# Entry scripts, found from the Snakefile so that --directory can move a run elsewhere.
SCRIPTS = Path(workflow.basedir) / "scripts"
# {sweep: [members]} of the runs with `sweep` (expanded by validate_config)
SWEEPS = sweeps_of(config["runs"])
NAME_PATTERN = "[A-Za-z][A-Za-z0-9_-]{0,63}"
KEY_PATTERN = "[A-Za-z0-9_-]+__[A-Za-z0-9_-]+__[0-9a-f]{12}"


def as_json(value):
    """A config value as compact JSON for a script's --spec argument."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def model_spec(wildcards):
    return as_json(config["models"][wildcards.model])


def dataset_spec(wildcards):
    return as_json(config["datasets"][wildcards.dataset])


def model_source(wildcards):
    """The local model directory as an input (so a rule can make it), none for the hub."""
    spec = config["models"][wildcards.model]
    return {"source": spec["path"]} if spec["source"] == "local" else {}


def dataset_source(wildcards):
    """The local dataset file as an input (so a rule can make it), none for the hub."""
    spec = config["datasets"][wildcards.dataset]
    return {"source": spec["path"]} if spec["source"] == "local" else {}


def tokenize_inputs(wildcards):
    """Downloaded sources, model directory and chat template of a tokenized copy."""
    spec = TOKENIZE[wildcards.key]
    inputs = {
        "data": [
            f"resources/datasets/{s['name']}/data.parquet" for s in spec["sources"]
        ],
        "model": f"resources/models/{spec['model']}",
    }
    if spec["chat_template"]:
        inputs["template"] = spec["chat_template"]["path"]
    return inputs


def tokenize_spec(wildcards):
    return as_json(TOKENIZE[wildcards.key])


def run_tokenized(wildcards):
    """The tokenized copy a run trains on."""
    key = tokenize_key(run_tokenize_spec(config, wildcards.run))
    return f"results/tokenized/{key}/data.parquet"


def shard_eval_input(wildcards):
    """A run's tokenized eval set, so that shard_dataset refuses an overlap before training."""
    if "eval_dataset" not in config["runs"][wildcards.run]:
        return {}
    return {"eval": run_eval_tokenized(wildcards)}


def shard_packing_arg(wildcards):
    """--packing or --no-packing (validation turns packing off for GRPO runs)."""
    return "--packing" if config["runs"][wildcards.run]["packing"] else "--no-packing"


def shard_micro_batch(wildcards):
    """Examples per device and pass; for GRPO, prompts (each makes num_generations rows)."""
    run = config["runs"][wildcards.run]
    if run["method"] == "grpo":
        return run["micro_batch_size"] // run["grpo"]["num_generations"]
    return run["micro_batch_size"]


def shard_layout(wildcards):
    """The batch layout's arguments, named: Snakemake compares a rule's params as a sorted
    list of values without their names, so nodes 2 / accumulation 1 and nodes 1 /
    accumulation 2 would look the same and the shards would not be redone."""
    run = config["runs"][wildcards.run]
    return (
        f"--nodes {run['nodes']} --gpus-per-node {run['gpus_per_node']}"
        f" --micro-batch-size {shard_micro_batch(wildcards)}"
        f" --gradient-accumulation-steps {run['gradient_accumulation_steps']}"
        f" --seed {run['seed']}"
    )


def shard_model(wildcards):
    """The base model's directory (its tokenizer and packing support); a GRPO run's shards
    need not wait for the run it starts from."""
    return f"resources/models/{config['runs'][wildcards.run]['model']}"


def run_shards(wildcards):
    """The shards a run trains on: its own, or, for a sweep's member, those of the first
    member with the same shard inputs and layout (a sweep over the learning rate or the
    LoRA rank shards once)."""
    run = config["runs"][wildcards.run]
    if "sweep_of" not in run:
        return f"results/{wildcards.run}/shards"
    mine = shard_signature(wildcards.run)
    for member in SWEEPS[run["sweep_of"]["run"]]:
        if shard_signature(member) == mine:
            return f"results/{member}/shards"


def shard_signature(name):
    """Everything shard_dataset's output depends on, for run ``name``: the inputs and
    params of rule shard_dataset (keep the two in step)."""
    w = SimpleNamespace(run=name)  # what these functions read of a job's wildcards
    run = config["runs"][name]
    return (
        run_tokenized(w),
        shard_eval_input(w),
        shard_model(w),
        shard_layout(w),
        shard_packing_arg(w),
        run["attn_implementation"],
    )


def shard_eval_arg(wildcards, input):
    return f"--eval {input.eval}" if "eval" in input.keys() else ""


def best_member(sweep):
    """A sweep's best member, once its evaluations are done and select_sweep (a checkpoint)
    has chosen it from results/<sweep>/best.json."""
    best = checkpoints.select_sweep.get(sweep=sweep).output[0]
    return json.loads(Path(best).read_text())["best"]


def start_run(name):
    """The run a run with init_from starts from: the run it names, or that sweep's best."""
    parent = config["runs"][name]["init_from"]
    return best_member(parent) if parent in SWEEPS else parent


def run_model(wildcards):
    """The model a run trains from: its base model, or (init_from) that run's final model."""
    run = config["runs"][wildcards.run]
    if "init_from" in run:
        return final_model(start_run(wildcards.run))
    return f"resources/models/{run['model']}"


def run_deepspeed(wildcards):
    """The run's DeepSpeed JSON: a preset from config/deepspeed/ or the user's file."""
    return str(
        resolve_deepspeed(
            config["runs"][wildcards.run]["deepspeed"], Path(workflow.basedir)
        )
    )


# Run keys later stages read; left out of the train rule's params so that changing them
# does not retrain.
NOT_TRAINING = (
    "eval",
    "eval_dataset",
    "export",
    "gpu",
    "skip_memory_check",
    "publish",
    "sweep_of",
)


def run_spec(wildcards):
    run = config["runs"][wildcards.run]
    return as_json({k: v for k, v in run.items() if k not in NOT_TRAINING})


def min_busbw_arg(wildcards):
    """The train job's floor on the all-reduce bus bandwidth (preflight.min_busbw_gbps)."""
    floor = config["preflight"].get("min_busbw_gbps")
    return f"--min-busbw {floor}" if floor else ""


def train_threads(wildcards):
    """Processes of a run on one machine (the local profile runs every emulated node here)."""
    run = config["runs"][wildcards.run]
    return run["nodes"] * run["gpus_per_node"]


def train_nodes(wildcards):
    """Nodes of a run's train job; also its SLURM task count (one torchrun agent per node)."""
    return config["runs"][wildcards.run]["nodes"]


def train_mpi(wildcards):
    """The SLURM executor plugins' `mpi` resource, on every train job: the rule's shell runs
    in the batch script and starts its own srun step (one task per node). So SLURM's
    `--signal=USR1@...` (sent to job steps) reaches only the training processes, which
    handle it, never the job's own snakemake, which it would end. The job-step plugin
    checks only that the key is there; the submitting plugin refuses an MPI job of one task
    ("'tasks' must be greater than 1"), so a 1-node run sets it to 0, which it reads as
    no MPI (plain --ntasks=1) while the job step still runs the shell unwrapped."""
    return "srun" if config["runs"][wildcards.run]["nodes"] > 1 else 0


def train_gres(wildcards):
    """GPUs per node of a run's train job (SLURM --gres is per node)."""
    return f"gpu:{config['runs'][wildcards.run]['gpus_per_node']}"


def export_kind(run):
    """Where convert_checkpoint writes a run: hf/ (full) or lora_adapters/ (LoRA)."""
    return "lora_adapters" if adapter_kind(config["runs"][run]) == "lora" else "hf"


def convert_inputs(wildcards):
    """No extra inputs; refuses the export directory of the other method."""
    if wildcards.export != export_kind(wildcards.run):
        raise ValueError(
            f"results/{wildcards.run}/{wildcards.export}: run {wildcards.run} makes "
            f"results/{wildcards.run}/{export_kind(wildcards.run)}"
        )
    return {}


def final_model(run):
    """The model a run ends with: the merged model (LoRA) or the converted one (full)."""
    return f"results/{run}/{final_model_dir(config['runs'][run])}"


def eval_args(settings):
    """evaluate.py options for a run's eval settings."""
    args = f"--max-new-tokens {settings['max_new_tokens']} --batch-size {settings['batch_size']}"
    args += f" --limit {settings['limit']}" if "limit" in settings else ""
    if settings.get("lm_eval"):
        settings_json = json.dumps(settings["lm_eval"], sort_keys=True)
        args += f" --lm-eval {shlex.quote(settings_json)}"
    return args


def run_eval_key(run):
    return tokenize_key(run_eval_tokenize_spec(config, run))


def run_eval_tokenized(wildcards):
    return f"results/tokenized/{run_eval_key(wildcards.run)}/data.parquet"


def run_base_metrics(wildcards):
    """What a run's evaluation is compared with: its base model's evaluation; or (init_from)
    the evaluation of the run it started from, or, where that run was scored on another
    eval set or otherwise, the starting model's own evaluation (rule evaluate_start)."""
    run = config["runs"][wildcards.run]
    if "init_from" not in run:
        return f"results/base_eval/{run_eval_key(wildcards.run)}/metrics.json"
    if evaluates_its_start(config, wildcards.run):
        return f"results/{wildcards.run}/start_eval/metrics.json"
    return f"results/{start_run(wildcards.run)}/eval/metrics.json"


def run_adapter_kind(wildcards):
    """convert_checkpoint's --method: what the run's checkpoint holds (lora or full)."""
    return adapter_kind(config["runs"][wildcards.run])


def run_final_model(wildcards):
    return final_model(wildcards.run)


def run_eval_settings(wildcards):
    return eval_args(config["runs"][wildcards.run]["eval"])


def base_eval_model(wildcards):
    return f"resources/models/{TOKENIZE[wildcards.key]['model']}"


def base_eval_settings(wildcards):
    return eval_args(BASE_EVALS[wildcards.key])


def run_targets(wildcards):
    """What `all` asks of each run: its evaluation when it has an eval set, else its model;
    and of each sweep its best member."""
    return [
        f"results/{run}/eval/metrics.json" if "eval_dataset" in r else final_model(run)
        for run, r in config["runs"].items()
    ] + [f"results/{sweep}/best.json" for sweep in SWEEPS]


def sweep_inputs(wildcards):
    """Each member's training metrics, and its evaluation when it has one."""
    inputs = {}
    for member in SWEEPS[wildcards.sweep]:
        inputs[f"{member}_train"] = f"results/{member}/train/metrics.jsonl"
        if "eval_dataset" in config["runs"][member]:
            inputs[f"{member}_eval"] = f"results/{member}/eval/metrics.json"
    return inputs


def sweep_members(wildcards):
    return as_json({m: config["runs"][m] for m in SWEEPS[wildcards.sweep]})


def report_inputs(wildcards):
    """Every run's training metrics and provenance, and its evaluation when it has one."""
    inputs = {}
    for run, r in config["runs"].items():
        inputs[f"{run}_metrics"] = f"results/{run}/train/metrics.jsonl"
        inputs[f"{run}_provenance"] = f"results/{run}/train/provenance.json"
        if "eval_dataset" in r:
            inputs[f"{run}_eval"] = f"results/{run}/eval/metrics.json"
            inputs[f"{run}_samples"] = f"results/{run}/eval/samples.jsonl"
            inputs[f"{run}_lineage"] = f"results/{run}/eval/provenance.json"
        else:
            inputs[f"{run}_lineage"] = final_model(run)
    return inputs


def check_before_queueing(dry_run):
    """Before any job runs (onstart), or in a dry run once the jobs are known: the checks of
    snaketune.checks.before_queueing on this workflow's jobs; one line per problem, then
    stop. On SLURM, a watch then cancels a pending job whose reason can never clear."""
    from snaketune.checks import Job, before_queueing, meant_for_slurm, refuse
    from snaketune.slurmfit import PendingWatch

    # (a dry run runs every job locally; whether a rule is local on the cluster is its own)
    local_rules = {r.name for r in workflow.rules if r.norun} | workflow._localrules
    jobs = [
        Job(
            job.rule.name,
            dict(job.wildcards_dict),
            dict(job.resources.items()),
            job.rule.name in local_rules,
        )
        for job in workflow.dag.needrun_jobs()
    ]
    local = workflow.local_exec and not (dry_run and meant_for_slurm(jobs))
    found = before_queueing(config, jobs, Path("."), Path(workflow.basedir), local)
    if found:
        refuse(found, dry_run)
    if not local and not dry_run:
        PendingWatch(os.getcwd()).start()


def published_run(wildcards):
    """The run whose model `publish_run` uploads: the run itself, or a sweep's best member."""
    return best_member(wildcards.run) if wildcards.run in SWEEPS else wildcards.run


def publish_inputs(wildcards):
    """The model, the sweep's choice (a sweep), and the evaluation (its figures go into the
    model card) when the run has one."""
    name = published_run(wildcards)
    inputs = {"model": final_model(name)}
    if wildcards.run in SWEEPS:
        inputs["best"] = f"results/{wildcards.run}/best.json"
    if "eval_dataset" in config["runs"][name]:
        inputs["metrics"] = f"results/{name}/eval/metrics.json"
    return inputs


def publish_metrics_arg(wildcards, input):
    return f"--metrics {input.metrics}" if "metrics" in input.keys() else ""


def publish_spec(wildcards):
    """The run's config entry and the datasets it trained on (for the model card)."""
    run = config["runs"][published_run(wildcards)]
    sources = [c["name"] for c in components(config, run["dataset"])]
    return as_json({**run, "dataset_sources": sources})


def publish_config(name):
    """publish settings of a run, or of a sweep (kept in its members' sweep_of)."""
    run = (
        config["runs"][SWEEPS[name][0]]["sweep_of"]
        if name in SWEEPS
        else config["runs"][name]
    )
    return run.get("publish") or {}


def publish_settings(wildcards):
    settings = publish_config(wildcards.run)
    if not settings.get("repo_id"):
        raise ValueError(
            f"results/{wildcards.run}/publish: run {wildcards.run} has no publish.repo_id"
        )
    return as_json(settings)


def publish_targets(wildcards):
    """What `publish` asks for: the receipt of every run and sweep with publish.repo_id."""
    return [
        f"results/{name}/publish.json"
        for name in [*config["runs"], *SWEEPS]
        if publish_config(name).get("repo_id")
    ]


def report_line():
    """After a successful pipeline (onsuccess): the report's path and each run's result."""
    from snaketune.report import headline

    html, tsv = Path("results/summary.html"), Path("results/summary.tsv")
    if html.is_file() and tsv.is_file():
        print(headline(tsv, html.resolve()), file=sys.stderr)
