"""Shards: an exact, seeded partition of the kept examples with equal steps per node."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snaketune.errors import DataError
from snaketune.io import sha256_file
from snaketune.shard import Layout, assign, shard
from snaketune.tokenization import OUTPUT_SCHEMA

layouts = st.builds(
    Layout,
    nodes=st.integers(1, 8),
    gpus_per_node=st.integers(1, 8),
    micro_batch_size=st.integers(1, 8),
    gradient_accumulation_steps=st.integers(1, 4),
)


@settings(max_examples=300, deadline=None)
@given(layout=layouts, extra=st.integers(0, 3000), seed=st.integers(0, 2**31))
def test_assignment_is_a_step_balanced_partition(layout, extra, seed):
    n = layout.global_batch + extra
    node = assign(n, layout, seed)
    steps = n // layout.global_batch
    counts = np.bincount(node[node >= 0], minlength=layout.nodes)
    assert counts.tolist() == [steps * layout.per_node_step] * layout.nodes  # same steps per node
    assert (node < 0).sum() == n % layout.global_batch < layout.global_batch  # left over < a batch
    assert set(np.unique(node)) <= set(range(-1, layout.nodes))  # each row in at most one shard
    assert np.array_equal(node, assign(n, layout, seed))  # reproducible


def test_seed_changes_the_assignment():
    layout = Layout(nodes=2, gpus_per_node=2, micro_batch_size=2, gradient_accumulation_steps=1)
    assert not np.array_equal(assign(100, layout, 0), assign(100, layout, 1))


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
    for entry in manifest["shards"]:
        table = pq.read_table(tmp / "out" / entry["file"])
        assert table.num_rows == entry["rows"] == manifest["steps_per_epoch"] * layout.per_node_step
        assert entry["tokens"] == 3 * entry["rows"]
        assert entry["sha256"] == sha256_file(tmp / "out" / entry["file"])
        seen += table.column("example_id").to_pylist()
    dropped = manifest["dropped_for_balance"]["example_ids"]
    assert len(seen) == len(set(seen))
    assert sorted(seen + dropped) == sorted(f"d:{i}" for i in range(n))
    assert manifest["kept"] + len(dropped) == n
    json.dumps(manifest)  # serialisable as manifest.json


def test_too_small_for_one_global_batch(tmp_path):
    layout = Layout(nodes=2, gpus_per_node=4, micro_batch_size=4, gradient_accumulation_steps=2)
    with pytest.raises(DataError) as info:
        shard(_tokenized(tmp_path / "t.parquet", 63), tmp_path / "out", layout, 0)
    assert str(info.value) == (
        "the dataset has 63 examples, fewer than one global batch of 64 (micro_batch_size 4 x "
        "gpus_per_node 4 x nodes 2 x gradient_accumulation_steps 2); lower one of these or add data"
    )
