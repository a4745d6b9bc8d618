"""Summed log-probabilities of preference pairs: the batches DPO trains on, the model's
log-probs of each side's response, and the reference stage that computes them once.

A pair batch (``snaketune.data.pairs.batch``) holds the chosen sides, then the rejected
sides, padded on the right, with ``completion_mask`` 1 on each side's response tokens (its
labels): TRL's DPOTrainer reads that layout. ``sequence_logps`` scores such a batch with
TRL's fused LM head (the same code DPOTrainer scores the policy and a live reference with),
so a precomputed reference and a live one give the same numbers.

The reference stage (rule reference_logps, ``scripts/reference_logps.py``) splits the
tokenized pairs into chunks of ``CHUNK_PAIRS``; worker w of W computes chunks w, w+W, ...
and writes each as ``parts/part-<chunk>.parquet`` (atomically), so a rerun after a kill
computes only the chunks missing; ``merge`` writes the one parquet the runs read:

    example_id          string
    ref_chosen_logps    float32   summed over the chosen response's tokens
    ref_rejected_logps  float32

or, for labelled responses (snaketune.data.labelled: KTO's data), ``ref_logps``, each
response's. What a batch of the tokenized rows is, is their kind's (snaketune.data.kinds).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from snaketune.core import parts as tokenized_set
from snaketune.core.io import atomic_path
from snaketune.core.rows import IGNORE_INDEX
from snaketune.data.kinds import Kind, kind_of_columns

log = logging.getLogger(__name__)

SCORED = ("input_ids", "attention_mask", "completion_mask")  # what a scored batch feeds

CHUNK_PAIRS = 256  # pairs per part file: what a rerun after a kill may compute again
SCHEMA = pa.schema(
    [
        ("example_id", pa.string()),
        ("ref_chosen_logps", pa.float32()),
        ("ref_rejected_logps", pa.float32()),
    ]
)


def sequence_logps(model, batch: dict[str, Any], sides: int = 2):
    """(chosen, rejected) summed log-probs of each side's response tokens, float32 (each
    sequence's, one side); the model carries TRL's fused LM head
    (``trl.trainer.utils.add_fused_lm_head``)."""
    import torch

    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
    inputs = {k: v for k, v in batch.items() if k != "completion_mask"}  # and pictures' inputs
    with torch.no_grad():
        out = model(**inputs, labels=labels, fused_lm_head=True, use_cache=False)
    return [x.float() for x in out.log_probs.sum(dim=1).chunk(sides, dim=0)]


def load_scorer(
    model_dir: str | Path, precision: str, attention: str, device, quantize: dict | None = None
):
    """The reference model, in eval mode on ``device``, with TRL's fused LM head; with
    ``quantize`` its base in 4 bits, as the DPO run's policy starts (snaketune.core.qlora)."""
    from trl.trainer.utils import add_fused_lm_head

    from snaketune.evaluation.model import build_model

    if quantize is not None:
        model = build_model(Path(model_dir), precision, attention, quantize, device=str(device))
    else:
        model = build_model(Path(model_dir), precision, attention).to(device)
    model.eval()
    add_fused_lm_head(model)
    return model


def chunks(tokenized: str | Path, chunk_pairs: int = CHUNK_PAIRS) -> int:
    """How many part files the pairs of ``tokenized`` make."""
    rows = tokenized_set.num_rows(tokenized)
    return (rows + chunk_pairs - 1) // chunk_pairs


def part_path(parts: Path, chunk: int) -> Path:
    return parts / f"part-{chunk:06d}.parquet"


