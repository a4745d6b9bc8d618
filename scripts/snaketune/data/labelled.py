"""Labelled responses, the ``labelled`` kind (snaketune.data.kinds): single responses to a
prompt, each desirable or not, what KTO trains on. They come from a ``labelled`` dataset
(below) or from preference pairs (the ``pairs`` kind's tokenized rows:
snaketune.data.pairs): a pair's chosen response is a desirable one, its rejected response
an undesirable one, both in the pair's micro batch.

A batch (``batch``) is laid out as TRL's KTOTrainer reads it: the chosen sides, then the
rejected sides, right-padded (``input_ids``, ``attention_mask``, ``completion_mask`` 1 on
the response tokens, ``label`` True for desirable), and the KL sequences KTO estimates its
reference point from: each example's prompt with another prompt's response
(``KL_input_ids``, ``KL_attention_mask``, ``KL_completion_mask``). TRL takes that other
response from the next example of the same micro batch, which needs micro batches of 2 or
more with different prompts; a token-balanced plan gives micro batches of 1 pair, so here
it is the same side of the pair's ``partner``: the next pair in the rank's planned rows
(fixed by the plan, so a resumed run rebuilds the same KL sequences).

A dataset of format ``labelled`` (TRL's unpaired preference form: ``prompt``,
``completion``, a boolean ``label``) is tokenized as this kind: one row per response, its
completion's assistant turns labelled (a prompt's own assistant turns are context), and

    desirable  bool   its label

beside the supervised columns; its rows are planned one response an example.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa

from snaketune.core.errors import DataError
from snaketune.core.rows import IGNORE_INDEX
from snaketune.data.chat import ChatRenderer, Turn
from snaketune.data.conversations import Items, Source, Stats, _turns
from snaketune.data.kinds import Encoded

SIDES = (("input_ids", "labels"), ("rejected_input_ids", "rejected_labels"))


@dataclass(frozen=True)
class Labelled:
    """A labelled row: the prompt's turns and the completion's, desirable or not."""

    prompt: tuple[Turn, ...]
    completion: tuple[Turn, ...]
    desirable: bool

    def hashed(self) -> tuple[Turn, ...]:
        """What its text hash covers: its turns and its label."""
        return (*self.prompt, *self.completion, ("\x1d", str(self.desirable)))


def read_row(
    source: Source, system: tuple[Turn, ...], cols: dict[str, Any], data: dict, i: int, row: int
) -> Labelled:
    """One row of a ``labelled`` dataset: a prompt and a completion, text or messages, and
    a boolean label."""
    name, label, raw = source.name, data[cols["label"]][i], data[cols["prompt"]][i]
    if not isinstance(label, bool):
        raise DataError(
            f"datasets.{name} row {row}: column {cols['label']!r} must be true "
            f"or false (got {label!r:.40}); clean the data or filter the row "
            "out"
        )
    completion = _turns(data[cols["completion"]][i], name, row, cols["completion"], "assistant")
    if any(turn[0] != "assistant" for turn in completion):
        raise DataError(
            f"datasets.{name} row {row}: a completion is assistant turns only; "
            "clean the data or filter the row out"
        )
    prompt = _turns(raw, name, row, cols["prompt"], "user")
    return Labelled((*(system if isinstance(raw, str) else ()), *prompt), completion, label)


# --------------------------------------------------- tokens (the kind's, snaketune.data.kinds)


def schema(base: pa.Schema) -> pa.Schema:
    return base.append(pa.field("desirable", pa.bool_()))


def render(renderer: ChatRenderer, items: Items, stats: Stats):
    """Texts and the completion's assistant spans (not the prompt's own assistant turns)."""
    texts, spans = [], []
    for _, row in items:
        turns = (*row.prompt, *row.completion)
        renderer.check(turns)
        text, sp = renderer.spans(turns)
        texts.append(text)
        spans.append(sp[len(sp) - len(row.completion) :])
    return items, texts, spans


def label(b: Encoded) -> pa.Table:
    """The supervised rows' labels and length policy, and each kept row's label."""
    from snaketune.data.tokenization import label_batch

    table = label_batch(replace(b, items=[(i, row.hashed()) for i, row in b.items]))
    desirable = {i: row.desirable for i, row in b.items}
    kept = [desirable[i] for i in table.column("example_id").to_pylist()]
    return table.append_column(b.schema.field("desirable"), pa.array(kept, pa.bool_()))


def dropped(stats: Stats) -> str:
    return ""


def split(ids, labels) -> tuple[list[int], list[int], list[int]]:
    """A side's prompt tokens (before its first response token), its response part's tokens
    and their completion mask (1 on the labelled ones)."""
    labelled = np.asarray(labels) != IGNORE_INDEX
    start = int(np.argmax(labelled))
    return list(ids[:start]), list(ids[start:]), labelled[start:].astype(np.int64).tolist()


def _padded(seqs: list[tuple[list[int], list[int]]], pad_token_id: int) -> dict[str, Any]:
    """Right-padded input ids, attention mask and completion mask of (ids, mask) sequences."""
    import torch

    width = max(len(ids) for ids, _ in seqs)
    input_ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    completion = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (ids, mask) in enumerate(seqs):
        input_ids[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        attention[i, : len(ids)] = 1
        completion[i, : len(ids)] = torch.as_tensor(mask, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion}


def batch(
    examples: list[dict[str, Any]], pad_token_id: int, partners: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Labelled responses as KTOTrainer reads them and, given each example's ``partners``,
    their KL sequences: a labelled set's rows in order; a preference set's pairs as their
    chosen sides (desirable), then their rejected sides (undesirable)."""
    import torch

    if "desirable" in examples[0]:
        sides, labels = SIDES[:1], [bool(e["desirable"]) for e in examples]
    else:
        sides, labels = SIDES, [True] * len(examples) + [False] * len(examples)
    seqs, kl = [], []
    for ids_key, labels_key in sides:
        for k, e in enumerate(examples):
            prompt, response, mask = split(e[ids_key], e[labels_key])
            seqs.append((prompt + response, [0] * len(prompt) + mask))
            if partners is not None:
                _, other, other_mask = split(partners[k][ids_key], partners[k][labels_key])
                kl.append((prompt + other, [0] * len(prompt) + other_mask))
    out = _padded(seqs, pad_token_id)
    out["label"] = torch.tensor(labels)
    if partners is not None:
        out.update({f"KL_{k}": v for k, v in _padded(kl, pad_token_id).items()})
    return out
