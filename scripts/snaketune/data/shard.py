"""Plan every optimizer step of an epoch, then write one parquet shard per node.

The plan is global first. With a global batch of

    B = micro_batch_size x gpus_per_node x nodes x gradient_accumulation_steps / sequence_parallel

an epoch has S = floor(N / B) steps. A seeded permutation of the N examples fixes which
B examples form global step k (positions k*B .. k*B+B-1); the N mod B left over are
listed in the manifest by example id. That depends on the data, the seed and B only.

The topology then splits each global step across the R = nodes x gpus_per_node /
sequence_parallel data-parallel ranks, A micro batches of micro_batch_size examples per rank
(with ``sequence_parallel: N``, the N GPUs of a sequence-parallel group, consecutive ranks of
one node, read the same rows: data-parallel rank = global rank // N; each takes its slice of
every sequence, snaketune.data.sequence):

- ``packing: false``: in permutation order (today's random micro batches);
- ``packing: true``: balanced by tokens, so that no rank waits for another: the examples of
  the step are dealt longest first in a snake order to the ranks, pairs are swapped between
  the heaviest and the lightest rank while that narrows the gap, and each rank's examples
  are dealt the same way to its A micro batches.

Every rank runs the same number of micro batches per step and every kept example is in
exactly one (step, rank, micro batch). Node k's shard holds the rows of data-parallel ranks
k*D .. k*D+D-1 (D = gpus_per_node / sequence_parallel), one row per example in the
tokenized file's order, with three more columns:
``step``, ``rank`` (global data-parallel rank) and ``micro``. The trainer only executes this
plan (see snaketune.data.batches.PlanBatches); the manifest records the tokens per shard, the
worst step's max/mean token ratio across ranks, and ``plan_sha256``: a digest of which
examples form each global step, the same for every topology of the same global batch (a
run continues on another topology only when it matches; snaketune.plan.topology).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snaketune.core import parts
from snaketune.core.errors import DataError
from snaketune.core.imports import deferred
from snaketune.core.io import digest, sha256_file
from snaketune.data.kinds import PICTURES

np = deferred("numpy")
pa = deferred("pyarrow")
pc = deferred("pyarrow.compute")
pq = deferred("pyarrow.parquet")

log = logging.getLogger(__name__)

BATCH_ROWS = 8192
PLAN_COLUMNS = (("step", pa.int32()), ("rank", pa.int32()), ("micro", pa.int32()))
SWAP_ROUNDS = 64  # pair swaps tried per step between its heaviest and lightest rank


@dataclass(frozen=True)
class Layout:
    """The batch geometry of a run."""

    nodes: int
    gpus_per_node: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    sequence_parallel: int = 1

    @property
    def data_ranks_per_node(self) -> int:
        """Data-parallel ranks of a node: its GPUs over the sequence-parallel size."""
        return self.gpus_per_node // self.sequence_parallel

    @property
    def ranks(self) -> int:
        """Data-parallel ranks (each a sequence-parallel group of GPUs)."""
        return self.nodes * self.data_ranks_per_node

    @property
    def per_rank_step(self) -> int:
        """Examples one rank consumes per optimizer step."""
        return self.micro_batch_size * self.gradient_accumulation_steps

    @property
    def per_node_step(self) -> int:
        """Examples one node consumes per optimizer step."""
        return self.per_rank_step * self.data_ranks_per_node

    @property
    def global_batch(self) -> int:
        """Examples all nodes consume per optimizer step."""
        return self.per_node_step * self.nodes


@dataclass(frozen=True)
class Plan:
    """Where each row of the tokenized file is trained (-1 everywhere: left over)."""

    step: np.ndarray
    rank: np.ndarray
    micro: np.ndarray
    steps: int

    def node(self, ranks_per_node: int) -> np.ndarray:
        return np.where(self.rank >= 0, self.rank // ranks_per_node, -1)


def check_overlap(train: Path, evaluation: Path) -> None:
    """Fail when an eval example is also a training example (same id or same text)."""
    cols = ["example_id", "text_sha"]
    t, e = parts.read_table(train, cols), parts.read_table(evaluation, cols)
    for col, what in (("example_id", "example id"), ("text_sha", "text")):
        shared = set(t.column(col).to_pylist()) & set(e.column(col).to_pylist())
        if shared:
            example = sorted(shared)[0]
            raise DataError(
                f"the eval set shares {len(shared)} examples with the training set "
                f"(same {what}, e.g. "
                f"{example}); evaluate on held-out data (another split or file)"
            )


def _refine(lengths: np.ndarray, bins: np.ndarray, n_bins: int, min_items: int) -> None:
    """Narrow the gap between the heaviest and the lightest bin: move one item across when
    that bin keeps ``min_items``, else swap a pair, while either helps. In place."""
    for _ in range(SWAP_ROUNDS):
        load = np.bincount(bins, weights=lengths, minlength=n_bins)
        hi, lo = int(load.argmax()), int(load.argmin())
        gap = load[hi] - load[lo]
        a, b = np.flatnonzero(bins == hi), np.flatnonzero(bins == lo)
        # a move of x from hi to lo leaves a gap |gap - 2x|; a swap of x for y, |gap - 2(x - y)|
        best, how = gap, None
        if len(a) > min_items:
            i = int(np.abs(gap - 2 * lengths[a]).argmin())
            if abs(gap - 2 * lengths[a][i]) < best:
                best, how = abs(gap - 2 * lengths[a][i]), (a[i], None)
        diff = lengths[a][:, None] - lengths[b][None, :]
        score = np.abs(gap - 2 * diff)
        i, j = np.unravel_index(int(score.argmin()), score.shape)
        if score[i, j] < best:
            best, how = score[i, j], (a[i], b[j])
        if how is None:
            return
        bins[how[0]] = lo
        if how[1] is not None:
            bins[how[1]] = hi


def balanced_bins(lengths: np.ndarray, n_bins: int, min_items: int = 1) -> np.ndarray:
    """Bin of each item: ``n_bins`` bins of at least ``min_items`` items each whose sums of
    ``lengths`` are as even as a greedy longest-first deal and pair moves make them."""
    n = len(lengths)
    bins = np.empty(n, dtype=np.int64)
    load = np.zeros(n_bins)
    count = np.zeros(n_bins, dtype=np.int64)
    for left, i in enumerate(np.argsort(-lengths, kind="stable")):
        missing = np.maximum(min_items - count, 0)
        if n - left <= missing.sum():  # the rest must fill the bins still short of items
            choice = np.flatnonzero(missing > 0)
            q = int(choice[load[choice].argmin()])
        else:
            q = int(load.argmin())
        bins[i] = q
        load[q] += lengths[i]
        count[q] += 1
    if n_bins > 1:
        _refine(lengths.astype(np.float64), bins, n_bins, min_items)
    return bins


def plan(lengths: np.ndarray, layout: Layout, seed: int, balance: bool) -> Plan:
    """The (step, rank, micro batch) of every row; see the module docstring."""
    n_rows = len(lengths)
    B, R, A = layout.global_batch, layout.ranks, layout.gradient_accumulation_steps
    steps = n_rows // B
    if steps == 0:
        raise DataError(
            f"the dataset has {n_rows} examples, fewer than one global batch of "
            f"{layout.global_batch} (micro_batch_size {layout.micro_batch_size} x gpus_per_node "
            f"{layout.gpus_per_node} x nodes {layout.nodes} x gradient_accumulation_steps "
            f"{layout.gradient_accumulation_steps}{sp_part(layout)}); lower one of these or add "
            "data"
        )
    order = np.random.default_rng(seed).permutation(n_rows)
    step = np.full(n_rows, -1, dtype=np.int32)
    rank = np.full(n_rows, -1, dtype=np.int32)
    micro = np.full(n_rows, -1, dtype=np.int32)
    per_rank = layout.per_rank_step
    in_step = np.arange(B)
    for k in range(steps):
        rows = order[k * B : (k + 1) * B]
        if balance:
            r = balanced_bins(lengths[rows], R, min_items=A)
            m = np.empty(B, dtype=np.int64)
            for q in range(R):
                mine = np.flatnonzero(r == q)
                m[mine] = balanced_bins(lengths[rows[mine]], A)
        else:
            r, m = in_step // per_rank, (in_step % per_rank) // layout.micro_batch_size
        step[rows], rank[rows], micro[rows] = k, r, m
    return Plan(step, rank, micro, steps)


def sp_part(layout: Layout) -> str:
    """The global batch's divisor, where there is one."""
    n = layout.sequence_parallel
    return f" / sequence_parallel {n}" if n > 1 else ""


