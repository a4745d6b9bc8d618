"""The names a config's entries use of each other: a run's model and datasets, the run it
starts from. Checked for every run in the one pass of ``snaketune.plan.config`` (a run the
schema refused too), so that a user fixing a config sees each unknown name with the
schema's own lines, not after them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_references(name: str, run: Mapping[str, Any], cfg: Mapping[str, Any]) -> list[str]:
    """The names a run refers to that the config does not define (its model, datasets, and
    for a run the schema refused, the run it starts from): a line each. Checked for every
    run, so that a run with a typo in a key also has its unknown names said in one pass."""
    from snaketune.plan.sweep import sweeps_of

    where, lines = f"runs.{name}", []
    for key, section in (
        ("model", "models"),
        ("dataset", "datasets"),
        ("eval_dataset", "datasets"),
    ):
        if isinstance(run.get(key), str) and run[key] not in cfg[section]:
            lines.append(
                f"{where}.{key}: unknown {section[:-1]} {run[key]!r} "
                f"(defined: {', '.join(sorted(cfg[section]))})"
            )
    parent = run.get("init_from")
    runs = cfg["runs"]
    sweeps = sweeps_of(runs)
    if isinstance(parent, str) and parent not in runs and parent not in sweeps:
        lines.append(
            f"{where}.init_from: unknown run or sweep {parent!r} (defined: "
            f"{', '.join(sorted([*runs, *sweeps]))})"
        )
    return lines
