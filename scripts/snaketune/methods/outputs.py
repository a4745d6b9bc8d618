"""What a method's runs show of their training, the method's own: the first panel of its
training plot (``Panel``: the series of metrics.jsonl it draws), its columns of
summary.tsv (figures of its steps), and its early warnings (snaketune.train.vitals asks
for them beside the ones every run gets). The report, the summary and the vitals draw and
write what a method gives here; none of them reads a method's keys by itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Rows = list[dict[str, Any]]
WINDOW = 5  # steps: a figure that holds over each of them is a run that cannot learn


def holds(rows: Rows, key: str, test: Callable[[Any], bool]) -> bool:
    """Whether ``key`` is there and passes ``test`` in each of at least WINDOW rows."""
    values = [r.get(key) for r in rows]
    return len(values) >= WINDOW and all(v is not None and test(v) for v in values)


@dataclass(frozen=True)
class Panel:
    """The first panel of a method's training plot (snaketune.app.plots draws it): its
    series (a metrics.jsonl key, its label, its colour), series found in the rows
    (``more``: GRPO's rewards by name), one series on a right axis of 0 to 1 (``right``),
    and the held-out figure drawn over it while training (a loss on its own axis, any other
    on a second one)."""

    title: str
    ylabel: str
    series: tuple[tuple[str, str, str | None], ...]
    more: Callable[[Rows], list[tuple[str, str]]] | None = None
    right: tuple[str, str] | None = None
    heldout: str = "loss"


def quarters(values: list[float]) -> tuple[float, float]:
    """The mean of the first and of the last quarter of ``values`` (at least one each),
    rounded as summary.tsv shows them."""
    n = max(1, len(values) // 4)
    return round(sum(values[:n]) / n, 4), round(sum(values[-n:]) / n, 4)


def no_figures(metrics: Rows) -> dict[str, float]:
    return {}


def no_warnings(run: dict[str, Any], rows: Rows) -> dict[str, str]:
    return {}


# The preference methods' steps (DPO, ORPO, SimPO, KTO, a reward model): the implicit or
# the model's rewards of each step's pairs.
PREFERENCE_PANEL = Panel(
    title="preference",
    ylabel="loss; reward (beta x log-ratio)",
    series=(
        ("loss", "loss", "tab:blue"),
        ("reward_chosen", "reward chosen", "tab:green"),
        ("reward_rejected", "reward rejected", "tab:red"),
        ("reward_margin", "reward margin", "tab:orange"),
    ),
    right=("reward_accuracy", "reward accuracy"),
)
PREFERENCE_COLUMNS = ("reward_accuracy_last_quarter", "reward_margin_last_quarter")


def preference_quarter(metrics: Rows) -> dict[str, float]:
    """A preference run's mean reward accuracy and margin over its last quarter of steps
    (what it logs of them: KTO's trainer has no reward accuracy)."""
    rows = [m for m in metrics if m.get("reward_margin") is not None]
    if not rows:
        return {}
    return {
        f"{key}_last_quarter": quarters([m[key] for m in rows])[1]
        for key in ("reward_accuracy", "reward_margin")
        if all(m.get(key) is not None for m in rows)
    }
