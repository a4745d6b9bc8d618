"""Collation of planned micro batches in the layout their attention kernel takes
(snaketune.data.kernels).

One component turns the examples of a micro batch (see snaketune.data.shard for how they are
chosen) into model inputs, in one of three layouts:

- ``padded`` (``packing: false``): one row per example, right-padded to the longest, with an
  attention mask (trl's collator).
- ``varlen`` (packing with flash-attention 2, or with sdpa where there is no GPU): every
  example laid side by side in ONE row, no pad token, position ids restarting at 0 per
  example, and the sequence boundaries (``cu_seq_lens``) for a variable-length kernel (trl's
  padding-free collator). Attention cost follows each example's own length. On GPU the
  kernel is flash-attention's; on CPU it is snaketune.data.kernels.segment_attention
  (registered with transformers as ``sdpa_segments``): PyTorch's sdpa run causally on one
  example at a time, with no mask at all.
- ``rows`` (packing with eager, or with sdpa on a GPU without flash-attn): examples dealt
  into few rows of at most ``row_tokens`` (max_length) tokens, balanced so the rows come
  out nearly equal; position ids restart per example, rows are right-padded to the longest
  row (a few tokens), and NO attention mask: transformers then finds the example boundaries
  from the position ids and builds a block-diagonal causal mask
  (masking_utils.find_packed_sequence_indices), so no token attends to another example.
  These kernels have no variable-length path and pay attention over a whole row (rows^2):
  keeping rows to max_length bounds that, where one long row would square it.

Which runs where was measured (bench/train_throughput.py, docs/benchmarks.md): on CPU,
forward+backward of the same micro batches took about 1,350 ms padded, 1,050 ms as sdpa
rows with the dense mask and 920 ms as one row under ``sdpa_segments``; one long row under
the dense mask is slower than padding. The GPU choice for sdpa without flash-attn (rows) is not
measured: no GPU was lent to this project's sessions.

In every packed layout the first label of each example is -100, so the last token of one
example never learns to predict the next example's first token (position 0 is never a
target in the padded layout either: the same targets either way). Packed batches carry
``use_cache=False``: with a KV cache, transformers skips the packed-sequence check and
every token would attend across examples.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snaketune.core.io import IdsLog
from snaketune.core.throughput import Counted

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def fill_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of the examples in each row. Of the layouts into r rows of at most
    ``capacity`` tokens (r from the fewest possible, two more tried), the one with the
    fewest tokens once rows are padded to the longest, each balanced like the ranks of a
    step (snaketune.data.shard.balanced_bins). An example longer than ``capacity`` gets a row of
    its own; no example is ever cut."""
    import numpy as np

    from snaketune.data.shard import balanced_bins

    n, sizes = len(lengths), np.asarray(lengths, dtype=np.int64)
    fewest = max(1, -(-int(sizes.sum()) // capacity))
    best, best_cost = [[i] for i in range(n)], float("inf")
    for r in range(min(fewest, n), min(fewest + 2, n) + 1):
        bins = balanced_bins(sizes, r)
        loads = np.bincount(bins, weights=sizes, minlength=r)
        alone = np.bincount(bins, minlength=r) == 1
        if (loads[~alone] > capacity).any():
            continue
        if r * int(loads.max()) < best_cost:
            best = [np.flatnonzero(bins == q).tolist() for q in range(r)]
            best_cost = r * int(loads.max())
    return best


def example_order(layout: str, lengths: list[int], row_tokens: int) -> list[int]:
    """The order a micro batch's examples come in, row by row, once collated in ``layout``:
    as given, but for ``rows``, where each row holds the examples fill_rows deals it."""
    if layout != "rows":
        return list(range(len(lengths)))
    return [i for row in fill_rows(lengths, max(row_tokens, *lengths)) for i in row]


def packed_rows(
    examples: list[dict[str, Any]], row_tokens: int, pad_token_id: int
) -> dict[str, torch.Tensor]:
    """The ``rows`` layout (see the module docstring)."""
    import torch

    lengths = [len(e["input_ids"]) for e in examples]
    rows = fill_rows(lengths, max(row_tokens, *lengths))
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n = lengths[i]
            ids[r, at : at + n] = torch.as_tensor(examples[i]["input_ids"])
            labels[r, at + 1 : at + n] = torch.as_tensor(examples[i]["labels"][1:])
            positions[r, at : at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(width - at)  # padding: a segment of its own
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "use_cache": False}


class Collator(Counted):
    """Collates a planned micro batch in the run's layout, counting real and padded tokens
    (and logging example ids when asked)."""

    def __init__(
        self, layout: str, pad_token_id: int, row_tokens: int, ids_log: Path | None = None
    ):
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        self.layout, self.pad_token_id, self.row_tokens = layout, pad_token_id, row_tokens
        self._trl = DataCollatorForLanguageModeling(
            pad_token_id=pad_token_id, padding_free=layout == "varlen"
        )
        super().__init__()
        self._ids_log = IdsLog(ids_log)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        self._ids_log.write([e["example_id"] for e in examples])
        plain = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
        if self.layout == "rows":
            batch = packed_rows(plain, self.row_tokens, self.pad_token_id)
        else:
            batch = self._trl(plain)
            if self.layout == "varlen":
                batch["use_cache"] = False
        self.add([len(e["input_ids"]) for e in examples], batch["input_ids"].numel(), len(examples))
        return batch
