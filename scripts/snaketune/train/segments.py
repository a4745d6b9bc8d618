"""A run's segments: one per train job (or per continuation within one), recorded in
``checkpoints/segments.jsonl`` (when, where, from which step to which, why it ended, time
spent training), the allocation's end a segment stops ahead of, and a SLURM job putting
itself back in the queue to continue.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import time
from datetime import datetime

from snaketune.core.io import read_jsonl
from snaketune.core.job import Job

log = logging.getLogger(__name__)

SEGMENTS = "segments.jsonl"  # one line per job of the run: when, where, why it ended


def allocation_end(job: Job, started: float) -> float | None:
    """When this job's allocation ends (epoch seconds): SLURM's end time for a SLURM job,
    else ``started`` plus the rule's runtime; None: no limit known."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id and shutil.which("squeue"):
        try:
            out = subprocess.run(
                ["squeue", "-h", "-j", job_id, "-o", "%e"],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout.strip()
            if out in ("UNLIMITED", "NONE"):
                return None  # the job has no time limit
            return datetime.fromisoformat(out).timestamp()
        except (subprocess.SubprocessError, ValueError):  # N/A, squeue down
            log.warning("could not read the end time of SLURM job %s from squeue", job_id)
    if job.time_limit_min:
        return started + job.time_limit_min * 60
    return None


def read_segments(job: Job) -> list[dict]:
    path = job.ckpt / SEGMENTS
    if not path.exists():
        return []
    return read_jsonl(path)


def slurm_restarts() -> int:
    """How many times this SLURM job was requeued (scontrol's Restarts; SLURM_RESTART_COUNT
    does not always reach the job's shell)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return 0
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=60
        ).stdout
    except (subprocess.SubprocessError, OSError):
        out = ""
    found = re.search(r"\bRestarts=(\d+)", out)
    return int(found.group(1)) if found else int(os.environ.get("SLURM_RESTART_COUNT", "0"))


def record_segment(job: Job, began: float, from_step: int, ended: dict, attempt: int = 0) -> None:
    line = {
        "attempt": attempt,  # snaketune.train.attempts: the job start it ran in
        "job": os.environ.get("SLURM_JOB_ID"),
        "restart": slurm_restarts(),
        "host": socket.gethostname(),
        "began": round(began, 3),
        "ended": round(time.time(), 3),
        "from_step": from_step,
        "to_step": ended.get("step"),
        "reason": ended.get("reason", "failed"),
        "train_s": ended.get("train_s", 0.0),
        "save_s": ended.get("save_s"),
        # rank 0's start-up (snaketune.train.startup): its worker's start, its first step's,
        # the one-time op builds it waited on
        **{k: ended.get(k) for k in ("worker_started", "first_step_at", "compile_s")},
    }
    try:
        with open(job.ckpt / SEGMENTS, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    except OSError as exc:  # a full disk: the job's own outcome is what to report
        log.warning("could not record this job in %s: %s", SEGMENTS, exc)


def process_started() -> float | None:
    """When this process started (epoch seconds; Linux's /proc), None where unknown: the
    train job's own start, its Python's and its imports' time included, as Snakemake's
    benchmark of the rule counts it."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as fh:
            boot = next(ln for ln in fh if ln.startswith("btime"))
        return float(boot.split()[1]) + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def segments_summary(segments: list[dict]) -> dict:
    """Jobs the run took, its wall time from the first start to the last end (queue waits
    between jobs included) and the part of it spent outside training steps."""
    if not segments:
        return {"jobs": 0}
    wall = segments[-1]["ended"] - segments[0]["began"]
    train = sum(s.get("train_s") or 0.0 for s in segments)
    compiled = sum(s.get("compile_s") or 0.0 for s in segments)
    out = {
        "jobs": len(segments),
        "continuations": sum(s["reason"] == "time" for s in segments),
        "wall_s": round(wall, 1),
        "train_s": round(train, 1),
        "outside_training_s": round(wall - train, 1),
        "compile_s": round(compiled, 1),  # one-time: a machine's first job's op builds
    }
    timed = [s for s in segments if s.get("first_step_at")]
    if timed:  # each job's own start-up: its start to its first step, less the op builds
        startup = sum(s["first_step_at"] - s["began"] - (s.get("compile_s") or 0) for s in timed)
        out["startup_s"] = round(startup / len(timed), 1)  # a job's, on average
        started = [s["worker_started"] - s["began"] for s in timed if s.get("worker_started")]
        if started:  # of it: the launcher, the agents, their rendezvous
            out["launch_s"] = round(sum(started) / len(started), 1)
    return out


def requeue_self() -> bool:
    """Put this SLURM job back in the queue (``scontrol requeue``): SLURM ends this run of
    it and starts it again, same job id, which resumes from the checkpoint just saved."""
    job_id = os.environ["SLURM_JOB_ID"]
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job_id, proc.stderr.strip())
        return False
    log.warning(
        "SLURM job %s requeued: it continues from the checkpoint when it starts again", job_id
    )
    return True
