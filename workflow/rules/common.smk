# Input functions of the rules, grouped by stage (no rules here). What they return is
# computed in the library (snaketune.plan.stages): these only look it up for a job's wildcards.
import json
import shlex
import sys
from functools import partial
from pathlib import Path

from snaketune.evaluation import scorers
from snaketune.methods import method_of
from snaketune.methods.needs import PASSED_NEEDS
from snaketune.evaluation import settings as evaluations
from snaketune.budget import fit, scoring, slurmfit
from snaketune.plan import stages, targets, trainjob
from snaketune.plan import clean as cleaning
from snaketune.plan import teacher as teachers
from snaketune.plan.config import resolve_deepspeed
from snaketune.plan.runspec import RunSpec
from snaketune.plan.sweep import sweeps_of
from snaketune.core.parts import PART_PATTERN  # a set's part: 00003-of-00008
from snaketune.train.rerun import request_fresh

# Entry scripts, found from the workflow's folder (ROOT: workflow/Snakefile) so that
# --directory, or a project using the workflow as a module, runs them from anywhere.
SCRIPTS = ROOT / "scripts"
# The rules' `python` is the interpreter Snakemake runs in (its environment holds the
# stack, whether or not it was activated: its bin/ first on the jobs' PATH), unless a
# software-deployment method (conda, apptainer) provides the rule's own.
if not workflow.deployment_settings.deployment_method:
    shell.prefix(f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH; ")
# {sweep: [members]} of the runs with `sweep` (expanded by validate_config)
SWEEPS = sweeps_of(config["runs"])
# {key: (stage, job)} of the scoring stages the runs need (snaketune.budget.scoring: a DPO
# run's precomputed reference log-probs, a distillation run's teacher top-k)
SCORING = scoring.jobs(config)
# {key: spec} of the datasets cleaned before they are tokenized (datasets.<d>.clean)
CLEAN = cleaning.clean_jobs(TOKENIZE)
NAME_PATTERN = "[A-Za-z][A-Za-z0-9_-]{0,63}"
KEY_PATTERN = "[A-Za-z0-9_-]+__[A-Za-z0-9_-]+__[0-9a-f]{12}"
REF_PATTERN = "[A-Za-z][A-Za-z0-9_-]{0,63}__[0-9a-f]{12}"
# The Snakemake inside a cluster job (remote mode; the executor plugin's job step and the
# one an MPI-style job starts in turn) applies a rule's `retries` too: a failed train
# attempt would start again inside the same SLURM job, beside the submitting Snakemake's
# own retry as a new job. Only the submitting side retries; the job side starts the train
# rule once (snaketune.train.attempts refuses a second start there; the Snakefile tells it so).
JOB_SIDE = workflow.remote_exec
TRAIN_RETRIES = 0 if JOB_SIDE else 2


def run_of(wildcards):
    return config["runs"][wildcards.run]


# ----------------------------------------------------------------------------- download


def model_spec(wildcards):
    return stages.as_json(config["models"][wildcards.model])


def dataset_spec(wildcards):
    return stages.as_json(stages.download_spec(config["datasets"][wildcards.dataset]))


def model_source(wildcards):
    return stages.local_source(config["models"][wildcards.model])


def dataset_source(wildcards):
    return stages.local_source(config["datasets"][wildcards.dataset])


# ----------------------------------------------------------------------------- data


def tokenize_inputs(wildcards):
    return stages.tokenize_inputs(TOKENIZE[wildcards.key])


def tokenize_spec(wildcards):
    return stages.as_json(TOKENIZE[wildcards.key])


def tokenize_removed(wildcards):
    spec = TOKENIZE[wildcards.key]
    return (
        f"--removed {cleaning.removed_path(spec['clean'])}" if "clean" in spec else ""
    )


def clean_inputs(wildcards):
    return cleaning.inputs(CLEAN[wildcards.ckey])


def clean_spec(wildcards):
    return stages.as_json(CLEAN[wildcards.ckey])


def clean_signatures(wildcards):
    return cleaning.signature_paths(CLEAN[wildcards.ckey])


def index_inputs(wildcards):
    spec = TOKENIZE[wildcards.key]
    return {
        "parts": stages.part_paths(spec),
        "model": f"resources/models/{spec['model']}",
    }


def run_tokenized(wildcards):
    return stages.tokenized(config, wildcards.run)


def run_eval_tokenized(wildcards):
    return stages.tokenized(config, wildcards.run, eval_set=True)


def shard_inputs(wildcards):
    return stages.shard_job(config, wildcards.run)["inputs"]


def shard_layout(wildcards):
    return stages.shard_job(config, wildcards.run)["layout"]


def shard_packing_arg(wildcards):
    return stages.shard_job(config, wildcards.run)["packing"]


def shard_eval_arg(wildcards, input):
    return stages.flag_of(input, "eval")


# ----------------------------------------------------------------------------- train


def run_shards(wildcards):
    """The manifest of the shards a run trains on (the folder beside it: shards_folder)."""
    return stages.shards_of(config, SWEEPS, wildcards.run) + ".manifest.json"


def shards_folder(wildcards):
    return stages.shards_of(config, SWEEPS, wildcards.run)


def request_fresh_train():
    """--forcerun train (-R train, -F, or a train output named with -f): the user's word that
    those runs start from step 0. The submitting Snakemake hands its train jobs one token
    (inherited, locally and through sbatch); a retry or requeue of the same job resumes what
    it began; any other rerun resumes when its inputs are the same (snaketune.train.rerun).
    """
    settings = workflow.dag_settings
    request_fresh(
        [*settings.forcerun, *(settings.targets if settings.forcetargets else ())],
        settings.forceall,
        rules.train.rule.name,
    )


def best_member(sweep):
    """A sweep's best member, once its evaluations are done and select_sweep (a checkpoint)
    has chosen it in results/<sweep>/best.json."""
    best = checkpoints.select_sweep.get(sweep=sweep).output[0]
    return json.loads(Path(best).read_text())["best"]


def start_run(name):
    """The run a run with init_from starts from: the run it names, or that sweep's best."""
    parent = config["runs"][name]["init_from"]
    return best_member(parent) if parent in SWEEPS else parent


def model_of(run):
    """The model a run trains from: its base model, or (init_from) that run's final model."""
    if "init_from" in config["runs"][run]:
        return stages.final_model(config, start_run(run))
    return f"resources/models/{config['runs'][run]['model']}"


def run_model(wildcards):
    return model_of(wildcards.run)


def run_deepspeed(wildcards):
    return str(resolve_deepspeed(run_of(wildcards)["deepspeed"], ROOT))


def run_spec(wildcards):
    extras = trainjob.train_extras(config, wildcards.run, reward_run)
    return trainjob.train_spec(
        run_of(wildcards),
        heldout=extras.get("heldout"),
        reward_models=trainjob.reward_models(config, wildcards.run, reward_run),
        prompt_sources=trainjob.prompt_sources(config, wildcards.run),
    )


def train_extras(wildcards):
    """What a run's training reads besides its shards and model (trainjob.train_extras): the
    outputs of its needs' stages under their stage's name (a DPO run's precomputed reference
    log-probs, a distillation run's teacher top-k), the eval set it scores while training
    (eval_steps), the reward models a GRPO run scores with ("model:<run>" rewards)."""
    return trainjob.train_extras(config, wildcards.run, reward_run)


def stage_inputs(wildcards, input):
    """The train job's --stage-input flags: each need's path it reads (a scoring stage's
    output, a live teacher's model)."""
    return " ".join(
        f"--stage-input {name}={input[name]}"
        for name in (need.name for need in PASSED_NEEDS)
        if name in input.keys()  # noqa: SIM118 (a rule's input: a list with names)
    )


def reward_run(name):
    """The run a "model:<name>" reward scores with: that run, or that sweep's best member."""
    return best_member(name) if name in SWEEPS else name


def train_flags(wildcards):
    return trainjob.train_flags(config)


def train_threads(wildcards):
    """Processes of a run on one machine (the local profile runs every emulated node here)."""
    return run_of(wildcards)["nodes"] * run_of(wildcards)["gpus_per_node"]


def train_nodes(wildcards):
    return run_of(wildcards)["nodes"]


def train_mpi(wildcards):
    return slurmfit.train_mpi(run_of(wildcards))


def train_gres(wildcards):
    return f"gpu:{run_of(wildcards)['gpus_per_node']}"


# ----------------------------------------------------------------------------- scoring stages

# (stage, run) -> the mem_mb its plan asks (planned once per invocation)
PLANNED_MEM = {}


def scoring_inputs(wildcards):
    """What a scoring stage's job reads (snaketune.budget.scoring: its record's inputs)."""
    stage, job = SCORING[wildcards.ref]
    return stage.inputs(config, job, model_of, reward_run)


def scoring_run(wildcards):
    return config["runs"][SCORING[wildcards.ref][1]["run"]]


def scoring_nodes(wildcards):
    return scoring_run(wildcards)["nodes"]


def scoring_threads(wildcards):
    return scoring_run(wildcards)["nodes"] * scoring_run(wildcards)["gpus_per_node"]


def scoring_mpi(wildcards):
    return slurmfit.train_mpi(scoring_run(wildcards))


def scoring_gres(wildcards):
    return f"gpu:{scoring_run(wildcards)['gpus_per_node']}"


def scoring_gpus(wildcards):
    return scoring_run(wildcards)["gpus_per_node"]


def scoring_batch(wildcards):
    return scoring_run(wildcards)["micro_batch_size"]


def scoring_sharded(wildcards):
    """1 where the model does not fit one of the run's GPUs (the stage's plan)."""
    stage, _ = SCORING[wildcards.ref]
    return int(stage.sharded(config, scoring_run(wildcards)))


def scoring_timeout(wildcards):
    return scoring_run(wildcards)["timeout_minutes"]


def scoring_settings(wildcards):
    """What the output depends on besides the inputs (also in the output's key)."""
    return SCORING[wildcards.ref][0].settings(scoring_run(wildcards))


def scoring_mem_mb(wildcards):
    """Its stage's plan of CPU memory per node for the run it serves, a tenth to spare, at
    least 16000 (a profile's set-resources replaces it; checked before queueing)."""
    stage, job = SCORING[wildcards.ref]
    return stage_mem_mb(stage.name, job["run"])


def stage_mem_mb(stage, run):
    """The mem_mb a job of ``stage`` for ``run`` asks (its plan, planned once)."""
    if (stage, run) not in PLANNED_MEM:
        PLANNED_MEM[stage, run] = fit.planned_mem_mb(config, run, stage, 16000)
    return PLANNED_MEM[stage, run]


def scoring_input_flags(wildcards):
    """The job's further inputs (a teacher's student model) as its script's flags."""
    return scoring.input_flags(scoring_inputs(wildcards))


# ----------------------------------------------------------------------------- export


def convert_inputs(wildcards):
    return stages.check_export(config, wildcards.run, wildcards.export)


def run_adapter_kind(wildcards):
    return RunSpec.of(run_of(wildcards)).adapter


def run_final_model(wildcards):
    return stages.final_model(config, wildcards.run)


# ----------------------------------------------------------------------------- evaluate


def run_base_metrics(wildcards):
    return stages.base_metrics(config, wildcards.run, partial(start_run, wildcards.run))


def eval_run(wildcards):
    """The run whose eval settings an evaluate job follows (evaluate_base: the first run
    scored on that base model and eval set)."""
    if "key" in wildcards.keys():
        return BASE_EVALS[wildcards.key]["run"]
    return wildcards.run


# (run, final) -> (nodes, GPUs per node) of its evaluate jobs, decided once per process
EVAL_LAYOUTS = {}


def eval_resource(what, final=False):
    """An evaluate job's resource of its layout (snaketune.budget.stageplan; inside the job,
    what SLURM allocated, so the command always matches its allocation); ``final``: rule
    evaluate (the run's own model), else its base or start model."""

    def resource(wildcards):
        key = (eval_run(wildcards), final)  # one plan per job, not one per resource
        if key not in EVAL_LAYOUTS:
            EVAL_LAYOUTS[key] = fit.eval_job_layout(config, key[0], JOB_SIDE, final)
        nodes, gpus = EVAL_LAYOUTS[key]
        return {"nodes": nodes, "gpus": gpus, "threads": nodes * gpus, "gres": f"gpu:{gpus}",
                "mpi": "srun" if nodes > 1 else 0}[what]  # fmt: skip

    return resource


# (rule, run) -> the memory its jobs ask by default, decided once per process
def planned_mem_mb(stage):
    """The memory (mem_mb, per node) a job of ``stage`` asks: its plan's figure, at least
    16000 (snaketune.budget.fit.planned_mem_mb); a profile's set-resources replaces it, and the
    check before queueing compares either with the plan."""

    def mem_mb(wildcards):
        return stage_mem_mb(stage, eval_run(wildcards))

    return mem_mb


def eval_timeout(wildcards):
    return config["runs"][eval_run(wildcards)]["timeout_minutes"]


def eval_adapter_inputs(wildcards):
    """A run whose final model is its adapter (export.merged: false): the base it goes on."""
    if RunSpec.of(run_of(wildcards)).adapter_only:
        return {"adapter_base": run_model(wildcards)}
    return {}


def eval_adapter_arg(wildcards, input):
    return (
        f"--adapter-base {input.adapter_base}" if "adapter_base" in input.keys() else ""
    )


def eval_teacher_inputs(wildcards):
    """A distillation run: its teacher's top-k of the eval set (the held-out KL); an
    on-policy one: its teacher's model (its NLL of the greedy completions)."""
    out = {}
    if path := teachers.teacher_path(config, wildcards.run, eval_set=True):
        out["teacher"] = path
    if live := trainjob.live_teacher(config, wildcards.run, reward_run):
        out["teacher_model"] = live
    return out


def eval_teacher_arg(wildcards, input):
    # a rule's input is a list of paths with names: `in` alone would look among the paths
    names = input.keys()
    flags = []
    if "teacher" in names:
        flags.append(f"--teacher-topk {input.teacher}")
    if "teacher_model" in names:
        flags.append(f"--teacher-model {input.teacher_model}")
    return " ".join(flags)


def eval_metrics(run):
    """What a run's evaluate stage scores its user's metrics with (None: it has none)."""
    return scorers.spec(
        config,
        run,
        lambda name: stages.final_model(config, reward_run(name)),
        lambda model: stages.chat_template(config, model),
    )


def start_eval_settings(wildcards):
    tools = trainjob.eval_tools_args(config, wildcards.run)
    return stages.run_eval_args(run_of(wildcards)) + tools


def run_eval_settings(wildcards):
    tools = trainjob.eval_tools_args(config, wildcards.run)
    return stages.run_eval_args(run_of(wildcards), eval_metrics(wildcards.run)) + tools


def eval_metric_inputs(wildcards):
    """The reward models a run's metrics score with ("model:<run>" in eval.metrics)."""
    return {"metric_models": scorers.model_folders(eval_metrics(wildcards.run))}


def base_eval_model(wildcards):
    return f"resources/models/{TOKENIZE[wildcards.key]['model']}"


def base_eval_set(wildcards):
    return stages.tokenized_set(TOKENIZE[wildcards.key])


def base_eval_settings(wildcards):
    return evaluations.eval_args(BASE_EVALS[wildcards.key])


# ----------------------------------------------------------------------------- sweeps


def sweep_inputs(wildcards):
    return targets.sweep_inputs(config, SWEEPS[wildcards.sweep])


def sweep_members(wildcards):
    return stages.as_json({m: config["runs"][m] for m in SWEEPS[wildcards.sweep]})


# ----------------------------------------------------------------------------- report


def run_targets(wildcards):
    return targets.run_targets(config, SWEEPS)


def report_inputs(wildcards):
    return targets.report_inputs(config)


# ----------------------------------------------------------------------------- publish


def published_run(wildcards):
    """The run whose model `publish_run` uploads: the run itself, or a sweep's best member."""
    return best_member(wildcards.run) if wildcards.run in SWEEPS else wildcards.run


def publish_inputs(wildcards):
    sweep = wildcards.run in SWEEPS
    return targets.publish_inputs(
        config, wildcards.run, published_run(wildcards), sweep
    )


def publish_metrics_arg(wildcards, input):
    return stages.flag_of(input, "metrics")


def publish_spec(wildcards):
    return targets.publish_spec(config, published_run(wildcards))


def publish_settings(wildcards):
    return targets.publish_settings(config, SWEEPS, wildcards.run)


def publish_targets(wildcards):
    return targets.publish_targets(config, SWEEPS)
