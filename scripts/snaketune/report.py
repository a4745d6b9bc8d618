"""The report of all runs: one self-contained HTML page (results/summary.html) with the
summary table (snaketune.summary), per run its training plots (matplotlib, inline SVG), a
base-versus-tuned view of every metric, samples marked right or wrong, and each sweep's
members compared."""

from __future__ import annotations

from typing import Any, NamedTuple

from snaketune.heldout import split_rows
from snaketune.summary import lm_eval_figures


def pretty(value: Any, percent: bool = False) -> str:
    """A number as a person reads it: 0.7656 -> 76.6% (``percent``), 6.31459 -> 6.31,
    552.575 -> 553, 26290.8 -> 26,291, 0.000123 -> 1.23e-04."""
    if value is None or value == "":
        return "–"
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if percent:
        return f"{100 * value:.1f}%"
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    size = abs(value)
    if size >= 100:
        return f"{value:,.0f}"
    if size >= 1:
        return f"{value:.3g}" if size < 10 else f"{value:.1f}"
    if size >= 1e-3:
        return f"{value:.3f}"
    return f"{value:.2e}"


def _svg(fig) -> str:
    """A matplotlib figure as inline SVG (text kept as text, no external files)."""
    import io

    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _figure(width_in: float, height_in: float, cols: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "axes.grid": True,
                         "grid.alpha": 0.3, "svg.hashsalt": "snaketune"})  # fmt: skip
    return plt.subplots(1, cols, figsize=(width_in, height_in), squeeze=False)


def training_svg(metrics: list[dict[str, Any]], title: str, eval_loss: float | None,
                 exported: int | None = None) -> str:  # fmt: skip
    """Training loss (with the held-out loss where measured) or, for a GRPO run, its
    rewards; learning rate; tokens/s; against the optimizer step, side by side, with ticks
    and units. Held-out passes while training (eval_steps) are points over the first panel,
    and ``exported`` (export.checkpoint: best) marks the step the model was taken from."""
    metrics, held = split_rows(metrics)
    steps = [m["step"] for m in metrics]
    fig, axes = _figure(11.5, 3.0, 3)
    loss, lr, tps = axes[0]
    if metrics and "reward" in metrics[0]:
        _reward_panel(loss, metrics, steps)
        loss.set_title(f"{title}: reward")
        _heldout_points(loss, held, "exact_match", twin=True)
    elif metrics and "reward_margin" in metrics[0]:
        _preference_panel(loss, metrics, steps)
        loss.set_title(f"{title}: preference")
        _heldout_points(loss, held, "loss", twin=True)
    else:
        _loss_panel(loss, metrics, steps, eval_loss)
        loss.set_title(f"{title}: loss")
        _heldout_points(loss, held, "loss", twin=False)
    if exported is not None:
        loss.axvline(exported, color="tab:gray", linestyle=":", linewidth=1.5)
        loss.annotate(f"exported: step {exported}", (exported, 0.02), fontsize=7,
                      xycoords=("data", "axes fraction"), rotation=90, ha="right")  # fmt: skip
    lr.plot(steps, [m.get("lr", float("nan")) for m in metrics], color="tab:green")
    lr.set(title="learning rate", xlabel="optimizer step", ylabel="learning rate")
    lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    speed = [(m["step"], m["tokens_per_s"]) for m in metrics[1:] if "tokens_per_s" in m]
    if speed:
        tps.plot(*zip(*speed, strict=True), color="tab:purple")
    tps.set(title="throughput (first step left out)", xlabel="optimizer step",
            ylabel="real tokens / s (all ranks)")  # fmt: skip
    for ax in axes[0]:
        ax.xaxis.get_major_locator().set_params(integer=True)
    return _svg(fig)


def _heldout_points(ax, held: list[dict[str, Any]], figure: str, twin: bool) -> None:
    """The held-out figure of each pass while training (eval_steps), on the panel's axis or,
    where its unit differs, on a second one at the right."""
    points = [(m["step"], m[f"heldout_{figure}"]) for m in held if f"heldout_{figure}" in m]
    if not points:
        return
    target = ax.twinx() if twin else ax
    name = figure.replace("_", " ")
    (line,) = target.plot(*zip(*points, strict=True), "s--", color="tab:orange", markersize=4,
                          label=f"held-out {name} (while training)")  # fmt: skip
    line.set_gid(f"heldout_{figure}")
    if twin:
        target.set_ylabel(f"held-out {name}")
        target.legend(fontsize=8, loc="lower right")
    else:
        ax.legend(fontsize=8)


