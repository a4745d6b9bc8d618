"""Reading a run's attempts (snaketune.train.attempts writes them): each attempt's log
under ``results/<run>/train/logs``, its records in ``attempts.jsonl`` merged into one per
attempt (a running or killed attempt told apart), its last line, the rank that failed
first as torchrun reports it, the live progress of a running one, and the lines and
records the rule's log, provenance and the report show."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from snaketune.core.io import host_name, read_jsonl, written_rows
from snaketune.core.runlock import process_alive

LOGS = "logs"  # results/<run>/train/logs: attempt-<n>.log, attempts.jsonl


RECORDS = "attempts.jsonl"


def logs_dir(out: Path) -> Path:
    return out / LOGS


def attempt_log(out: Path, number: int) -> Path:
    return logs_dir(out) / f"attempt-{number}.log"


def last_line(path: Path) -> str:
    """The last non-empty line of a log ('' when none)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def live_progress(live: Path) -> str | None:
    """A training's newest step from its live metrics (``live``): step of steps, loss,
    tokens/s and the ETA of this start; None before its first step."""
    rows = [r for r in written_rows(live) if "loss" in r] if live.is_file() else []
    if not rows:
        return None
    last = rows[-1]
    total = last.get("max_steps")
    loss = f"{last['loss']:.4f}" if last.get("loss") is not None else "-"
    line = (
        f"step {last['step']}{f'/{total}' if total else ''}, loss {loss}, "
        f"{last.get('tokens_per_s', 0):,.0f} tok/s"
    )
    start = len(rows) - 1  # this start's rows: elapsed_s counts from its own start
    while start > 0 and rows[start - 1].get("elapsed_s", 0) < rows[start].get("elapsed_s", 0):
        start -= 1
    done = last["step"] - rows[start]["step"]
    if total and done > 0:
        left = (last["elapsed_s"] - rows[start]["elapsed_s"]) / done * (total - last["step"])
        line += f", ETA {int(left) // 3600}:{int(left) % 3600 // 60:02d}:{int(left) % 60:02d}"
    return line


def stopped_since(since: float, workdir: Path = Path(".")) -> list[str]:
    """A line per run whose train job stopped or failed after ``since`` (epoch seconds):
    its last attempt's reason and log, and how to resume (the workflow's last words on an
    interrupted or failed invocation)."""
    lines = []
    for out in sorted((workdir / "results").glob(f"*/train/{LOGS}")):
        attempts = read_attempts(out.parent)
        last = attempts[-1] if attempts else {}
        if last.get("exit", 0) != 0 and last.get("ended", 0) >= since:
            lines.append(
                f"snaketune: run {out.parent.parent.name}: {last['reason']} (its log: "
                f"{out.parent / last['log']})"
            )
    return lines


def read_attempts(out: Path) -> list[dict]:
    """Every attempt of the run, oldest first: its start record merged with its end (exit,
    reason). An attempt without an end is still running (its process is alive on this
    host) or was killed before it could write one (its log's last line is the reason)."""
    path = logs_dir(out) / RECORDS
    merged: dict[int, dict] = {}
    for record in read_jsonl(path) if path.is_file() else []:
        merged.setdefault(record["attempt"], {}).update(record)
    for number, attempt in merged.items():
        if "exit" in attempt:
            continue
        here = attempt.get("host") == host_name()
        if here and process_alive(attempt.get("pid", -1), attempt.get("pid_started")):
            attempt["reason"] = "running"
            continue
        last = last_line(attempt_log(out, number))
        attempt["reason"] = (
            "ended without a record (the job was killed: SIGKILL, its node, or SLURM's "
            "hard limit)" + (f"; its log's last line: {last}" if last else "")
        )
    return [merged[n] for n in sorted(merged)]


ROOT_CAUSE = "Root Cause (first observed failure):"


_FIELD = re.compile(r"^\s*(host|rank|exitcode|traceback)\s*: (.*)$")


def root_cause(text: str) -> str | None:
    """The failed rank torchrun's agents reported ('rank 1 on host-a: exitcode -9 (pid
    123) SIGKILL'), preferring a failure that was not the stop the others were sent, and
    among those a rank a signal ended (killed, out of memory, a crash) over one that exited
    with an error, which is what its peers do when a rank dies under them (each agent
    reports its own first failure: a killed rank's and a peer's both come)."""
    causes, killed = [], set()
    for block in text.split(ROOT_CAUSE)[1:]:
        fields: dict[str, str] = {}
        for line in block.splitlines()[1:12]:
            found = _FIELD.match(line)
            if found and found.group(1) not in fields:
                fields[found.group(1)] = " ".join(found.group(2).split())
        if "rank" in fields:
            rank = fields["rank"].split(" (")[0]
            cause = (
                f"rank {rank} on {fields.get('host', '?')}: exitcode {fields.get('exitcode', '?')}"
            )
            trace = fields.get("traceback", "")
            if trace and not trace.startswith("To enable traceback"):
                cause += f": {trace}"
            causes.append(cause)
            if fields.get("exitcode", "").startswith("-"):  # ended by a signal
                killed.add(cause)
    stops = ("SIGTERM", "SIGINT")
    first = [c for c in causes if not any(s in c for s in stops)] or causes
    first.sort(key=lambda c: c not in killed)  # stable: the report's order otherwise
    return first[0][:300] if first else None


def describe(attempt: dict) -> str:
    """One line: the attempt, its log, when and where, how it ended."""
    where = attempt.get("host", "?")
    if attempt.get("job"):
        where += f", SLURM job {attempt['job']} run {attempt.get('restart', 0) + 1}"
    began = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(attempt.get("began", 0)))
    ended = f"exit {attempt['exit']}" if "exit" in attempt else "no exit code"
    return (
        f"attempt {attempt['attempt']} ({LOGS}/attempt-{attempt['attempt']}.log, "
        f"{began}, {where}): {ended}: {attempt.get('reason') or '-'}"
    )


def summary(out: Path) -> list[dict]:
    """The attempts as provenance.json and the report show them."""
    keys = ("attempt", "log", "began", "ended", "host", "job", "restart", "exit", "reason")
    return [{k: a[k] for k in keys if k in a} for a in read_attempts(out)]
