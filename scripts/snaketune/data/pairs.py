"""Preference pairs as tokens: a prompt and two responses, chosen and rejected, rendered
with the model's chat template and labelled as supervised rows are (snaketune.data.tokenization).

A pair is one row of the tokenized file, with the chosen side in the columns every stage
reads (``input_ids``, ``labels``: so evaluation, the held-out loss and the reference
answers of exact match read a preference set as any other) and the rejected side beside it:

    rejected_input_ids  list<int32>
    rejected_labels     list<int32>   (-100 outside the rejected response)
    length              int32         both sides' tokens (what the shard plan balances)

The prompt's tokens are the same on both sides (checked) and never labelled: only the
assistant turns after the prompt are, so a multi-turn prompt's own assistant turns are
context. ``overlong`` applies to the longer side (drop: the pair goes; truncate: each side
is cut at ``max_length``, and the pair goes when a side has no response token left).
Pairs whose responses are identical or empty are dropped and counted.

This is the ``pairs`` kind's module (snaketune.data.kinds): its schema, rendering, labels,
dropped counts and batches (``batch``: chosen sides, then rejected sides).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from snaketune.core.rows import IGNORE_INDEX
from snaketune.data.chat import ChatRenderer
from snaketune.data.conversations import Items, Pair, Stats, text_sha
from snaketune.data.tokens import first_token_at

PAIR_COLUMNS = (
    ("rejected_input_ids", pa.list_(pa.int32())),
    ("rejected_labels", pa.list_(pa.int32())),
)


def schema(base: pa.Schema) -> pa.Schema:
    """The tokenized schema of a preference set: the supervised one and the rejected side."""
    out = base
    for name, kind in PAIR_COLUMNS:
        out = out.append(pa.field(name, kind))
    return out


def dropped(stats: Stats) -> str:
    return (
        f"preference pairs dropped: {stats.dropped_identical_pair} with identical sides, "
        f"{stats.dropped_empty_pair} with an empty side, {stats.dropped_prompt_mismatch} "
        "whose prompt tokens differ between the sides"
    )


def batch(examples: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Chosen sides then rejected sides, right-padded: input_ids, attention_mask and
    completion_mask (1 on the response tokens), as TRL's DPOTrainer reads them."""
    import torch

    seqs = [(e["input_ids"], e["labels"]) for e in examples]
    seqs += [(e["rejected_input_ids"], e["rejected_labels"]) for e in examples]
    width = max(len(ids) for ids, _ in seqs)
    input_ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    completion = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (ids, labels) in enumerate(seqs):
        n = len(ids)
        input_ids[i, :n] = torch.as_tensor(ids, dtype=torch.long)
        attention[i, :n] = 1
        completion[i, :n] = torch.as_tensor(np.asarray(labels) != IGNORE_INDEX, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion}


pair_batch = batch  # what the DPO family's collators and scorers call it


def usable(pair: Pair, stats: Stats) -> bool:
    """False (and counted) for a pair whose sides are identical or a side is empty."""
    if any(not content.strip() for side in (pair.chosen, pair.rejected) for _, content in side):
        stats.dropped_empty_pair += 1
        return False
    if pair.chosen == pair.rejected:
        stats.dropped_identical_pair += 1
        return False
    return True


def render(renderer: ChatRenderer, items: Items, stats: Stats):
    """The usable pairs of a batch, and texts and response spans: chosen sides first, then
    rejected, in the pairs' order (2n of each)."""
    kept = [(i, p) for i, p in items if usable(p, stats)]
    texts, spans = [], []
    for side in ("chosen", "rejected"):
        for _, pair in kept:
            response = getattr(pair, side)
            turns = (*pair.prompt, *response)
            renderer.check(turns)
            text, sp = renderer.spans(turns)
            texts.append(text)
            spans.append(sp[len(sp) - len(response) :])  # the response's turns only
    return kept, texts, spans


