"""The on-policy figure of a distilled student: its teacher's mean negative log-likelihood of
the student's own greedy completions of the held-out prompts (``teacher_nll``, nats per
completion token): how likely the teacher finds what the student writes, where the held-out
loss says how likely the student finds the dataset's responses. The evaluate stage of a run
with a teacher (on-policy distillation's live teacher) scores its own generations and its
base model's (the samples.jsonl beside the base's metrics.json) with the same teacher, so the
figure has the base's beside it; lower is better.

Each completion is the generation's text encoded again with the student's tokenizer (the
teacher's: distillation checks they are one), after the prompt's own tokens from the eval
set; an empty generation adds nothing. The teacher runs on one device, one example at a
time, at the evaluation's precision.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

KEY = "teacher_nll"


def pairs(
    eval_tokenized: Path, samples: list[dict[str, Any]], tokenizer
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) of each sample: the eval row's prompt, the generation
    encoded without special tokens."""
    from snaketune.core import parts
    from snaketune.core.rows import prompt_and_answer

    table = parts.read_table(eval_tokenized, ["example_id", "input_ids", "labels"]).to_pydict()
    prompts = {
        i: prompt_and_answer(ids, labels)[0]
        for i, ids, labels in zip(
            table["example_id"], table["input_ids"], table["labels"], strict=True
        )
    }
    return [
        (prompts[s["example_id"]], tokenizer(s["generation"], add_special_tokens=False).input_ids)
        for s in samples
    ]


def nll_sums(model, examples: list[tuple[list[int], list[int]]]) -> tuple[float, int]:
    """The summed NLL of every completion token under ``model`` and their count."""
    import torch

    device = next(model.parameters()).device
    total, count = 0.0, 0
    for prompt, completion in examples:
        if not completion:
            continue
        ids = torch.tensor([prompt + completion], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        target = ids[0, len(prompt) :]
        total += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        count += len(completion)
    return total, count


def scorer(
    teacher: Path | None, eval_tokenized: Path, base_samples: Path | None
) -> Callable[[list[dict[str, Any]], dict[str, Any]], list[str]] | None:
    """The evaluate stage's scoring by ``teacher`` (a model's folder; None: no teacher): the
    mean over the tuned model's samples into the metrics, the base's (``base_samples``,
    where the base generated) into their ``base``; returns the key."""
    if teacher is None:
        return None

    def apply(samples: list[dict[str, Any]], metrics: dict[str, Any]) -> list[str]:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from snaketune.evaluation.model import DTYPES, resolve_precision
        from snaketune.evaluation.scorers import base_generations

        device = "cuda" if torch.cuda.is_available() else "cpu"
        tokenizer = AutoTokenizer.from_pretrained(teacher, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            teacher, dtype=DTYPES[resolve_precision("auto")], local_files_only=True
        )
        model = model.to(device).eval()
        total, count = nll_sums(model, pairs(eval_tokenized, samples, tokenizer))
        metrics[KEY] = total / count if count else None
        theirs = base_generations(base_samples, samples)
        if theirs and "base" in metrics:
            total, count = nll_sums(model, pairs(eval_tokenized, theirs, tokenizer))
            metrics["base"][KEY] = total / count if count else None
        return [KEY]

    return apply


def both(*scorers: Callable | None) -> Callable | None:
    """The scorers given (a user's metrics, the teacher's) as one evaluate stage's
    ``user_scores``: each applied in turn, their keys together."""
    given = [s for s in scorers if s is not None]
    if not given:
        return None

    def apply(samples: list[dict[str, Any]], metrics: dict[str, Any]) -> list[str]:
        return [k for s in given for k in s(samples, metrics)]

    return apply
