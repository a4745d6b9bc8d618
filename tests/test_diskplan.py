"""The disk before the save (snaketune.budget.diskplan): the estimate against real checkpoints,
older checkpoints reduced to weights, a run that cannot fit refused before it starts, and a
disk that fills mid-run stopping the run with its last checkpoint intact."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
from conftest import ROOT, launch_train, read_jsonl, run_spec, snakemake, tmpfs, workers_after

from snaketune.budget.diskplan import checkpoint_size, folder_bytes, run_need, small_files
from snaketune.budget.fit import setup_of
from snaketune.budget.memplan import Shape
from snaketune.core.checkpoints import (
    COMPLETE,
    is_reduced,
    mark_complete,
    newest_complete,
    prune,
)

MIB = 2**20


def _fake_checkpoint(ckpt: Path, step: int, model_file: str | None = "model.safetensors") -> Path:
    path = ckpt / f"checkpoint-{step}"
    (path / f"global_step{step}").mkdir(parents=True)
    (path / f"global_step{step}" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(
        b"o" * 12000
    )
    (path / "latest").write_text(f"global_step{step}")
    if model_file:
        (path / model_file).write_bytes(b"w" * 1000)
    mark_complete(path, step, 0.0)
    return path


def test_older_checkpoints_are_reduced_to_weights_and_never_resumed(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        _fake_checkpoint(ckpt, step)
    prune(ckpt, keep=2, optimizer="last")
    assert not (ckpt / "checkpoint-10").exists()  # beyond save_total_limit
    older, newest = ckpt / "checkpoint-20", ckpt / "checkpoint-30"
    assert is_reduced(older) and not is_reduced(newest)
    assert not (older / "global_step20").exists() and not (older / "latest").exists()
    assert (older / "model.safetensors").is_file()  # the weights stay
    assert (newest / "global_step30").is_dir()
    assert json.loads((older / COMPLETE).read_text())["step"] == 20
    shutil.rmtree(newest)  # the newest lost: the reduced one is not resumed from
    assert newest_complete(ckpt) is None


def test_all_keeps_every_checkpoint_whole_and_one_without_saved_weights_stays_whole(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for step in (10, 20):
        _fake_checkpoint(ckpt, step)
    prune(ckpt, keep=2, optimizer="all")
    assert not is_reduced(ckpt / "checkpoint-10")
    # ZeRO-3 without gathered 16-bit weights: the states are the only weights there are
    other = tmp_path / "zero3"
    for step in (10, 20):
        _fake_checkpoint(other, step, model_file=None)
    prune(other, keep=2, optimizer="last")
    assert (other / "checkpoint-10/global_step10").is_dir() and not is_reduced(
        other / "checkpoint-10"
    )


def test_optimizer_last_needs_a_fraction_of_all_for_a_full_fine_tune():
    """An 8B Llama, full fine-tuning in bf16 on 2 x 8 GPUs, 3 checkpoints kept."""
    from snaketune.budget.memplan import Setup

    shape = Shape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                  head_dim=128, vocab=128256, tied=False, qkv_bias=False)  # fmt: skip
    s = Setup("full", 2, False, False, 2, 8, 1, 4096, True, "sdpa", False, 2)
    one = checkpoint_size(shape, s)
    assert one.whole / shape.params == pytest.approx(16, rel=0.01)  # 2 + 2 + 12 per parameter
    assert one.reduced / shape.params == pytest.approx(2, rel=0.01)
    every = run_need(shape, s, 3, "all")["checkpoints"]
    last = run_need(shape, s, 3, "last")["checkpoints"]
    assert every == pytest.approx(4 * one.whole) and last == pytest.approx(
        2 * one.whole + 2 * one.reduced
    )


def test_each_fix_of_a_disk_that_is_short_says_what_it_saves():
    """The 32B QLoRA example was told to lower save_total_limit, which saves a reduced
    adapter checkpoint, of 55 GiB short; its merged export and its download are 61 GiB
    each. Each fix now carries what it saves, largest first, by hand here."""
    import dataclasses

    from snaketune.budget.diskplan import fixes
    from snaketune.budget.memplan import Setup

    shape = Shape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                  head_dim=128, vocab=128256, tied=False, qkv_bias=False)  # fmt: skip
    full = Setup("full", 2, False, False, 2, 8, 1, 4096, True, "sdpa", False, 2)
    one = checkpoint_size(shape, full, True, 0.0)
    got = fixes(shape, full, 3, "all", True, 0.0, 0.0)
    assert got == [("save_total_limit: 1 (now 3)", pytest.approx(2 * one.whole)),
                   ("checkpoints.optimizer: last", pytest.approx(2 * (one.whole - one.reduced)))]  # fmt: skip
    lora = dataclasses.replace(full, adapter="lora", lora_r=16)
    merged = lora.bytes_per_weight * shape.params
    got = dict(fixes(shape, lora, 2, "last", True, 0.0, 5e9))
    assert list(got) == ["export.merged: false (the adapter alone)",
                         "resources/models on another filesystem (a symlink)",
                         "save_total_limit: 1 (now 2)"]  # fmt: skip
    assert got["export.merged: false (the adapter alone)"] == pytest.approx(merged)
    reduced = checkpoint_size(shape, lora, True, 0.0).reduced
    assert reduced > 0 and got["save_total_limit: 1 (now 2)"] == pytest.approx(reduced)
    assert fixes(shape, dataclasses.replace(lora, merged=False), 1, "last", True, 0.0, 0.0) == []


@pytest.mark.slow
def test_the_estimate_matches_real_checkpoints(demo, full_zero3):
    """One checkpoint's estimated bytes within 10% of what DeepSpeed and Trainer wrote:
    the demo's (LoRA, ZeRO-2, 2 x 1) and a full fine-tune's (ZeRO-3, 2 x 2)."""
    model = demo / "resources/models/tiny"
    shape = Shape.from_config(json.loads((model / "config.json").read_text()))
    cases = [
        (run_spec(), "zero2", demo / "results/demo/train/checkpoints/checkpoint-192"),
        (run_spec(method="full", nodes=2, gpus_per_node=2, micro_batch_size=16), "zero3",
         full_zero3 / "results/x/train/checkpoints/checkpoint-32"),
    ]  # fmt: skip
    for spec, preset, real in cases:
        deepspeed = json.loads((ROOT / f"config/deepspeed/{preset}.json").read_text())
        s = setup_of(spec, deepspeed, on_gpu=False)
        one = checkpoint_size(shape, s, True, small_files(model, s.gpus))
        assert one.whole == pytest.approx(folder_bytes(real), rel=0.10), (preset, one)


def _demo_job_args(demo: Path) -> tuple[Path, Path]:
    return demo / "results/demo/shards", demo / "resources/models/tiny"


@pytest.mark.slow
def test_a_run_that_cannot_fit_is_refused_before_any_worker_starts(demo, tmp_path):
    """The train job on a 2 MiB results filesystem: one line with the need, the free space
    and the fixes, in well under a minute, and nothing started or written."""
    shards, model = _demo_job_args(demo)
    with tmpfs(tmp_path / "results", 2):
        began = time.monotonic()
        out, _ = launch_train(tmp_path, run_spec(), shards, model, "zero2").communicate(60)
        took = time.monotonic() - began
        errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1, out[-3000:]
        assert errors[0].startswith("error: disk: x: needs ") and "does NOT fit" in errors[0]
        assert "MiB free" in errors[0] and "save_total_limit: 1 (now 2) saves " in errors[0]
        assert "or put results/ on a larger filesystem" in errors[0]
        assert took < 60 and "launching" not in out
        assert not (tmp_path / "results/x/train/checkpoints").exists()


@pytest.mark.slow
def test_snakemake_refuses_before_queueing_when_results_cannot_hold_the_run(demo, tmp_path):
    """The demo with its model there and results/ on a 2 MiB filesystem: refused before
    any job, one line naming the run, the need and the free space."""
    work = tmp_path / "w"
    work.mkdir()
    shutil.copytree(demo / "resources", work / "resources", symlinks=True)
    with tmpfs(work / "results", 2):
        began = time.monotonic()
        proc = snakemake("--configfile", str(ROOT / "config/config.yaml"), "--directory",
                         str(work), check=False)  # fmt: skip
        assert time.monotonic() - began < 60
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0
        lines = [ln for ln in out.splitlines() if ln.startswith("error: disk plan: demo: ")]
        assert len(lines) == 1 and "does NOT fit" in lines[0], out[-3000:]
        assert "problem(s) found before queueing; nothing was run" in out
        assert not list((work / "results").iterdir())  # no job ran


@pytest.mark.extended
@pytest.mark.slow
def test_a_disk_that_fills_mid_run_stops_before_the_save_and_the_rerun_resumes(demo, tmp_path):
    """LoRA on 2 emulated nodes, a checkpoint every 4 steps, on a 24 MiB tmpfs. Once
    checkpoint-4 is complete the workers are paused and the disk filled: at step 8 the run
    stops without saving, one line says so, checkpoint-4 is intact and nothing half-written
    is left. With the space back, the rerun resumes from checkpoint-4 and trains every step
    once; checkpoints.optimizer last reduced the older kept checkpoint to weights."""
    shards, model = _demo_job_args(demo)
    spec = run_spec(max_steps=12, save_steps=4, save_total_limit=2)
    ckpt = tmp_path / "results/x/train/checkpoints"
    with tmpfs(tmp_path / "results", 24):
        proc = launch_train(tmp_path, spec, shards, model, "zero2")
        try:
            workers = workers_after(proc, ckpt / "checkpoint-4" / COMPLETE)
            for w in workers:
                w.send_signal(signal.SIGSTOP)
            free = shutil.disk_usage(tmp_path / "results").free
            (tmp_path / "results/ballast").write_bytes(b"\0" * int(free - 1.5 * MIB))
            for w in workers:
                w.send_signal(signal.SIGCONT)
            out, _ = proc.communicate(timeout=300)
        finally:
            proc.kill()
        assert proc.returncode == 2, out[-3000:]
        errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith("error: disk full: "), out[-3000:]
        assert (
            "stopped at step 8 without saving; checkpoint-4 is complete and resumable"
            in (errors[0])
        )
        assert [p.name for p in sorted(ckpt.glob("checkpoint-*"))] == ["checkpoint-4"]
        assert newest_complete(ckpt) == ckpt / "checkpoint-4"
        (tmp_path / "results/ballast").unlink()
        out, _ = launch_train(tmp_path, spec, shards, model, "zero2").communicate(timeout=600)
        assert "resuming from checkpoint-4" in out, out[-3000:]
        steps = [m["step"] for m in read_jsonl(tmp_path / "results/x/train/metrics.jsonl")]
        assert steps == list(range(1, 13))
        older, newest = ckpt / "checkpoint-8", ckpt / "checkpoint-12"
        assert is_reduced(older) and not list(older.glob("global_step*"))
        assert (newest / "global_step12").is_dir() and not is_reduced(newest)


def test_a_save_cut_short_by_a_full_disk_is_removed_and_named(tmp_path):
    """The workers died while writing checkpoint-8 on a full disk (ENOSPC): the launcher
    removes the half-written checkpoint and names the disk, the last complete one intact."""
    from snaketune.core.errors import UserError
    from snaketune.core.job import Job
    from snaketune.train.launch import outcome

    with tmpfs(tmp_path / "results", 1):
        out = tmp_path / "results/x/train"
        _fake_checkpoint(out / "checkpoints", 4)
        half = out / "checkpoints/checkpoint-8/global_step8"
        half.mkdir(parents=True)
        free = shutil.disk_usage(out).free
        (half / "part.pt").write_bytes(b"\0" * (free - 4096))
        job = Job({}, tmp_path, tmp_path, tmp_path, out, "local", [])
        with pytest.raises(UserError, match=r"^disk full during a save: .* half-written "
                           r"checkpoint-8 removed; checkpoint-4 is complete and resumable"):  # fmt: skip
            outcome(job, 1, None, {})
        assert not (out / "checkpoints/checkpoint-8").exists()
        assert (out / "checkpoints/checkpoint-4/global_step4").is_dir()


def test_runs_on_one_filesystem_are_added_up(fixtures_dir, tmp_path, capsys):
    """Four sweep members that each fit on a filesystem but not together: each is fine
    alone, the filesystem's line names all four and refuses."""
    from snaketune.budget.diskplan import check_disk_runs, disk_plan_of, shared_filesystems
    from snaketune.plan.config import load_yaml, validate_config

    config = load_yaml(ROOT / "config/config.yaml")
    config["models"]["tiny"]["path"] = str(fixtures_dir / "tiny-llama")
    config["runs"]["demo"]["sweep"] = {"learning_rate": [0.001, 0.002, 0.003, 0.004]}
    config = validate_config(config, ROOT)
    members = sorted(config["runs"])
    need = disk_plan_of(config, members[0], tmp_path, ROOT, False)["need_bytes"]
    one, download = need["total"], need["download"]  # the base's download: once for all
    assert download > 0  # not under tmp_path/resources/models yet
    with tmpfs(tmp_path / "fs", 2.5 * one / 2**20) as fs:  # room for two of them, not four
        plans = {m: disk_plan_of(config, m, fs, ROOT, False) for m in members}
        assert all(p["fits"] for p in plans.values())
        (group,) = shared_filesystems(plans)
        assert group["runs"] == members and not group["fits"]
        assert group["need_bytes"] == pytest.approx(4 * one - 3 * download, rel=0.01)
        (line,) = check_disk_runs(config, members, fs, ROOT, False)
        assert line.startswith("disk plan: 4 runs write to the filesystem of ")
        assert "does NOT fit" in line and all(m in line for m in members)
        # two of them fit together: a note, no refusal
        assert check_disk_runs(config, members[:2], fs, ROOT, False) == []
        assert "2 runs write to the filesystem" in capsys.readouterr().err
