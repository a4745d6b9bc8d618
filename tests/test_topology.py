"""A run continues on another topology (node count, devices per node, micro batch split)
exactly: weights, optimizer moments and step, scheduler and data position carried over
through DeepSpeed universal checkpoints (snaketune.plan.topology)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import ENV, ROOT, read_jsonl, run_spec, train

from snaketune.core.errors import ConfigError
from snaketune.data.shard import Layout, plan, plan_digest
from snaketune.evaluation.model import untie_optimizer_steps
from snaketune.plan.topology import adapt_accumulation, changed_keys, describe, stamp

CONFIG = str(ROOT / "config" / "config.yaml")


# ----------------------------------------------------------------------------- fast


@pytest.mark.parametrize("packing", [True, False])
def test_the_plan_of_global_batches_does_not_depend_on_the_topology(packing):
    lengths = np.random.default_rng(0).integers(20, 300, size=1000)
    ids = [f"ex-{i}" for i in range(1000)]

    def digest(nodes, gpus, micro, accumulation, seed=7):
        p = plan(lengths, Layout(nodes, gpus, micro, accumulation), seed, balance=packing)
        return plan_digest(ids, p)

    same = {digest(2, 1, 32, 1), digest(1, 1, 32, 2), digest(2, 2, 16, 1), digest(1, 4, 8, 2)}
    assert len(same) == 1
    assert digest(2, 1, 16, 1) not in same  # another global batch
    assert digest(2, 1, 32, 1, seed=8) not in same  # another order


def _stamped(tmp_path: Path, **topology) -> Path:
    spec = {"learning_rate": 1e-3, "nodes": 2, "gpus_per_node": 1, "micro_batch_size": 32,
            "gradient_accumulation_steps": 1, **topology}  # fmt: skip
    manifest = {"global_batch": 64, "steps_per_epoch": 32, "plan_sha256": "p"}
    ckpt = tmp_path / "results/demo/train/checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "fingerprint").write_text(json.dumps(stamp(spec, manifest, "d")))
    return tmp_path / "results"


def _config(**run) -> dict:
    return {"runs": {"demo": {"nodes": 2, "gpus_per_node": 1, "micro_batch_size": 32,
                              "gradient_accumulation_steps": 1, **run}}}  # fmt: skip


def test_accumulation_adapts_to_keep_the_checkpoints_global_batch(tmp_path):
    results = _stamped(tmp_path)
    config = _config(nodes=1)
    (note,) = adapt_accumulation(config, results)
    assert config["runs"]["demo"]["gradient_accumulation_steps"] == 2
    assert "gradient_accumulation_steps 1 -> 2 on 1 node x 1 GPU (was 2 nodes x 1 GPU)" in note
    assert "global batch 64" in note
    config = _config(nodes=2)  # back where it was: nothing to adapt
    assert adapt_accumulation(config, results) == []
    config = _config(nodes=1, micro_batch_size=16)  # a split the user chose: left alone
    assert adapt_accumulation(config, results) == []
    assert config["runs"]["demo"]["gradient_accumulation_steps"] == 1
    assert adapt_accumulation(_config(nodes=1), tmp_path / "elsewhere") == []  # no checkpoints


def test_sequence_parallel_is_topology_and_the_kept_batch_counts_data_parallel_ranks(tmp_path):
    """Checkpoints of 1 node x 4 GPUs with sequence_parallel 2 (2 data-parallel ranks x
    micro 32 = global batch 64): the same run without the split, or on 2 nodes with it,
    continues with the accumulation that keeps 64; the split is not part of the math."""
    results = _stamped(tmp_path, nodes=1, gpus_per_node=4, sequence_parallel=2)
    found = json.loads((results / "demo/train/checkpoints/fingerprint").read_text())
    assert "sequence_parallel" not in found["math"]
    assert describe(found["topology"]) == "1 node x 4 GPUs (sequence_parallel 2)"
    # 2 GPUs without the split: the same 2 ranks, nothing to adapt
    assert adapt_accumulation(_config(nodes=1, gpus_per_node=2, sequence_parallel=1), results) == []
    with pytest.raises(ConfigError, match="use micro_batch_size 16 with gradient_accumulation"):
        adapt_accumulation(_config(nodes=1, gpus_per_node=4, sequence_parallel=1), results)
    config = _config(nodes=1, gpus_per_node=4, sequence_parallel=4)  # 1 rank: accumulation 2
    (note,) = adapt_accumulation(config, results)
    assert config["runs"]["demo"]["gradient_accumulation_steps"] == 2
    assert "(was 1 node x 4 GPUs (sequence_parallel 2)): keeps the global batch 64" in note
    config = _config(nodes=2, gpus_per_node=4, sequence_parallel=4)  # 2 ranks again
    assert adapt_accumulation(config, results) == []


def test_a_topology_that_cannot_keep_the_global_batch_is_refused_naming_what_does(tmp_path):
    results = _stamped(tmp_path)
    with pytest.raises(ConfigError) as err:
        adapt_accumulation(_config(nodes=4), results)
    assert str(err.value) == (
        "runs.demo: 4 nodes x 1 GPU x micro_batch_size 32 cannot keep the global batch 64 of "
        f"the checkpoints in {results}/demo/train/checkpoints; use micro_batch_size 16 with "
        "gradient_accumulation_steps 1 or micro_batch_size 8 with gradient_accumulation_steps "
        "2, or move the checkpoints aside to start over"
    )


def test_changed_keys_name_nested_paths():
    old = {"learning_rate": 1e-3, "lora": {"r": 8, "alpha": 16}, "seed": 1}
    new = {"learning_rate": 2e-3, "lora": {"r": 16, "alpha": 16}, "seed": 1, "x": 0}
    assert changed_keys(old, new) == ["learning_rate", "lora.r", "x"]


def test_shared_optimizer_step_counters_are_untied():
    """DeepSpeed's ZeRO-3 universal load gives every parameter group one step tensor;
    Adam would then count each step once per group."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b]}], lr=0.1)
    shared = torch.tensor(6.0)
    for p in (a, b):
        opt.state[p].update(step=shared, exp_avg=torch.zeros_like(p),
                            exp_avg_sq=torch.zeros_like(p))  # fmt: skip
    assert untie_optimizer_steps(opt) == 1
    a.grad, b.grad = torch.ones(2), torch.ones(3)
    opt.step()
    assert [opt.state[p]["step"].item() for p in (a, b)] == [7.0, 7.0]


