"""What an evaluation measures, chosen by what is evaluated, and how each figure reads.

The evaluate stage scores every eval set with the figures that fit its references (its
*format*, decided from the references themselves):

- ``numeric``: every reference has a final answer (a ``#### <n>`` line or a ``\\boxed{}``,
  GSM8K- and MATH-style): ``exact_match`` (the number after ``####``) and ``math_verify``;
- ``text``: no reference has one (chat, instructions, summaries): ``chrf``, sacrebleu's
  chrF (character n-gram F-score of the generations against the references, corpus level,
  0-100), and where the references are short (a median of at most ``SHORT_WORDS`` words)
  ``normalized_match``: the share of generations equal to their reference once both are
  lower-cased and stripped of punctuation, articles and extra spaces (SQuAD's rule);
- ``mixed``: both families;
- ``documents``: raw text (a ``text`` eval set: snaketune.data.text), which has no prompt
  to generate from: no generation, only the held-out ``loss`` per token, its
  ``perplexity`` and ``bits_per_byte`` (the summed loss in bits over the text's UTF-8
  bytes, comparable across tokenizers).

Every generating evaluation has the held-out ``loss`` and ``perplexity`` over response
tokens and the ``stop_rate``; an eval set of preference pairs adds ``likelihood_accuracy``
and, for a method that scores pairs with a beta (DPO), the implicit reward's
``preference_accuracy`` and ``reward_margin``; a reward model's evaluation has its scores'
``preference_accuracy`` and ``reward_margin`` only; a distilled model's adds ``heldout_kl``,
its forward KL from the teacher's top-k on the eval set, and the teacher's own held-out
``teacher_loss`` beside its ``loss``; an on-policy distilled model's adds ``teacher_nll``,
its teacher's NLL of the model's own greedy completions (snaketune.evaluation.teacher_nll);
the user's own metrics (``eval.metrics``, snaketune.evaluation.scorers) are figures under
their keys.

A run's *headline* is its method's own figures (snaketune.methods: ``Method.headline``),
then its data's, then the held-out loss, then the user's metrics: the end-of-run line,
summary.tsv's ``headline`` column, the report, the model card and a sweep's ``auto``
selection lead with it. metrics.json holds ``format``, ``headline`` and ``figures`` (each
figure's value, the base model's and the difference), so every reader shows what the
evaluation measured without knowing which method or data made it.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from snaketune.evaluation.answers import last_boxed, parse_answer

SHORT_WORDS = 12  # references of at most this many words (median): normalized_match too
FORMATS = ("numeric", "text", "mixed", "documents")
FAMILY = {
    "numeric": ("exact_match", "math_verify"),
    "text": ("chrf", "normalized_match"),
    "mixed": ("exact_match", "math_verify", "chrf", "normalized_match"),
    "documents": ("bits_per_byte",),
}
# the data's figures in a headline: numeric answers lead with exact match, free text with
# the held-out loss (steadier than any overlap score of a small model's generations)
LEADING = {
    "numeric": ("exact_match", "math_verify", "loss"),
    "text": ("loss", "chrf"),
    "mixed": ("exact_match", "chrf", "loss"),
    "documents": ("loss", "bits_per_byte", "perplexity"),
}
GENERATED = ("loss", "perplexity", "stop_rate")  # every generating evaluation's


class Described(NamedTuple):
    """How a figure reads: its label, whether it is a share (shown as 76.6%), which way is
    better, and its short name for the end-of-run line."""

    label: str
    percent: bool
    higher_is_better: bool
    short: str


DESCRIBED = {
    "exact_match": Described("exact match (#### number)", True, True, "exact_match"),
    "math_verify": Described("math_verify accuracy", True, True, "math_verify"),
    "chrf": Described("chrF (overlap with the reference, 0-100)", False, True, "chrF"),
    "normalized_match": Described(
        "normalized exact match (short references)", True, True, "normalized_match"
    ),
    "loss": Described("held-out loss (nats/token)", False, False, "eval loss"),
    "perplexity": Described("perplexity", False, False, "perplexity"),
    "bits_per_byte": Described(
        "bits per byte (held-out text, any tokenizer)", False, False, "bits_per_byte"
    ),
    "stop_rate": Described("stop rate (ends on a stop id)", True, True, "stop_rate"),
    "preference_accuracy": Described(
        "preference accuracy (chosen ranked first)", True, True, "preference_accuracy"
    ),
    "reward_margin": Described("reward margin (chosen - rejected)", False, True, "reward_margin"),
    "likelihood_accuracy": Described(
        "chosen more likely than rejected", True, True, "likelihood_accuracy"
    ),
    "heldout_kl": Described(
        "KL to the teacher (nats/token, held out)", False, False, "kl_to_teacher"
    ),
    "teacher_loss": Described(
        "the teacher's held-out loss (nats/token)", False, False, "teacher loss"
    ),
    "teacher_nll": Described(
        "the teacher's NLL of the model's greedy completions (nats/token)",
        False,
        False,
        "teacher_nll",
    ),
}


def described(key: str) -> Described:
    """How ``key`` reads (a user's metric: its key, higher is better)."""
    return DESCRIBED.get(key) or Described(key, False, True, key)


def has_answer(reference: str) -> bool:
    """Whether a reference holds a final answer: a ``####`` number or a ``\\boxed{}``."""
    return parse_answer(reference) is not None or last_boxed(reference) is not None


def answer_format(references: Sequence[str]) -> str:
    """``numeric`` when every reference has a final answer, ``text`` when none has,
    ``mixed`` otherwise."""
    answers = sum(has_answer(r) for r in references)
    if answers == len(references):
        return "numeric"
    return "text" if answers == 0 else "mixed"


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """SQuAD's answer normalization: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def short_references(references: Sequence[str]) -> bool:
    """Whether the references are short enough for normalized exact match to mean much."""
    from statistics import median

    return bool(references) and median(len(r.split()) for r in references) <= SHORT_WORDS


def text_scores(
    references: Sequence[str], generations: Sequence[str]
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Free-text figures: each example's sentence chrF (and normalized match where the
    references are short), and over all of them the corpus chrF (and the share matched)."""
    from sacrebleu.metrics import CHRF

    chrf = CHRF()
    short = short_references(references)
    per = []
    for ref, gen in zip(references, generations, strict=True):
        one = {"chrf": chrf.sentence_score(gen, [ref]).score}
        if short:
            one["normalized_match"] = normalize(gen) == normalize(ref)
        per.append(one)
    figures = {"chrf": chrf.corpus_score(list(generations), [list(references)]).score}
    if short:
        figures["normalized_match"] = sum(p["normalized_match"] for p in per) / len(per)
    return per, figures


def value_of(metrics: Mapping[str, Any] | None, key: str) -> Any:
    """A figure of a metrics.json (or its ``base``): at the top, or among the pairs'."""
    if not metrics:
        return None
    if key in metrics and not isinstance(metrics[key], dict):
        return metrics[key]
    return (metrics.get("preference") or {}).get(key)


def headline(
    method_headline: Sequence[str], fmt: str | None, user: Sequence[str], generates: bool = True
) -> list[str]:
    """A run's headline figures, in order: its method's, its data's with the held-out loss
    (where it generates), the user's metrics."""
    keys = list(method_headline)
    if generates and fmt is not None:
        keys += LEADING[fmt]
    keys += list(user)
    return list(dict.fromkeys(keys))


def table(metrics: Mapping[str, Any], keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``figures`` of a metrics.json: for each key it has, its value, the base model's
    (where evaluated) and the difference (tuned - base), in ``keys``' order."""
    base = metrics.get("base")
    out = {}
    for key in keys:
        value = value_of(metrics, key)
        if value is None:
            continue
        entry: dict[str, Any] = {"value": value}
        before = value_of(base, key)
        if before is not None:
            entry.update(base=before, gain=value - before)
        out[key] = entry
    return out


def shown(metrics: Mapping[str, Any], first: Sequence[str]) -> list[str]:
    """Every figure an evaluation shows: ``first`` (its headline), then its data's family,
    the generation figures and the pairs' (what it has of them)."""
    fmt = metrics.get("format")
    rest = [
        *(FAMILY[fmt] if fmt else ()),
        *GENERATED,
        "preference_accuracy",
        "reward_margin",
        "likelihood_accuracy",
    ]
    return list(dict.fromkeys([*first, *rest]))
