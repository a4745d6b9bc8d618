"""A teacher's top-k log-probs of every label token (rule teacher_logps), and the divergence
of a student from them: what distillation (snaketune.methods.distill) trains on and what its
evaluation reports.

A row's *targets* are its label tokens past the first position (labels[t] != -100, t >= 1):
the tokens a causal LM predicts, token t from position t - 1, in every collation layout
(snaketune.data.packing: position 0 of an example is never a target). For each target the
teacher stage stores the k largest values of log_softmax(teacher logits at t - 1), at
temperature 1, float32, with their token ids: the parquet it writes has

    example_id   string
    ids          list<int32>    targets x k, target by target, the largest first
    logps        list<float32>  the same shape

so the disk is targets x k x 8 bytes before compression (``BYTES_PER_VALUE``). Chunks,
parts and their merge are the reference stage's (snaketune.evaluation.logps).

The divergence at a target (``divergence``), with temperature T: the teacher's top-k
renormalised at T, p = softmax(logps / T) over the k ids; the student's log-probs at those
ids, log q = log_softmax(student logits / T)[ids] over its whole vocabulary. Forward KL is
sum p (log p - log q); reverse KL is sum q' (log q' - log p) with q' the student's
probabilities renormalised over the k ids; ``mixed`` is w x forward + (1 - w) x reverse.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from snaketune.core.io import atomic_path
from snaketune.core.rows import IGNORE_INDEX
from snaketune.evaluation.logps import CHUNK_PAIRS, chunks, part_path

log = logging.getLogger(__name__)

BYTES_PER_VALUE = 8  # an int32 token id and a float32 log-prob per stored value
DIVERGENCES = ("forward", "reverse", "mixed")


def schema(k: int) -> pa.Schema:
    """The teacher stage's columns; ``k`` in its metadata."""
    return pa.schema(
        [
            ("example_id", pa.string()),
            ("ids", pa.list_(pa.int32())),
            ("logps", pa.list_(pa.float32())),
        ],
        metadata={"k": str(k)},
    )


def targets(labels: list[int]) -> list[int]:
    """The positions of a row's targets (see the module docstring)."""
    return [t for t in range(1, len(labels)) if labels[t] != IGNORE_INDEX]


def row_topk(model, rows: list[dict[str, Any]], pad: int, k: int):
    """Each row's (ids int32 [targets, k], logps float32 [targets, k]): one right-padded
    forward pass of ``model`` (on its device), log-softmax in float32."""
    import torch

    device = next(model.parameters()).device
    logits = _padded_logits(model, rows, pad)
    with torch.no_grad():
        out = []
        for j, r in enumerate(rows):
            at = torch.as_tensor(targets(r["labels"]), dtype=torch.long, device=device) - 1
            logp = torch.log_softmax(logits[j, at].float(), dim=-1)
            top = logp.topk(k, dim=-1)
            out.append((top.indices.to(torch.int32).cpu().numpy(), top.values.cpu().numpy()))
    return out


