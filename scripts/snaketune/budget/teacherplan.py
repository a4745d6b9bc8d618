"""What a distillation run's teacher stage (the need TEACHER_TOPK) costs, before queueing: its
GPUs (the run's own: one worker per GPU, each holding the whole teacher), their memory, the
tokens it reads (its time: snaketune.budget.scoring.teacher_seconds) and the disk of what
it writes (k x 8 + 4 bytes per label token before compression: snaketune.evaluation.topk). The
student's own memory plan has no teacher in it: the training job never holds one (its loss
reads the logits, as a method without a fused loss: memplan's ``fused_loss``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from snaketune.budget.evalplan import EVAL_BYTES, scoring_plan
from snaketune.budget.memplan import CONTEXT_GIB, FRAGMENTATION, GIB, Shape
from snaketune.budget.modelcount import shape_of


def teacher_base(
    config: dict[str, Any], run: dict[str, Any], name: str | None = None
) -> str | None:
    """The model of the config whose shape a run's teacher has (its teacher stage's, or
    ``name``: a live teacher): the teacher itself, or the teacher run's (a sweep's first
    member's) model; None for a run without a teacher."""
    from snaketune.plan.sweep import sweeps_of
    from snaketune.plan.teacher import teacher_of

    name = name or teacher_of(run)
    if name is None or name in config["models"]:
        return name
    runs = config["runs"]
    return (runs.get(name) or runs[sweeps_of(runs)[name][0]])["model"]


def teacher_shape(
    config: dict[str, Any], run: dict[str, Any], workdir: Path, name: str | None = None
) -> Shape | None:
    """The teacher's shape (its stage's, or ``name``'s) from its config.json where it can be
    read now, as the run's own model's is (snaketune.budget.modelfiles.locate_config_json:
    its download, a local model's path, the Hub's config.json alone, or the one ``snaketune
    plan --model-config`` names), else None."""
    import json

    from snaketune.budget.modelfiles import find_config_json

    model = teacher_base(config, run, name)
    path = None if model is None else find_config_json(config, {"model": model}, workdir)
    return None if path is None else shape_of(json.loads(path.read_text()), str(path))


def live_shape(config: dict[str, Any], run: dict[str, Any], workdir: Path) -> Shape | None:
    """An on-policy distillation run's live teacher's shape where it can be read now (None
    for other runs, or before)."""
    from snaketune.methods import method_of
    from snaketune.methods.needs import LIVE_TEACHER

    live = method_of(run).needs(run).get(LIVE_TEACHER)
    return None if live is None else teacher_shape(config, run, workdir, live["teacher"])


def tokens(config: dict[str, Any], name: str, workdir: Path) -> float | None:
    """The tokens the teacher stage reads (the training set and the eval set, at most: every
    token counted as a label) from the tokenized sets' lengths (None before they are
    tokenized)."""
    from snaketune.core import parts
    from snaketune.plan.stages import tokenized

    run, total = config["runs"][name], 0.0
    for eval_set in (False, True) if "eval_dataset" in run else (False,):
        path = workdir / tokenized(config, name, eval_set)
        if not parts.exists(path):
            return None
        total += float(parts.read_table(path, ["length"]).column("length").to_numpy().sum())
    return total


def disk_bytes(config: dict[str, Any], name: str, workdir: Path) -> float | None:
    """Bytes of the teacher's top-k of a run's sets (at most), None before they are known."""
    from snaketune.evaluation.topk import BYTES_PER_TARGET, BYTES_PER_VALUE
    from snaketune.plan.teacher import top_k

    counted = tokens(config, name, workdir)
    per_token = top_k(config["runs"][name]) * BYTES_PER_VALUE + BYTES_PER_TARGET
    return None if counted is None else counted * per_token


def memory_plan(
    config: dict[str, Any], run: dict[str, Any], gpu_gib: float | None, workdir: Path = Path(".")
) -> dict[str, Any] | None:
    """The teacher stage's GPU memory: the whole teacher, a batch (micro_batch_size rows of
    max_length) through one layer at a time, the batch's logits and one row's log-softmax
    in float32; where the whole teacher does not fit ``gpu_gib``, its weights sharded over
    the run's GPUs (ZeRO-3, a layer gathered at a time: the stage's ``--sharded``). None
    before the teacher's config can be read."""
    shape = teacher_shape(config, run, workdir)
    if shape is None:
        return None
    devices = run["nodes"] * run["gpus_per_node"]
    weights = shape.params * EVAL_BYTES
    batch = run["micro_batch_size"] * run["max_length"]
    passing = batch * (4 * shape.hidden + shape.mlp_pass) * EVAL_BYTES
    logits = batch * shape.vocab * EVAL_BYTES + run["max_length"] * shape.vocab * 8

    def gib(held: float) -> float:
        return round((held + passing + logits) / GIB * (1 + FRAGMENTATION) + CONTEXT_GIB, 2)

    total, sharded = gib(weights), False
    if gpu_gib is not None and total > gpu_gib and devices > 1:
        total = gib(weights / devices + shape.largest_layer * EVAL_BYTES)
        sharded = True
    held = (
        f"the teacher sharded over {devices} GPUs ({weights / GIB:.1f} GiB in all, a layer "
        "gathered at a time)"
        if sharded
        else f"each worker holds the whole teacher ({weights / GIB:.1f} GiB)"
    )
    why = f"{held} and a batch's logits ({logits / GIB:.1f} GiB)"
    fix = (
        "lower micro_batch_size (the stage's rows per forward pass), or give the run more "
        "GPUs, or GPUs with more memory"
    )
    return scoring_plan(run, shape, total, gpu_gib, sharded, why, fix)


def sharded(config: dict[str, Any], run: dict[str, Any], workdir: Path = Path(".")) -> bool:
    """Whether the teacher stage shards the teacher over the run's GPUs (it does not fit
    one, by the memory plan against the run's `gpu`)."""
    from snaketune.budget.memplan import gpu_memory

    plan = memory_plan(config, run, gpu_memory(run.get("gpu", config.get("gpu"))), workdir)
    return bool(plan and plan["sharded"])