def _loss_panel(ax, metrics: list[dict[str, Any]], steps: list[int], eval_loss) -> None:
    (line,) = ax.plot(steps, [m["loss"] for m in metrics], color="tab:blue", label="training")
    line.set_gid("loss")
    evals = [(m["step"], m["eval_loss"]) for m in metrics if m.get("eval_loss") is not None]
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", color="tab:orange", label="eval")
    if eval_loss is not None and steps:
        ax.plot([steps[-1]], [eval_loss], "D", color="tab:red", label="held-out (final)")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats/token)")
    ax.legend(fontsize=8)


def _reward_panel(ax, metrics: list[dict[str, Any]], steps: list[int]) -> None:
    """GRPO: the total (weighted) reward per completion and each reward's mean."""
    (line,) = ax.plot(steps, [m["reward"] for m in metrics], color="tab:blue", label="total")
    line.set_gid("reward")
    names = sorted({k[len("reward_"):-len("_mean")] for m in metrics for k in m
                    if k.startswith("reward_") and k.endswith("_mean")})  # fmt: skip
    for name in names:
        ax.plot(steps, [m.get(f"reward_{name}_mean", float("nan")) for m in metrics],
                linewidth=1, label=name)  # fmt: skip
    ax.set(xlabel="optimizer step", ylabel="mean reward per completion")
    ax.legend(fontsize=8)


def _preference_panel(ax, metrics: list[dict[str, Any]], steps: list[int]) -> None:
    """DPO: the loss, the implicit rewards of chosen and rejected and their margin, and (on
    the right axis) the reward accuracy of each step's pairs."""
    (line,) = ax.plot(steps, [m["loss"] for m in metrics], color="tab:blue", label="loss")
    line.set_gid("loss")
    for key, color in (("reward_chosen", "tab:green"), ("reward_rejected", "tab:red"),
                       ("reward_margin", "tab:orange")):  # fmt: skip
        ax.plot(steps, [m.get(key, float("nan")) for m in metrics], linewidth=1, color=color,
                label=key.replace("_", " "))  # fmt: skip
    ax.set(xlabel="optimizer step", ylabel="loss; reward (beta x log-ratio)")
    right = ax.twinx()
    right.plot(steps, [m.get("reward_accuracy", float("nan")) for m in metrics], ":",
               color="tab:gray", label="reward accuracy")  # fmt: skip
    right.set(ylabel="reward accuracy", ylim=(0, 1.05))
    right.grid(False)
    lines = ax.get_legend_handles_labels(), right.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], fontsize=7)


class Comparison(NamedTuple):
    """One metric of an evaluation, base against tuned."""

    label: str
    base: Any
    tuned: Any
    gain: Any
    percent: bool  # shown as a share (76.6%)
    higher_is_better: bool
    stderr: float | None = None


def comparison_rows(ev: dict[str, Any]) -> list[Comparison]:
    """Every metric of an evaluation: exact match, math_verify, loss, perplexity, each
    lm-eval figure (with its stderr)."""
    base, gain = ev.get("base") or {}, ev.get("gain") or {}
    rows = [
        Comparison("exact match (#### number)", base.get("exact_match"), ev.get("exact_match"),
                   gain.get("exact_match"), True, True),
        Comparison("math_verify accuracy", base.get("math_verify"), ev.get("math_verify"),
                   gain.get("math_verify"), True, True),
        Comparison("stop rate (ends on a stop id)", base.get("stop_rate"), ev.get("stop_rate"),
                   None if None in (base.get("stop_rate"), ev.get("stop_rate"))
                   else ev["stop_rate"] - base["stop_rate"], True, True),
        Comparison("held-out loss (nats/token)", base.get("loss"), ev.get("loss"),
                   None if "loss" not in gain else -gain["loss"], False, False),
        Comparison("perplexity", base.get("perplexity"), ev.get("perplexity"),
                   None if base.get("perplexity") is None
                   else ev["perplexity"] - base["perplexity"], False, False),
    ]  # fmt: skip
    pref, base_pref = ev.get("preference") or {}, base.get("preference") or {}
    if "preference_accuracy" in pref:  # held-out pairs of a DPO run
        rows += [
            Comparison("preference accuracy (implicit reward ranks chosen first)",
                       base_pref.get("preference_accuracy"), pref["preference_accuracy"],
                       gain.get("preference_accuracy"), True, True),
            Comparison("reward margin (chosen - rejected)", base_pref.get("reward_margin"),
                       pref["reward_margin"], gain.get("preference_reward_margin"), False, True),
            Comparison("chosen more likely than rejected", base_pref.get("likelihood_accuracy"),
                       pref["likelihood_accuracy"], gain.get("preference_likelihood_accuracy"),
                       True, True),
        ]  # fmt: skip
    for label, f in lm_eval_figures(ev):
        rows.append(Comparison(f"lm-eval {label}", f.get("base"), f["value"], f.get("gain"),
                               False, True, f.get("stderr")))  # fmt: skip
    return rows


