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


def newest_complete(directory: Path) -> Path | None:
    """The checkpoint a rerun resumes from (half-written ones are ignored)."""
    done = [p for p in checkpoints(directory) if is_complete(p)]
    return done[-1] if done else None


def prune(directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop older and half-written ones."""
    done = [p for p in checkpoints(directory) if is_complete(p)]
    newest = checkpoint_step(done[-1]) if done else -1
    for p in checkpoints(directory):
        stale = p in done[:-keep] if is_complete(p) else checkpoint_step(p) <= newest
        if stale:
            shutil.rmtree(p, ignore_errors=True)


def mark_complete(path: Path, step: int, time: float) -> None:
    (path / COMPLETE).write_text(json.dumps({"step": step, "time": time}))


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines after ``step`` (a resumed run writes them again)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
    path.write_text("".join(f"{ln}\n" for ln in lines))
