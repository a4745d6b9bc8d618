"""The plans of the registry of needs (snaketune.methods.needs): for each record, what its
stage's jobs are and read, what its output depends on, and what it costs (its memory on the
run's GPUs, its seconds, its disk) or, for a need met inside the train job, what that job
holds for it. One ``NeedPlan`` per record in ``PLANS``; the stage, memory, disk and cost
plans, the checks before queueing and ``snaketune status`` ask ``plan_of(need)`` and never
name a need.

A stage need (``STAGES``: the precomputed reference log-probs of DPO-like runs, a teacher's
top-k for distillation) is work that depends only on a model and tokenized rows, computed
once in a data-parallel stage on the GPUs of the run it serves and read by every run that
shares it: its rule (workflow/rules/scoring.smk: one rule body, the others ``use rule ...
with:`` it), its jobs and their keys, inputs, the settings its output depends on, its
layout (whether the model is sharded over the workers). The SLURM profiles give each its
resources (tests/test_slurm_scripts.py checks them).

Adding a need: its record in snaketune.methods.needs, its plan here; for a stage, its entry
script (scripts/<name>.py taking the flags of ``NeedPlan``), its logic in the wing it
belongs to, one ``use rule`` line in workflow/rules/scoring.smk, its resources in each
cluster profile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snaketune.budget import teacherplan
from snaketune.budget.evalplan import EVAL_BYTES, four_bit_base, scoring_plan
from snaketune.budget.memplan import CONTEXT_GIB, FRAGMENTATION, GIB, Shape
from snaketune.budget.rates import (
    DISK_MB_S,
    FORWARD_MFU,
    MB,
    forward_seconds,
    stage,
    weight_bytes,
)
from snaketune.methods.needs import (
    LIVE_TEACHER,
    NEEDS,
    REFERENCE,
    REWARD_MODELS,
    TEACHER_TOPK,
    Need,
)
from snaketune.plan import stages, trainjob
from snaketune.plan import teacher as teachers


@dataclass(frozen=True)
class NeedContext:
    """What a need's plans of its cost (memory, time, disk) read of the run it serves: one
    typed context for every need's plans, each reading what it asks of it."""

    config: dict[str, Any]
    name: str  # the run
    shape: Shape | None = None  # the run's model
    gpu_gib: float | None = None  # a GPU's memory (None: not given)
    epoch: float = 0.0  # one epoch's tokens
    peak: float | None = None  # one GPU's peak TFLOP/s
    workdir: Path = Path(".")

    @property
    def run(self) -> dict[str, Any]:
        return self.config["runs"][self.name]


@dataclass(frozen=True)
class NeedPlan:
    """What the budget and the workflow know of one need (``need``, its record)."""

    need: Need
    # --- a stage's (None for a need met inside the train job)
    # key -> the job (``run``: the first run that reads it, and what else the stage needs)
    jobs: Callable[[dict[str, Any]], dict[str, dict[str, Any]]] | None = None
    # what a job reads: tokenized (rows), model, and any further input (a flag of the
    # script); given the workflow's model_of (a run's starting model) and resolve (a run or
    # sweep's name -> the run whose final model it means)
    inputs: Callable[..., dict[str, str]] | None = None
    settings: Callable[[dict[str, Any]], str] | None = None  # what the output depends on
    sharded: Callable[[dict[str, Any], dict[str, Any]], bool] = lambda config, run: False
    # key -> what ``snaketune validate`` lists of its jobs (the runs or the run it serves)
    listing: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # --- its cost, each of a NeedContext
    # its stage's memory plan on the run's GPUs (nodes, gpus_per_node, per_gpu_gib, cpu_gib,
    # fits, sharded, why, fix); None: unknown yet
    memory: Callable[[NeedContext], dict[str, Any] | None] | None = None
    # its stage's figure (snaketune.budget.rates.stage); None: not estimated
    seconds: Callable[[NeedContext], dict[str, Any] | None] | None = None
    # the bytes its output takes on the run's results filesystem
    disk: Callable[[NeedContext], float | None] | None = None
    # (config, run, workdir) -> weights the train job holds for it (whole on every GPU, or
    # sharded under ZeRO-3 where the need's field says so), counted in memplan.Setup's field
    # ``held_as``
    held_params: Callable[[dict[str, Any], dict[str, Any], Path], int] | None = None
    held_as: str | None = None

    @property
    def name(self) -> str:
        return self.need.name

    @property
    def output(self) -> str | None:
        return self.need.output


