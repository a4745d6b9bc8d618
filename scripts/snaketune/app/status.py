"""`snaketune status`: where a pipeline is, read from what it already writes (no daemon).

Each run under results/ with its stages and their state: done, running (a train job's
step, loss, tokens/s, ETA and attempt), queued or running on SLURM (its job id, from
squeue's comment, which the SLURM executor plugin sets to ``rule_<rule>_wildcards_<run>``),
stopped or failed (the attempt's one-line reason), not started; the warnings of a run that
cannot learn (snaketune.train.vitals); a finished run's headline figures. Then each
scoring stage's jobs (snaketune.budget.scoring), with the runs that read them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from snaketune.plan.pipeline import EVALUATE, SHARD, TRAIN, with_status

COMMENT = re.compile(r"^rule_(?P<rule>.+?)_wildcards_(?P<wildcards>.*)$")


def slurm_jobs(runs: list[str]) -> dict[tuple[str, str], tuple[str, str]]:
    """(rule, run) -> (SLURM job id, state) of this user's jobs the workflow submitted
    (empty off SLURM: no squeue)."""
    if shutil.which("squeue") is None:
        return {}
    try:
        out = subprocess.run(
            ["squeue", "--me", "-h", "-o", "%i|%T|%k"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in out.splitlines():
        job, state, comment = (line.split("|", 2) + ["", ""])[:3]
        match = COMMENT.match(comment.strip())
        if not match:
            continue
        wildcards = match["wildcards"]
        run = max(
            (r for r in runs if wildcards == r or wildcards.startswith(r + "_")),
            key=len,
            default=None,
        )
        if run is not None:
            found[(match["rule"], run)] = (job, state.lower())
    return found


def started_outputs(workdir: Path) -> tuple[list[str], bool]:
    """The outputs Snakemake marks as being made (.snakemake/incomplete: running now, or left
    by an interrupted invocation) and whether a Snakemake holds the directory's lock."""
    from base64 import urlsafe_b64decode

    marks = workdir / ".snakemake/incomplete"
    paths = []
    for mark in marks.rglob("*") if marks.is_dir() else ():
        if mark.is_file() and "@" not in mark.name:
            try:
                paths.append(urlsafe_b64decode(mark.name.encode()).decode())
            except (ValueError, UnicodeDecodeError):
                continue
    locks = workdir / ".snakemake/locks"
    return paths, locks.is_dir() and any(locks.iterdir())


def train_state(folder: Path) -> str | None:
    """A train job that has started: running (its step, loss, tokens/s, ETA and attempt),
    or how its last attempt ended; None: never started."""
    from snaketune.train.attemptlog import live_progress, read_attempts

    attempts = read_attempts(folder)
    if not attempts:
        return None
    last = attempts[-1]
    n = f"attempt {last['attempt']}"
    if last.get("reason") == "running":
        step = live_progress(folder / "checkpoints/metrics.jsonl") or "starting (no step yet)"
        return f"running, {n}: {step}"
    if last.get("exit") == 0:
        return f"finished ({n}), publishing"
    word = "stopped" if last.get("exit") == 3 else "failed"
    return f"{word} ({n}): {last.get('reason')}; rerun the same command to resume"


def headline(metrics: Path) -> str:
    """A finished evaluation's headline figures, tuned (base)."""
    ev = json.loads(metrics.read_text())
    figures = ev.get("figures") or {}
    parts = []
    for name in ev.get("headline") or []:
        f = figures.get(name) or {}
        if f.get("value") is None:
            continue
        base = f" (base {f['base']:.4g})" if f.get("base") is not None else ""
        parts.append(f"{name} {f['value']:.4g}{base}")
    return ", ".join(parts) or "evaluated"


