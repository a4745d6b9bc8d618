"""The contract between the train job's launcher (snaketune.train.launch, one per node or job)
and its workers (snaketune.train.worker, one per device): exit codes, output names, the record a
segment of training leaves, what the launcher hands the workers (``Handoff``). Both
import this module; the launcher never imports the worker (nor torch).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
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


def write_segment(
    ckpt_dir: Path,
    reason: str,
    step: int,
    train_s: float,
    save_s: float,
    disk: str | None = None,
    startup: dict[str, Any] | None = None,
) -> None:
    """How this job's training ended (rank 0): ``reason`` done, time, signal, health or
    disk (with what was short), the step, the seconds spent training and saving, and its
    start-up figures (snaketune.train.startup)."""
    from snaketune.core.io import write_json

    record: dict[str, Any] = {
        "reason": reason,
        "step": step,
        "train_s": round(train_s, 3),
        "save_s": round(save_s, 3),
        **(startup or {}),
    }
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


# What the launcher hands its workers for one start of them, through their environment:
# the Handoff's fields and their variables. Nothing else passes from launcher to worker.
HANDOFF_ENV = {
    "deadline": "SNAKETUNE_DEADLINE",
    "stop_margin_s": "SNAKETUNE_STOP_MARGIN",
    "save_s": "SNAKETUNE_SAVE_S",
    "load_universal": "SNAKETUNE_LOAD_UNIVERSAL",
    "checkpoint_bytes": "SNAKETUNE_CHECKPOINT_BYTES",
}


@dataclass(frozen=True)
class Handoff:
    """What the launcher hands its workers (set by snaketune.train.launch.start_workers, read by
    the worker once, at its start)."""

    deadline: float | None = None  # epoch seconds to stop ahead of (None: no limit known)
    stop_margin_s: float = 0.0  # with a deadline: the run's stop_margin_seconds
    save_s: float | None = None  # the save time the previous job measured (None: none yet)
    load_universal: bool = False  # resume from a universal checkpoint (another rank count)
    checkpoint_bytes: int = 0  # one checkpoint's size, from the disk plan (0: not planned)

    def environ(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` (the workers' environment) with this handoff in it, and nothing of an
        earlier one."""
        out = {k: v for k, v in env.items() if k not in HANDOFF_ENV.values()}
        if self.deadline is not None:
            out[HANDOFF_ENV["deadline"]] = f"{self.deadline:.0f}"
            out[HANDOFF_ENV["stop_margin_s"]] = f"{self.stop_margin_s:.0f}"
        if self.save_s is not None:
            out[HANDOFF_ENV["save_s"]] = f"{self.save_s:.1f}"
        if self.load_universal:
            out[HANDOFF_ENV["load_universal"]] = "1"
        if self.checkpoint_bytes:
            out[HANDOFF_ENV["checkpoint_bytes"]] = str(self.checkpoint_bytes)
        return out

    @classmethod
    def from_environ(cls, env: dict[str, str] | None = None) -> Handoff:
        env = os.environ if env is None else env

        def number(key: str) -> float | None:
            value = env.get(HANDOFF_ENV[key])
            return float(value) if value else None

        return cls(
            deadline=number("deadline"),
            stop_margin_s=number("stop_margin_s") or 0.0,
            save_s=number("save_s"),
            load_universal=env.get(HANDOFF_ENV["load_universal"]) == "1",
            checkpoint_bytes=int(number("checkpoint_bytes") or 0),
        )


# results/<run>/train/job.json: the train job as its launcher resolved it, written once per
# start; every worker process reads it once (its only argument besides --worker).
JOB_FILE = "job.json"


@dataclass(frozen=True)
class Job:
    """One train job: the run's settings, its inputs (shards, model, DeepSpeed config and
    the scoring stages' outputs it reads, by stage name: ``reference_logps``,
    ``teacher_logps``) and its launch settings; written to ``<out>/job.json`` by the
    launcher, read from there by every worker."""

    spec: dict
    shards: Path
    model: Path
    deepspeed: Path
    out: Path
    launcher: str  # auto, local or slurm
    worker_argv: list[str]  # the worker's command line (scripts/train.py --worker --job ...)
    lock_wait_s: float = 180.0  # how long a second training of the run waits for the first
    time_limit_min: float | None = None  # the job's runtime (used where SLURM gives no end)
    # stop this long (plus a step and a save) before the end: scripts/train.py gives the
    # config's stop_margin_seconds
    stop_margin_s: float = 0.0
    # the scoring stages' outputs the run's method reads, by stage name (not in its block)
    inputs: Mapping[str, str] = field(default_factory=dict)
    min_busbw: float | None = None  # preflight.min_busbw_gbps: a slower fabric ends the job
    ids_dir: Path | None = None  # each rank appends the example ids it trains on here

    @property
    def ckpt(self) -> Path:
        return self.out / "checkpoints"

    @property
    def file(self) -> Path:
        return self.out / JOB_FILE

    def write(self) -> Path:
        """``<out>/job.json``, whole (renamed into place)."""
        from snaketune.core.io import atomic_path

        paths = ("shards", "model", "deepspeed", "out", "ids_dir")
        record = {
            "run": self.spec,
            "inputs": {k: str(getattr(self, k)) for k in paths[:3]} | dict(self.inputs),
            "out": str(self.out),
            "launch": {
                "launcher": self.launcher,
                "lock_wait_s": self.lock_wait_s,
                "time_limit_min": self.time_limit_min,
                "stop_margin_s": self.stop_margin_s,
                "min_busbw": self.min_busbw,
                "ids_dir": str(self.ids_dir) if self.ids_dir else None,
            },
        }
        self.out.mkdir(parents=True, exist_ok=True)
        # the settings' order kept (not sorted): the order of a run's rewards is the order
        # its trainer calls and logs them
        with atomic_path(self.file) as tmp:
            tmp.write_text(json.dumps(record, indent=2) + "\n", "utf-8")
        return self.file

    @classmethod
    def read(cls, path: Path) -> Job:
        """The job a launcher wrote (a worker's one read of its settings)."""
        record = json.loads(Path(path).read_text())
        inputs, launch = dict(record["inputs"]), record["launch"]
        return cls(
            spec=record["run"],
            shards=Path(inputs.pop("shards")),
            model=Path(inputs.pop("model")),
            deepspeed=Path(inputs.pop("deepspeed")),
            out=Path(record["out"]),
            launcher=launch["launcher"],
            worker_argv=[],
            lock_wait_s=launch["lock_wait_s"],
            time_limit_min=launch["time_limit_min"],
            stop_margin_s=launch["stop_margin_s"],
            inputs=inputs,
            min_busbw=launch["min_busbw"],
            ids_dir=Path(launch["ids_dir"]) if launch["ids_dir"] else None,
        )