def plan_digest(example_ids: list[str], p: Plan) -> str:
    """sha256 of the examples of each global step (sets: the split across ranks and micro
    batches left out), so that every topology of one global batch has the same digest."""
    kept = np.flatnonzero(p.step >= 0)
    steps = [[] for _ in range(p.steps)]
    for i in kept.tolist():
        steps[p.step[i]].append(example_ids[i])
    return digest([sorted(s) for s in steps])


def data_digest(tokenized: str | Path) -> str:
    """The content key of a run's data, the same on every topology: the sha256 of the
    tokenized files the shards are cut from (a train job resumes only checkpoints of the
    same; snaketune.train.rerun)."""
    return digest([sha256_file(f) for f in parts.files(tokenized)])


def token_balance(lengths: np.ndarray, p: Plan, ranks: int) -> dict[str, Any]:
    """Per step, the most tokens a rank processes over the mean across ranks."""
    kept = p.step >= 0
    load = np.zeros((p.steps, ranks))
    np.add.at(load, (p.step[kept], p.rank[kept]), lengths[kept])
    ratio = load.max(axis=1) / load.mean(axis=1)
    worst = int(ratio.argmax())
    return {
        "worst_step": worst,
        "worst_max_over_mean": round(float(ratio[worst]), 4),
        "mean_max_over_mean": round(float(ratio.mean()), 4),
    }


