"""The plan each run gets before queueing: its steps, its warnings, its train estimate and
the costs of its stages on stderr, each estimate kept for the summary, and the runs whose
train estimate needs more continuations of its job than ``max_continuations`` allows."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def check_steps(
    config: dict[str, Any],
    shapes: dict[str, Any],
    workdir: Path,
    runtime: dict[str, float] | None = None,
    record: list[tuple[Path, dict[str, Any]]] | None = None,
) -> list[str]:
    """The check before queueing, of each run of ``shapes`` (its model's Shape, None where
    its config.json cannot be read yet): its steps, warnings and train estimate on stderr;
    a line per run the shard stage would refuse, or whose estimate needs more continuations
    of its train job (``runtime``: its time limit in minutes, by run) than
    max_continuations allows. ``record`` (a real run, not a dry one): each estimate and the
    results/<run>/estimate.json to keep it in (the summary and the report compare it with
    what the run took), appended for the caller to write once nothing is refused."""

    from snaketune.budget.cost import ESTIMATE, estimate, format_estimate, format_steps, steps_of
    from snaketune.budget.stagecost import costs_of, format_costs, format_pipeline

    found, costs = [], []
    for name, shape in shapes.items():
        run = config["runs"][name]
        s = steps_of(config, name, workdir)
        if "problem" in s:
            found.append(s["problem"])
            continue
        lines = format_steps(name, s)
        if shape is not None:
            e = estimate(config, name, workdir, shape, s)
            lines.append(format_estimate(name, e, run["nodes"] * run["gpus_per_node"]))
            costs.append(costs_of(config, name, shape, s, e, workdir))
            lines += format_costs(name, costs[-1])
            if record is not None and "wall_s" in e:
                record.append((workdir / "results" / name / ESTIMATE, {**e, "steps": s["steps"]}))
            problem, said = continuations(name, run, e, (runtime or {}).get(name))
            if problem:
                found.append(problem)
                continue
            lines += [said] if said else []
        for line in lines:
            print(f"plan: {line}", file=sys.stderr)
    for line in format_pipeline(costs):
        print(f"plan: {line}", file=sys.stderr)
    return found


def keep_all(estimates: list[tuple[Path, dict[str, Any]]]) -> None:
    """Write each estimate check_steps recorded (snaketune.budget.cost.keep)."""
    from snaketune.budget.cost import keep

    for path, figures in estimates:
        keep(path, figures)


def continuations(
    name: str, run: dict[str, Any], e: dict[str, Any], limit: float | None
) -> tuple[str | None, str | None]:
    """Where the train estimate is over the job's time limit (``limit`` minutes): (the
    problem, None) when it needs more continuations than max_continuations allows, else
    (None, the plan's line saying how many); (None, None) within the limit."""
    import math

    from snaketune.budget.cost import duration

    if not limit or "wall_s" not in e or e["wall_s"] <= limit * 60:
        return None, None
    jobs = math.ceil(e["wall_s"] / (limit * 60))
    line = (
        f"runs.{name}: the train estimate ({duration(e['wall_s'])}) is over "
        f"its job's time limit ({limit:g} min): about {jobs} jobs, "
        f"{jobs - 1} continuation(s)"
    )
    if jobs - 1 > run["max_continuations"]:
        return (
            f"{line}, more than max_continuations ({run['max_continuations']}); raise it, "
            "or the job's runtime, or train fewer steps"
        ), None
    return None, f"{name}: {line.split(': ', 1)[1]} (max_continuations {run['max_continuations']})"