def comparison_svg(ev: dict[str, Any], title: str) -> str | None:
    """Base and tuned side by side, one pair of bars per accuracy-like metric (0-1)."""
    pairs = [
        (r.label, r.base, r.tuned)
        for r in comparison_rows(ev)
        if r.base is not None and 0 <= r.base <= 1 and 0 <= r.tuned <= 1
    ]
    if not pairs:
        return None
    import textwrap

    fig, axes = _figure(min(11.5, 2.0 + 2.0 * len(pairs)), 3.0, 1)
    ax = axes[0][0]
    xs = range(len(pairs))
    for offset, which, name, color in (
        (-0.2, 1, "base", "tab:gray"),
        (0.2, 2, "tuned", "tab:blue"),
    ):
        values = [p[which] for p in pairs]
        bars = ax.bar([x + offset for x in xs], values, 0.4, label=name, color=color)
        ax.bar_label(bars, labels=[f"{100 * v:.0f}%" for v in values], fontsize=8)
    ax.set_xticks(list(xs), [textwrap.fill(lab, 22) for lab, _, _ in pairs], fontsize=8)
    ax.set(ylim=(0, 1.1), ylabel="accuracy (share of examples)", title=title)
    ax.legend(fontsize=8)
    return _svg(fig)


STYLE = (
    "body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em;"
    "color:#222}h1{font-size:1.5em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em}"
    "table{border-collapse:collapse;margin:.5em 0 1em;max-width:100%}"
    "td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top;text-align:left}"
    "td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}"
    "th{background:#f4f4f4}svg{max-width:100%;height:auto}"
    "table.samples{table-layout:fixed;width:100%}"
    "pre{margin:0;white-space:pre-wrap;overflow-wrap:anywhere}"
    "tr.right td.mark{color:#167a2c;font-weight:bold}tr.wrong td.mark{color:#b3261e;"
    "font-weight:bold}.gain-pos{color:#167a2c}.gain-neg{color:#b3261e}"
    "tr.best td{background:#eef7ee}tr.best td.mark{color:#167a2c;font-weight:bold}"
    "div.wide{max-width:100%;overflow-x:auto}td.name{overflow-wrap:anywhere;min-width:6em}"
)
SUMMARY = [("run", "run", False), ("model", "model", False), ("method", "method", False),
           ("nodes_x_devices", "nodes × devices", False), ("steps", "steps", False),
           ("final_loss", "final train loss", False), ("eval_loss", "held-out loss", False),
           ("base_exact_match", "exact match, base", True), ("exact_match", "exact match", True),
           ("math_verify", "math_verify", True), ("stop_rate", "stop rate", True),
           ("tokens_per_s", "tokens/s", False),
           ("padding", "padding", True), ("mfu", "MFU", True),
           ("wall_time_s", "wall time (s)", False), ("gpu_hours", "GPU-hours", False)]  # fmt: skip


def _gain(value: Any, percent: bool, higher_better: bool) -> str:
    from html import escape

    if value is None:
        return "<td class='num'>–</td>"
    good = (value > 0) == higher_better if value else None
    cls = "" if good is None else (" gain-pos" if good else " gain-neg")
    sign = "+" if value > 0 else ""
    text = f"{sign}{100 * value:.1f} pt" if percent else f"{sign}{pretty(value)}"
    return f"<td class='num{cls}'>{escape(text)}</td>"


