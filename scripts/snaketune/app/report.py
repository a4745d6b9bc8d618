"""The report of all runs: one self-contained HTML page (results/summary.html) with the
summary table (snaketune.app.summary), per run its training plots (snaketune.app.plots), a
base-versus-tuned view of every metric, samples marked right or wrong, and each sweep's
members compared."""

from __future__ import annotations

from typing import Any

from snaketune import __version__
from snaketune.app.comparison import (
    base_label,
    comparison_svg,
    comparison_table,
    pretty,
)
from snaketune.core import heldout
from snaketune.methods import method_named

STYLE = (
    "body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em;"
    "color:#222}h1{font-size:1.5em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em}"
    "table{border-collapse:collapse;margin:.5em 0 1em;max-width:100%}"
    "td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top;text-align:left}"
    "td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}"
    "th{background:#f4f4f4}svg{max-width:100%;height:auto}"
    "table.samples,table#summary{table-layout:fixed;width:100%}"
    "table#summary td,table#summary th{overflow-wrap:anywhere}"
    "th.results{width:24%}small{color:#666}"
    "pre{margin:0;white-space:pre-wrap;overflow-wrap:anywhere}"
    "tr.right td.mark{color:#167a2c;font-weight:bold}tr.wrong td.mark{color:#b3261e;"
    "font-weight:bold}.gain-pos{color:#167a2c}.gain-neg{color:#b3261e}"
    "tr.best td{background:#eef7ee}tr.best td.mark{color:#167a2c;font-weight:bold}"
    "div.wide{max-width:100%;overflow-x:auto}td.name{overflow-wrap:anywhere;min-width:6em}"
    "span.run{white-space:nowrap}"
    "p.warn{border-left:4px solid #b3261e;padding:.3em .6em;background:#fbeeee}"
)
# the summary table's columns: (summary.tsv column, label, shown as a share); `results` is
# each run's headline figures, base beside tuned (headline_cell)
SUMMARY = [
    ("run", "run (model)", False),
    ("method", "method", False),
    ("nodes_x_devices", "nodes × devices", False),
    ("steps", "steps", False),
    ("final_loss", "final train loss", False),
    ("results", "results (base → tuned)", False),
    ("tokens_per_s", "tokens/s", False),
    ("padding", "padding", True),
    ("mfu", "MFU", True),
    ("expert_load_last_quarter", "expert load (busiest / even)", False),
    ("aux_loss_last_quarter", "router aux loss", False),
    ("wall_time_s", "wall time (s)", False),
    ("gpu_hours", "GPU-hours", False),
]
ROUTER = ("expert_load_last_quarter", "aux_loss_last_quarter")


def scores_table(samples: list[dict[str, Any]], n: int) -> str:
    """A reward model's held-out pairs: each side's score, marked right where the chosen
    side scores higher."""
    right = sum(s["chosen_score"] > s["rejected_score"] for s in samples)
    trs = "".join(
        f"<tr class='{'right' if ok else 'wrong'}'><td class='mark'>"
        f"{'✓ right' if ok else '✗ wrong'}</td><td>{s['example_id']}</td>"
        f"<td>{s['chosen_score']:.4g}</td><td>{s['rejected_score']:.4g}</td></tr>"
        for s in samples[:n]
        for ok in [s["chosen_score"] > s["rejected_score"]]
    )
    return (
        f"<p>First {min(n, len(samples))} of {len(samples)} held-out pairs ({right} ranked "
        "right: the chosen response scored higher).</p><table class='samples'><tr><th>"
        "</th><th>pair</th><th>chosen score</th><th>rejected score</th></tr>"
        f"{trs}</table>"
    )


def sample_scores(s: dict[str, Any]) -> str:
    """A generation's own figures: chrF, normalized match, the user's metrics."""
    figures = {
        "chrF": s.get("chrf"),
        "normalized match": s.get("normalized_match"),
        **(s.get("scores") or {}),
    }
    shown = {
        k: ("yes" if v else "no") if isinstance(v, bool) else pretty(v)
        for k, v in figures.items()
        if v is not None
    }
    return "; ".join(f"{k} {v}" for k, v in shown.items())


