"""The summary of all runs, one row per run (results/summary.tsv): the model, the method,
the topology, the training and throughput figures, each eval metric with its base and
gain, lm-eval's figures, wall time and GPU-hours; and the one line the pipeline ends with.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from snaketune.budget.calibrate import benchmark_seconds
from snaketune.budget.cost import estimate_columns
from snaketune.core.heldout import split_rows
from snaketune.methods import method_of, methods
from snaketune.methods.outputs import quarters
from snaketune.train.vitals import read as read_warnings


def method_columns() -> list[str]:
    """The methods' own columns (snaketune.methods.outputs), each once, in registry order."""
    return list(dict.fromkeys(c for m in methods().values() for c in m.summary_columns))


COLUMNS = [
    "run",
    "sweep",
    "model",
    "method",
    "nodes_x_devices",
    "steps",
    "final_loss",
    *method_columns(),
    "tokens_per_s",
    "padding",
    "mfu",
    "headline",
    "eval_loss",
    "perplexity",
    "exact_match",
    "base_exact_match",
    "gain_exact_match",
    "math_verify",
    "base_math_verify",
    "gain_math_verify",
    "stop_rate",
    "base_stop_rate",
    "preference_accuracy",
    "gain_preference_accuracy",
    "reward_margin",
    "likelihood_accuracy",
    "base_likelihood_accuracy",
    "gain_loss",
    "wall_time_s",
    "jobs",
    "outside_training_s",
    "gpu_hours",
    "estimated_train_wall_s",
    "estimate_error",
    "estimate_basis",
    "allreduce_busbw_gbps",
    "aux_loss_last_quarter",
    "expert_load_last_quarter",
    "warnings",
]


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def throughput(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Median real tokens/s (the first step, with its start-up, left out), mean padding
    share, median MFU (GPU runs) of a run's metrics."""
    from statistics import median

    steady = metrics[1:] or metrics
    out: dict[str, float] = {}
    if steady and "tokens_per_s" in steady[0]:
        out["tokens_per_s"] = round(median(m["tokens_per_s"] for m in steady), 1)
    if steady and "padding" in steady[0]:
        out["padding"] = round(sum(m["padding"] for m in steady) / len(steady), 4)
    mfus = [m["mfu"] for m in steady if "mfu" in m]
    if mfus:
        out["mfu"] = round(median(mfus), 4)
    return out


def router_quarter(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """A mixture of experts' mean load-balancing loss and expert load (the busiest expert's
    share over an even one) over its last quarter of steps; nothing for a dense run."""
    out = {}
    for key in ("aux_loss", "expert_load"):
        values = [m[key] for m in metrics if m.get(key) is not None]
        if values:
            out[f"{key}_last_quarter"] = quarters(values)[1]
    return out


def heldout_columns(held: list[dict[str, Any]], exported: dict | None) -> dict[str, Any]:
    """Held-out passes while training (eval_steps): the last figures, and the step the model
    was exported from with its figure (export.checkpoint: best)."""
    if not held:
        return {}
    out = {
        f"heldout_{k}_last": held[-1][f"heldout_{k}"]
        for k in ("loss", "exact_match")
        if f"heldout_{k}" in held[-1]
    }
    if exported:
        out["exported_step"] = exported["step"]
        if "metric" in exported:
            out[f"exported_heldout_{exported['metric']}"] = exported["value"]
        if "start_value" in exported:
            out[f"start_heldout_{exported['metric']}"] = exported["start_value"]
            out["exported_worse_than_start"] = exported["worse_than_start"]
    return out


def summary_row(
    run: str,
    spec: dict[str, Any],
    train_dir: Path,
    eval_metrics: Path | None,
    train_benchmark: Path | None,
) -> dict[str, str]:
    from snaketune.core.io import read_jsonl

    metrics, held = split_rows(read_jsonl(train_dir / "metrics.jsonl"))
    provenance = json.loads((train_dir / "provenance.json").read_text())
    row: dict[str, Any] = {
        "run": run,
        "model": spec["model"],
        "method": spec["method"],
        "nodes_x_devices": f"{spec['nodes']}x{spec['gpus_per_node']}",
        "steps": metrics[-1]["step"] if metrics else 0,
        "final_loss": metrics[-1]["loss"] if metrics else None,
        **method_of(spec).summary_figures(metrics),  # the method's own
        **throughput(metrics),
        **router_quarter(metrics),
        **heldout_columns(held, provenance.get("exported")),
    }
    if eval_metrics is not None:
        ev = json.loads(eval_metrics.read_text())
        row.update(figure_columns(ev))  # what the evaluation measured, base beside tuned
        row.update(lm_eval_columns(ev))
    seconds = None  # the train job's, its rule's own start in (Snakemake's benchmark)
    if train_benchmark is not None and train_benchmark.is_file():
        seconds = benchmark_seconds(train_benchmark)
    segments = provenance.get("segments") or {}
    if segments.get("before_launcher_s") is not None:  # one job: its own, as it ran
        seconds = segments["wall_s"] + segments["before_launcher_s"]
    if segments.get("jobs"):
        if segments["jobs"] > 1 or seconds is None:  # every job of the run (continuations,
            seconds = segments["wall_s"]  # retries): first start to last end, waits between
        row.update(jobs=segments["jobs"], outside_training_s=segments["outside_training_s"])
    row.update(estimate_columns(train_dir.parent, seconds))  # made when it was queued
    # what its first steps said about whether it could learn (snaketune.train.vitals)
    row["warnings"] = " | ".join(read_warnings(train_dir).values()) or None
    network = provenance.get("network") or {}  # multi-node jobs: their all-reduce figure
    row["allreduce_busbw_gbps"] = network.get("busbw_gbps")
    if seconds is not None:
        row["wall_time_s"] = round(seconds, 1)
        if provenance.get("device") == "cuda":
            row["gpu_hours"] = round(seconds * spec["nodes"] * spec["gpus_per_node"] / 3600, 3)
    if "sweep_of" in spec:  # a sweep's member: its sweep and its values, a column each
        row["sweep"] = spec["sweep_of"]["run"]
        row.update({f"sweep:{k}": v for k, v in spec["sweep_of"]["values"].items()})
    return {c: _fmt(row.get(c)) for c in COLUMNS + extra_columns([row])}


def column_of(key: str) -> str:
    """summary.tsv's column of an evaluation figure (its key; the held-out loss's is
    eval_loss, beside the training loss)."""
    return {"loss": "eval_loss"}.get(key, key)


def figure_columns(ev: dict[str, Any]) -> dict[str, Any]:
    """Every figure an evaluation shows (metrics.json's ``figures``: snaketune.evaluation.figures)
    as ``<figure>``, ``base_<figure>`` and ``gain_<figure>`` (tuned - base, every one: a
    lower loss is a negative gain), and its
    ``headline``: the figures the run leads with, space-separated."""
    row: dict[str, Any] = {"headline": " ".join(ev.get("headline") or ())}
    for key, figure in (ev.get("figures") or {}).items():
        column = column_of(key)
        row[column] = figure["value"]
        if "base" in figure:
            row[f"base_{column}"] = figure["base"]
            # tuned - base, every one (the held-out loss's column is gain_loss)
            row["gain_loss" if key == "loss" else f"gain_{column}"] = figure["gain"]
    return row


def extra_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The columns after the fixed ones: each swept key (``sweep:<path>``, first seen
    first), a method's columns by name (a GRPO run's ``reward_first_quarter:<key>``), the held-out
    columns of runs evaluated while training, the evaluation's other figures (free text,
    the user's metrics: ``figure_columns``), then the lm-eval columns task by task."""
    seen = [c for row in rows for c in row if c not in COLUMNS]
    swept = list(dict.fromkeys(c for c in seen if c.startswith("sweep:")))
    # a method's columns by name (a GRPO run's reward_last_quarter:<reward>)
    owned = tuple(f"{c}:" for c in method_columns())
    rewards = list(dict.fromkeys(c for c in seen if c.startswith(owned)))
    prefixes = ("heldout_", "exported_", "start_heldout_")
    held = list(dict.fromkeys(c for c in seen if c.startswith(prefixes)))
    lm = sorted({c for c in seen if "lm_eval:" in c}, key=_lm_eval_order)
    figures = [c for c in dict.fromkeys(seen) if c not in {*swept, *rewards, *held, *lm}]
    return swept + rewards + held + figures + lm


def _lm_eval_order(column: str) -> tuple[str, int]:
    """lm_eval:T:M, then base_lm_eval:T:M, then gain_lm_eval:T:M, task by task."""
    prefix, _, name = column.partition("lm_eval:")
    return name, ("", "base_", "gain_").index(prefix)


def write_summary(rows: list[dict[str, str]], path: Path) -> None:
    """The fixed COLUMNS, then every run's lm-eval columns (empty where a run has none)."""
    extra = extra_columns(rows)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(
            fh, fieldnames=COLUMNS + extra, delimiter="\t", lineterminator="\n", restval=""
        )
        writer.writeheader()
        writer.writerows(rows)


def lm_eval_figures(ev: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label ``task metric``, figure) for every lm-eval metric of an eval's metrics.json;
    ``metric`` is lm-eval's ``metric,filter`` key with the filter in brackets."""
    out = []
    for task, metrics in sorted((ev.get("lm_eval") or {}).items()):
        for key, figure in sorted(metrics.items()):
            metric, _, filt = key.partition(",")
            label = f"{task} {metric}" + (f" [{filt}]" if filt and filt != "none" else "")
            out.append((label, figure))
    return out


def lm_eval_columns(ev: dict[str, Any]) -> dict[str, Any]:
    """summary.tsv columns of the lm-eval figures: ``lm_eval:<task>:<metric,filter>`` and its
    ``base_`` and ``gain_`` twins."""
    row: dict[str, Any] = {}
    for task, metrics in (ev.get("lm_eval") or {}).items():
        for key, figure in metrics.items():
            name = f"lm_eval:{task}:{key}"
            row[name] = figure["value"]
            if "base" in figure:
                row[f"base_{name}"], row[f"gain_{name}"] = figure["base"], figure["gain"]
    return row


def headline_figures(row: dict[str, str]) -> list[tuple[Any, str, str]]:
    """A summary row's headline figures it has, in order: how each reads
    (snaketune.evaluation.figures.Described), its value and the base model's ("": none)."""
    from snaketune.evaluation.figures import described

    out = []
    for key in (row.get("headline") or "").split():  # what the run's evaluation leads with
        column = column_of(key)
        if row.get(column):
            out.append((described(key), row[column], row.get(f"base_{column}") or ""))
    return out


def headline(summary_tsv: Path, html: Path, runs: Collection[str] | None = None) -> str:
    """One line for the end of a pipeline: where the report is, and each run's result (only
    ``runs``, the config's, where given: a summary in the same directory may hold another
    config's runs; none of them there is said so)."""
    with open(summary_tsv) as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    if runs is not None:
        rows = [r for r in rows if r["run"] in runs]
        if not rows:
            return (
                f"report: {html} holds no run of this config ({', '.join(sorted(runs))}): "
                "it is from another config or an earlier invocation; run without --until to "
                "evaluate them and write theirs"
            )
    parts = [f"report: {html}"]
    for r in rows:
        figures = [
            f"{d.short} {value}" + (f" (base {base})" if base else "")
            for d, value, base in headline_figures(r)
        ]
        if not figures and r.get("final_loss"):
            figures.append(f"final loss {r['final_loss']}")
        parts.append(f"{r['run']}: {', '.join(figures)}")
    return " | ".join(parts)


def report_line(runs: Collection[str] | None = None, results: Path = Path("results")) -> None:
    """After a successful pipeline: the report's path and the result of each of ``runs`` (the
    config's), one line; a config with no runs (data stages only) gets none."""
    import sys

    html, tsv = results / "summary.html", results / "summary.tsv"
    if runs is not None and not runs:
        return
    if html.is_file() and tsv.is_file():
        print(headline(tsv, html.resolve(), runs), file=sys.stderr)
