"""The summary of all runs: one row per run, and a loss curve per run (SVG, no plotting
library needed)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

COLUMNS = ["run", "model", "method", "nodes_x_devices", "steps", "final_loss", "tokens_per_s",
           "padding", "mfu", "eval_loss", "perplexity", "exact_match", "base_exact_match",
           "gain_exact_match", "math_verify", "base_math_verify", "gain_math_verify",
           "gain_loss", "wall_time_s", "jobs", "outside_training_s", "gpu_hours"]  # fmt: skip


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


def summary_row(run: str, spec: dict[str, Any], train_dir: Path, eval_metrics: Path | None,
                train_benchmark: Path | None) -> dict[str, str]:  # fmt: skip
    metrics = [json.loads(x) for x in (train_dir / "metrics.jsonl").read_text().splitlines() if x]
    provenance = json.loads((train_dir / "provenance.json").read_text())
    row: dict[str, Any] = {
        "run": run, "model": spec["model"], "method": spec["method"],
        "nodes_x_devices": f"{spec['nodes']}x{spec['gpus_per_node']}",
        "steps": metrics[-1]["step"] if metrics else 0,
        "final_loss": metrics[-1]["loss"] if metrics else None,
        **throughput(metrics),
    }  # fmt: skip
    if eval_metrics is not None:
        ev = json.loads(eval_metrics.read_text())
        row.update(eval_loss=ev["loss"], perplexity=ev["perplexity"], exact_match=ev["exact_match"],
                   math_verify=ev.get("math_verify"))  # fmt: skip
        if "base" in ev:
            row.update(
                base_exact_match=ev["base"]["exact_match"],
                gain_exact_match=ev["gain"]["exact_match"],
                base_math_verify=ev["base"].get("math_verify"),
                gain_math_verify=ev["gain"].get("math_verify"),
                gain_loss=ev["gain"]["loss"],
            )
    seconds = None
    if train_benchmark is not None and train_benchmark.is_file():
        with open(train_benchmark) as fh:
            seconds = float(next(csv.DictReader(fh, delimiter="\t"))["s"])
    segments = provenance.get("segments") or {}
    if segments.get("jobs"):  # every job of the run (continuations, retries that resumed)
        seconds = segments["wall_s"]  # first start to last end, queue waits between included
        row.update(jobs=segments["jobs"], outside_training_s=segments["outside_training_s"])
    if seconds is not None:
        row["wall_time_s"] = round(seconds, 1)
        if provenance.get("device") == "cuda":
            row["gpu_hours"] = round(seconds * spec["nodes"] * spec["gpus_per_node"] / 3600, 3)
    return {c: _fmt(row.get(c)) for c in COLUMNS}


def write_summary(rows: list[dict[str, str]], path: Path) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, delimiter="\t", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def loss_curve_svg(
    metrics: list[dict[str, Any]], title: str, width: int = 640, height: int = 320
) -> str:
    """A line plot of loss against step."""
    steps = [m["step"] for m in metrics]
    losses = [m["loss"] for m in metrics]
    pad = 48
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    y0, y1 = min(losses), max(max(losses), min(losses) + 1e-9)

    def xy(s: float, v: float) -> str:
        x = pad + (s - x0) / (x1 - x0) * (width - 2 * pad)
        y = height - pad - (v - y0) / (y1 - y0) * (height - 2 * pad)
        return f"{x:.1f},{y:.1f}"

    points = " ".join(xy(s, v) for s, v in zip(steps, losses, strict=True))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">'
        f'<title>{title}</title><rect width="100%" height="100%" fill="white"/>'
        f'<text x="{width / 2}" y="20" text-anchor="middle">{title}</text>'
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
        'stroke="black"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>'
        f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle">step ({x0}-{x1})</text>'
        f'<text x="12" y="{height / 2}" transform="rotate(-90 12 {height / 2})" '
        f'text-anchor="middle">loss ({y0:.3f}-{y1:.3f})</text>'
        f'<polyline class="loss" fill="none" stroke="steelblue" stroke-width="2" '
        f'points="{points}"/>'
        "</svg>\n"
    )


def summary_html(rows: list[dict[str, str]], curves: dict[str, str],
                 samples: dict[str, list[dict[str, Any]]],
                 lineages: dict[str, tuple[str, str, str]] | None = None,
                 n_samples: int = 5) -> str:  # fmt: skip
    """One self-contained page: the summary table, each run's loss curve, eval samples and
    lineage (``lineages``: run -> (link to its provenance.json, its artefact, the lineage))."""
    from html import escape

    head = "".join(f"<th>{escape(c)}</th>" for c in COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(row[c])}</td>" for c in COLUMNS) + "</tr>" for row in rows
    )
    sections = []
    for run, svg in curves.items():
        parts = [f'<section id="run-{escape(run)}"><h2>{escape(run)}</h2>', svg]
        if lineages and run in lineages:
            href, artefact, text = lineages[run]
            parts.append(
                f'<p class="lineage"><a href="{escape(href)}">provenance</a> '
                f"(<code>snaketune lineage {escape(artefact)}</code>)</p>"
                f"<details><summary>lineage</summary><pre>{escape(text)}</pre></details>"
            )
        if samples.get(run):
            cells = ("prompt", "reference", "generation", "parsed_answer", "correct")
            trs = "".join(
                "<tr>"
                + "".join(f"<td><pre>{escape(str(s.get(c)))}</pre></td>" for c in cells)
                + "</tr>"
                for s in samples[run][:n_samples]
            )
            ths = "".join(f"<th>{c}</th>" for c in cells)
            parts.append(f'<table class="samples"><tr>{ths}</tr>{trs}</table>')
        sections.append("".join(parts) + "</section>")
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>snaketune summary</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px;vertical-align:top}"
        "pre{margin:0;white-space:pre-wrap}"
        "</style></head><body><h1>snaketune: all runs</h1>"
        f'<table id="summary"><tr>{head}</tr>{body}</table>{"".join(sections)}</body></html>\n'
    )


def headline(summary_tsv: Path, html: Path) -> str:
    """One line for the end of a pipeline: where the report is, and each run's result."""
    with open(summary_tsv) as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    parts = [f"report: {html}"]
    for r in rows:
        figures = []
        for key in ("exact_match", "math_verify"):
            if r.get(key):
                base = f" (base {r[f'base_{key}']})" if r.get(f"base_{key}") else ""
                figures.append(f"{key} {r[key]}{base}")
        if r.get("eval_loss"):
            figures.append(f"eval loss {r['eval_loss']}")
        elif r.get("final_loss"):
            figures.append(f"final loss {r['final_loss']}")
        parts.append(f"{r['run']}: {', '.join(figures)}")
    return " | ".join(parts)