def samples_table(samples: list[dict[str, Any]], n: int, headline: str = "") -> str:
    """The first ``n`` generations with their prompts and reference texts; marked right or
    wrong where a checker decides (a reference with a final answer), otherwise with their
    scores."""
    from html import escape

    checked = [s for s in samples if s.get("reference_answer") is not None]
    # marked by the run's headline figure: math_verify ("The answer is 8." is right) unless
    # the run leads with exact match (only a "#### 8" line counts), or its samples lack it
    verify = any("math_verify" in s for s in checked) and (
        "math_verify" in headline.split() or "exact_match" not in headline.split()
    )
    right = sum(bool(s.get("math_verify" if verify else "correct")) for s in checked)
    trs = []
    for s in samples[:n]:
        if s.get("reference_answer") is not None:
            ok = bool(s.get("math_verify" if verify else "correct"))
            mark, cls = ("✓ right" if ok else "✗ wrong"), ("right" if ok else "wrong")
        else:
            mark, cls = sample_scores(s), "scored"
        trs.append(
            f"<tr class='{cls}'><td class='mark'>{escape(mark)}</td>"
            f"<td>{pictures_html(s)}<pre>{escape(str(s.get('prompt', '')))}</pre></td>"
            f"<td><pre>{escape(str(s.get('reference', '')))}</pre></td>"
            f"<td><pre>{escape(str(s.get('trajectory_text') or s.get('generation', '')))}"
            "</pre></td></tr>"
        )
    said = (
        f"{right} of {len(checked)} answered right: the mark is "
        + (
            "math_verify's (the final answer equal to the reference's)"
            if verify
            else "exact match on the number after ####"
        )
        if checked
        else "the references have no final answer to check, so each sample shows its scores"
    )
    return (
        f"<p>First {min(n, len(samples))} of {len(samples)} held-out examples ({said}).</p>"
        "<table class='samples'><col style='width:13%'><col style='width:29%'>"
        "<col style='width:23%'><col style='width:35%'><tr><th></th><th>prompt</th>"
        f"<th>reference</th><th>generation (tuned)</th></tr>{''.join(trs)}</table>"
    )


def pictures_html(sample: dict[str, Any]) -> str:
    """A picture sample's thumbnails (data URIs the evaluation wrote), above its prompt."""
    from html import escape

    return "".join(
        f"<img src='{escape(uri)}' alt='picture {i}' style='max-width:96px;margin:2px'>"
        for i, uri in enumerate(sample.get("pictures") or [])
        if str(uri).startswith("data:image/")
    )


def sweep_section(sweep: str, best: dict[str, Any], rows: list[dict[str, str]], svg: str) -> str:
    """A sweep's members side by side: their values, the selection figure, headline metrics,
    throughput and GPU-hours; the best one marked; the overlaid losses below."""
    from html import escape

    keys = list(best["members"][0]["values"])
    by_run = {r["run"]: r for r in rows}
    metric = best["metric"]
    cols = [
        ("exact_match", "exact match", True),
        ("eval_loss", "held-out loss", False),
        ("stop_rate", "stop rate", True),
        ("tokens_per_s", "tokens/s", False),
        ("gpu_hours", "GPU-hours", False),
    ]
    head = (
        "<tr><th></th><th>member</th>"
        + "".join(f"<th>{escape(k)}</th>" for k in keys)
        + f"<th>{escape(metric)} ({best['mode']})</th>"
        + "".join(f"<th>{escape(label)}</th>" for _, label, _ in cols)
        + "</tr>"
    )
    trs = []
    for m in best["members"]:
        row, mark = by_run.get(m["run"], {}), m["run"] == best["best"]
        trs.append(
            f"<tr class='{'best' if mark else ''}'><td class='mark'>{'★ best' if mark else ''}"
            f"</td><td>{escape(m['run'])}</td>"
            + "".join(f"<td class='num'>{escape(str(m['values'][k]))}</td>" for k in keys)
            + f"<td class='num'>{escape(pretty(m[metric]))}</td>"
            + "".join(
                f"<td class='num'>{escape(pretty(row.get(k), pct))}</td>" for k, _, pct in cols
            )
            + "</tr>"
        )
    return (
        f'<section id="sweep-{escape(sweep)}"><h2>Sweep {escape(sweep)}</h2>'
        f"<p>{len(best['members'])} members; best by {escape(metric)} ({best['mode']}): "
        f"<b>{escape(best['best'])}</b> (results/{escape(sweep)}/best.json)</p>"
        f"<div class='wide'><table class='sweep'>{head}{''.join(trs)}</table></div>{svg}"
        "</section>"
    )


