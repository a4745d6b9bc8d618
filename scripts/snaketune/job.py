"""The contract between the train job's launcher (snaketune.launch, one per node or job)
and its workers (snaketune.worker, one per device): exit codes, output names, the record a
segment of training leaves. Both import this module; the launcher never imports the
worker (nor torch).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STOPPED_EXIT_CODE = 3  # stopped at a step end (signal or time limit), checkpoint saved
HEALTH_EXIT_CODE = 4  # stopped by the GPU health watchdog (checkpoint saved)
DISK_EXIT_CODE = 5  # stopped before a save the disk had no room for (last checkpoint intact)
NETWORK_EXIT_CODE = 6  # the all-reduce was slower than preflight.min_busbw_gbps

# Written by rank 0 when this job's training ends: why, at which step, time spent.
SEGMENT = "segment.json"

# Outputs the workers write (staged); the launcher adds run_config.json and provenance.json
# and renames all of them into place at once, after every worker has exited 0.
WORKER_OUTPUTS = ("final_checkpoint", "model", "probe.safetensors", "metrics.jsonl")


def staged(out: Path, name: str) -> Path:
    """Where a finished output of the train step waits until the launcher publishes it."""
    return out / f".{name}.staged"


def write_segment(ckpt_dir: Path, reason: str, step: int, train_s: float, save_s: float,
                  disk: str | None = None) -> None:  # fmt: skip
    """How this job's training ended (rank 0): ``reason`` done, time, signal, health or
    disk (with what was short), the step, and the seconds spent training and saving."""
    from snaketune.io import write_json

    record: dict[str, Any] = {"reason": reason, "step": step, "train_s": round(train_s, 3),
                              "save_s": round(save_s, 3)}  # fmt: skip
    if disk is not None:
        record["disk"] = disk
    write_json(ckpt_dir / SEGMENT, record)


def read_segment(ckpt_dir: Path) -> dict[str, Any]:
    """The record of the segment that just ended ({} when the workers wrote none)."""
    path = ckpt_dir / SEGMENT
    return json.loads(path.read_text()) if path.exists() else {}


@dataclass(frozen=True)
class WorkerEnv:
    """Where this process sits in the job (from torchrun's environment)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int

    @classmethod
    def from_environ(cls) -> WorkerEnv:
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            node_rank=int(env.get("GROUP_RANK", 0)),
        )


@dataclass(frozen=True)
class Job:
    """One train job: the run's spec and where its inputs and outputs are."""

    spec: dict
    shards: Path
    model: Path
    deepspeed: Path
    out: Path
    launcher: str  # auto, local or slurm
    worker_argv: list[str]  # the worker's command line (scripts/train.py --worker ...)
    lock_wait_s: float = 180.0  # how long a second training of the run waits for the first
    time_limit_min: float | None = None  # the job's runtime (used where SLURM gives no end)
    stop_margin_s: float = 120.0  # stop this long (plus a step and a save) before the end

    @property
    def ckpt(self) -> Path:
        return self.out / "checkpoints"
