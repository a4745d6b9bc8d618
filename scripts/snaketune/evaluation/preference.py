"""Held-out preference pairs, scored by a model that generates: each pair's summed
log-probs of its chosen and rejected response (as DPO training computes them), and the
figures of all of them: likelihood accuracy, and against the starting model's log-probs
with the run's beta the implicit rewards' preference accuracy and margin.

The ``pairs`` kind's held-out scorer (snaketune.data.kinds): ``logps``, ``sample_fields``,
``figures`` and ``recorded``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from snaketune.evaluation.sharded import ONE, Share, whole_output_layer


def logps(
    model, rows: list[dict], batch_size: int, pad: int, share: Share = ONE
) -> list[tuple[float, float]]:
    """Each of this rank's held-out pairs' summed log-probs of its chosen and its rejected
    response (every rank runs as many batches: one short of pairs repeats a pair)."""
    from trl.trainer.utils import add_fused_lm_head

    from snaketune.data.pairs import pair_batch
    from snaketune.data.pictures import inputs_of
    from snaketune.evaluation.logps import sequence_logps

    add_fused_lm_head(model)  # the log-probs as DPO training computes them
    mine, out = share.mine(rows), []
    for b in range(share.batches(len(rows), batch_size)):
        part = mine[b * batch_size : (b + 1) * batch_size]
        batch = pair_batch(part or rows[:1], pad)
        batch = {k: v.to(model.device) for k, v in batch.items()}
        batch.update(inputs_of(model, part or rows[:1], batch["input_ids"]))  # pictures'
        with whole_output_layer(model, share.world > 1):
            chosen, rejected = sequence_logps(model, batch)
        if part:
            out += list(zip(chosen.tolist(), rejected.tolist(), strict=True))
    return out


def sample_fields(scores: tuple[float, float]) -> dict[str, float]:
    """What a pair's sample records of its scores."""
    return {"chosen_logp": scores[0], "rejected_logp": scores[1]}


def figures(
    samples: list[dict[str, Any]], base: dict[str, tuple[float, float]] | None, beta: float | None
) -> dict[str, Any]:
    """The metrics' own part for held-out pairs."""
    return {"preference": preference(samples, base, beta)}


def preference(
    samples: list[dict[str, Any]], base: dict[str, tuple[float, float]] | None, beta: float | None
) -> dict[str, Any]:
    """Figures of the held-out pairs: how often the model finds the chosen response more
    likely than the rejected (likelihood_accuracy); and, against the model it started from
    (``base``: example id -> its log-probs) with the run's ``beta``, the implicit reward
    beta * (log p - log p_start) of each side: how often it ranks chosen above rejected
    (preference_accuracy; 0 for the starting model itself, whose rewards are all 0) and the
    mean margin between them."""
    figures: dict[str, Any] = {
        "pairs": len(samples),
        "likelihood_accuracy": sum(s["chosen_logp"] > s["rejected_logp"] for s in samples)
        / len(samples),
    }
    if base is None or beta is None:
        return figures
    margins, chosen, rejected = [], [], []
    for s in samples:
        c0, r0 = base[s["example_id"]]
        chosen.append(beta * (s["chosen_logp"] - c0))
        rejected.append(beta * (s["rejected_logp"] - r0))
        margins.append(chosen[-1] - rejected[-1])
    figures.update(
        {
            "beta": beta,
            "preference_accuracy": sum(m > 0 for m in margins) / len(margins),
            "reward_margin": sum(margins) / len(margins),
            "reward_chosen": sum(chosen) / len(chosen),
            "reward_rejected": sum(rejected) / len(rejected),
        }
    )
    return figures


def recorded(samples: Path) -> dict[str, tuple[float, float]] | None:
    """The pairs' log-probs a base evaluation recorded in its samples (None: none there, an
    eval set of rows)."""
    if not samples.is_file():
        return None
    try:
        return {
            s["example_id"]: (s["chosen_logp"], s["rejected_logp"])
            for s in map(json.loads, samples.read_text().splitlines())
        } or None
    except KeyError:
        return None
