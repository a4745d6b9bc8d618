"""Know the network before the week (snaketune.train.network): the all-reduce figure of every
multi-node job in its metrics, provenance and the report; a floor that fails the job."""

from __future__ import annotations

import csv
import json
import time

import pytest
from conftest import launch_train, read_jsonl, run_spec

from snaketune.train.network import too_slow


def test_a_fabric_under_the_floor_is_one_line_naming_the_likely_cause():
    result = {"bytes": 256 * 2**20, "ranks": 16, "backend": "nccl", "busbw_gbps": 2.4}
    assert too_slow(result, None) is None and too_slow(result, 2.0) is None
    line = too_slow(result, 20)
    assert line.startswith(
        "network: all-reduce bus bandwidth 2.40 GB/s across 16 ranks (256 MiB, nccl) is under "
        "preflight.min_busbw_gbps 20: the nodes likely talk over TCP sockets instead of "
        "InfiniBand; check NCCL_IB_DISABLE"
    ), line
    assert "NCCL_SOCKET_IFNAME" in line


@pytest.mark.slow
def test_the_demo_records_its_all_reduce_bandwidth(demo):
    """The demo trains on 2 emulated nodes: its job timed a 4 MiB gloo all-reduce."""
    train = demo / "results/demo/train"
    network = json.loads((train / "provenance.json").read_text())["network"]
    assert network["bytes"] == 4 * 2**20 and network["ranks"] == 2
    assert network["backend"] == "gloo" and network["busbw_gbps"] > 0
    assert network["busbw_gbps"] == pytest.approx(network["algbw_gbps"] * 2 * 1 / 2)
    assert network["problem"] is None
    first = read_jsonl(train / "metrics.jsonl")[0]
    assert first["allreduce_busbw_gbps"] == network["busbw_gbps"]
    assert "allreduce_busbw_gbps" not in read_jsonl(train / "metrics.jsonl")[1]
    with open(demo / "results/summary.tsv") as fh:
        row = next(r for r in csv.DictReader(fh, delimiter="\t") if r["run"] == "demo")
    assert float(row["allreduce_busbw_gbps"]) == pytest.approx(network["busbw_gbps"])
    assert (
        "network: all-reduce of 4 MiB across 2 ranks (gloo): bus bandwidth"
        in (demo / "logs/train/demo.log").read_text()
    )


@pytest.mark.slow
def test_a_job_slower_than_the_floor_fails_at_its_start(demo, tmp_path):
    shards, model = demo / "results/demo/shards", demo / "resources/models/tiny"
    began = time.monotonic()
    out, _ = launch_train(tmp_path, run_spec(), shards, model, "zero2",
                          "--min-busbw", "100000").communicate(timeout=300)  # fmt: skip
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: network: all-reduce bus "), out[-3000:]
    assert "under preflight.min_busbw_gbps 100000" in errors[0]
    assert time.monotonic() - began < 120
    assert not list((tmp_path / "results/x/train/checkpoints").glob("checkpoint-*"))
    assert "step 1/" not in out  # no training step ran
