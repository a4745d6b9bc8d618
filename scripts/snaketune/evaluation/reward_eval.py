"""A reward model's evaluation (``method: reward``) on held-out preference pairs: each
side's score (read at its last real token: snaketune.evaluation.heads), how often the chosen side
scores higher (``preference_accuracy``), the mean margin between the sides, each side's
mean score and the mean pairwise loss -log sigmoid(margin).

The starting model is scored the same way (rule evaluate_start): a causal model gets the
run's new score head, drawn from the run's seed as the training job drew it, so its
accuracy is that of the head training starts from (about a coin's). The figures sit in
``metrics.json`` under ``preference`` (the report's and summary's preference columns, as a
DPO run's held-out pairs), with the start's under ``base`` and the gain over it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from snaketune.core.io import write_outputs
from snaketune.core.rows import pad_id

log = logging.getLogger(__name__)


def load_reward_model(model_dir: Path, seed: int, adapter_base: Path | None = None):
    """The tokenizer and the model as a reward model in eval mode (on the GPU when there
    is one): a saved reward model with its head, a causal model with the head drawn from
    ``seed``; ``adapter_base``: ``model_dir`` is a LoRA adapter, loaded on that base."""
    from transformers import AutoTokenizer

    from snaketune.evaluation import heads
    from snaketune.evaluation.model import DTYPES, resolve_precision

    dtype = DTYPES[resolve_precision("auto")]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = adapter_base or model_dir
    model = heads.load(start, "score", seed, dtype=dtype, local_files_only=True)
    if adapter_base is not None:
        from snaketune.core.lora_targets import load_adapter

        model = load_adapter(model, model_dir)
    return tokenizer, model.to(device).eval()


def pair_scores(model, rows: list[dict], batch_size: int, pad: int) -> list[tuple[float, float]]:
    """Each pair's (chosen, rejected) score, float32, batches of ``batch_size`` pairs (both
    sides of a pair in one batch, right-padded)."""
    from snaketune.data.pairs import pair_batch

    device = next(model.parameters()).device
    out: list[tuple[float, float]] = []
    for i in range(0, len(rows), batch_size):
        batch = pair_batch(rows[i : i + batch_size], pad)
        with torch.no_grad():
            logits = model(
                input_ids=batch["input_ids"].to(device),
                attention_mask=batch["attention_mask"].to(device),
            ).logits
        chosen, rejected = logits.float().squeeze(-1).cpu().chunk(2)
        out += list(zip(chosen.tolist(), rejected.tolist(), strict=True))
    return out


def figures(scores: list[tuple[float, float]]) -> dict[str, Any]:
    """Pairwise accuracy, mean margin, each side's mean score, mean pairwise loss."""
    margins = [c - r for c, r in scores]
    n = len(scores)
    return {
        "pairs": n,
        "preference_accuracy": sum(m > 0 for m in margins) / n,
        "reward_margin": sum(margins) / n,
        "reward_chosen": sum(c for c, _ in scores) / n,
        "reward_rejected": sum(r for _, r in scores) / n,
        "pairwise_loss": sum(math.log1p(math.exp(-m)) if m > -30 else -m for m in margins) / n,
    }


def against_start(metrics: dict[str, Any], start: dict[str, Any]) -> None:
    """The starting model's pair figures and the gain over them, in place."""
    mine, theirs = metrics["preference"], start["preference"]
    metrics["base"] = {"preference": theirs}
    metrics["gain"] = {
        "preference_accuracy": mine["preference_accuracy"] - theirs["preference_accuracy"],
        "preference_reward_margin": mine["reward_margin"] - theirs["reward_margin"],
    }


def evaluate_reward(
    model_dir: Path,
    eval_tokenized: Path,
    train_tokenized: Path | None,
    out_dir: Path,
    limit: int | None,
    batch_size: int,
    seed: int,
    base_metrics: dict[str, Any] | None = None,
    finish: Callable[[Path, dict[str, Any]], None] | None = None,
    adapter_base: Path | None = None,
    first: tuple[str, ...] = ("preference_accuracy",),
) -> dict[str, Any]:
    """Write ``metrics.json`` and ``samples.jsonl`` (each pair's two scores) under
    ``out_dir``; return the metrics. ``base_metrics``: the starting model's, for the gain;
    ``first``: the method's headline figures."""
    from snaketune.core.errors import DataError
    from snaketune.data.kinds import kind_named
    from snaketune.data.shard import check_overlap
    from snaketune.evaluation.evaluate import load_examples

    if train_tokenized is not None:
        check_overlap(train_tokenized, eval_tokenized)
    rows = load_examples(eval_tokenized, limit)
    if not kind_named("pairs").holds(rows[0]):
        raise DataError(
            f"{eval_tokenized}: a reward model is scored on preference pairs; "
            "give the run a `preference` eval_dataset"
        )
    tokenizer, model = load_reward_model(model_dir, seed, adapter_base)
    scores = pair_scores(model, rows, batch_size, pad_id(tokenizer))
    metrics: dict[str, Any] = {
        "head": "score",
        "examples": len(rows),
        "model": str(model_dir),
        "preference": figures(scores),
        "processes": 1,
        "format": None,
    }
    if base_metrics is not None:
        against_start(metrics, base_metrics)
    from snaketune.evaluation import figures as shown

    metrics["headline"] = shown.headline(first, None, (), generates=False)  # the method's
    metrics["figures"] = shown.table(metrics, shown.shown(metrics, metrics["headline"]))
    samples = [
        {"example_id": r["example_id"], "chosen_score": c, "rejected_score": s}
        for r, (c, s) in zip(rows, scores, strict=True)
    ]
    write_outputs(out_dir, metrics, samples, finish)
    p = metrics["preference"]
    log.info(
        "pairwise accuracy %.3f, mean margin %.3f, pairwise loss %.4f on %d pairs",
        p["preference_accuracy"],
        p["reward_margin"],
        p["pairwise_loss"],
        len(rows),
    )
    return metrics