def comparison_table(ev: dict[str, Any]) -> str:
    from html import escape

    trs = []
    for r in comparison_rows(ev):
        shown = pretty(r.tuned, r.percent)
        shown += f" ± {pretty(r.stderr)}" if r.stderr is not None else ""
        trs.append(
            f"<tr><td>{escape(r.label)}</td><td class='num'>{escape(pretty(r.base, r.percent))}"
            f"</td><td class='num'>{escape(shown)}</td>"
            f"{_gain(r.gain, r.percent, r.higher_is_better)}</tr>"
        )
    return (
        "<table class='comparison'><tr><th>metric</th><th>base model</th><th>tuned</th>"
        f"<th>gain</th></tr>{''.join(trs)}</table>"
    )


def samples_table(samples: list[dict[str, Any]], n: int) -> str:
    from html import escape

    right = sum(bool(s.get("correct")) for s in samples)
    trs = []
    for s in samples[:n]:
        ok = bool(s.get("correct"))
        trs.append(
            f"<tr class='{'right' if ok else 'wrong'}'>"
            f"<td class='mark'>{'✓ right' if ok else '✗ wrong'}</td>"
            f"<td><pre>{escape(str(s.get('prompt', '')))}</pre></td>"
            f"<td><pre>{escape(str(s.get('reference_answer')))}</pre></td>"
            f"<td><pre>{escape(str(s.get('generation', '')))}</pre></td></tr>"
        )
    return (
        f"<p>First {min(n, len(samples))} of {len(samples)} held-out examples ({right} answered "
        "right; the mark is exact match on the number after ####).</p>"
        "<table class='samples'><col style='width:8%'><col style='width:42%'>"
        "<col style='width:10%'><col style='width:40%'><tr><th></th><th>prompt</th>"
        f"<th>reference</th><th>generation (tuned)</th></tr>{''.join(trs)}</table>"
    )


def sweep_svg(curves: dict[str, list[dict[str, Any]]], evals: dict[str, float], best: str,
              title: str) -> str:  # fmt: skip
    """Every member's training loss against the step, overlaid; its held-out loss (where
    measured) as a marker of the same colour at its last step; the best member bold."""
    fig, axes = _figure(11.5, 3.6, 1)
    ax = axes[0][0]
    for i, (member, metrics) in enumerate(curves.items()):
        steps = [m["step"] for m in metrics]
        color = f"C{i % 10}"
        (line,) = ax.plot(steps, [m.get("loss") for m in metrics], color=color,
                          linewidth=2.2 if member == best else 1.0,
                          label=member + (" (best)" if member == best else ""))  # fmt: skip
        line.set_gid(f"sweep-loss-{i}")
        if member in evals and steps:
            ax.plot([steps[-1]], [evals[member]], "D", color=color)
    ax.set(xlabel="optimizer step", ylabel="training loss (nats/token)", title=title)
    ax.legend(fontsize=7, loc="upper right")
    return _svg(fig)


def sweep_section(sweep: str, best: dict[str, Any], rows: list[dict[str, str]], svg: str) -> str:
    """A sweep's members side by side: their values, the selection figure, headline metrics,
    throughput and GPU-hours; the best one marked; the overlaid losses below."""
    from html import escape

    keys = list(best["members"][0]["values"])
    by_run = {r["run"]: r for r in rows}
    metric = best["metric"]
    cols = [("exact_match", "exact match", True), ("eval_loss", "held-out loss", False),
            ("stop_rate", "stop rate", True), ("tokens_per_s", "tokens/s", False),
            ("gpu_hours", "GPU-hours", False)]  # fmt: skip
    head = ("<tr><th></th><th>member</th>" + "".join(f"<th>{escape(k)}</th>" for k in keys)
            + f"<th>{escape(metric)} ({best['mode']})</th>"
            + "".join(f"<th>{escape(label)}</th>" for _, label, _ in cols) + "</tr>")  # fmt: skip
    trs = []
    for m in best["members"]:
        row, mark = by_run.get(m["run"], {}), m["run"] == best["best"]
        trs.append(
            f"<tr class='{'best' if mark else ''}'><td class='mark'>{'★ best' if mark else ''}"
            f"</td><td>{escape(m['run'])}</td>"
            + "".join(f"<td class='num'>{escape(str(m['values'][k]))}</td>" for k in keys)
            + f"<td class='num'>{escape(pretty(m[metric]))}</td>"
            + "".join(f"<td class='num'>{escape(pretty(row.get(k), pct))}</td>"
                      for k, _, pct in cols)
            + "</tr>"
        )  # fmt: skip
    return (f'<section id="sweep-{escape(sweep)}"><h2>Sweep {escape(sweep)}</h2>'
            f"<p>{len(best['members'])} members; best by {escape(metric)} ({best['mode']}): "
            f"<b>{escape(best['best'])}</b> (results/{escape(sweep)}/best.json)</p>"
            f"<div class='wide'><table class='sweep'>{head}{''.join(trs)}</table></div>{svg}"
            "</section>")  # fmt: skip


