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

import re
from typing import Any

import numpy as np
import pyarrow as pa

from snaketune.core.errors import DataError
from snaketune.core.rows import IGNORE_INDEX
from snaketune.data.chat import ChatRenderer, Turn
from snaketune.data.conversations import Items, Pair, Source, Stats, _turns, text_sha
from snaketune.data.kinds import Encoded
from snaketune.data.tokens import first_token_at

PAIR_COLUMNS = (
    ("rejected_input_ids", pa.list_(pa.int32())),
    ("rejected_labels", pa.list_(pa.int32())),
)


# ----------------------------------------------------------------------------- rows


def read_pair(
    source: Source, system: tuple[Turn, ...], cols: dict[str, Any], data: dict, i: int, row: int
) -> Pair:
    """One preference row as a Pair, in any of TRL's forms: text prompt and responses; a
    prompt message list with assistant turns; or whole conversations sharing their prompt."""
    name = source.name
    raw = {
        f: data[cols[f]][i] if cols[f] in data else None for f in ("prompt", "chosen", "rejected")
    }
    if raw["prompt"] is None:  # whole conversations: text in the HH form, or messages
        chosen = _whole(raw["chosen"], name, row, cols["chosen"])
        rejected = _whole(raw["rejected"], name, row, cols["rejected"])
    else:
        chosen = _turns(raw["chosen"], name, row, cols["chosen"], "assistant")
        rejected = _turns(raw["rejected"], name, row, cols["rejected"], "assistant")
    if raw["prompt"] is None:  # implicit prompt: the turns both conversations share
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    else:
        prompt = _turns(raw["prompt"], name, row, cols["prompt"], "user")
        if isinstance(raw["prompt"], str):
            prompt = (*system, *prompt)
        # whole conversations repeat the prompt's turns: keep what follows them
        if chosen[: len(prompt)] == prompt and len(chosen) > len(prompt):
            chosen = chosen[len(prompt) :]
        if rejected[: len(prompt)] == prompt and len(rejected) > len(prompt):
            rejected = rejected[len(prompt) :]
    if not prompt or any(turn[0] != "assistant" for turn in (*chosen, *rejected)):
        raise DataError(
            f"datasets.{name} row {row}: a preference row needs prompt turns and responses of "
            "assistant turns only (chosen/rejected); clean the data or filter the row out"
        )
    return Pair(prompt, chosen, rejected)


# A turn of a conversation written as text in Anthropic's HH-RLHF form:
# "\n\nHuman: ...\n\nAssistant: ..." (a speaker's name at the start of the text or after a
# blank line).
HH_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant): ?")
# How a preference dataset without a prompt column may hold its pairs (its message names it).
WHOLE_FORMS = "lists of {role, content} messages, or text in the 'Human: ... Assistant: ...' form"


def hh_turns(text: str) -> tuple[Turn, ...] | None:
    """Text in the HH form as turns (Human: user, Assistant: assistant); None where the
    text is not in that form (it does not start with a speaker, or names only one)."""
    parts = HH_TURN.split(text)
    if len(parts) < 5 or parts[0].strip():
        return None
    pairs = zip(parts[1::2], parts[2::2], strict=True)
    return tuple(("user" if who == "Human" else "assistant", said.strip()) for who, said in pairs)


def _whole(value: Any, name: str, row: int, col: str) -> tuple[Turn, ...]:
    """A whole conversation of a preference dataset without a prompt column: messages, or
    text in the HH form. Plain text is refused for the dataset: no prompt can be told from
    it (the fix is a prompt column, or whole conversations)."""
    if not isinstance(value, str):
        return _turns(value, name, row, col, None)
    turns = hh_turns(value)
    if turns is None:
        raise DataError(
            f"datasets.{name}: a preference dataset without a prompt column needs `chosen` and "
            f"`rejected` as whole conversations that share their prompt ({WHOLE_FORMS}); column "
            f"{col!r} holds plain text (row {row}: {value!r:.60}); name the prompt column "
            "(columns.prompt) or give whole conversations"
        )
    return turns


read_row = read_pair  # the kind's own dataset format (snaketune.data.kinds)


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


def label(b: Encoded) -> pa.Table:
    """Labels and length policy of one encoded batch of pairs; the pairs kept, as a table."""
    n = len(b.items)
    rows: dict[str, list] = {f.name: [] for f in b.schema}
    for k, (example_id, pair) in enumerate(b.items):
        sides = encoded_sides(k, n, b.texts, b.spans, b.encodings)
        sides = kept_sides(example_id, sides, b.max_length, b.overlong, b.stats)
        if sides is None:
            continue
        for name, value in pair_values(example_id, sides, text_sha(pair)).items():
            rows[name].append(value)
    return pa.Table.from_pydict(rows, schema=b.schema)
