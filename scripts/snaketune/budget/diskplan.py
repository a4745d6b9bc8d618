"""Will a run's checkpoints and exports fit on the disk it writes to?

One checkpoint-<step> of the train stage holds, for P parameters of which T are trained
(all for full fine-tuning; the adapters' for LoRA), w bytes per weight (2 in bf16/fp16,
4 in fp32):

- the model Trainer saves beside the DeepSpeed states: w·P (the adapter for LoRA: w·T);
  under ZeRO-3 only with ``stage3_gather_16bit_weights_on_model_save``;
- DeepSpeed's module states (``mp_rank_00_model_states.pt``): w·T below ZeRO-3 (frozen
  weights excluded), next to nothing under ZeRO-3 (the weights live in the partitions);
- the optimizer states of all ranks together (``zero_pp_rank_*_optim_states.pt``): Adam's
  fp32 master weights and two moments, 12·T (also in fp32 training: ZeRO copies the
  partition);
- the tokenizer files, the RNG and scheduler states (measured in the model's folder, or
  ``SMALL_FILES`` when it is not there yet).

``checkpoints.optimizer: last`` (the default) reduces every kept checkpoint but the newest
to its model weights once a newer one is complete (resuming needs only the newest): while
a checkpoint is written, two whole ones and ``save_total_limit - 1`` reduced ones are on
the disk; with ``all``, ``save_total_limit + 1`` whole ones. The run also writes its final
DeepSpeed checkpoint (module and optimizer states), its model folder and its exports (the
converted model; for LoRA the adapters and the merged model, w·P). Before those, its token
ids: the tokenized sets and the shards not written yet (snaketune.budget.tokenizeplan).

tests/test_diskplan.py checks the estimate against real checkpoints (full ZeRO-3, LoRA
ZeRO-2) within 25%.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snaketune.budget.memplan import GIB, Setup, Shape
from snaketune.budget.modelcount import shape_of
from snaketune.core.errors import UserError
from snaketune.methods import method_of
from snaketune.methods.needs import NEEDS
from snaketune.plan.pipeline import TRAIN

log = logging.getLogger(__name__)

SMALL_FILES = 32 * 2**20  # tokenizer, RNG, scheduler, trainer state when not measured
OPTIMIZER_BYTES = 12  # fp32 master weights and Adam's two moments, per trained parameter
HEADROOM = 1.10  # a save goes ahead only with this much more free space than it needs
TOKENIZER_FILES = (
    "tokenizer*",
    "*.model",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "chat_template*",
)


@dataclass(frozen=True)
class CheckpointSize:
    """Bytes of one checkpoint of a run, by part."""

    model: float  # the weights Trainer saves (model or adapter)
    module: float  # DeepSpeed's module states
    optimizer: float  # all ranks' optimizer states
    small: float  # tokenizer, RNG, scheduler, trainer state

    @property
    def whole(self) -> float:
        return self.model + self.module + self.optimizer + self.small

    @property
    def reduced(self) -> float:
        """What ``checkpoints.optimizer: last`` leaves of an older checkpoint."""
        return self.model + self.small


def trained_params(shape: Shape, s: Setup) -> int:
    if s.adapter == "full":
        return shape.params
    return shape.lora_params(s.lora_r, s.lora_targets, s.lora_saved, s.lora_router, s.lora_vision)


def checkpoint_size(
    shape: Shape, s: Setup, gathered: bool = True, small: float = SMALL_FILES
) -> CheckpointSize:
    """One checkpoint's bytes; ``gathered``: ZeRO-3 saves the 16-bit model beside its
    partitions (stage3_gather_16bit_weights_on_model_save)."""
    w, t = s.bytes_per_weight, trained_params(shape, s)
    saved = shape.params if s.adapter == "full" else t
    model = w * saved if (s.stage < 3 or gathered or s.adapter != "full") else 0.0
    module = w * t if s.stage < 3 else 0.0
    return CheckpointSize(model, module, OPTIMIZER_BYTES * t, small)


def run_need(
    shape: Shape,
    s: Setup,
    keep: int,
    optimizer: str,
    gathered: bool = True,
    small: float = SMALL_FILES,
) -> dict[str, float]:
    """Bytes a run needs on its results filesystem at most, by part."""
    one = checkpoint_size(shape, s, gathered, small)
    if optimizer == "last":
        checkpoints = min(keep + 1, 2) * one.whole + max(keep - 1, 0) * one.reduced
    else:
        checkpoints = (keep + 1) * one.whole
    merged = s.adapter != "full" and s.merged  # export.merged: false writes the adapter alone
    exports = one.model + (s.bytes_per_weight * shape.params if merged else 0.0)
    parts = {
        "checkpoint": one.whole,
        "checkpoints": checkpoints,
        "final": one.module + one.optimizer + one.model + one.small,  # final states + model
        "exports": exports,
    }
    parts["total"] = parts["checkpoints"] + parts["final"] + parts["exports"]
    return parts


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it is not there), a file with several hard
    links once (a finished run's outputs and their kept links: snaketune.train.rerun)."""
    if not path.exists():
        return 0
    seen: dict[tuple[int, int], int] = {}
    for f in path.rglob("*"):
        if f.is_file() and not f.is_symlink():
            st = f.stat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def small_files(model_dir: Path, ranks: int) -> float:
    """Bytes of the tokenizer files a checkpoint copies from the model folder, plus the
    trainer and scheduler states, and each rank's RNG state (and ZeRO-3 module states);
    SMALL_FILES when the folder is not there."""
    if not model_dir.is_dir():
        return SMALL_FILES
    found = {f for pattern in TOKENIZER_FILES for f in model_dir.glob(pattern) if f.is_file()}
    return sum(f.stat().st_size for f in found) + 2**17 + 2**15 * ranks


def existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (where its files will go)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(existing(path)).free


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= 0.1 * GIB else f"{n / 2**20:.1f} MiB"


def plan_disk(
    shape: Shape,
    s: Setup,
    run: dict[str, Any],
    deepspeed: dict[str, Any],
    run_dir: Path,
    model_dir: Path,
    download: float = 0.0,
    extra: dict[str, float] | None = None,
) -> dict[str, Any]:
    """A run's disk plan: what it needs, what its filesystem has free (plus what the run
    already holds there, which it replaces), and whether it fits. ``download``: the bytes
    of its base model's download still to come, counted where it lands on the same
    filesystem; ``extra``: the bytes of other outputs its stages write there, by name (a
    distillation run's teacher top-k, by its need's name)."""
    zero = deepspeed.get("zero_optimization", {})
    gathered = bool(zero.get("stage3_gather_16bit_weights_on_model_save", False))
    keep = run["save_total_limit"]
    optimizer = run["checkpoints"]["optimizer"]
    small = small_files(model_dir, s.gpus)
    need = run_need(shape, s, keep, optimizer, gathered, small)
    held_in = (TRAIN.folder, "hf", "lora_adapters", "merged_model")  # its training and export
    held = sum(folder_bytes(run_dir / n) for n in held_in)
    where = existing(run_dir)
    free = free_bytes(where)
    need["download"] = download
    need.update(extra or {})
    need["total"] += download + sum((extra or {}).values())
    return {
        "need_bytes": {k: round(v) for k, v in need.items()},
        "model": run["model"],
        "free_bytes": free,
        "held_bytes": held,
        "path": str(where),
        "save_total_limit": keep,
        "optimizer": optimizer,
        "fits": need["total"] <= free + held,
        "fixes": fixes(shape, s, keep, optimizer, gathered, small, download),
    }


def fixes(
    shape: Shape, s: Setup, keep: int, optimizer: str, gathered: bool, small: float, download: float
) -> list[tuple[str, float]]:
    """What each change of the run's settings saves on its results filesystem, largest
    first: fewer kept checkpoints, the optimizer states in the last one only, the adapter
    exported alone (a LoRA run's merged model is a whole model), the download elsewhere."""
    now = run_need(shape, s, keep, optimizer, gathered, small)["checkpoints"]
    found = []
    if keep > 1:
        fewer = run_need(shape, s, 1, optimizer, gathered, small)["checkpoints"]
        found.append((f"save_total_limit: 1 (now {keep})", now - fewer))
    if optimizer != "last":
        last = run_need(shape, s, keep, "last", gathered, small)["checkpoints"]
        found.append(("checkpoints.optimizer: last", now - last))
    if s.adapter != "full" and s.merged:
        found.append(
            ("export.merged: false (the adapter alone)", s.bytes_per_weight * shape.params)
        )
    if download:
        found.append(("resources/models on another filesystem (a symlink)", download))
    return sorted(found, key=lambda f: -f[1])


