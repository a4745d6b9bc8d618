"""A sweep's best member (``results/<sweep>/best.json``, snaketune.plan.sweep has the rule):
every figure a member can be selected on, what ``auto`` stands for (the first figure of
the members' headline, snaketune.evaluation.figures), the selection and its tie-break."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from snaketune.core.errors import ConfigError
from snaketune.plan.sweep import AUTO, EVAL_FIGURES


def figures(
    metrics: Mapping[str, Any] | None,
    train_loss: float | None,
    held: list[dict[str, Any]] | None = None,
) -> dict[str, float]:
    """Every figure a member can be selected on (``held``: its held-out rows while
    training, whose best figures count too)."""
    from snaketune.app.summary import lm_eval_columns

    out: dict[str, float] = {}
    if train_loss is not None:
        out["train_loss"] = train_loss
    for key, best in (("loss", min), ("exact_match", max)):
        seen = [
            r[f"heldout_{key}"]
            for r in held or ()
            if r.get("step", 0) > 0 and f"heldout_{key}" in r
        ]
        if seen:
            out[f"heldout_{key}_best"] = best(seen)
    if metrics:
        out.update({k: metrics[k] for k in EVAL_FIGURES if metrics.get(k) is not None})
        out.update({k: f["value"] for k, f in (metrics.get("figures") or {}).items()})
        out.update(
            {
                k: v
                for k, v in lm_eval_columns(metrics).items()
                if not k.startswith(("base_", "gain_")) and v is not None
            }
        )
    return out


def resolve_auto(members: Mapping[str, Mapping[str, Any]]) -> tuple[str, str, str]:
    """The metric and mode ``auto`` stands for, and why: the first figure of the members'
    headline (their method's, else their data's: snaketune.evaluation.figures), the
    held-out loss (min) where they have none."""
    from snaketune.evaluation.figures import described

    heads = [tuple(info.get("headline") or ()) for info in members.values()]
    if heads and heads[0] and all(h[:1] == heads[0][:1] for h in heads):
        key = heads[0][0]
        mode = "max" if described(key).higher_is_better else "min"
        return key, mode, "the first figure of the members' headline"
    return "loss", "min", "the members' evaluations have no headline figure"


def select(members: Mapping[str, Mapping[str, Any]], rule: Mapping[str, str]) -> dict[str, Any]:
    """best.json: the best member by ``rule`` among ``{member: {values, figures, answers}}``;
    members tied on the metric are listed and the tie is broken by the held-out loss (else
    the training loss), then by name."""
    metric, mode, why = rule["metric"], rule.get("mode"), None
    if metric == AUTO:
        metric, mode, why = resolve_auto(members)
    scored = {m: info["figures"].get(metric) for m, info in members.items()}
    missing = [m for m, v in scored.items() if v is None]
    if missing:
        raise ConfigError(f"sweep_select: {metric} is not in the metrics of {missing[0]}")
    top = (max if mode == "max" else min)(scored.values())
    tied = sorted(m for m, v in scored.items() if v == top)

    def loss(m: str) -> float:
        figures = members[m]["figures"]
        value = figures.get("loss", figures.get("train_loss"))
        return float("inf") if value is None else value

    best = min(tied, key=lambda m: (loss(m), m))
    out = {
        "metric": metric,
        "mode": mode,
        "best": best,
        "value": scored[best],
        "values": members[best]["values"],
        "figures": members[best]["figures"],
        "members": [{"run": m, "values": members[m]["values"], metric: scored[m]} for m in members],
    }
    if why:
        out["metric_chosen"] = f"sweep_select auto: {metric} ({why})"
    if len(tied) > 1:
        out["tied"] = tied
        out["tie_broken_by"] = "loss" if "loss" in members[best]["figures"] else "train_loss"
    return out


def best_member(
    specs: Mapping[str, Mapping[str, Any]],
    evals: Mapping[str, Any],
    curves: Mapping[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """best.json of one sweep from its members' run configs, eval metrics (where they have
    them) and training metrics rows: what select_sweep writes and the report shows."""
    info = {}
    for name, spec in specs.items():
        losses = [r["loss"] for r in curves[name] if r.get("loss") is not None]
        last = losses[-1] if losses else None
        held = [r for r in curves[name] if "heldout_loss" in r]
        info[name] = {
            "values": spec["sweep_of"]["values"],
            "figures": figures(evals.get(name), last, held),
            "headline": (evals.get(name) or {}).get("headline"),
        }
    return select(info, next(iter(specs.values()))["sweep_of"]["select"])