# ----------------------------------------------------------------------------- reference


def _reference_jobs(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {key: {"run": run} for key, run in trainjob.reference_jobs(config).items()}


def _reference_inputs(
    config: dict[str, Any], job: dict[str, Any], model_of, resolve
) -> dict[str, str]:
    """The tokenized pairs of the first run that reads it, with the model that run starts
    from."""
    return {"tokenized": stages.tokenized(config, job["run"]), "model": model_of(job["run"])}


def reference_memory(ctx: NeedContext) -> dict[str, Any]:
    """The reference log-probs stage of a run that needs it (a DPO run's precomputed
    reference): data parallel on the run's GPUs, each worker holding the whole reference
    model (its 4-bit base for a 4-bit run) and one batch of pairs through one layer at a
    time (no gradients; TRL's fused head: no whole logits)."""
    from snaketune.plan.runspec import RunSpec

    run, shape = ctx.run, ctx.shape
    spec = RunSpec.of(run)
    w = EVAL_BYTES
    weights = shape.params * w
    if spec.quantized:
        weights = four_bit_base(shape, bool(spec.quantization["double_quant"]))
    tokens = 2 * run["micro_batch_size"] * run["max_length"]  # both sides of each pair
    passing = tokens * (4 * shape.hidden + shape.mlp_pass) * w
    total = round(((weights + passing) / GIB) * (1 + FRAGMENTATION) + CONTEXT_GIB, 2)
    why = f"each worker holds the whole reference model ({weights / GIB:.1f} GiB)"
    fix = (
        f"set {spec.method.block}.reference: live (the training job holds the reference, "
        "sharded with the policy under ZeRO-3), or use GPUs with more memory"
    )
    return scoring_plan(run, shape, total, ctx.gpu_gib, False, why, fix, spec.quantized)


def reference_seconds(ctx: NeedContext) -> dict[str, Any] | None:
    """The reference stage on the run's GPUs: its model read, and a forward pass over one
    epoch's tokens at FORWARD_MFU (None without the GPU's peak)."""
    if not ctx.peak:
        return None
    shape, devices = ctx.shape, ctx.run["nodes"] * ctx.run["gpus_per_node"]
    forward = forward_seconds(shape.active_params, ctx.epoch, devices, ctx.peak)
    basis = f"a forward pass over one epoch at assumed MFU {FORWARD_MFU:.1%}"
    return stage(weight_bytes(shape) / (DISK_MB_S * MB) + forward, devices, basis)


# ----------------------------------------------------------------------------- teacher


def teacher_seconds(
    config: dict[str, Any],
    name: str,
    workdir: Path,
    peak: float | None,
) -> dict[str, Any] | None:
    """A distillation run's teacher stage on the run's GPUs (``peak``: one GPU's TFLOPs):
    the teacher read, and its forward pass over the sets' tokens at FORWARD_MFU; None for
    another run, or before the teacher or the tokens are known."""
    run = config["runs"][name]
    shape = teacherplan.teacher_shape(config, run, workdir)
    counted = teacherplan.tokens(config, name, workdir)
    if shape is None or counted is None or not peak:
        return None
    devices = run["nodes"] * run["gpus_per_node"]
    forward = forward_seconds(shape.active_params, counted, devices, peak)
    basis = (
        f"the teacher's forward pass over {counted:,.0f} tokens (the tokenized sets') at "
        f"assumed MFU {FORWARD_MFU:.1%}, read {weight_bytes(shape) / 1e9:.1f} GB"
    )
    return stage(weight_bytes(shape) / (DISK_MB_S * MB) + forward, devices, basis)


# ----------------------------------------------------------------------------- reward models


@functools.lru_cache(maxsize=64)
def _params(path: str) -> int:
    import json

    from snaketune.budget.modelcount import shape_of

    return shape_of(json.loads(Path(path).read_text()), path).params


def reward_model_params(config: dict[str, Any], run: dict[str, Any], workdir: Path) -> int:
    """Weights of the reward models a GRPO run scores with ("model:<run>" rewards), from
    each reward run's model config.json where it can be read now (an LM head counted where
    the score head will be: a little over)."""
    from snaketune.budget.modelfiles import find_config_json
    from snaketune.evaluation.model_rewards import settings_run
    from snaketune.methods import method_of

    total = 0
    for name in method_of(run).needs(run)[REWARD_MODELS]["runs"]:
        path = find_config_json(config, config["runs"][settings_run(config["runs"], name)], workdir)
        total += _params(str(path)) if path is not None else 0
    return total


def live_teacher_params(config: dict[str, Any], run: dict[str, Any], workdir: Path) -> int:
    """Weights of an on-policy distillation run's teacher (its model's config.json, or its
    run's model's, where it can be read now; 0 before)."""
    shape = teacherplan.live_shape(config, run, workdir)
    return shape.params if shape is not None else 0


# ----------------------------------------------------------------------------- the registry

PLANS = (
    NeedPlan(
        need=REFERENCE,
        jobs=_reference_jobs,
        inputs=_reference_inputs,
        settings=trainjob.reference_settings,
        listing=trainjob.reference_runs,
        memory=reference_memory,
        seconds=reference_seconds,
    ),
    NeedPlan(
        need=TEACHER_TOPK,
        jobs=teachers.teacher_jobs,
        inputs=lambda config, job, model_of, resolve: teachers.teacher_inputs(config, job, resolve),
        settings=teachers.teacher_settings,
        sharded=teacherplan.sharded,
        listing=teachers.teacher_jobs,
        memory=lambda ctx: teacherplan.memory_plan(ctx.config, ctx.run, ctx.gpu_gib),
        seconds=lambda ctx: teacher_seconds(ctx.config, ctx.name, ctx.workdir, ctx.peak),
        disk=lambda ctx: teacherplan.disk_bytes(ctx.config, ctx.name, ctx.workdir) or 0.0,
    ),
    NeedPlan(need=REWARD_MODELS, held_params=reward_model_params, held_as="reward_model_params"),
    NeedPlan(
        need=LIVE_TEACHER,
        held_params=live_teacher_params,
        held_as="teacher_params",
    ),
)
assert tuple(p.need for p in PLANS) == NEEDS, "a plan per record of the registry, in its order"
STAGES = tuple(p for p in PLANS if p.need.stage)


def plan_of(need: Need) -> NeedPlan:
    return next(p for p in PLANS if p.need == need)


def stage_named(name: str) -> NeedPlan:
    return next(s for s in STAGES if s.name == name)


def held_params(config: dict[str, Any], run: dict[str, Any], workdir: Path) -> dict[str, int]:
    """The weights a run's train job holds for its needs, by memplan.Setup field (reward
    models, a live teacher)."""
    from snaketune.methods import method_of

    out: dict[str, int] = {}
    for need in method_of(run).needs(run):
        plan = plan_of(need)
        if plan.held_params is not None:
            out[plan.held_as] = out.get(plan.held_as, 0) + plan.held_params(config, run, workdir)
    return out


def jobs(config: dict[str, Any]) -> dict[str, tuple[NeedPlan, dict[str, Any]]]:
    """Every scoring job the config's runs need: key -> (its stage, the job). A key is
    unique across the stages (each names its model and a digest of what it depends on)."""
    found: dict[str, tuple[NeedPlan, dict[str, Any]]] = {}
    for stage_plan in STAGES:
        for key, job in stage_plan.jobs(config).items():
            if key in found:
                raise ValueError(
                    f"scoring key {key} of {stage_plan.name} is {found[key][0].name}'s"
                )
            found[key] = (stage_plan, job)
    return found


def input_flags(inputs: dict[str, str]) -> str:
    """A job's further inputs (besides its rows and model) as its script's flags."""
    return " ".join(
        f"--{name.replace('_', '-')} {path}"
        for name, path in inputs.items()
        if name not in ("tokenized", "model", "script")
    )