# what else a run writes to its results filesystem, when it does: the plan's key, its words
OTHER_NEEDS = (
    ("download", "the base model download"),
    ("tokens", "tokenized sets and shards"),
    *((need.name, need.label) for need in NEEDS),  # what a need's stage writes (its plan's disk)
    ("pictures", "pictures in tokenized data and shards"),
)


def format_disk(name: str, plan: dict[str, Any]) -> str:
    """One line: need (and its parts), free space, and the fixes when it does not fit."""
    n = plan["need_bytes"]
    where = plan["path"]
    have = plan["free_bytes"] + plan["held_bytes"]
    held = f" (+{gib(plan['held_bytes'])} the run already holds)" if plan["held_bytes"] else ""
    line = (
        f"{name}: needs {gib(n['total'])} on {where} ({plan['save_total_limit']} kept "
        f"checkpoints of {gib(n['checkpoint'])}, optimizer states in {plan['optimizer']}: "
        f"{gib(n['checkpoints'])} while saving; final checkpoint and model "
        f"{gib(n['final'])}; exports {gib(n['exports'])}"
        + "".join(f"; {what} {gib(n[key])}" for key, what in OTHER_NEEDS if n.get(key))
        + "), "
        f"{gib(plan['free_bytes'])} free{held}"
    )
    if plan["fits"]:
        return f"{line}: fits"
    said = [f"{what} saves {gib(saved)}" for what, saved in plan.get("fixes", ())]
    said.append("or put results/ on a larger filesystem (e.g. a symlink to scratch)")
    return f"{line}: does NOT fit, {gib(n['total'] - have)} short; {', '.join(said)}"


def disk_plan_of(
    config: dict[str, Any], name: str, root: Path, basedir: Path, on_gpu: bool = True
) -> dict[str, Any] | None:
    """The disk plan of run ``name`` of a validated config (precision auto: bf16 on GPU,
    fp32 on CPU); None when the model's config.json cannot be read yet."""
    from snaketune.budget.fit import setup_of, shape_and_deepspeed
    from snaketune.budget.modelfiles import find_config_json
    from snaketune.budget.pictureplan import picture_bytes
    from snaketune.budget.stagecost import weights_in
    from snaketune.budget.tokenizeplan import token_bytes

    run = config["runs"][name]
    path = find_config_json(config, run, root)
    if path is None:
        return None
    shape, deepspeed = shape_and_deepspeed(path, run, basedir)
    s = setup_of(run, deepspeed, on_gpu=on_gpu)
    run_dir, models = root / "results" / name, root / "resources/models"
    download = 0.0
    same = os.stat(existing(models)).st_dev == os.stat(existing(run_dir)).st_dev
    if same and not weights_in(models / run["model"]):
        download = shape.params * (shape.saved_bytes or 2)
    extra = {"tokens": token_bytes(config, name, root)}  # snaketune.budget.tokenizeplan
    pictures = picture_bytes(config, name, root)  # snaketune.budget.pictureplan
    if pictures:
        extra["pictures"] = pictures
    from snaketune.budget.scoring import NeedContext, plan_of  # not the launcher's imports

    for need in method_of(run).needs(run):  # its needs' outputs (a teacher's top-k)
        if (disk := plan_of(need).disk) is not None:
            extra[need.name] = disk(NeedContext(config, name, workdir=root))
    return plan_disk(shape, s, run, deepspeed, run_dir, path.parent, download, extra)


