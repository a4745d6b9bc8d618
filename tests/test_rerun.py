"""What a rerun of train does (snaketune.train.rerun; docs/reliability.md, "What a rerun of
train does"): the same inputs resume (a finished run trains no step and its records stay
byte for byte), other inputs or `--forcerun train` start from step 0, a shard changed by hand
is refused. The decisions in milliseconds; the pipeline once (CI tier)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, quick_config, read_jsonl, snakemake, started

from snaketune.core.errors import DataError
from snaketune.train import rerun

# ----------------------------------------------------------------------------- the user's word


def test_only_the_train_rule_or_its_outputs_named_force_a_fresh_start():
    assert rerun.forced_runs(["train"], False, "train") == "*"
    assert rerun.forced_runs(["snaketune_train"], False, "snaketune_train") == "*"
    assert rerun.forced_runs([], True, "train") == "*"  # -F: everything again
    assert rerun.forced_runs(["shard_dataset", "evaluate"], False, "train") is None
    assert rerun.forced_runs([], False, "train") is None
    named = ["results/b/train/model", "results/a/train/metrics.jsonl", "results/c/eval/x"]
    assert rerun.forced_runs(named, False, "train") == "a,b"


def test_a_token_names_the_forced_runs_and_a_plain_invocation_clears_it():
    env: dict[str, str] = {}
    value = rerun.request_fresh(["results/a/train/model"], False, "train", env)
    token = value.split(":")[0]
    assert rerun.fresh_token("a", env) == token and rerun.fresh_token("ab", env) is None
    rerun.request_fresh(["train"], False, "train", env)
    assert rerun.fresh_token("anything", env) not in (None, token)  # a new invocation
    rerun.request_fresh([], False, "train", env)
    assert env == {} and rerun.fresh_token("a", env) is None


# ----------------------------------------------------------------------------- the decision


def _stamp(**length) -> dict:
    return {
        "math": {"learning_rate": 1e-3, "data": "d", "model": "m", "steps_per_epoch": 32},
        "length": {"max_steps": None, "epochs": None, **length},
        "topology": {"nodes": 2},
    }


def test_the_same_key_resumes_and_another_starts_from_step_zero():
    old = _stamp(max_steps=100)
    assert rerun.decide(old, _stamp(max_steps=100), 60, None) == (True, "")
    for key, value in (("data", "other shards"), ("model", "other weights"), ("learning_rate", 2)):
        now = _stamp(max_steps=100)
        now["math"][key] = value
        keep, why = rerun.decide(old, now, 60, None)
        assert not keep and why == f"run settings changed ({key}): starting from step 0"
    assert rerun.decide(None, _stamp(), 60, None)[0] is False


def test_a_raised_length_continues_and_one_below_the_newest_checkpoint_starts_over():
    old = _stamp(max_steps=100)
    keep, why = rerun.decide(old, _stamp(max_steps=150), 100, None)
    assert (
        keep and why == "max_steps 100 -> 150: continuing to step 150 (the schedule now ends there)"
    )
    # epochs instead of max_steps: 2 epochs of 32 steps, the checkpoint at 64 is the end
    keep, why = rerun.decide(_stamp(epochs=1), _stamp(epochs=2), 32, None)
    assert keep and "continuing to step 64" in why
    keep, why = rerun.decide(old, _stamp(max_steps=50), 60, None)
    assert not keep and "past the new last step 50" in why
    # lowered to the newest checkpoint's step exactly: kept (it is the end: nothing trained)
    assert rerun.decide(old, _stamp(max_steps=60), 60, None)[0] is True


def test_a_stamp_of_an_earlier_version_is_compared_on_what_it_holds():
    old = {"math": {"learning_rate": 1e-3, "max_steps": 100, "steps_per_epoch": 32},
           "topology": {"nodes": 2}}  # fmt: skip
    assert rerun.decide(old, _stamp(max_steps=100), 60, None) == (True, "")
    assert rerun.decide(old, _stamp(max_steps=200), 60, None)[0] is True


def test_a_forced_train_starts_over_once_and_its_retry_resumes():
    old = _stamp(max_steps=100)
    keep, why = rerun.decide(old, _stamp(max_steps=100), 60, "tok1")
    assert not keep and "forced" in why
    assert rerun.decide({**old, "fresh_token": "tok1"}, _stamp(max_steps=100), 60, "tok1")[0]
    assert not rerun.decide({**old, "fresh_token": "tok0"}, _stamp(max_steps=100), 60, "tok1")[0]


def test_total_steps_is_max_steps_else_the_epochs_as_the_trainer_counts_them():
    assert rerun.total_steps({"max_steps": 7, "epochs": 3}, 32) == 7
    assert rerun.total_steps({"max_steps": 0, "epochs": 3}, 32) == 96  # 0 is not "unset"...
    assert rerun.total_steps({"max_steps": -1, "epochs": 1.5}, 31) == 47  # ...nor is -1
    assert rerun.total_steps({"max_steps": None, "epochs": None}, 10) == 10


# ----------------------------------------------------------------------------- the launcher


def _job(tmp_path: Path, manifest: dict | None = None, **spec):
    from snaketune.core.job import Job

    shards = tmp_path / "shards"
    shards.mkdir(exist_ok=True)
    pq.write_table(pa.table({"x": [1, 2, 3]}), shards / "node-0.parquet")
    from snaketune.core.io import sha256_file

    manifest = manifest or {
        "global_batch": 64,
        "steps_per_epoch": 32,
        "plan_sha256": "p",
        "data_sha256": "d1",
        "shards": [{"file": "node-0.parquet", "sha256": sha256_file(shards / "node-0.parquet")}],
    }
    (shards / "manifest.json").write_text(json.dumps(manifest))
    ds = tmp_path / "zero2.json"
    ds.write_text("{}")
    spec = {"learning_rate": 1e-3, "nodes": 2, "gpus_per_node": 1, "micro_batch_size": 32,
            "gradient_accumulation_steps": 1, "save_steps": 50, "max_steps": 40, **spec}  # fmt: skip
    return Job(spec, shards, tmp_path / "model", ds, tmp_path / "results/demo/train", "local", [])


def _checkpoint(job, step: int) -> None:
    from snaketune.core.checkpoints import mark_complete

    (job.ckpt / f"checkpoint-{step}").mkdir()
    mark_complete(job.ckpt / f"checkpoint-{step}", step, 0.0)


def test_the_launcher_keeps_resumes_and_sets_aside_by_the_key(tmp_path, monkeypatch, caplog):
    from snaketune.train.resume import prepare_checkpoints

    monkeypatch.delenv(rerun.FRESH_ENV, raising=False)
    caplog.set_level("INFO")
    job = _job(tmp_path)
    prepare_checkpoints(job)
    _checkpoint(job, 20)
    prepare_checkpoints(_job(tmp_path))  # a crash's rerun: the same key
    assert (job.ckpt / "checkpoint-20").is_dir()
    # the same names, other content (data_sha256 of other tokenized files): from step 0
    changed = json.loads((job.shards / "manifest.json").read_text()) | {"data_sha256": "d2"}
    prepare_checkpoints(_job(tmp_path, changed))
    assert "run settings changed (data): starting from step 0" in caplog.text
    assert not (job.ckpt / "checkpoint-20").exists()
    (aside,) = job.out.glob("checkpoints.previous-*")
    assert (aside / "checkpoint-20").is_dir()
    # --forcerun train: from step 0 once; the same invocation's retry resumes
    _checkpoint(job, 10)
    monkeypatch.setenv(rerun.FRESH_ENV, "tok:demo")
    prepare_checkpoints(_job(tmp_path, changed))
    assert (
        not (job.ckpt / "checkpoint-10").exists()
        and len(list(job.out.glob("checkpoints.previous-*"))) == 2
    )
    _checkpoint(job, 10)
    prepare_checkpoints(_job(tmp_path, changed))
    assert (job.ckpt / "checkpoint-10").is_dir()
    # the next invocation, not forced: the token stays in the stamp and the run resumes
    monkeypatch.delenv(rerun.FRESH_ENV)
    prepare_checkpoints(_job(tmp_path, changed))
    assert (job.ckpt / "checkpoint-10").is_dir()


def test_a_shard_changed_after_sharding_is_named_before_any_start(tmp_path, monkeypatch):
    from snaketune.train.resume import prepare_checkpoints

    monkeypatch.delenv(rerun.FRESH_ENV, raising=False)
    job = _job(tmp_path)
    prepare_checkpoints(job)
    _checkpoint(job, 20)
    # the same name, other content
    pq.write_table(pa.table({"x": [1, 2, 4]}), job.shards / "node-0.parquet")
    with pytest.raises(DataError, match=r"node-0.parquet is not the shard the shard job wrote"):
        prepare_checkpoints(job)
    assert (job.ckpt / "checkpoint-20").is_dir()  # nothing lost


def test_a_finished_run_s_outputs_are_put_back_only_for_its_key_and_step(tmp_path):
    from snaketune.plan.topology import STAMP

    ckpt, out = tmp_path / "checkpoints", tmp_path
    ckpt.mkdir()
    (ckpt / STAMP).write_text(json.dumps(_stamp(max_steps=40)))
    (out / "model").mkdir()
    (out / "model/w.bin").write_bytes(b"weights")
    (out / "metrics.jsonl").write_text('{"step": 40}\n')
    names = ("model", "metrics.jsonl")
    assert rerun.keep_published(ckpt, out, names, 40)
    shutil.rmtree(out / "model")
    (out / "metrics.jsonl").unlink()  # as Snakemake removes a job's outputs before it runs
    assert not rerun.restore_published(ckpt, out, names, 39)  # another step
    assert rerun.restore_published(ckpt, out, names, 40)
    assert (out / "model/w.bin").read_bytes() == b"weights"
    assert (out / "metrics.jsonl").read_text() == '{"step": 40}\n'
    (ckpt / STAMP).write_text(json.dumps(_stamp(max_steps=80)))  # raised: train on
    assert not rerun.restore_published(ckpt, out, names, 40)
    # the kept links hold no second copy: the disk plan counts each file once
    from snaketune.budget.diskplan import folder_bytes

    assert folder_bytes(out) == len(b"weights") + len('{"step": 40}\n') + sum(
        p.stat().st_size for p in (ckpt / STAMP, ckpt / rerun.KEPT / "key.json")
    )


# ----------------------------------------------------------------------------- the pipeline


def _steps(metrics: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(metrics)]


def _train_log(work: Path) -> str:
    logs = sorted((work / "results/demo/train/logs").glob("attempt-*.log"),
                  key=lambda p: int(p.stem.split("-")[1]))  # fmt: skip
    return logs[-1].read_text()


@pytest.mark.slow
def test_reruns_resume_what_is_the_same_and_start_over_on_what_changed(demo, tmp_path):
    """A finished run (max_steps inside an epoch, examples of unequal lengths), then: shards
    cut again byte for byte retrain nothing; the same forced in one invocation puts the
    outputs back and, without its kept outputs, trains no step past max_steps; --forcerun
    train and shards of other content each train from step 0 to max_steps."""
    work = tmp_path / "w"
    work.mkdir()  # the demo's fixtures and model, made once for the suite
    subprocess.run(["cp", "-a", str(demo / "resources"), str(work)], check=True)
    # GSM8K-like rows (unequal lengths): 512 of them, 16 steps an epoch of 32 on one node
    # (the rerun rule is the launcher's, the same on any number of nodes; the demo and the
    # fault tests train on two)
    config = str(quick_config(tmp_path / "c.yaml", max_steps=5, save_steps=2, nodes=1,
                              dataset="gsm8k_demo", eval_dataset="gsm8k_demo_test"))  # fmt: skip
    run = ("--configfile", config, "--directory", str(work))
    train_out = work / "results/demo/train"
    snakemake(*run, "--until", "train")
    lengths = pq.read_table(work / "results/demo/shards/node-0.parquet", columns=["length"])
    assert len(set(lengths.column("length").to_pylist())) > 5  # unequal lengths
    assert _steps(train_out / "metrics.jsonl") == [1, 2, 3, 4, 5]
    records = {n: (train_out / n).read_bytes()
               for n in ("metrics.jsonl", "provenance.json", "probe.safetensors")}  # fmt: skip

    def same_records() -> None:
        for name, data in records.items():
            assert (train_out / name).read_bytes() == data, name

    # the shard stage alone, cut again byte for byte: the next plain run retrains nothing
    snakemake(*run, "--forcerun", "shard_dataset", "--until", "shard_dataset")
    proc = snakemake(*run, "--until", "train")
    assert not started(proc.stderr, "train"), proc.stderr[-3000:]
    same_records()
    # in one invocation: train runs, puts back its kept outputs, trains nothing
    proc = snakemake(*run, "--forcerun", "shard_dataset", "--until", "train")
    assert started(proc.stderr, "train") and "no step trained" in proc.stderr
    same_records()
    # without them (a filesystem without hard links): resumed at its last step, which is
    # inside an epoch (16 steps), it trains no step past max_steps (transformers would)
    shutil.rmtree(train_out / "checkpoints/published")
    snakemake(*run, "--forcerun", "shard_dataset", "--until", "train")
    assert "nothing left to train" in _train_log(work)
    assert _steps(train_out / "metrics.jsonl") == [1, 2, 3, 4, 5]
    assert (train_out / "metrics.jsonl").read_bytes() == records["metrics.jsonl"]
    # --forcerun train: the user's word, from step 0; the earlier checkpoints kept aside
    snakemake(*run, "--forcerun", "train", "--until", "train")
    assert "train was forced (--forcerun): starting from step 0" in _train_log(work)
    assert _steps(train_out / "metrics.jsonl") == [1, 2, 3, 4, 5]
    assert len(list(train_out.glob("checkpoints.previous-*"))) == 1
    # other content under the same names: one tokenized row's tokens changed, its length
    # kept; the shard job cuts node shards of the same names, the run starts from step 0
    (tokenized,) = (work / "results/tokenized").glob("gsm8k_demo__*/data.parquet")
    table = pq.read_table(tokenized)
    ids = table.column("input_ids").to_pylist()
    ids[0] = [ids[0][0], *reversed(ids[0][1:])]
    pq.write_table(table.set_column(table.schema.get_field_index("input_ids"), "input_ids",
                                    pa.array(ids, table.schema.field("input_ids").type)),
                   tokenized)  # fmt: skip
    before = json.loads((work / "results/demo/shards/manifest.json").read_text())
    snakemake(*run, "--until", "train")
    after = json.loads((work / "results/demo/shards/manifest.json").read_text())
    assert [s["file"] for s in after["shards"]] == [s["file"] for s in before["shards"]]
    assert after["plan_sha256"] == before["plan_sha256"]  # the same plan: only content differs
    assert after["data_sha256"] != before["data_sha256"]
    assert "run settings changed (data): starting from step 0" in _train_log(work)
    assert _steps(train_out / "metrics.jsonl") == [1, 2, 3, 4, 5]
    assert len(list(train_out.glob("checkpoints.previous-*"))) == 2


@pytest.mark.slow
def test_a_stage_cut_again_byte_for_byte_leaves_every_record_as_it_was(demo, tmp_path):
    """The demo as it finished, its shard stage forced alone and then the whole pipeline:
    nothing retrains; forced in one invocation: summary.tsv and metrics.json byte for byte."""
    work = tmp_path / "w"
    subprocess.run(["cp", "-a", str(demo), str(work)], check=True)
    run = ("--configfile", str(ROOT / "config/config.yaml"), "--directory", str(work),
           "--config", "runs={'demo': {'checkpoints': {'optimizer': 'all'}}}")  # fmt: skip
    records = {p: (work / p).read_bytes()
               for p in ("results/summary.tsv", "results/demo/eval/metrics.json")}  # fmt: skip
    snakemake(*run, "--forcerun", "shard_dataset", "--until", "shard_dataset")
    proc = snakemake(*run)
    assert "Nothing to be done" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    proc = snakemake(*run, "--forcerun", "shard_dataset")
    assert started(proc.stderr, "train") and "no step trained" in proc.stderr
    for path, data in records.items():
        assert (work / path).read_bytes() == data, path
