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
    label_logps  list<float32>  targets: the label's own log-prob (the teacher's loss)

so the disk is targets x (k x 8 + 4) bytes before compression (``BYTES_PER_VALUE``,
``BYTES_PER_TARGET``). Chunks,
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

from snaketune.core import parts as tokenized_set
from snaketune.core.io import atomic_path
from snaketune.core.rows import IGNORE_INDEX
from snaketune.evaluation.logps import CHUNK_PAIRS, chunks, part_path

log = logging.getLogger(__name__)

BYTES_PER_VALUE = 8  # an int32 token id and a float32 log-prob per stored value
BYTES_PER_TARGET = 4  # the label's own log-prob, float32
DIVERGENCES = ("forward", "reverse", "mixed")


def schema(k: int) -> pa.Schema:
    """The teacher stage's columns; ``k`` in its metadata."""
    return pa.schema(
        [
            ("example_id", pa.string()),
            ("ids", pa.list_(pa.int32())),
            ("logps", pa.list_(pa.float32())),
            ("label_logps", pa.list_(pa.float32())),
        ],
        metadata={"k": str(k)},
    )


def targets(labels: list[int]) -> list[int]:
    """The positions of a row's targets (see the module docstring)."""
    return [t for t in range(1, len(labels)) if labels[t] != IGNORE_INDEX]


def row_topk(model, rows: list[dict[str, Any]], pad: int, k: int):
    """Each row's (ids int32 [targets, k], logps float32 [targets, k], the labels' own
    log-probs float32 [targets]): one right-padded forward pass of ``model`` (on its
    device), log-softmax in float32."""
    import torch

    from snaketune.evaluation.model import padded_logits

    device = next(model.parameters()).device
    logits = padded_logits(model, rows, pad)
    with torch.no_grad():
        out = []
        for j, r in enumerate(rows):
            t = torch.as_tensor(targets(r["labels"]), dtype=torch.long, device=device)
            logp = torch.log_softmax(logits[j, t - 1].float(), dim=-1)
            top = logp.topk(k, dim=-1)
            label = logp.gather(-1, torch.as_tensor(r["labels"], device=device)[t][:, None])
            out.append(
                (
                    top.indices.to(torch.int32).cpu().numpy(),
                    top.values.cpu().numpy(),
                    label[:, 0].cpu().numpy(),
                )
            )
    return out