def attempts_table(attempts: list[dict[str, Any]]) -> str:
    """Every start of the run's training (snaketune.train.attempts): when, where, how it ended and
    where its whole log is; open when one of them failed."""
    import time
    from html import escape

    failed = sum(a.get("exit") != 0 for a in attempts)
    rows = "".join(
        f"<tr><td class='num'>{a['attempt']}</td>"
        f"<td>{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(a.get('began', 0)))}</td>"
        f"<td>{escape(str(a.get('host', '')))}"
        + (f" (SLURM job {escape(str(a['job']))})" if a.get("job") else "")
        + "</td>"
        f"<td class='num'>{escape(str(a.get('exit', '-')))}</td>"
        f"<td>{escape(str(a.get('reason', '')))}</td>"
        f"<td><code>train/{escape(str(a.get('log', '')))}</code></td></tr>"
        for a in attempts
    )
    return (
        f"<details{' open' if failed else ''}><summary>Training attempts: {len(attempts)}"
        f"{f', {failed} ended early or failed' if failed else ''}</summary><table>"
        "<tr><th>#</th><th>began</th><th>host</th><th>exit</th><th>reason</th>"
        f"<th>log</th></tr>{rows}</table></details>"
    )


def estimate_said(row: dict[str, str]) -> str | None:
    """The train stage's time beside the estimate made when it was queued (None: none)."""
    if not row.get("estimated_train_wall_s") or not row.get("wall_time_s"):
        return None
    error = float(row["estimate_error"])
    return (
        f"Training took {pretty(row['wall_time_s'])} s; estimated "
        f"{pretty(row['estimated_train_wall_s'])} s when queued ({100 * error:+.0f}%; "
        f"{row['estimate_basis']})."
    )


def worse_than_start(row: dict[str, str]) -> str | None:
    """The report's word on a run whose held-out figure before training beats every
    evaluated checkpoint (its summary row's exported_* and start_heldout_* columns)."""
    if row.get("exported_worse_than_start") != "True":
        return None
    (key,) = [k for k in row if k.startswith("start_heldout_")]
    metric = key.removeprefix("start_heldout_")
    return heldout.worse_than_start(
        metric, float(row[key]), float(row[f"exported_heldout_{metric}"]), int(row["exported_step"])
    )


def headline_cell(row: dict[str, str]) -> str:
    """A run's headline figures (its summary row's ``headline``), one a line, the base
    model's before the tuned one's."""
    from html import escape

    from snaketune.app.summary import headline_figures

    lines = []
    for d, value, base in headline_figures(row):
        before = f"{pretty(base, d.percent)} → " if base else ""
        lines.append(f"{escape(d.short)}: {escape(before + pretty(value, d.percent))}")
    return "<br>".join(lines) or "–"


def summary_cell(row: dict[str, str], key: str, percent: bool) -> str:
    """One cell of the summary table."""
    from html import escape

    if key == "run":
        return (
            f"<td class='name'><span class='run'>{escape(row['run'])}</span><br>"
            f"<small>{escape(row['model'])}</small></td>"
        )
    if key == "method":
        return f"<td class='name'>{escape(row[key])}</td>"
    if key == "results":
        return f"<td class='results'>{headline_cell(row)}</td>"
    return f"<td class='num'>{escape(pretty(row.get(key), percent))}</td>"


