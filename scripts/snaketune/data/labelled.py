"""Labelled responses, the ``labelled`` kind (snaketune.data.kinds): single responses to a
prompt, each desirable or not, what KTO trains on. They come from preference pairs (its
tokenized rows are the ``pairs`` kind's: snaketune.data.pairs): a pair's chosen response is
a desirable one, its rejected response an undesirable one, both in the pair's micro batch.

A batch (``batch``) is laid out as TRL's KTOTrainer reads it: the chosen sides, then the
rejected sides, right-padded (``input_ids``, ``attention_mask``, ``completion_mask`` 1 on
the response tokens, ``label`` True for desirable), and the KL sequences KTO estimates its
reference point from: each example's prompt with another prompt's response
(``KL_input_ids``, ``KL_attention_mask``, ``KL_completion_mask``). TRL takes that other
response from the next example of the same micro batch, which needs micro batches of 2 or
more with different prompts; a token-balanced plan gives micro batches of 1 pair, so here
it is the same side of the pair's ``partner``: the next pair in the rank's planned rows
(fixed by the plan, so a resumed run rebuilds the same KL sequences).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from snaketune.core.rows import IGNORE_INDEX

SIDES = (("input_ids", "labels"), ("rejected_input_ids", "rejected_labels"))


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


def batch(examples: list[dict[str, Any]], pad_token_id: int,
          partners: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """Pairs as labelled responses (chosen sides desirable, then rejected sides
    undesirable) and, given each pair's ``partners``, their KL sequences."""
    import torch

    seqs, kl = [], []
    for ids_key, labels_key in SIDES:
        for k, e in enumerate(examples):
            prompt, response, mask = split(e[ids_key], e[labels_key])
            seqs.append((prompt + response, [0] * len(prompt) + mask))
            if partners is not None:
                _, other, other_mask = split(partners[k][ids_key], partners[k][labels_key])
                kl.append((prompt + other, [0] * len(prompt) + other_mask))
    out = _padded(seqs, pad_token_id)
    out["label"] = torch.tensor([True] * len(examples) + [False] * len(examples))
    if partners is not None:
        out.update({f"KL_{k}": v for k, v in _padded(kl, pad_token_id).items()})
    return out
