"""The report's plots (matplotlib, inline SVG): each run's training curves (loss, rewards
or preference figures, held-out points) and a sweep's members side by side."""

from __future__ import annotations

from typing import Any

from snaketune.core.heldout import split_rows
from snaketune.methods.outputs import Panel


def svg_of(fig) -> str:
    """A matplotlib figure as inline SVG (text kept as text, no external files)."""
    import io

    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def figure(width_in: float, height_in: float, cols: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "svg.fonttype": "none",
            "font.size": 9,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "svg.hashsalt": "snaketune",
        }
    )
    # constrained: each panel's labels (a second axis at its right included) keep clear of
    # the next panel's
    return plt.subplots(1, cols, figsize=(width_in, height_in), squeeze=False, layout="constrained")


def training_svg(
    metrics: list[dict[str, Any]],
    title: str,
    eval_loss: float | None,
    exported: int | None = None,
    panel: Panel | None = None,
) -> str:
    """The method's first ``panel`` (snaketune.methods.outputs.Panel; None: the training
    loss, with the held-out loss where measured); learning rate;
    tokens/s; against the optimizer step, side by side, with ticks and units. Held-out
    passes while training (eval_steps) are points over the first panel, and ``exported``
    (export.checkpoint: best) marks the step the model was taken from."""
    return svg_of(training_figure(metrics, title, eval_loss, exported, panel))


def training_figure(
    metrics: list[dict[str, Any]],
    title: str,
    eval_loss: float | None,
    exported: int | None = None,
    panel: Panel | None = None,
):
    """The matplotlib figure of ``training_svg``."""
    metrics, held = split_rows(metrics)
    steps = [m["step"] for m in metrics]
    fig, axes = figure(11.5, 3.0, 3)
    loss, lr, tps = axes[0]
    if metrics and panel is not None:
        method_panel(loss, panel, metrics, steps)
        loss.set_title(f"{title}: {panel.title}")
        # a loss on the panel's own axis; another figure on a second one
        _heldout_points(loss, held, panel.heldout, twin=panel.heldout != "loss")
    else:
        _loss_panel(loss, metrics, steps, eval_loss)
        loss.set_title(f"{title}: loss")
        _heldout_points(loss, held, "loss", twin=False)
    if exported is not None:
        loss.axvline(exported, color="tab:gray", linestyle=":", linewidth=1.5)
        loss.annotate(
            f"exported: step {exported}",
            (exported, 0.02),
            fontsize=7,
            xycoords=("data", "axes fraction"),
            rotation=90,
            ha="right",
        )
    lr.plot(steps, [m.get("lr", float("nan")) for m in metrics], color="tab:green")
    lr.set(title="learning rate", xlabel="optimizer step", ylabel="learning rate")
    lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    speed = [(m["step"], m["tokens_per_s"]) for m in metrics[1:] if "tokens_per_s" in m]
    if speed:
        tps.plot(*zip(*speed, strict=True), color="tab:purple")
    tps.set(
        title="throughput (first step left out)",
        xlabel="optimizer step",
        ylabel="real tokens / s (all ranks)",
    )
    for ax in axes[0]:
        ax.xaxis.get_major_locator().set_params(integer=True)
    return fig


def _heldout_points(ax, held: list[dict[str, Any]], figure: str, twin: bool) -> None:
    """The held-out figure of each pass while training (eval_steps), on the panel's axis or,
    where its unit differs, on a second one at the right."""
    points = [(m["step"], m[f"heldout_{figure}"]) for m in held if f"heldout_{figure}" in m]
    if not points:
        return
    target = ax.twinx() if twin else ax
    name = figure.replace("_", " ")
    (line,) = target.plot(
        *zip(*points, strict=True),
        "s--",
        color="tab:orange",
        markersize=4,
        label=f"held-out {name} (while training)",
    )
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


def method_panel(ax, panel: Panel, metrics: list[dict[str, Any]], steps: list[int]) -> None:
    """A method's own first panel: its series (the first marked for the tests by its key),
    those found in the rows, and its right-axis series on 0 to 1."""
    found = panel.more(metrics) if panel.more else []
    series = [*panel.series, *((key, label, None) for key, label in found)]
    for i, (key, label, color) in enumerate(series):
        (line,) = ax.plot(
            steps,
            [m.get(key, float("nan")) for m in metrics],
            color=color,
            linewidth=1.5 if i == 0 else 1,
            label=label,
        )
        if i == 0:
            line.set_gid(key)
    ax.set(xlabel="optimizer step", ylabel=panel.ylabel)
    if panel.right is None:
        ax.legend(fontsize=8)
        return
    key, label = panel.right
    right = ax.twinx()
    right.plot(
        steps, [m.get(key, float("nan")) for m in metrics], ":", color="tab:gray", label=label
    )
    right.set(ylabel=label, ylim=(0, 1.05))
    right.grid(False)
    lines = ax.get_legend_handles_labels(), right.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], fontsize=7)


def sweep_svg(
    curves: dict[str, list[dict[str, Any]]], evals: dict[str, float], best: str, title: str
) -> str:
    """Every member's training loss against the step, overlaid; its held-out loss (where
    measured) as a marker of the same colour at its last step; the best member bold."""
    fig, axes = figure(11.5, 3.6, 1)
    ax = axes[0][0]
    for i, (member, metrics) in enumerate(curves.items()):
        steps = [m["step"] for m in metrics]
        color = f"C{i % 10}"
        (line,) = ax.plot(
            steps,
            [m.get("loss") for m in metrics],
            color=color,
            linewidth=2.2 if member == best else 1.0,
            label=member + (" (best)" if member == best else ""),
        )
        line.set_gid(f"sweep-loss-{i}")
        if member in evals and steps:
            ax.plot([steps[-1]], [evals[member]], "D", color=color)
    ax.set(xlabel="optimizer step", ylabel="training loss (nats/token)", title=title)
    ax.legend(fontsize=7, loc="upper right")
    return svg_of(fig)
