"""A run's evaluation, base model versus tuned: each figure with its gain, as a table and a
bar chart, and numbers as a person reads them (``pretty``)."""

from __future__ import annotations

from typing import Any, NamedTuple

from snaketune.app.plots import figure, svg_of
from snaketune.app.summary import lm_eval_figures


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


class Comparison(NamedTuple):
    """One metric of an evaluation, base against tuned."""

    label: str
    base: Any
    tuned: Any
    gain: Any
    percent: bool  # shown as a share (76.6%)
    higher_is_better: bool
    stderr: float | None = None
    headline: bool = False  # one of the figures the run leads with


# an agent's evaluation (metrics.json's ``tools``): the figures its report shows
TOOL_FIGURES = (
    ("calls_per_sample", "tool calls per question"),
    ("failures", "tool calls that failed, per question"),
)


def base_label(ev: dict[str, Any]) -> str:
    """What the "base" column holds: the base model, or (a run that starts from another
    run's model: init_from) that run's model, which its evaluation runs beside it."""
    model = str((ev.get("base") or {}).get("model") or "")
    parts = model.split("/")
    if len(parts) > 2 and parts[0] == "results":
        return f"start: run {parts[1]}"
    return "base model"


def comparison_rows(ev: dict[str, Any]) -> list[Comparison]:
    """Every figure the evaluation measured (metrics.json's ``figures``: its headline
    first, snaketune.evaluation.figures), then each lm-eval figure (with its stderr)."""
    from snaketune.evaluation.figures import described

    lead = set(ev.get("headline") or ())
    rows = []
    for key, f in (ev.get("figures") or {}).items():
        d = described(key)
        rows.append(
            Comparison(
                d.label,
                f.get("base"),
                f["value"],
                f.get("gain"),
                d.percent,
                d.higher_is_better,
                None,
                key in lead,
            )
        )
    tools, before = ev.get("tools"), (ev.get("base") or {}).get("tools") or {}
    for key, label in TOOL_FIGURES if tools else ():  # an agent's tool loop, both models'
        rows.append(Comparison(label, before.get(key), tools.get(key), None, False, True))
    for label, f in lm_eval_figures(ev):
        rows.append(
            Comparison(
                f"lm-eval {label}",
                f.get("base"),
                f["value"],
                f.get("gain"),
                False,
                True,
                f.get("stderr"),
            )
        )
    return rows


def comparison_svg(ev: dict[str, Any], title: str) -> str | None:
    """Base and tuned side by side, one pair of bars per accuracy-like metric (0-1)."""
    pairs = [
        (r.label, r.base, r.tuned)
        for r in comparison_rows(ev)
        if r.percent and r.base is not None and 0 <= r.base <= 1 and 0 <= r.tuned <= 1
    ]
    if not pairs:
        return None
    import textwrap

    fig, axes = figure(min(11.5, 2.0 + 2.0 * len(pairs)), 3.0, 1)
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
    return svg_of(fig)


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
        label = f"<b>{escape(r.label)}</b>" if r.headline else escape(r.label)
        trs.append(
            f"<tr><td>{label}</td><td class='num'>{escape(pretty(r.base, r.percent))}"
            f"</td><td class='num'>{escape(shown)}</td>"
            f"{_gain(r.gain, r.percent, r.higher_is_better)}</tr>"
        )
    return (
        f"<table class='comparison'><tr><th>metric</th><th>{escape(base_label(ev))}</th>"
        "<th>tuned</th>"
        f"<th>gain</th></tr>{''.join(trs)}</table>"
    )