# ----------------------------------------------------------------------------- slow


def moments(checkpoint: Path, tmp: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's fp32 weights and Adam moments in a checkpoint (a copy is turned
    into a universal checkpoint, which holds them whole whatever the rank count)."""
    from snaketune.train.resume import make_universal

    copy = tmp / checkpoint.name
    shutil.copytree(checkpoint, copy)
    out = {}
    for folder in (make_universal(copy) / "zero").iterdir():
        if folder.is_dir() and (folder / "exp_avg.pt").exists():
            loaded = {k: torch.load(folder / f"{k}.pt", weights_only=False)
                      for k in ("fp32", "exp_avg", "exp_avg_sq")}  # fmt: skip
            out[folder.name] = {k: v["param"] if isinstance(v, dict) else v
                                for k, v in loaded.items()}  # fmt: skip
    return out


# Continuing on another node count, measured (this 2-core CPU, gloo, fp32; the tests print
# their figures): full ZeRO-3 2x2 -> 1x2, losses 1.45e-7 and moments 3.06e-7 apart at most;
# full ZeRO-2 2x1 -> 1x1 and the LoRA demo 2x1 -> 1x1, identical (0). The sums run
# in another order on another rank count, so not always bit-equal: 1e-6, as same-topology
# resume is held to (conftest.kill_and_resume).
TOLERANCE = 1e-6


def assert_same_moments(got: dict, want: dict, rel: float) -> None:
    assert got.keys() == want.keys() and got
    worst = 0.0
    for name, states in want.items():
        for key, w in states.items():
            diff = (got[name][key] - w).norm() / w.norm().clamp_min(1e-30)
            worst = max(worst, diff.item())
            assert diff.item() <= rel, (name, key, diff.item())
    print(f"moments: largest relative difference {worst:.3g}")


def assert_same_losses(got: list[dict], want: list[dict], after: int, rel: float) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in want]  # every step once
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        if g["step"] > after:
            worst = max(worst, abs(g["loss"] - w["loss"]) / abs(w["loss"]))
            assert g["loss"] == pytest.approx(w["loss"], rel=rel), g["step"]
            assert g["lr"] == pytest.approx(w["lr"], rel=1e-9), g["step"]
    print(f"losses: largest relative difference {worst:.3g}")


@pytest.mark.extended
@pytest.mark.slow
def test_demo_continues_on_one_node_from_its_two_node_checkpoint(demo, tmp_path):
    """The finished 2-node demo (LoRA, ZeRO-2) with its training taken back to checkpoint-150,
    rerun with nodes: 1 through the local profile: the accumulation adapts (global batch 64
    kept), the run continues at step 150 instead of starting over, and its losses, learning
    rates and final optimizer moments are the uninterrupted run's."""
    work = tmp_path / "w"
    subprocess.run(["cp", "-a", str(demo), str(work)], check=True)
    train_dir = work / "results/demo/train"
    for p in train_dir.iterdir():
        if p.name != "checkpoints":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    shutil.rmtree(train_dir / "checkpoints/checkpoint-192")
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"),
         "--profile", str(ROOT / "profiles/local"), "--configfile", CONFIG,
         "--directory", str(work), "--config", "runs={'demo': {'nodes': 1}}",
         # the demo's 2-node train job ran with Snakemake's OMP_NUM_THREADS 2 (the rule's
         # threads); on 1 node it would get 1, and float sums in another thread count
         # differ in the last bits (measured 2.1e-6 on a moment): the same count here
         "--set-threads", "train=2", "--", "results/demo/train/metrics.jsonl"],
        env=ENV, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert (
        "runs.demo: gradient_accumulation_steps 1 -> 2 on 1 node x 1 GPU (was 2 nodes x 1 GPU): "
        "keeps the global batch 64 of its checkpoints" in out
    )
    assert "rule tokenize_dataset" not in out  # the same tokens; only the split is redone
    log = (work / "logs/train/demo.log").read_text()
    assert (
        "continuing demo at step 150 on 1 node x 1 GPU (was 2 nodes x 1 GPU), global batch 64 "
        "unchanged" in log
    ), log[-3000:]
    assert "ZeRO states of 2 ranks turned into global_step150_universal for 1 ranks" in log
    assert "resuming from checkpoint-150" in log and "starting fresh" not in log
    assert "micro 32 x 1 devices x 1 nodes x accumulation 2" in log
    got = read_jsonl(train_dir / "metrics.jsonl")
    want = read_jsonl(demo / "results/demo/train/metrics.jsonl")
    assert_same_losses(got, want, after=150, rel=TOLERANCE)
    # the old topology's checkpoint stays until the new one has saved its own
    assert (train_dir / "checkpoints/checkpoint-150").is_dir()
    assert_same_moments(
        moments(train_dir / "checkpoints/checkpoint-192", tmp_path / "got"),
        moments(demo / "results/demo/train/checkpoints/checkpoint-192", tmp_path / "want"),
        rel=TOLERANCE,
    )


