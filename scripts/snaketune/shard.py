"""Split a tokenized dataset into one parquet shard per node, step-balanced.

Every node must run the same number of optimizer steps, or the job hangs in a collective
when one node runs out of data. With a global batch of

    B = micro_batch_size x gpus_per_node x nodes x gradient_accumulation_steps

an epoch has S = floor(N / B) steps; a seeded permutation of the N examples keeps the
first S x B, and node k gets the k-th block of S x B / nodes of them. The N mod B left
over are listed in the manifest by example id. Shards keep the tokenized file's row
order (the trainer shuffles every epoch), and are written in streaming batches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from snaketune.errors import DataError
from snaketune.io import sha256_file

log = logging.getLogger(__name__)

BATCH_ROWS = 8192


@dataclass(frozen=True)
class Layout:
    """The batch geometry of a run."""

    nodes: int
    gpus_per_node: int
    micro_batch_size: int
    gradient_accumulation_steps: int

    @property
    def per_node_step(self) -> int:
        """Examples one node consumes per optimizer step."""
        return self.micro_batch_size * self.gpus_per_node * self.gradient_accumulation_steps

    @property
    def global_batch(self) -> int:
        """Examples all nodes consume per optimizer step."""
        return self.per_node_step * self.nodes


def check_overlap(train: Path, evaluation: Path) -> None:
    """Fail when an eval example is also a training example (same id or same text)."""
    cols = ["example_id", "text_sha"]
    t, e = pq.read_table(train, columns=cols), pq.read_table(evaluation, columns=cols)
    for col, what in (("example_id", "example id"), ("text_sha", "text")):
        shared = set(t.column(col).to_pylist()) & set(e.column(col).to_pylist())
        if shared:
            example = sorted(shared)[0]
            raise DataError(
                f"the eval set shares {len(shared)} examples with the training set "
                f"(same {what}, e.g. "
                f"{example}); evaluate on held-out data (another split or file)"
            )


def assign(n_rows: int, layout: Layout, seed: int) -> np.ndarray:
    """Node index of each row (-1: left over to balance steps)."""
    steps = n_rows // layout.global_batch
    if steps == 0:
        raise DataError(
            f"the dataset has {n_rows} examples, fewer than one global batch of "
            f"{layout.global_batch} (micro_batch_size {layout.micro_batch_size} x gpus_per_node "
            f"{layout.gpus_per_node} x nodes {layout.nodes} x gradient_accumulation_steps "
            f"{layout.gradient_accumulation_steps}); lower one of these or add data"
        )
    per_node = steps * layout.per_node_step
    order = np.random.default_rng(seed).permutation(n_rows)
    node = np.full(n_rows, -1, dtype=np.int32)
    for k in range(layout.nodes):
        node[order[k * per_node : (k + 1) * per_node]] = k
    return node


def shard(tokenized: str | Path, out_dir: str | Path, layout: Layout, seed: int) -> dict[str, Any]:
    """Write ``node-{k}.parquet`` for each node under ``out_dir``; return the manifest dict."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pf = pq.ParquetFile(tokenized)
    n_rows = pf.metadata.num_rows
    node = assign(n_rows, layout, seed)
    paths = [out_dir / f"node-{k}.parquet" for k in range(layout.nodes)]
    rows = [0] * layout.nodes
    tokens = [0] * layout.nodes
    leftover: list[str] = []
    writers = [pq.ParquetWriter(p, pf.schema_arrow) for p in paths]
    try:
        start = 0
        for batch in pf.iter_batches(batch_size=BATCH_ROWS):
            where = node[start : start + batch.num_rows]
            start += batch.num_rows
            table = pa.Table.from_batches([batch])
            for k, writer in enumerate(writers):
                part = table.filter(pa.array(where == k))
                if part.num_rows:
                    writer.write_table(part)
                    rows[k] += part.num_rows
                    tokens[k] += pc.sum(part.column("length")).as_py()
            leftover.extend(table.filter(pa.array(where < 0)).column("example_id").to_pylist())
    finally:
        for writer in writers:
            writer.close()
    steps = n_rows // layout.global_batch
    manifest = {
        "examples": n_rows,
        "kept": sum(rows),
        "global_batch": layout.global_batch,
        "per_node_step": layout.per_node_step,
        "steps_per_epoch": steps,
        "nodes": layout.nodes,
        "gpus_per_node": layout.gpus_per_node,
        "micro_batch_size": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.gradient_accumulation_steps,
        "seed": seed,
        "dropped_for_balance": {"count": len(leftover), "example_ids": leftover},
        "shards": [
            {
                "node": k,
                "file": p.name,
                "rows": rows[k],
                "tokens": tokens[k],
                "sha256": sha256_file(p),
            }
            for k, p in enumerate(paths)
        ],
    }
    log.info(
        "%d examples -> %d nodes x %d rows (%d steps/epoch of %d); %d left over for balance",
        n_rows,
        layout.nodes,
        rows[0],
        steps,
        layout.global_batch,
        len(leftover),
    )
    return manifest