def compute_parts(
    tokenized: str | Path,
    model_dir: str | Path,
    parts: Path,
    worker: int,
    workers: int,
    batch_rows: int,
    k: int,
    precision: str,
    attention: str,
    on_batch: Callable[[int], None] | None = None,
    chunk_rows: int = CHUNK_PAIRS,
) -> int:
    """Worker ``worker`` of ``workers``: the teacher's top-k of its chunks that have no
    part file yet; returns how many it computed. ``on_batch(chunk)`` is called before each
    forward pass (the worker's heartbeat)."""
    import torch
    from transformers import AutoTokenizer

    from snaketune.core.rows import pad_id
    from snaketune.evaluation.model import build_model

    todo = [
        c
        for c in range(worker, chunks(tokenized, chunk_rows), workers)
        if not part_path(parts, c).exists()
    ]
    if not todo:
        return 0
    device = torch.device(
        f"cuda:{worker % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    )
    pad = pad_id(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    model = build_model(Path(model_dir), precision, attention).to(device).eval()
    table = pq.read_table(tokenized, columns=["example_id", "input_ids", "labels"])
    for c in todo:
        rows = table.slice(c * chunk_rows, chunk_rows).to_pylist()
        ids, logps = [], []
        for at in range(0, len(rows), batch_rows):
            if on_batch is not None:
                on_batch(c)
            for i, lp in row_topk(model, rows[at : at + batch_rows], pad, k):
                ids.append(i.reshape(-1))
                logps.append(lp.reshape(-1))
        part = pa.Table.from_arrays(
            [
                pa.array([r["example_id"] for r in rows], pa.string()),
                pa.array(ids, pa.list_(pa.int32())),
                pa.array(logps, pa.list_(pa.float32())),
            ],
            schema=schema(k),
        )
        with atomic_path(part_path(parts, c)) as tmp:
            pq.write_table(part, tmp)
        log.info("worker %d/%d: chunk %d (%d rows) done", worker, workers, c, len(rows))
    return len(todo)


def read_topk(
    path: str | Path,
    ids: list[str] | None = None,
    k: int | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """example_id -> (ids int64 [targets, k], logps float32 [targets, k]) of the stored
    top-k (of ``ids`` only, when given); ``k`` (at most the stored one) keeps the k largest."""
    import pyarrow.compute as pc

    table = pq.read_table(path)
    if ids is not None:
        table = table.filter(pc.is_in(table.column("example_id"), pa.array(ids, pa.string())))
    stored = stored_k(table)
    k = stored if k is None else k
    out = {}
    for name, i, lp in zip(
        table.column("example_id").to_pylist(),
        table.column("ids").to_numpy(zero_copy_only=False),
        table.column("logps").to_numpy(zero_copy_only=False),
        strict=True,
    ):
        out[name] = (
            np.array(i, np.int64).reshape(-1, stored)[:, :k],
            np.array(lp, np.float32).reshape(-1, stored)[:, :k],
        )
    return out


def stored_k(table: pa.Table) -> int:
    """The k a teacher stage's table was written with (its schema's metadata)."""
    return int((table.schema.metadata or {})[b"k"])


def divergence(
    student_logits,
    teacher_ids,
    teacher_logps,
    temperature: float = 1.0,
    kind: str = "forward",
    mix: float = 0.5,
):
    """The per-target divergence of the student from the teacher's top-k (see the module
    docstring): ``student_logits`` [N, V], ``teacher_ids`` [N, k], ``teacher_logps`` [N, k];
    float32 [N]."""
    import torch

    s = torch.log_softmax(student_logits.float() / temperature, dim=-1).gather(-1, teacher_ids)
    t = torch.log_softmax(teacher_logps.float() / temperature, dim=-1)
    forward = (t.exp() * (t - s)).sum(-1)
    if kind == "forward":
        return forward
    s_top = torch.log_softmax(s, dim=-1)
    reverse = (s_top.exp() * (s_top - t)).sum(-1)
    return reverse if kind == "reverse" else mix * forward + (1 - mix) * reverse


def heldout_kl(
    model, rows: list[dict[str, Any]], path: str | Path, batch_size: int, pad: int, share=None
) -> dict[str, float]:
    """The held-out forward KL (temperature 1) of ``model`` from the teacher's top-k stored
    at ``path``, the mean per target over ``rows`` (every rank's share: each rank runs as
    many forward passes)."""
    import torch

    from snaketune.core.collective import gather_combined
    from snaketune.evaluation.sharded import DUMMY, ONE

    share = share or ONE
    mine = share.mine(rows)
    teacher = read_topk(path, [r["example_id"] for r in mine])
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for b in range(share.batches(len(rows), batch_size)):
        batch = mine[b * batch_size : (b + 1) * batch_size]
        got = _padded_logits(model, batch or [DUMMY], pad)
        for j, r in enumerate(batch):
            at = torch.as_tensor(targets(r["labels"]), dtype=torch.long) - 1
            ids, logps = (torch.as_tensor(x) for x in teacher[r["example_id"]])
            kl = divergence(got[j, at.to(device)], ids.to(device), logps.to(device))
            total, count = total + float(kl.double().sum()), count + len(at)
    total, count = gather_combined([total, float(count)], ("sum", "sum"))
    return {"heldout_kl": total / max(count, 1.0)}


def _padded_logits(model, rows: list[dict[str, Any]], pad: int):
    """The logits of ``rows``, right-padded, one forward pass (no gradient)."""
    import torch

    device = next(model.parameters()).device
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), n), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for j, r in enumerate(rows):
        ids[j, : len(r["input_ids"])] = torch.as_tensor(r["input_ids"])
        mask[j, : len(r["input_ids"])] = 1
    with torch.no_grad():
        return model(
            input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False
        ).logits