def _continue(reference: Path, step: int, workdir: Path, spec: dict, shards: Path,
              model: Path, preset: str, *extra: str) -> Path:  # fmt: skip
    """Train ``spec`` in ``workdir`` from ``reference``'s checkpoint-<step> (its stamp and
    metrics too): a run stopped there and rerun on ``spec``'s topology."""
    ckpt = workdir / "results/x/train/checkpoints"
    ckpt.mkdir(parents=True)
    shutil.copytree(reference / f"checkpoints/checkpoint-{step}", ckpt / f"checkpoint-{step}")
    for name in ("fingerprint", "metrics.jsonl"):
        shutil.copy(reference / "checkpoints" / name, ckpt / name)
    return train(workdir, spec, shards, model, preset, *extra)


def _shard(demo: Path, out: Path, nodes: int, gpus: int, micro: int, accumulation: int) -> Path:
    tokenized = next((demo / "results/tokenized").glob("arith__*/data.parquet"))
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/shard_dataset.py"), "--tokenized", str(tokenized),
         "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--micro-batch-size", str(micro),
         "--gradient-accumulation-steps", str(accumulation), "--seed", "7", "--out", str(out)],
        check=True, env=ENV, capture_output=True,
    )  # fmt: skip
    return out


@pytest.mark.slow
def test_full_zero3_continues_on_one_node_exactly(full_zero3, demo, tmp_path):
    """Full fine-tuning, ZeRO-3, 2 nodes x 2 stopped at step 20 and continued on 1 node x 2
    (accumulation 2): the same losses and final moments as the uninterrupted run, and the
    examples of steps 21-32 each trained once, as the old topology planned them."""
    reference = full_zero3 / "results/x/train"
    shards = _shard(demo, tmp_path / "shards", 1, 2, 16, 2)
    spec = run_spec(method="full", nodes=1, gpus_per_node=2, gradient_accumulation_steps=2,
                    micro_batch_size=16, epochs=1, learning_rate=1e-3, deepspeed="zero3",
                    save_steps=20)  # fmt: skip
    out = _continue(reference, 20, tmp_path / "w", spec, shards, demo / "resources/models/tiny",
                    "zero3", "--log-example-ids", str(tmp_path / "ids"))  # fmt: skip
    assert_same_losses(read_jsonl(out / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl"),
                       after=20, rel=TOLERANCE)  # fmt: skip
    assert_same_moments(moments(out / "checkpoints/checkpoint-32", tmp_path / "got"),
                        moments(reference / "checkpoints/checkpoint-32", tmp_path / "want"),
                        rel=TOLERANCE)  # fmt: skip
    trained = [i for f in (tmp_path / "ids").glob("rank-*.txt") for i in f.read_text().split()]
    planned = [pq.read_table(f, columns=["example_id", "step"]).to_pylist()
               for f in sorted((full_zero3 / "shards").glob("node-*.parquet"))]  # fmt: skip
    # as the 2 x 2 run planned them: every example of steps 21-32 (0-based 20-31) once
    assert sorted(trained) == sorted(r["example_id"] for rows in planned for r in rows
                                     if r["step"] >= 20)  # fmt: skip


@pytest.mark.extended
@pytest.mark.slow
def test_full_zero2_continues_on_one_node_exactly(demo, tmp_path):
    """Full fine-tuning, ZeRO-2: 2 nodes x 1 to step 4, then 1 node x 1 (accumulation 2)."""
    model = demo / "resources/models/tiny"
    spec = run_spec(method="full", max_steps=8, save_steps=4, learning_rate=1e-3,
                    checkpoints={"optimizer": "all"})  # fmt: skip
    (tmp_path / "ref").mkdir()
    reference = train(tmp_path / "ref", spec, _shard(demo, tmp_path / "s2", 2, 1, 32, 1), model,
                      "zero2")  # fmt: skip
    spec = {**spec, "nodes": 1, "gradient_accumulation_steps": 2}
    out = _continue(reference, 4, tmp_path / "w", spec, _shard(demo, tmp_path / "s1", 1, 1, 32, 2),
                    model, "zero2")  # fmt: skip
    assert_same_losses(read_jsonl(out / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl"),
                       after=4, rel=TOLERANCE)  # fmt: skip
    assert_same_moments(moments(out / "checkpoints/checkpoint-8", tmp_path / "got"),
                        moments(reference / "checkpoints/checkpoint-8", tmp_path / "want"),
                        rel=TOLERANCE)  # fmt: skip


def _job(tmp_path: Path, **spec) -> object:
    from snaketune.core.job import Job

    shards = tmp_path / "shards"
    shards.mkdir(exist_ok=True)
    (shards / "manifest.json").write_text(
        json.dumps({"global_batch": 64, "steps_per_epoch": 32, "plan_sha256": "p"})
    )
    ds = tmp_path / "zero2.json"
    ds.write_text("{}")
    spec = {"learning_rate": 1e-3, "nodes": 2, "gpus_per_node": 1, "micro_batch_size": 32,
            "gradient_accumulation_steps": 1, "save_steps": 50, **spec}  # fmt: skip
    return Job(spec, shards, tmp_path / "model", ds, tmp_path / "results/demo/train", "local", [])


def test_checkpoints_are_continued_on_a_new_topology_and_set_aside_on_new_math(tmp_path, caplog):
    from snaketune.core.checkpoints import mark_complete
    from snaketune.train.resume import prepare_checkpoints

    first = _job(tmp_path)
    prepare_checkpoints(first)
    (first.ckpt / "checkpoint-20").mkdir()
    mark_complete(first.ckpt / "checkpoint-20", 20, 0.0)
    caplog.set_level("INFO")
    # another topology and save interval, the same global batch: continued
    prepare_checkpoints(_job(tmp_path, nodes=1, gradient_accumulation_steps=2, save_steps=10))
    assert (first.ckpt / "checkpoint-20").is_dir()
    assert ("continuing demo at step 20 on 1 node x 1 GPU (was 2 nodes x 1 GPU), global batch "
            "64 unchanged") in caplog.text  # fmt: skip
    assert json.loads((first.ckpt / "fingerprint").read_text())["origin"]["nodes"] == 2
    # another learning rate: set aside, the key named
    prepare_checkpoints(_job(tmp_path, nodes=1, gradient_accumulation_steps=2,
                             learning_rate=2e-3))  # fmt: skip
    assert "run settings changed (learning_rate)" in caplog.text
    assert not (first.ckpt / "checkpoint-20").exists()
    (aside,) = first.out.glob("checkpoints.previous-*")
    assert (aside / "checkpoint-20").is_dir()