def shared_filesystems(plans: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs whose results go to one filesystem, added up: a dict per filesystem that two or
    more of ``plans`` ({run: disk plan}) write to, with their need together against its
    free space (plus what they already hold there)."""
    groups: dict[int, list[str]] = {}
    for name, plan in plans.items():
        groups.setdefault(os.stat(plan["path"]).st_dev, []).append(name)
    out = []
    for names in groups.values():
        if len(names) < 2:
            continue
        need = sum(plans[n]["need_bytes"]["total"] for n in names)
        downloads = {
            plans[n].get("model"): plans[n]["need_bytes"].get("download", 0) for n in names
        }
        need -= sum(plans[n]["need_bytes"].get("download", 0) for n in names)
        need += sum(downloads.values())  # a model shared by runs is downloaded once
        held = sum(plans[n]["held_bytes"] for n in names)
        free = min(plans[n]["free_bytes"] for n in names)
        out.append(
            {
                "runs": sorted(names),
                "path": os.path.commonpath([plans[n]["path"] for n in names]),
                "need_bytes": need,
                "free_bytes": free,
                "held_bytes": held,
                "fits": need <= free + held,
            }
        )
    return out


def format_shared(group: dict[str, Any]) -> str:
    """One line: the runs on one filesystem, their need together, and whether it fits."""
    held = f" (+{gib(group['held_bytes'])} they already hold)" if group["held_bytes"] else ""
    line = (
        f"{len(group['runs'])} runs write to the filesystem of {group['path']} "
        f"({', '.join(group['runs'])}): {gib(group['need_bytes'])} together, "
        f"{gib(group['free_bytes'])} free{held}"
    )
    if group["fits"]:
        return f"{line}: fits"
    short = group["need_bytes"] - group["free_bytes"] - group["held_bytes"]
    return (
        f"{line}: does NOT fit, {gib(short)} short; train fewer of them at once (ask for "
        "some runs' outputs, or fewer sweep values), lower save_total_limit, or put "
        "results/ on a larger filesystem"
    )


def check_disk_runs(
    config: dict[str, Any], runs: list[str], root: Path, basedir: Path, on_gpu: bool
) -> list[str]:
    """The workflow's check before anything is queued: a line per run whose checkpoints and
    exports do not fit on its results filesystem, and a line per filesystem that the runs
    writing to it do not fit on together (runs skipped, with a line, while the model's
    config.json is not there yet; the train job checks again before it starts)."""
    import sys

    found, plans = [], {}
    for name in runs:
        run = config["runs"][name]
        gpu = on_gpu or run.get("gpu", config.get("gpu")) is not None
        try:
            plan = disk_plan_of(config, name, root, basedir, gpu)
        except UserError as exc:  # a model whose config.json the estimate cannot read
            print(f"disk plan: {name}: not checked ({exc})", file=sys.stderr)
            continue
        if plan is None:
            print(
                f"disk plan: {name}: checked by the train job (the model's config.json is "
                "not there yet)",
                file=sys.stderr,
            )
            continue
        plans[name] = plan
        line = format_disk(name, plan)
        if plan["fits"]:
            print(f"disk plan: {line}", file=sys.stderr)
        else:
            found.append(f"disk plan: {line}")
    for group in shared_filesystems(plans):
        if group["fits"]:
            print(f"disk plan: {format_shared(group)}", file=sys.stderr)
        else:
            found.append(f"disk plan: {format_shared(group)}")
    return found


def check_job_disk(
    spec: dict[str, Any], model_dir: Path, deepspeed: Path, run_dir: Path, on_gpu: bool
) -> dict[str, Any] | None:
    """The train job's check before it starts any worker: UserError (one line) when the
    run does not fit; its plan when it does; None (with a log line) for a model whose
    config.json the estimate cannot read."""
    import json

    from snaketune.budget.fit import setup_of

    config = model_dir / "config.json"
    try:
        shape = shape_of(json.loads(config.read_text()), str(config))
    except (UserError, OSError, ValueError) as exc:
        log.warning("disk plan: not checked (%s); each save is still checked", exc)
        return None
    ds = json.loads(deepspeed.read_text())
    plan = plan_disk(shape, setup_of(spec, ds, on_gpu), spec, ds, run_dir, model_dir)
    if not plan["fits"]:
        raise UserError(f"disk: {format_disk(run_dir.name, plan)}")
    return plan
