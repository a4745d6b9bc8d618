"""Shards: an exact, seeded partition of the kept examples with equal steps per node."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snaketune.core.errors import DataError
from snaketune.core.io import sha256_file
from snaketune.data.shard import Layout, plan, shard, token_balance
from snaketune.data.tokenization import OUTPUT_SCHEMA

layouts = st.builds(
    Layout,
    nodes=st.integers(1, 8),
    gpus_per_node=st.integers(1, 8),
    micro_batch_size=st.integers(1, 8),
    gradient_accumulation_steps=st.integers(1, 4),
)


@settings(max_examples=200, deadline=None)
@given(
    layout=layouts,
    extra=st.integers(0, 300),
    seed=st.integers(0, 2**31),
    balance=st.booleans(),
    spread=st.integers(1, 400),
)
def test_plan_trains_every_kept_example_once_in_equal_steps(layout, extra, seed, balance, spread):
    n = layout.global_batch + extra
    lengths = np.random.default_rng(seed).integers(1, spread + 1, n)
    p = plan(lengths, layout, seed, balance)
    kept = p.step >= 0
    assert p.steps == n // layout.global_batch
    assert (~kept).sum() == n % layout.global_batch  # left over < a batch
    assert ((p.rank >= 0) == kept).all() and ((p.micro >= 0) == kept).all()
    # every (step, rank, micro batch) has examples; each step's examples are one global batch
    cells = np.zeros((p.steps, layout.ranks, layout.gradient_accumulation_steps), dtype=int)
    np.add.at(cells, (p.step[kept], p.rank[kept], p.micro[kept]), 1)
    assert cells.min() >= 1
    assert (cells.sum(axis=(1, 2)) == layout.global_batch).all()
    if not balance:  # unbalanced: exactly micro_batch_size per micro batch, as before
        assert (cells == layout.micro_batch_size).all()
    again = plan(lengths, layout, seed, balance)
    assert np.array_equal(p.step, again.step) and np.array_equal(p.rank, again.rank)


@settings(max_examples=50, deadline=None)
@given(layout=layouts, seed=st.integers(0, 1000))
def test_the_examples_of_a_step_do_not_depend_on_the_topology_or_packing(layout, seed):
    """Global first: which examples form step k depends on the data, seed and global batch."""
    n = layout.global_batch * 3 + 5
    lengths = np.random.default_rng(seed).integers(1, 300, n)
    other = Layout(1, 1, layout.global_batch, 1)  # the same global batch on one device
    a, b = plan(lengths, layout, seed, True), plan(lengths, other, seed, False)
    assert np.array_equal(a.step, b.step)


def test_packed_plan_balances_tokens_on_gsm8k_shaped_lengths():
    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(170), 0.35, 7473), 50, 600)
    lengths = lengths.astype(np.int64)
    for layout in (Layout(2, 8, 4, 1), Layout(4, 4, 4, 2), Layout(2, 1, 4, 2)):
        balanced = token_balance(lengths, plan(lengths, layout, 42, True), layout.ranks)
        random = token_balance(lengths, plan(lengths, layout, 42, False), layout.ranks)
        assert balanced["worst_max_over_mean"] <= 1.05, (layout, balanced)
        assert random["worst_max_over_mean"] > 1.2, (layout, random)


def test_seed_changes_the_plan():
    layout = Layout(nodes=2, gpus_per_node=2, micro_batch_size=2, gradient_accumulation_steps=1)
    lengths = np.arange(100) % 17 + 1
    assert not np.array_equal(
        plan(lengths, layout, 0, True).step, plan(lengths, layout, 1, True).step
    )


def _tokenized(path, n):
    rows = {
        "example_id": [f"d:{i}" for i in range(n)],
        "input_ids": [[1, 2, i % 7 + 3] for i in range(n)],
        "labels": [[-100, 2, i % 7 + 3] for i in range(n)],
        "length": [3] * n,
        "text_sha": [f"{i:016x}" for i in range(n)],
    }
    pq.write_table(pa.table(rows, schema=OUTPUT_SCHEMA), path, row_group_size=7)
    return path


@settings(max_examples=25, deadline=None)
@given(layout=layouts, extra=st.integers(0, 200), seed=st.integers(0, 1000))
def test_shard_files_partition_the_examples(tmp_path_factory, layout, extra, seed):
    tmp = tmp_path_factory.mktemp("shard")
    n = layout.global_batch + extra
    manifest = shard(_tokenized(tmp / "t.parquet", n), tmp / "out", layout, seed)
    seen = []
    for k, entry in enumerate(manifest["shards"]):
        table = pq.read_table(tmp / "out" / entry["file"])
        assert table.num_rows == entry["rows"] == manifest["steps_per_epoch"] * layout.per_node_step
        assert entry["tokens"] == 3 * entry["rows"]
        assert entry["sha256"] == sha256_file(tmp / "out" / entry["file"])
        ranks = set(table.column("rank").to_pylist())  # the ranks of node k only
        assert ranks == set(range(k * layout.gpus_per_node, (k + 1) * layout.gpus_per_node))
        seen += table.column("example_id").to_pylist()
    dropped = manifest["dropped_for_balance"]["example_ids"]
    assert len(seen) == len(set(seen))
    assert sorted(seen + dropped) == sorted(f"d:{i}" for i in range(n))
    assert manifest["kept"] + len(dropped) == n
    assert manifest["packing"] is True and manifest["token_balance"]["worst_max_over_mean"] == 1.0
    json.dumps(manifest)  # serialisable as manifest.json


def test_too_small_for_one_global_batch(tmp_path):
    layout = Layout(nodes=2, gpus_per_node=4, micro_batch_size=4, gradient_accumulation_steps=2)
    with pytest.raises(DataError) as info:
        shard(_tokenized(tmp_path / "t.parquet", 63), tmp_path / "out", layout, 0)
    assert str(info.value) == (
        "the dataset has 63 examples, fewer than one global batch of 64 (micro_batch_size 4 x "
        "gpus_per_node 4 x nodes 2 x gradient_accumulation_steps 2); lower one of these or add data"
    )