def run_status(
    run_dir: Path, queued: dict[tuple[str, str], tuple[str, str]], started: tuple[list[str], bool]
) -> list[str]:
    """The lines of one run: a line per stage, then its warnings."""
    from snaketune.train.vitals import read

    run = run_dir.name
    lines = [f"run {run}"]
    for stage in with_status():  # a run's own stages, in order
        outputs = stage.done
        done = next((o for o in outputs if (run_dir / o).exists()), None)
        making = any(
            p.startswith(f"results/{run}/{o.split('/')[0]}") for o in outputs for p in started[0]
        )
        state = None
        if done and stage is EVALUATE:
            state = f"done: {headline(run_dir / done)}"
        elif done:
            state = "done"
        elif (stage.name, run) in queued:
            job, slurm = queued[(stage.name, run)]
            state = f"{slurm} on SLURM (job {job})"
        elif making:
            state = "running" if started[1] else "interrupted (rerun to redo it)"
        if stage is TRAIN and not done:
            state = train_state(run_dir / TRAIN.folder) or state
        lines.append(f"  {stage.name:<19}{state or '-'}")
    for warning in read(run_dir / TRAIN.folder).values():
        lines.append(f"  warning: {warning}")
    return lines


def status(workdir: Path) -> list[str]:
    """Every run under ``workdir``/results, a few lines each, in name order."""
    results = workdir / "results"
    found = results.iterdir() if results.is_dir() else ()
    runs = sorted(p for p in found if (p / SHARD.folder).is_dir() or (p / TRAIN.folder).is_dir())
    sets = parts_status(results, started_outputs(workdir))
    if not runs:
        return sets or [f"no run has started under {results} yet"]
    from snaketune.budget.scoring import STAGES

    keys = [p.name for s in STAGES for p in (results / s.name).glob("*") if p.is_dir()]
    # one squeue for every run and scoring key (a key names no run: its own jobs)
    queued, started = slurm_jobs([p.name for p in runs] + keys), started_outputs(workdir)
    lines = [line for p in runs for line in run_status(p, queued, started)]
    return sets + lines + scoring_status(results, runs, queued, started)


def scoring_status(
    results: Path,
    runs: list[Path],
    queued: dict[tuple[str, str], tuple[str, str]],
    started: tuple[list[str], bool],
) -> list[str]:
    """The scoring stages' jobs (snaketune.budget.scoring's registry: the reference log-probs,
    a teacher's top-k) under results/<stage>/<key>: done, running, queued on SLURM or
    interrupted, and the runs whose train jobs read each (their job.json)."""
    from snaketune.budget.scoring import STAGES

    readers: dict[str, list[str]] = {}
    for run in runs:
        job = run / TRAIN.folder / "job.json"
        inputs = json.loads(job.read_text())["inputs"] if job.is_file() else {}
        for stage in STAGES:
            if stage.name in inputs:
                readers.setdefault(inputs[stage.name], []).append(run.name)
    lines = []
    for stage in STAGES:
        folders = sorted(p for p in (results / stage.name).glob("*") if p.is_dir())
        for folder in folders:
            output = f"results/{stage.name}/{folder.name}/{stage.output}"
            if (folder / stage.output).is_file():
                state = "done"
            elif (stage.name, folder.name) in queued:
                job, slurm = queued[(stage.name, folder.name)]
                state = f"{slurm} on SLURM (job {job})"
            elif any(p.startswith(f"results/{stage.name}/{folder.name}/") for p in started[0]):
                state = "running" if started[1] else "interrupted (rerun to redo it)"
            else:
                state = "-"
            read = readers.get(output)
            lines.append(
                f"{stage.name} {folder.name}: {state}"
                + (f" (read by {', '.join(read)})" if read else "")
            )
    return lines


def parts_status(results: Path, started: tuple[list[str], bool]) -> list[str]:
    """A line for each tokenized set being made in parts (snaketune.core.parts): the parts
    done of how many, and those running or interrupted; none once its index is there."""
    import re

    name = re.compile(r"part-\d{5}-of-(\d{5})\.parquet$")
    lines = []
    for folder in sorted((results / "tokenized").glob("*")) if results.is_dir() else ():
        made = [m for p in folder.glob("part-*.parquet") if (m := name.search(p.name))]
        prefix = f"results/tokenized/{folder.name}/"
        making = [m for p in started[0] if p.startswith(prefix) and (m := name.search(p))]
        if (folder / "parts.json").is_file() or not (made or making):
            continue
        line = f"tokenize {folder.name}: {len(made)} of {int((made + making)[0][1])} parts done"
        if making:
            word = "running" if started[1] else "interrupted (rerun to redo them)"
            line += f", {len(making)} {word}"
        lines.append(line)
    return lines
