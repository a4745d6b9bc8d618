"""Resumable checkpoints of the train stage: which ones count, which ones are kept.

Checkpoints live in ``<out>/checkpoints/checkpoint-<step>``; one counts (is resumed from)
only once every rank has written its part and rank 0 has added the COMPLETE mark.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

COMPLETE = "snaketune-complete.json"


def checkpoint_step(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[1])


def checkpoints(directory: Path) -> list[Path]:
    """checkpoint-<step> directories, oldest first."""
    found = [
        p for p in directory.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()
    ]
    return sorted(found, key=checkpoint_step)


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def is_reduced(path: Path) -> bool:
    """Reduced to its model weights (``checkpoints.optimizer: last``): not resumable."""
    try:
        return bool(json.loads((path / COMPLETE).read_text()).get("weights_only"))
    except (OSError, ValueError):
        return False


def newest_complete(directory: Path) -> Path | None:
    """The checkpoint a rerun resumes from (half-written and reduced ones are ignored)."""
    done = [p for p in checkpoints(directory) if is_complete(p) and not is_reduced(p)]
    return done[-1] if done else None


# What Trainer writes of the model into a checkpoint (a reduced checkpoint keeps these).
MODEL_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def reduce_to_weights(path: Path) -> None:
    """Drop a complete checkpoint's DeepSpeed states (optimizer and module partitions),
    keeping the model Trainer saved beside them; a checkpoint with no saved model (ZeRO-3
    without gathered 16-bit weights) is left whole."""
    if not is_complete(path) or is_reduced(path):
        return
    if not any((path / name).is_file() for name in MODEL_FILES):
        return
    # marked first: a reduction cut short never leaves a checkpoint that claims to resume
    mark = json.loads((path / COMPLETE).read_text())
    (path / COMPLETE).write_text(json.dumps({**mark, "weights_only": True}))
    for states in path.glob("global_step*"):
        shutil.rmtree(states, ignore_errors=True)
    for name in ("latest", "latest_universal"):
        (path / name).unlink(missing_ok=True)


def heldout_of(path: Path) -> dict | None:
    """The held-out figures a checkpoint's completion mark records (None: not evaluated)."""
    try:
        return json.loads((path / COMPLETE).read_text()).get("heldout")
    except (OSError, ValueError):
        return None


def best_checkpoint(directory: Path, metric: str, greater: bool) -> Path | None:
    """The complete checkpoint with the best held-out ``metric`` in its mark (the earliest
    of equals; None: no checkpoint was evaluated)."""
    best, value = None, None
    for p in checkpoints(directory):
        got = heldout_of(p) if is_complete(p) else None
        if got is None or metric not in got:
            continue
        if value is None or (got[metric] > value if greater else got[metric] < value):
            best, value = p, got[metric]
    return best


def prune(
    directory: Path, keep: int, optimizer: str = "all", best: tuple[str, bool] | None = None
) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop older and half-written ones. With
    ``optimizer`` last, every kept one but the newest is reduced to its model weights. With
    ``best`` (a held-out metric and whether greater is better), the checkpoint best by it
    is kept whole besides (export.checkpoint: best loads it at the end)."""
    done = [p for p in checkpoints(directory) if is_complete(p)]
    newest = checkpoint_step(done[-1]) if done else -1
    kept = best_checkpoint(directory, *best) if best else None
    for p in checkpoints(directory):
        stale = p in done[:-keep] if is_complete(p) else checkpoint_step(p) <= newest
        if stale and p != kept:
            shutil.rmtree(p, ignore_errors=True)
    resumable = newest_complete(directory)
    if optimizer == "last" and resumable is not None:
        for p in done[-keep:]:
            if checkpoint_step(p) < checkpoint_step(resumable) and p != kept:
                reduce_to_weights(p)


def drop_incomplete(directory: Path) -> list[Path]:
    """Remove every checkpoint without its COMPLETE mark (only when no worker runs)."""
    dropped = [p for p in checkpoints(directory) if not is_complete(p)]
    for p in dropped:
        shutil.rmtree(p, ignore_errors=True)
    return dropped


def mark_complete(path: Path, step: int, time: float, heldout: dict | None = None) -> None:
    """The completion mark, with the held-out figures of an evaluation at this step."""
    mark = {"step": step, "time": time, **({"heldout": heldout} if heldout else {})}
    (path / COMPLETE).write_text(json.dumps(mark))


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines after ``step`` (a resumed run writes them again)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
    path.write_text("".join(f"{ln}\n" for ln in lines))