def load_teacher(model_dir: str | Path, precision: str, attention: str, worker: int, sharded: bool):
    """(the teacher in eval mode, its pad id, what keeps a sharded one's DeepSpeed config
    alive): whole on this worker's device, or (``sharded``) its weights over every worker
    as the evaluation shards a model larger than one GPU (snaketune.evaluation.sharded)."""
    import torch
    from transformers import AutoTokenizer

    from snaketune.core.rows import pad_id
    from snaketune.evaluation.model import DTYPES, build_model

    if sharded:
        from snaketune.evaluation.sharded import load_sharded

        tokenizer, model, keep = load_sharded(Path(model_dir), DTYPES[precision])
        return model, pad_id(tokenizer), keep
    device = torch.device(
        f"cuda:{worker % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    )
    pad = pad_id(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    return build_model(Path(model_dir), precision, attention).to(device).eval(), pad, None


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
    sharded: bool = False,
) -> int:
    """Worker ``worker`` of ``workers``: the teacher's top-k of its chunks that have no
    part file yet; returns how many it computed. ``on_batch(chunk)`` is called before each
    forward pass (the worker's heartbeat). ``sharded``: the teacher's weights are over
    every worker, each forward pass a collective: a worker short of chunks runs passes
    that keep nothing until the busiest is done."""
    from snaketune.evaluation.sharded import DUMMY

    n = tokenized_set.num_rows(tokenized)
    todo = [
        c
        for c in range(worker, chunks(tokenized, chunk_rows), workers)
        if not part_path(parts, c).exists()
    ]
    if not todo and not sharded:
        return 0
    model, pad, _keep = load_teacher(model_dir, precision, attention, worker, sharded)
    passes = sum(-(-min(chunk_rows, n - c * chunk_rows) // batch_rows) for c in todo)
    idle = 0
    if sharded:
        from snaketune.core.collective import gather_combined

        idle = int(gather_combined([float(passes)], ("max",))[0]) - passes
    table = tokenized_set.read_table(tokenized, ["example_id", "input_ids", "labels"])
    for c in todo:
        rows = table.slice(c * chunk_rows, chunk_rows).to_pylist()
        got = []
        for at in range(0, len(rows), batch_rows):
            if on_batch is not None:
                on_batch(c)
            got += row_topk(model, rows[at : at + batch_rows], pad, k)
        write_part(part_path(parts, c), [r["example_id"] for r in rows], got, k)
        log.info("worker %d/%d: chunk %d (%d rows) done", worker, workers, c, len(rows))
    for _ in range(idle):
        row_topk(model, [DUMMY], pad, 1)
    return len(todo)


def write_part(path: Path, ids: list[str], got: list[tuple], k: int) -> None:
    """One chunk's rows (``got``: row_topk's, in order) as a part file, atomically."""
    part = pa.Table.from_arrays(
        [
            pa.array(ids, pa.string()),
            pa.array([g[0].reshape(-1) for g in got], pa.list_(pa.int32())),
            pa.array([g[1].reshape(-1) for g in got], pa.list_(pa.float32())),
            pa.array([g[2] for g in got], pa.list_(pa.float32())),
        ],
        schema=schema(k),
    )
    with atomic_path(path) as tmp:
        pq.write_table(part, tmp)


def read_topk(
    path: str | Path,
    ids: list[str] | None = None,
    k: int | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """example_id -> (ids int64 [targets, k], logps float32 [targets, k]) of the stored
    top-k (of ``ids`` only, when given); ``k`` (at most the stored one) keeps the k largest."""
    table = pq.read_table(path, filters=None if ids is None else of_ids(ids))
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


def of_ids(ids: list[str]):
    """The rows of ``ids`` only, as a filter applied while the file is read."""
    import pyarrow.compute as pc

    return pc.field("example_id").isin(pa.array(ids, pa.string()))


def stored_k(table: pa.Table) -> int:
    """The k a teacher stage's table was written with (its schema's metadata)."""
    return int((table.schema.metadata or {})[b"k"])


def divergence(
    student_logits,
    teacher_ids,
    teacher_values,
    temperature: float = 1.0,
    kind: str = "forward",
    mix: float = 0.5,
):
    """The per-target divergence of the student from the teacher's top-k (see the module
    docstring): ``student_logits`` [N, V], ``teacher_ids`` [N, k], ``teacher_values`` [N, k]
    (their log-probs); float32 [N]."""
    import torch

    s = torch.log_softmax(student_logits.float() / temperature, dim=-1).gather(-1, teacher_ids)
    t = torch.log_softmax(teacher_values.float() / temperature, dim=-1)
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
    at ``path``, the mean per target over ``rows``, and the teacher's own held-out loss
    (every rank's share: each rank runs as many forward passes)."""
    import torch

    from snaketune.core.collective import gather_combined
    from snaketune.evaluation.model import padded_logits
    from snaketune.evaluation.sharded import DUMMY, ONE

    share = share or ONE
    mine = share.mine(rows)
    teacher = read_topk(path, [r["example_id"] for r in mine])
    own = own_logps(path, [r["example_id"] for r in mine])
    device = next(model.parameters()).device
    total, count, teacher_nll = 0.0, 0, 0.0
    for b in range(share.batches(len(rows), batch_size)):
        batch = mine[b * batch_size : (b + 1) * batch_size]
        got = padded_logits(model, batch or [DUMMY], pad)
        for j, r in enumerate(batch):
            at = torch.as_tensor(targets(r["labels"]), dtype=torch.long) - 1
            ids, logps = (torch.as_tensor(x) for x in teacher[r["example_id"]])
            kl = divergence(got[j, at.to(device)], ids.to(device), logps.to(device))
            total, count = total + float(kl.double().sum()), count + len(at)
            teacher_nll -= float(np.sum(own[r["example_id"]], dtype=np.float64))
    total, teacher_nll, count = gather_combined([total, teacher_nll, float(count)], ("sum",) * 3)
    return {"heldout_kl": total / max(count, 1.0), "teacher_loss": teacher_nll / max(count, 1.0)}


def own_logps(path: str | Path, ids: list[str]) -> dict[str, np.ndarray]:
    """example_id -> the teacher's log-probs of the labels themselves (of ``ids``)."""
    table = pq.read_table(path, columns=["example_id", "label_logps"], filters=of_ids(ids))
    return dict(
        zip(
            table.column("example_id").to_pylist(),
            (np.asarray(x, np.float32) for x in table.column("label_logps").to_pylist()),
            strict=True,
        )
    )