@dataclass
class Written:
    """What shard wrote: each node's file, rows and tokens; the examples left over; every
    row's example id (for the plan digest)."""

    paths: list[Path]
    rows: list[int]
    tokens: list[int]
    leftover: list[str]
    ids: list[str]


def write_nodes(
    tokenized: str | Path, out_dir: Path, p: Plan, node: np.ndarray, nodes: int
) -> Written:
    """Stream the tokenized rows into each node's parquet, with the plan's columns."""
    paths = [out_dir / f"node-{k}.parquet" for k in range(nodes)]
    out = Written(paths, [0] * nodes, [0] * nodes, [], [])
    schema = pq.ParquetFile(parts.files(tokenized)[0]).schema_arrow
    for name, kind in PLAN_COLUMNS:
        schema = schema.append(pa.field(name, kind))
    writers = [pq.ParquetWriter(path, schema) for path in paths]
    try:
        start = 0
        for batch in parts.iter_batches(tokenized, BATCH_ROWS):
            span = slice(start, start + batch.num_rows)
            start += batch.num_rows
            table = pa.Table.from_batches([batch])
            for (name, kind), values in zip(PLAN_COLUMNS, (p.step, p.rank, p.micro), strict=True):
                table = table.append_column(pa.field(name, kind), pa.array(values[span], kind))
            where = node[span]
            for k, writer in enumerate(writers):
                part = table.filter(pa.array(where == k))
                if part.num_rows:
                    writer.write_table(part)
                    out.rows[k] += part.num_rows
                    out.tokens[k] += pc.sum(part.column("length")).as_py()
            out.leftover.extend(table.filter(pa.array(where < 0)).column("example_id").to_pylist())
            out.ids.extend(batch.column("example_id").to_pylist())
    finally:
        for writer in writers:
            writer.close()
    return out


PADDED = " for picture rows, which are padded, never packed"


def shard(
    tokenized: str | Path, out_dir: str | Path, layout: Layout, seed: int, packing: bool = True
) -> dict[str, Any]:
    """Write ``node-{k}.parquet`` for each node under ``out_dir``; return the manifest dict."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_rows = parts.num_rows(tokenized)
    lengths = parts.read_table(tokenized, ["length"]).column("length").to_numpy()
    lengths = lengths.astype(np.int64)
    pictured = PICTURES.holds(parts.names(tokenized))
    p = plan(lengths, layout, seed, balance=packing)
    written = write_nodes(tokenized, out_dir, p, p.node(layout.data_ranks_per_node), layout.nodes)
    paths, rows, tokens, leftover = written.paths, written.rows, written.tokens, written.leftover
    balance = token_balance(lengths, p, layout.ranks)
    manifest = {
        "examples": n_rows,
        "kept": sum(rows),
        "global_batch": layout.global_batch,
        "per_node_step": layout.per_node_step,
        "steps_per_epoch": p.steps,
        "nodes": layout.nodes,
        "gpus_per_node": layout.gpus_per_node,
        "sequence_parallel": layout.sequence_parallel,
        "micro_batch_size": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.gradient_accumulation_steps,
        "seed": seed,
        "packing": packing,
        "plan_sha256": plan_digest(written.ids, p),
        "data_sha256": data_digest(tokenized),
        "token_balance": balance,
        "dropped_for_balance": {"count": len(leftover), "example_ids": leftover},
        "shards": [
            {
                "node": k,
                "file": path.name,
                "rows": rows[k],
                "tokens": tokens[k],
                "sha256": sha256_file(path),
            }
            for k, path in enumerate(paths)
        ],
    }
    log.info(
        "%d examples -> %d nodes x %d rows (%d steps/epoch of %d); %d left over for "
        "balance; tokens per rank and step: worst max/mean %.3f (step %d), mean %.3f%s",
        n_rows,
        layout.nodes,
        rows[0],
        p.steps,
        layout.global_batch,
        len(leftover),
        balance["worst_max_over_mean"],
        balance["worst_step"],
        balance["mean_max_over_mean"],
        "" if packing else f" (packing off{PADDED if pictured else ''}: random split)",
    )
    return manifest
