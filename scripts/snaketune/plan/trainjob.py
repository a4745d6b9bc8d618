"""What the train job and the scoring stages before it read, from a validated config: the
run's settings (``train_spec``: what retrains when it changes), the inputs beside its
shards and model (the reference log-probs, the held-out set, the reward models), the
reference log-probs jobs the runs need, keyed by what they depend on, and their flags."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from snaketune.core.heldout import spec_of as held_out_spec
from snaketune.core.io import digest
from snaketune.evaluation import model_rewards
from snaketune.methods import calls_tools, method_of, reward_runs
from snaketune.methods.needs import LIVE_TEACHER, REFERENCE, REWARD_MODELS, TEACHER_TOPK
from snaketune.plan.runspec import RunSpec
from snaketune.plan.stages import (
    as_json,
    chat_template,
    final_model,
    run_tokenize_spec,
    tokenize_key,
    tokenized,
)
from snaketune.tools import tooluse

# Run keys later stages read; left out of the train rule's params so that changing them
# does not retrain.
NOT_TRAINING = ("eval", "eval_dataset", "export", "gpu", "skip_memory_check", "publish", "sweep_of")


def train_spec(
    run: dict[str, Any],
    heldout: str | None = None,
    reward_models: dict[str, Any] | None = None,
    prompt_sources: dict[str, Any] | None = None,
) -> str:
    """The run's settings the train job reads (--run-spec), as JSON: what retrains it when
    it changes. A run with eval_steps gets what it evaluates while training (``heldout``: its
    tokenized eval set; the eval and export keys that matter to it), a GRPO run what it
    scores with its reward models (``reward_models``: below), a GRPO run with tools how
    its prompts read as conversations (``prompt_sources``: below). The scoring stages' outputs
    (a DPO run's reference log-probs, a distillation run's teacher top-k) are the job's
    inputs (--stage-input), not settings: its method reads them from the job."""
    spec = {k: v for k, v in run.items() if k not in NOT_TRAINING}
    if "eval_steps" not in run:  # a default that means nothing here: no params change
        spec.pop("eval_at_start", None)
    if spec.get("sequence_parallel") == 1:  # the default: runs made before it keep their params
        del spec["sequence_parallel"]
    if isinstance(spec.get("lora"), dict) and spec["lora"].get("adapt_vision") is False:
        spec["lora"] = {k: v for k, v in spec["lora"].items() if k != "adapt_vision"}  # as above
    code = method_of(run).code(run)
    if code:  # the user's functions: a change retrains, provenance records them
        spec["code_sha256"] = code
    block = method_of(run).block  # what a method's job reads beside its settings goes there
    if heldout is not None:
        spec["heldout"] = held_out_spec(run, heldout)
    if block in spec:  # a GRPO run's reward models (reward_models below), its tools
        spec[block] = tooluse.in_spec(model_rewards.in_spec(spec[block], reward_models))
    if prompt_sources:
        spec["prompt_sources"] = prompt_sources
    gather = run["eval"].get("gather_for_generation", "auto")
    if gather != "auto":  # GRPO's completions under ZeRO-3 (the default left unsaid)
        spec["gather_for_generation"] = gather
    return as_json(spec)


def train_extras(
    config: dict[str, Any],
    run: str,
    resolve: Callable[[str], str] = str,
) -> dict[str, Any]:
    """What a run's training reads besides its shards and model, by name: its needs' (a DPO
    run's precomputed log-probs and a distillation run's teacher top-k, by the need's name: the
    stages' outputs; a GRPO run's reward models' folders)
    and ``heldout`` (the eval set of a run with eval_steps)."""
    from snaketune.plan.teacher import teacher_path

    out: dict[str, Any] = {}
    reference = reference_path(config, run)
    if reference:
        out[REFERENCE.name] = reference
    if teacher := teacher_path(config, run):  # a distillation run's teacher top-k
        out[TEACHER_TOPK.name] = teacher
    if live := live_teacher(config, run, resolve):  # on-policy distillation's teacher
        out[LIVE_TEACHER.name] = live
    if config["runs"][run].get("eval_steps"):
        out["heldout"] = tokenized(config, run, eval_set=True)
    if models := reward_models(config, run, resolve):
        out[REWARD_MODELS.name] = [m["path"] for m in models["models"].values()]
    return out


def live_teacher(config: dict[str, Any], run: str, resolve: Callable[[str], str] = str):
    """The model an on-policy distillation run's teacher is (a model's download, or a run's
    final model: ``resolve``, a sweep's best member); None for other runs."""
    from snaketune.plan.teacher import teacher_model

    r = config["runs"][run]
    live = method_of(r).needs(r).get(LIVE_TEACHER)
    return None if live is None else teacher_model(config, live["teacher"], resolve)


def prompt_sources(
    config: dict[str, Any], run: str, dataset: str = "dataset"
) -> dict[str, Any] | None:
    """A GRPO run with tools: how each of its datasets' rows (``dataset``: its training set,
    or ``eval_dataset``) read as conversations (their format, columns and system prompt), by
    dataset; its job rebuilds each prompt's messages from its source row. None for any other
    run."""
    from snaketune.data.formats import components

    r = config["runs"][run]
    if not calls_tools(r):
        return None
    keys = ("format", "columns", "system_prompt")
    return {
        c["name"]: {k: v for k, v in config["datasets"][c["name"]].items() if k in keys}
        for c in components(config, r[dataset])
    }


def eval_tools_args(config: dict[str, Any], run: str) -> str:
    """evaluate.py's ``--tools`` of a run with tools (its evaluation and its start's run the
    tool loop: the tools, their settings, their files' digests, the eval set's sources);
    empty for any other run."""
    import shlex

    r = config["runs"][run]
    if not calls_tools(r) or "eval_dataset" not in r:
        return ""
    b = r[method_of(r).block]
    settings = {k: b[k] for k in tooluse.KEYS if k in b}
    settings.update(sources=prompt_sources(config, run, "eval_dataset"), code=tooluse.digests(b))
    return " --tools " + shlex.quote(as_json(settings))


def reward_models(config: dict[str, Any], run: str, resolve: Callable[[str], str] = str):
    """What a GRPO run's job scores with each reward model it names (model_rewards.spec):
    the final model of the run (``resolve``: a sweep's best member), its chat template."""
    return model_rewards.spec(
        config,
        run,
        lambda name: final_model(config, resolve(name)),
        lambda model: chat_template(config, model),
        reward_runs(config["runs"][run]),
    )


def reference_key(config: dict[str, Any], run: str) -> str | None:
    """The reference log-probs a DPO run with a precomputed reference reads, by what they
    depend on: the model it starts from (a base model, or the final model of the run or
    sweep it starts from), its tokenized pairs, the precision, the attention kernel and a
    4-bit base's quantization.
    Runs and sweep members that share these share one job of the stage. None for others."""
    r = config["runs"][run]
    spec = RunSpec.of(r)
    if REFERENCE not in spec.needs:
        return None
    start = {"run": r["init_from"]} if "init_from" in r else {"model": r["model"]}
    what = {
        **start,
        "tokenized": tokenize_key(run_tokenize_spec(config, run)),
        "precision": r["precision"],
        "attn_implementation": r["attn_implementation"],
    }
    if spec.quantized:  # a 4-bit base scores differently
        what["quantize"] = dict(spec.quantization)
    return f"{next(iter(start.values()))}__{digest(what)[:12]}"


def reference_path(config: dict[str, Any], run: str) -> str | None:
    key = reference_key(config, run)
    return REFERENCE.path(key) if key else None


def reference_runs(config: dict[str, Any]) -> dict[str, list[str]]:
    """Every job of the reference stage the runs need: key -> the runs that read it."""
    jobs: dict[str, list[str]] = {}
    for run in config["runs"]:
        key = reference_key(config, run)
        if key is not None:
            jobs.setdefault(key, []).append(run)
    return jobs


def reference_jobs(config: dict[str, Any]) -> dict[str, str]:
    """Every job of the reference stage the runs need: key -> the first run that reads it."""
    return {key: runs[0] for key, runs in reference_runs(config).items()}


def train_flags(config: dict[str, Any]) -> str:
    """The train job's optional flags: the all-reduce floor (preflight.min_busbw_gbps)."""
    floor = config["preflight"].get("min_busbw_gbps")
    return f"--min-busbw {floor}" if floor else ""


def reference_settings(run: dict[str, Any]) -> str:
    """What a run's reference log-probs depend on besides the inputs (also in the
    output's key), as the stage's flags."""
    settings = f"--precision {run['precision']} --attn-implementation {run['attn_implementation']}"
    quantization = RunSpec.of(run).quantization
    if quantization is not None:  # the policy's 4-bit base, adapter off
        settings += (
            f" --quantize {quantization['quantize']}"
            f" --quant-type {quantization['quant_type']}"
            f" --double-quant {str(quantization['double_quant']).lower()}"
            f" --compute-dtype {quantization['compute_dtype']}"
        )
    return settings