def summary_html(
    rows: list[dict[str, str]],
    plots: dict[str, str],
    evals: dict[str, dict[str, Any]],
    samples: dict[str, list[dict[str, Any]]],
    lineages: dict[str, tuple[str, str, str]] | None = None,
    n_samples: int = 8,
    sweeps: list[str] | None = None,
    attempts: dict[str, list[dict[str, Any]]] | None = None,
    others: list[str] | None = None,
    cleaned: dict[str, dict[str, Any]] | None = None,
) -> str:
    """One self-contained page (inline SVG and CSS, nothing fetched): the summary table; per
    run its training plots, base-versus-tuned table and chart, samples marked right or wrong,
    and its provenance link and lineage. ``others``: runs of another config trained in the
    same directory (results/<run>/), named, not shown."""
    from html import escape

    # a mixture of experts' router columns only where a run has them
    columns = [c for c in SUMMARY if c[0] not in ROUTER or any(r.get(c[0]) for r in rows)]
    head = "".join(f"<th class='{key}'>{escape(label)}</th>" for key, label, _ in columns)
    body = "".join(
        "<tr>" + "".join(summary_cell(row, key, pct) for key, _, pct in columns) + "</tr>"
        for row in rows
    )
    by_run = {row["run"]: row for row in rows}
    sections = [
        run_section(run, svg, by_run.get(run, {}), evals.get(run))
        + cleaning_html((cleaned or {}).get(run))
        + lineage_html(run, lineages)
        + (attempts_table(attempts[run]) if attempts and attempts.get(run) else "")
        + samples_html(by_run.get(run, {}), samples.get(run), n_samples)
        + "</section>"
        for run, svg in plots.items()
    ]
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width'><title>snaketune summary</title>"
        f"<style>{STYLE}</style></head><body><h1>snaketune: the runs of this config</h1>"
        "<p>Every figure is also in results/summary.tsv (full precision). Made by snaketune "
        f"{__version__}.</p>"
        + (
            f"<p class='others'>Also under results/, runs of another config (not on this "
            f"page; each in results/&lt;run&gt;/, its report made by its own config): "
            f"{escape(', '.join(others))}.</p>"
            if others
            else ""
        )
        + f'<div class="wide"><table id="summary"><tr>{head}</tr>{body}</table></div>'
        f"{''.join(sweeps or [])}"
        f"{''.join(sections)}</body></html>\n"
    )


def run_section(run: str, svg: str, row: dict[str, str], ev: dict[str, Any] | None) -> str:
    """A run's section, opened: its training plots, the estimate and warnings, base versus
    tuned."""
    from html import escape

    parts = [f'<section id="run-{escape(run)}"><h2>{escape(run)}</h2>', "<h3>Training</h3>", svg]
    said = estimate_said(row)
    if said:
        parts.append(f"<p class='estimate'>{escape(said)}</p>")
    warning = worse_than_start(row)
    if warning:
        parts.append(f'<p class="warn">{escape(warning)}</p>')
    for line in filter(None, (row.get("warnings") or "").split(" | ")):
        parts.append(f'<p class="warn">Training warned: {escape(line)}</p>')
    if ev is not None:
        parts.append(f"<h3>{base_label(ev).capitalize()} versus tuned</h3>")
        parts.append(comparison_table(ev))
        parts.append(comparison_svg(ev, f"{run}: base versus tuned") or "")
    return "".join(parts)


def cleaning_html(report: dict[str, Any] | None) -> str:
    """What cleaning removed from a run's training data (snaketune.data.cleaning's report):
    per reason, and per held-out set the training rows that overlapped it."""
    if not report:
        return ""
    from html import escape

    words = {"heldout": "overlapping a held-out set", "exact": "exact dup.", "near": "near dup."}
    rows = [("rows read", report["rows"]), ("kept", report["kept"])]
    rows += [(f"removed: {words[k]}", n) for k, n in report["removed"].items()]
    if report["spans_cut"]:
        rows.append(("kept, overlapping spans cut", report["spans_cut"]))
    rows += [(f"overlapping held-out set {k}", n) for k, n in sorted(report["per_heldout"].items())]
    body = "".join(f"<tr><td>{escape(k)}</td><td class='num'>{n:,}</td></tr>" for k, n in rows)
    return f"<h3>Cleaning of its training data</h3><table class='cleaning'>{body}</table>"


def samples_html(row: dict[str, str], samples: list[dict[str, Any]] | None, n: int) -> str:
    """The run's samples marked right or wrong (a scoring model's: its scored pairs)."""
    if not samples:
        return ""
    pairs = method_named(row["method"]).reward_model if row else False
    if pairs:
        return "<h3>Samples</h3>" + scores_table(samples, n)
    return "<h3>Samples</h3>" + samples_table(samples, n, (row or {}).get("headline") or "")


def lineage_html(run: str, lineages: dict[str, tuple[str, str, str]] | None) -> str:
    """The run's provenance link and its lineage, folded."""
    from html import escape

    if not lineages or run not in lineages:
        return ""
    href, artefact, text = lineages[run]
    return (
        f'<p class="lineage"><a href="{escape(href)}">provenance</a> '
        f"(<code>snaketune lineage {escape(artefact)}</code>)</p>"
        f"<details><summary>lineage</summary><pre>{escape(text)}</pre></details>"
    )
