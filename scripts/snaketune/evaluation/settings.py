"""The evaluate stages' settings: which of a run's eval settings its base model's
evaluation shares, and the options evaluate.py gets (a run's: its method and the method's
own settings, the user's metrics; a base model's: the shared settings alone), and whether
they generate."""

from __future__ import annotations

import json
from typing import Any


def shared_eval(run: dict[str, Any]) -> dict[str, Any] | None:
    """A run's eval settings that its base model's evaluation shares: all but the user's
    metrics (``metrics``: the run's own evaluate stage scores the base's generations too)."""
    ev = run.get("eval")
    return None if ev is None else {k: v for k, v in ev.items() if k != "metrics"}


def eval_args(
    settings: dict[str, Any],
    method: str | None = None,
    own: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
) -> str:
    """evaluate.py options for eval settings: a run's (``method``, its name; ``own``, its
    method's settings, snaketune.methods' ``eval_settings``; ``metrics``, the user's
    metrics, snaketune.evaluation.scorers.spec) or a base model's (none of them)."""
    import shlex

    args = f"--max-new-tokens {settings['max_new_tokens']} --batch-size {settings['batch_size']}"
    args += f" --method {method}" if method is not None else ""
    args += "".join(f" --{k} {v}" for k, v in sorted((own or {}).items()))
    args += f" --limit {settings['limit']}" if "limit" in settings else ""
    if settings.get("lm_eval"):
        args += f" --lm-eval {shlex.quote(json.dumps(settings['lm_eval'], sort_keys=True))}"
    if metrics:
        args += (
            f" --metrics {shlex.quote(json.dumps(metrics, sort_keys=True, separators=(',', ':')))}"
        )
    return args


def generates(config: dict[str, Any], run: dict[str, Any]) -> bool:
    """Whether a run's evaluate stages generate: its eval set's kind (documents have no
    prompt: their loss alone)."""
    from snaketune.data.formats import components
    from snaketune.data.kinds import kind_of_sources

    specs = (config["datasets"][p["name"]] for p in components(config, run["eval_dataset"]))
    return kind_of_sources(specs).generates