def _side(ids: list[int], spans, enc, text: str) -> np.ndarray:
    """Labels of one side: its ids where a response span covers the token, else -100."""
    labels = np.full(len(ids), IGNORE_INDEX, np.int32)
    for s, t in spans:
        a = first_token_at(enc, s, len(ids), len(text))
        b = first_token_at(enc, t, len(ids), len(text))
        labels[a:b] = np.asarray(ids[a:b], np.int32)
    return labels


def counted(stats: Stats, sides: list) -> None:
    """A kept pair's sides (ids, labels) counted into the tokenize stats."""
    (c_ids, c_labels), (r_ids, r_labels) = sides
    stats.rows += 1
    stats.tokens += len(c_ids) + len(r_ids)
    stats.label_tokens += int((c_labels != IGNORE_INDEX).sum() + (r_labels != IGNORE_INDEX).sum())
    stats.max_tokens = max(stats.max_tokens, len(c_ids), len(r_ids))
    stats.max_token_id = max(stats.max_token_id, int(c_ids.max()), int(r_ids.max()))


def encoded_sides(k: int, n: int, texts: list[str], spans: list, encodings: list) -> list:
    """Pair ``k``'s (ids, labels) of each side, chosen then rejected, from a batch of ``n``
    pairs' encodings (chosen sides first)."""
    sides = []
    for j in (k, k + n):
        ids = encodings[j].ids
        sides.append((np.asarray(ids, np.int32), _side(ids, spans[j], encodings[j], texts[j])))
    return sides


def kept_sides(
    example_id: str, sides: list, max_length: int, overlong: str, stats: Stats, cut_ok=None
) -> list | None:
    """A pair's sides after the length policy (``overlong`` on the longer side; ``cut_ok(ids)``
    whether a side may be cut at ``max_length``), counted; None (counted) where it goes."""
    longest = max(len(ids) for ids, _ in sides)
    stats.conversations += 1
    if longest > max_length:
        cuttable = cut_ok is None or all(cut_ok(ids) for ids, _ in sides)
        if overlong == "truncate" and cuttable:
            stats.truncated += 1
            sides = [(ids[:max_length], labels[:max_length]) for ids, labels in sides]
        else:
            stats.dropped_overlong += 1
            if longest > stats.longest_overlong[0]:
                stats.longest_overlong = (longest, example_id)
            return None
    if any(not (labels != IGNORE_INDEX).any() for _, labels in sides):
        stats.dropped_no_response += 1
        return None
    (c_ids, c_labels), (r_ids, r_labels) = sides
    start = min(int(np.argmax(c_labels != IGNORE_INDEX)), int(np.argmax(r_labels != IGNORE_INDEX)))
    if not np.array_equal(c_ids[:start], r_ids[:start]):
        stats.dropped_prompt_mismatch += 1  # tokens merged across the prompt's end
        return None
    if stats.end_of_turn_id is not None and stats.end_of_turn_id not in c_labels:
        stats.rows_without_end_of_turn += 1
    counted(stats, sides)
    return sides


def pair_values(example_id: str, sides: list, sha: str) -> dict[str, Any]:
    """A kept pair's row of the tokenized file (the pairs kind's columns)."""
    (c_ids, c_labels), (r_ids, r_labels) = sides
    return {
        "example_id": example_id,
        "input_ids": c_ids,
        "labels": c_labels,
        "length": len(c_ids) + len(r_ids),
        "text_sha": sha,
        "rejected_input_ids": r_ids,
        "rejected_labels": r_labels,
    }


def label(
    items: Items,
    texts: list[str],
    spans: list,
    encodings: list,
    max_length: int,
    overlong: str,
    stats: Stats,
    *,
    schema: pa.Schema,
) -> pa.Table:
    """Labels and length policy of one encoded batch of pairs; the pairs kept, as a table."""
    n = len(items)
    rows: dict[str, list] = {f.name: [] for f in schema}
    for k, (example_id, pair) in enumerate(items):
        sides = encoded_sides(k, n, texts, spans, encodings)
        sides = kept_sides(example_id, sides, max_length, overlong, stats)
        if sides is None:
            continue
        for name, value in pair_values(example_id, sides, text_sha(pair)).items():
            rows[name].append(value)
    return pa.Table.from_pydict(rows, schema=schema)