def compute_parts(
    tokenized: str | Path,
    model_dir: str | Path,
    parts: Path,
    worker: int,
    workers: int,
    batch_pairs: int,
    precision: str,
    attention: str,
    quantize: dict | None = None,
    on_batch: Callable[[int], None] | None = None,
    chunk_pairs: int = CHUNK_PAIRS,
) -> int:
    """Worker ``worker`` of ``workers``: compute its chunks that have no part file yet;
    returns how many it computed. ``on_batch(chunk)`` is called before each forward pass
    (the worker's heartbeat)."""
    import torch

    from snaketune.core.rows import pad_id
    from snaketune.data.pictures import inputs_of

    todo = [
        c
        for c in range(worker, chunks(tokenized, chunk_pairs), workers)
        if not part_path(parts, c).exists()
    ]
    if not todo:
        return 0
    device = torch.device(
        f"cuda:{worker % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    )
    from transformers import AutoTokenizer

    pad = pad_id(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    model = load_scorer(model_dir, precision, attention, device, quantize)
    kind = kind_of_columns(tokenized_set.names(tokenized))
    table, schema = tokenized_set.read_table(tokenized, kind.read_columns), schema_of(kind)
    for c in todo:
        rows = table.slice(c * chunk_pairs, chunk_pairs).to_pylist()
        sides: list[list] = [[] for _ in range(kind.sequences)]
        for at in range(0, len(rows), batch_pairs):
            if on_batch is not None:
                on_batch(c)
            part = rows[at : at + batch_pairs]
            batch = kind.impl().batch(part, pad)
            scored = {k: batch[k].to(device) for k in SCORED}
            scored.update(inputs_of(model, part, batch["input_ids"]))  # a picture set's
            logps = sequence_logps(model, scored, kind.sequences)
            for side, lp in zip(sides, logps, strict=True):
                side.append(lp.cpu().numpy())
        part = pa.Table.from_arrays(
            [pa.array([r["example_id"] for r in rows], pa.string())]
            + [pa.array(np.concatenate(x), pa.float32()) for x in sides],
            schema=schema,
        )
        with atomic_path(part_path(parts, c)) as tmp:
            pq.write_table(part, tmp)
        log.info("worker %d/%d: chunk %d (%d pairs) done", worker, workers, c, len(rows))
    return len(todo)


def merge(
    tokenized: str | Path,
    parts: Path,
    out: Path,
    chunk_pairs: int = CHUNK_PAIRS,
    what: str = "reference log-probs",
) -> pa.Table:
    """The part files as one parquet in the tokenized file's order (every example once);
    ``what`` they are, for the errors."""
    n = chunks(tokenized, chunk_pairs)
    missing = [c for c in range(n) if not part_path(parts, c).exists()]
    if missing:
        raise RuntimeError(
            f"{what}: {len(missing)} of {n} chunks missing "
            f"(first: {missing[0]}); a worker failed, see its lines "
            "above"
        )
    table = pa.concat_tables([pq.read_table(part_path(parts, c)) for c in range(n)])
    ids = tokenized_set.read_table(tokenized, ["example_id"]).column("example_id")
    if not table.column("example_id").equals(ids):
        raise RuntimeError(
            f"{what}: the part files do not match the tokenized examples; delete {parts} and rerun"
        )
    with atomic_path(out) as tmp:
        pq.write_table(table, tmp)
    return table


def schema_of(kind: Kind) -> pa.Schema:
    """The reference log-probs' columns for tokenized data of ``kind``: a pair's two sides,
    or one response's."""
    return (
        SCHEMA
        if kind.sequences == 2
        else pa.schema([("example_id", pa.string()), ("ref_logps", pa.float32())])
    )


def read_reference(path: str | Path) -> dict[str, tuple[float, ...]]:
    """example_id -> (reference chosen, reference rejected) summed log-probs (a labelled
    response's: its one)."""
    table = pq.read_table(path)
    sides = [table.column(name).to_pylist() for name in table.column_names[1:]]
    return dict(zip(table.column("example_id").to_pylist(), zip(*sides, strict=True), strict=True))


def threads_per_worker(workers: int) -> int:
    """CPU threads each local worker may use (the machine's cores shared out)."""
    return max(1, (os.cpu_count() or 1) // workers)