def attempts_table(attempts: list[dict[str, Any]]) -> str:
    """Every start of the run's training (snaketune.attempts): when, where, how it ended and
    where its whole log is; open when one of them failed."""
    import time
    from html import escape

    failed = sum(a.get("exit") != 0 for a in attempts)
    rows = "".join(
        f"<tr><td class='num'>{a['attempt']}</td>"
        f"<td>{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(a.get('began', 0)))}</td>"
        f"<td>{escape(str(a.get('host', '')))}"
        + (f" (SLURM job {escape(str(a['job']))})" if a.get("job") else "") + "</td>"
        f"<td class='num'>{escape(str(a.get('exit', '-')))}</td>"
        f"<td>{escape(str(a.get('reason', '')))}</td>"
        f"<td><code>train/{escape(str(a.get('log', '')))}</code></td></tr>"
        for a in attempts
    )  # fmt: skip
    return (f"<details{' open' if failed else ''}><summary>Training attempts: {len(attempts)}"
            f"{f', {failed} ended early or failed' if failed else ''}</summary><table>"
            "<tr><th>#</th><th>began</th><th>host</th><th>exit</th><th>reason</th>"
            f"<th>log</th></tr>{rows}</table></details>")  # fmt: skip


def summary_html(rows: list[dict[str, str]], plots: dict[str, str],
                 evals: dict[str, dict[str, Any]], samples: dict[str, list[dict[str, Any]]],
                 lineages: dict[str, tuple[str, str, str]] | None = None,
                 n_samples: int = 8, sweeps: list[str] | None = None,
                 attempts: dict[str, list[dict[str, Any]]] | None = None) -> str:  # fmt: skip
    """One self-contained page (inline SVG and CSS, nothing fetched): the summary table; per
    run its training plots, base-versus-tuned table and chart, samples marked right or wrong,
    and its provenance link and lineage."""
    from html import escape

    head = "".join(f"<th>{escape(label)}</th>" for _, label, _ in SUMMARY)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td class='name'>{escape(row[key])}</td>" if key in ("run", "model", "method")
            else f"<td class='num'>{escape(pretty(row.get(key), pct))}</td>"
            for key, _, pct in SUMMARY
        )
        + "</tr>"
        for row in rows
    )  # fmt: skip
    sections = []
    for run, svg in plots.items():
        parts = [f'<section id="run-{escape(run)}"><h2>{escape(run)}</h2>',
                 "<h3>Training</h3>", svg]  # fmt: skip
        ev = evals.get(run)
        if ev is not None:
            parts.append("<h3>Base model versus tuned</h3>" + comparison_table(ev))
            chart = comparison_svg(ev, f"{run}: base versus tuned")
            parts.append(chart or "")
        if lineages and run in lineages:
            href, artefact, text = lineages[run]
            parts.append(
                f'<p class="lineage"><a href="{escape(href)}">provenance</a> '
                f"(<code>snaketune lineage {escape(artefact)}</code>)</p>"
                f"<details><summary>lineage</summary><pre>{escape(text)}</pre></details>"
            )
        if attempts and attempts.get(run):
            parts.append(attempts_table(attempts[run]))
        if samples.get(run):
            parts.append("<h3>Samples</h3>" + samples_table(samples[run], n_samples))
        sections.append("".join(parts) + "</section>")
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width'><title>snaketune summary</title>"
        f"<style>{STYLE}</style></head><body><h1>snaketune: all runs</h1>"
        "<p>Every figure is also in results/summary.tsv (full precision).</p>"
        f'<div class="wide"><table id="summary"><tr>{head}</tr>{body}</table></div>'
        f"{''.join(sweeps or [])}"
        f"{''.join(sections)}</body></html>\n"
    )
