"""Training on 2 emulated nodes (CPU, gloo, DeepSpeed): LoRA + ZeRO-2 through the workflow,
full + ZeRO-3 on 2 x 2 processes with every example seen once, a killed rank that fails
the job fast and resumes to the same losses, and SIGTERM that leaves a checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
from conftest import BIN, ENV, ROOT, launch_train, read_jsonl, run_spec, workers_after
from safetensors.torch import load_file

from snaketune.core.checkpoints import COMPLETE, checkpoints

pytestmark = pytest.mark.slow
CONFIG = str(ROOT / "config" / "config.yaml")


def _wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _last_step(metrics: Path) -> int:
    return read_jsonl(metrics)[-1]["step"] if metrics.exists() and metrics.read_text() else 0


def _workers(workdir: Path) -> list[psutil.Process]:
    """The training's ranks in ``workdir`` (not their torchrun agents, whose command line
    holds the worker's too: after the PIDs wrap, an agent can have the highest PID)."""
    from snaketune.train.commands import AGENT

    found = []
    for p in psutil.process_iter(["cmdline", "cwd"]):
        cmd = p.info["cmdline"] or []
        if (
            "--worker" in cmd
            and any(c.endswith("train.py") for c in cmd)
            and AGENT not in cmd
            and p.info["cwd"] == str(workdir)
        ):
            found.append(p)
    return found


def test_lora_zero2_demo_trains(demo):
    train = demo / "results/demo/train"
    metrics = read_jsonl(train / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 193))  # 6 x 2048 examples / 64 per step
    first, last = metrics[0]["loss"], sum(m["loss"] for m in metrics[-4:]) / 4
    assert last < first - 0.3, (first, last)
    for key in (
        "epoch",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "samples_per_s",
        "peak_memory_mib",
        "elapsed_s",
    ):
        assert metrics[-1][key] is not None, key
    assert (train / "model" / "adapter_model.safetensors").stat().st_size > 10_000
    assert (train / "final_checkpoint" / "final").is_dir()
    probe = load_file(train / "probe.safetensors")
    vocab = json.loads((demo / "resources/models/tiny/config.json").read_text())["vocab_size"]
    assert (
        probe["logits"].shape[:2] == probe["input_ids"].shape and probe["logits"].shape[2] == vocab
    )
    prov = json.loads((train / "provenance.json").read_text())
    assert set(prov["hosts"]) == {"node-0", "node-1"}
    assert prov["segments"]["jobs"] == 1 and prov["segments"]["continuations"] == 0
    assert json.loads((train / "run_config.json").read_text())["method"] == "lora"
    assert list((train / "tensorboard").iterdir())
    log = (demo / "logs/train/demo.log").read_text()
    assert "global batch 64 = micro 32 x 1 devices x 2 nodes x accumulation 1" in log
    # packed (the default) on CPU: one row per micro batch, sdpa one example at a time
    assert "attention sdpa_segments, varlen batches" in log
    assert "ETA" in log
    assert all(m["padding"] == 0 for m in metrics), [m["padding"] for m in metrics]
    # only complete checkpoints are kept, at most save_total_limit of them
    kept = checkpoints(train / "checkpoints")
    assert [p.name for p in kept] == ["checkpoint-150", "checkpoint-192"]  # save_steps 50
    assert all((p / COMPLETE).is_file() for p in kept)


def _launcher(workdir: Path) -> psutil.Process:
    for p in psutil.process_iter(["cmdline", "cwd"]):
        cmd = p.info["cmdline"] or []
        if (
            "--worker" not in cmd
            and any(c.endswith("scripts/train.py") for c in cmd)
            and p.info["cwd"] == str(workdir)
        ):
            return p
    raise AssertionError("no train launcher running")


def test_killed_launcher_killed_rank_and_ctrl_c_each_resume_to_the_same_losses(demo, tmp_path):
    """Three faults in one run of the local pipeline (retries: 2), then its rerun: the
    launcher SIGKILLed takes its agents and workers with it (no orphan keeps training beside
    the retry); a killed rank fails the job fast; Ctrl-C (SIGINT to the pipeline's process
    group, as a terminal sends it) saves the step under way (no step lost) and the terminal
    ends with one line (where it stopped, the checkpoint, how to resume), no traceback and no
    process of the run left, `snaketune status` showing each state. Each retry and the rerun
    resume; the losses are an uninterrupted run's, every step logged once. On a copy of the
    finished demo without its training, checkpointing every 40 steps (the math is the
    demo's), only as far as training: one training of the 192-step demo for the three."""
    work = tmp_path / "w"
    subprocess.run(["cp", "-a", str(demo), str(work)], check=True)
    shutil.rmtree(work / "results/demo/train")
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"),
               "--profile", str(ROOT / "profiles/local"), "--configfile", CONFIG, "--directory",
               str(work), "--config", "runs={'demo': {'save_steps': 40}}", "--",
               "results/demo/train/metrics.jsonl"]  # fmt: skip
    env = {**ENV, "SNAKETUNE_PROGRESS_S": "3"}
    # as a terminal's foreground job: its own process group, SIGINT not ignored (a shell's
    # background job, as the test tiers run, would start it ignored)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    live = work / "results/demo/train/checkpoints/metrics.jsonl"

    def status() -> str:
        return subprocess.run([str(BIN / "snaketune"), "status", str(work)], env=ENV,
                              capture_output=True, text=True, check=True).stdout  # fmt: skip

    try:
        # 1. SIGKILL the launcher (what Snakemake runs) after the first checkpoint
        _wait_for(lambda: _last_step(live) >= 41, 300, "step 41")
        launcher = _launcher(work)
        family = launcher.children(recursive=True)
        assert len([p for p in family if "--worker" in p.cmdline()]) >= 2, family  # 2 ranks
        launcher.kill()
        gone, alive = psutil.wait_procs(family, timeout=15)
        assert not alive, [p.cmdline() for p in alive]  # no orphan agent or worker
        # 2. the retry resumes from checkpoint-40; kill one of its ranks at step 43
        _wait_for(lambda: _last_step(live) in range(1, 41), 120, "the retry to resume")
        _wait_for(lambda: _last_step(live) >= 43, 300, "step 43 of the retry")
        victim = _workers(work)[-1]
        victim.kill()
        killed = time.monotonic()
        _wait_for(lambda: not _workers(work) or _last_step(live) < 43, 90, "the job to stop")
        stopped = time.monotonic() - killed
        # 3. the third attempt resumes from checkpoint-40 (the rank died at 43, before the
        # next checkpoint); Ctrl-C once it trains past step 50
        _wait_for(lambda: _last_step(live) >= 50, 300, "step 50 of the third attempt")
        running = status()
        os.killpg(proc.pid, signal.SIGINT)
        seen = _last_step(live)
        out, _ = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert stopped < 60, stopped
    assert "  train              running, attempt 3: step " in running, running
    assert "/192, loss " in running and "ETA" in running
    assert proc.returncode != 0 and "Traceback" not in out, out[-5000:]
    # the two faults; the Ctrl-C's job error, train command and verdict: the log's only
    assert out.count("Error in rule train") == 2, out
    stop = out.split("Terminating processes on user request")[1]
    assert "RuleException" not in stop and "WorkflowError" not in stop, stop[-5000:]
    assert "Error in rule" not in stop and "--run-spec" not in stop, stop[-5000:]
    saved = checkpoints(work / "results/demo/train/checkpoints")[-1]
    step = int(saved.name.split("-")[1])
    assert step >= seen and (saved / COMPLETE).is_file()  # the step under way, saved
    line = (f"snaketune: run demo: stopped by Ctrl-C (SIGINT); newest complete checkpoint: "
            f"checkpoint-{step}; run the same command again to resume")  # fmt: skip
    last = out.strip().splitlines()[-2:]  # then Snakemake's log path
    assert last[0].startswith(line) and last[1].startswith("Complete log(s): "), last
    assert "snaketune: train demo: step " in out  # progress reached the terminal
    left = [p for p in psutil.process_iter(["cmdline"])
            if str(work) in " ".join(p.info["cmdline"] or [])]  # fmt: skip
    assert not left, [p.info["cmdline"] for p in left]
    assert "  train              stopped (attempt 3): stopped by Ctrl-C (SIGINT)" in status()
    # the second attempt took over the lock of the SIGKILLed launcher and resumed (its own
    # log: the rule's log is the last attempt's; the terminal shows a log's error lines)
    second = (work / "results/demo/train/logs/attempt-2.log").read_text()
    assert "taking it over" in second and "is gone" in second, second[-5000:]
    assert out.count("resuming from checkpoint-40") >= 1

    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    again = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, again[-4000:]
    log = (work / "logs/train/demo.log").read_text()  # the last attempt's
    assert f"resuming from checkpoint-{step}" in log
    assert "varlen batches" in log  # a packed run, resumed
    assert not (work / "results/demo/train/train.lock").exists()
    got = read_jsonl(work / "results/demo/train/metrics.jsonl")
    want = read_jsonl(demo / "results/demo/train/metrics.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-6, abs=1e-7), g["step"]
        assert g["lr"] == pytest.approx(w["lr"], rel=1e-9), g["step"]
    assert "  train              done" in status()
    _check_every_attempt_kept_its_log(work, log, out + again, victim.pid, step)


def _check_every_attempt_kept_its_log(
    work: Path, rule_log: str, out: str, victim: int, stopped_at: int
) -> None:
    """Four attempts (launcher SIGKILLed, a rank SIGKILLed, Ctrl-C, done): each kept its
    whole log in results/demo/train/logs though Snakemake emptied the rule's log before each
    retry; the first three hold what ended them, the records say how each ended, the rule's
    log names the earlier files and ends with every outcome, and provenance lists them."""
    folder = work / "results/demo/train/logs"
    logs = {n: (folder / f"attempt-{n}.log").read_text() for n in (1, 2, 3, 4)}
    assert sorted(p.name for p in folder.glob("attempt-*.log")) == [
        "attempt-1.log", "attempt-2.log", "attempt-3.log", "attempt-4.log"]  # fmt: skip
    # 1: trained past checkpoint-40, then nothing: SIGKILL leaves no line of its own
    assert "checkpoint checkpoint-40 complete" in logs[1] and "step 41/" in logs[1]
    assert "attempts of run demo" not in logs[1]  # it never got to write its outcome
    # 2: resumed, then the rank killed: torchrun's report of it and the launcher's line
    assert "resuming from checkpoint-40" in logs[2]
    assert f"Signal 9 (SIGKILL) received by PID {victim}" in logs[2], logs[2][-3000:]
    assert "training exited with code" in logs[2]
    # 3: resumed, then Ctrl-C: the step under way saved
    assert "resuming from checkpoint-40" in logs[3]
    assert f"checkpoint checkpoint-{stopped_at} complete" in logs[3], logs[3][-3000:]
    # 4: the rule's log is this attempt's: the attempt's file holds all of it from its start
    # (anything the launcher printed before, e.g. while it imported, came before; since the
    # launcher imports no ML library, the attempt's first line opens the rule's log)
    began = rule_log.rfind("\n", 0, rule_log.index("train attempt 4 of run demo")) + 1
    assert rule_log[began:].strip() in logs[4] and logs[4].count("\n") > 100
    records = {a["attempt"]: a for a in _attempts(folder)}
    assert "exit" not in records[1]  # killed before it could record an end
    assert records[2]["exit"] == 1
    assert f"Signal 9 (SIGKILL) received by PID {victim}" in records[2]["reason"]
    assert "stopped by Ctrl-C (SIGINT)" in records[3]["reason"], records[3]
    assert records[4]["exit"] == 0 and records[4]["reason"] == "done at step 192"
    # the rule's log names the earlier files and ends with every attempt's outcome
    assert "earlier attempts' logs" in rule_log
    assert "attempt-1.log, attempt-2.log, attempt-3.log" in rule_log
    tail = rule_log.strip().splitlines()[-5:]
    assert tail[0].startswith("attempts of run demo"), tail
    assert "attempt 1 (logs/attempt-1.log" in tail[1] and "ended without a record" in tail[1]
    assert "attempt 2 (logs/attempt-2.log" in tail[2] and ": exit 1: " in tail[2]
    assert "SIGKILL" in tail[2]
    assert "attempt 3 (logs/attempt-3.log" in tail[3] and "Ctrl-C" in tail[3]
    assert tail[4].endswith(": exit 0: done at step 192"), tail[4]
    # Snakemake's own output (the job's stderr) named each attempt's file
    for n in (1, 2, 3, 4):
        assert f"train demo: attempt {n}, its log: results/demo/train/logs/attempt-{n}.log" in out
    prov = json.loads((work / "results/demo/train/provenance.json").read_text())
    assert [(a["attempt"], a.get("exit")) for a in prov["attempts"]] == [
        (1, None), (2, 1), (3, records[3]["exit"]), (4, 0)]  # fmt: skip
    segments = read_jsonl(work / "results/demo/train/checkpoints/segments.jsonl")
    assert [s["attempt"] for s in segments] == [2, 3, 4]  # the SIGKILLed launcher recorded none


def _attempts(folder: Path) -> list[dict]:
    merged: dict[int, dict] = {}
    for record in read_jsonl(folder / "attempts.jsonl"):
        merged.setdefault(record["attempt"], {}).update(record)
    return [merged[n] for n in sorted(merged)]


@pytest.mark.extended
def test_time_limit_stops_saves_and_continues_to_the_same_losses(demo, tmp_path):
    """A 2-minute time limit (the rule's runtime off SLURM): a segment stops at a step end
    ahead of it, saves, and the next segment continues; no step twice, the losses of the
    uninterrupted demo run. The workers are paused (SIGSTOP) after the first checkpoint until
    the limit is near, as a slow stretch would: the stop does not depend on how fast this
    machine trains (a fast one finished the demo inside the limit; on a slow one the first
    segment may have stopped for time before its first checkpoint, then nothing is paused).
    Two minutes, not one: on a loaded machine a segment's start-up took most of a minute,
    and the run went through ten segments of a few steps each."""
    began = time.time()
    proc = launch_train(tmp_path, run_spec(), demo / "results/demo/shards",
                        demo / "resources/models/tiny", "zero2", "--time-limit", "2",
                        "--stop-margin", "10")  # fmt: skip
    out = tmp_path / "results/x/train"
    workers = workers_after(proc, out / "checkpoints/checkpoint-*" / COMPLETE)
    paused = []
    for w in workers:
        with contextlib.suppress(psutil.NoSuchProcess):  # its segment ended already
            w.send_signal(signal.SIGSTOP)
            paused.append(w)
    time.sleep(max(0.0, began + 125 - time.time()) if paused else 0.0)  # launcher began after
    for w in paused:
        with contextlib.suppress(psutil.NoSuchProcess):
            w.send_signal(signal.SIGCONT)
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-5000:]
    segments = read_jsonl(out / "checkpoints/segments.jsonl")
    reasons = [s["reason"] for s in segments]
    assert len(segments) >= 2 and set(reasons[:-1]) == {"time"} and reasons[-1] == "done", segments
    for before, after in zip(segments, segments[1:], strict=False):
        assert after["from_step"] == before["to_step"]  # each continues where the last saved
    got = read_jsonl(out / "metrics.jsonl")
    want = read_jsonl(demo / "results/demo/train/metrics.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-6, abs=1e-7), g["step"]
    summary = json.loads((out / "provenance.json").read_text())["segments"]
    assert summary["jobs"] == len(segments) and summary["continuations"] == len(segments) - 1
    assert 0 < summary["train_s"] < summary["wall_s"]
    assert summary["outside_training_s"] == pytest.approx(
        summary["wall_s"] - summary["train_s"], abs=0.2
    )


def test_second_training_of_a_run_refuses_naming_the_first(demo, tmp_path):
    """The run's lock is held by a live process (another training): the train stage waits
    its bounded time, then refuses with one line naming host and PID, before any compute;
    the run's directory gets only the refused attempt's log and record (its reason that
    line)."""
    from snaketune.core.io import host_name
    from snaketune.core.runlock import start_time

    holder = subprocess.Popen(["sleep", "60"])
    lock = tmp_path / "results/x/train/train.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(json.dumps({"host": host_name(), "pid": holder.pid, "job": None,
                                "pid_started": start_time(holder.pid), "since": "now"}))  # fmt: skip
    try:
        proc = launch_train(tmp_path, run_spec(), demo / "results/demo/shards",
                            demo / "resources/models/tiny", "zero2", "--lock-wait", "3")  # fmt: skip
        out, _ = proc.communicate(timeout=120)
    finally:
        holder.kill()
    assert proc.returncode == 2, out
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert errors == [
        f"error: results/x/train is in use by another training of this run (host {host_name()}, "
        f"PID {holder.pid}, since now); let it finish or stop it, then rerun (waited 3s for it)"
    ], out
    assert sorted(p.name for p in lock.parent.iterdir()) == ["logs", "train.lock"]
    assert sorted(p.name for p in (lock.parent / "logs").iterdir()) == [
        "attempt-1.log", "attempts.jsonl"]  # fmt: skip
    (ended,) = [r for r in read_jsonl(lock.parent / "logs/attempts.jsonl") if "exit" in r]
    assert ended["exit"] == 2 and ended["reason"] == errors[0].removeprefix("error: ")


@pytest.mark.extended
def test_sigterm_saves_a_checkpoint_at_that_step(demo, tmp_path):
    spec = run_spec(max_steps=32, save_steps=1000)
    proc = launch_train(
        tmp_path, spec, demo / "results/demo/shards", demo / "resources/models/tiny", "zero2"
    )
    live = tmp_path / "results/x/train/checkpoints/metrics.jsonl"
    try:
        _wait_for(lambda: _last_step(live) >= 5, 300, "step 5")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 3, out
    step = _last_step(live)
    assert 5 <= step < 32
    saved = checkpoints(tmp_path / "results/x/train/checkpoints")
    assert [p.name for p in saved] == [f"checkpoint-{step}"], out
    assert (saved[0] / COMPLETE).is_file()
    assert "saving a checkpoint at the end of this step" in out
    assert not (tmp_path / "results/x/train/model").exists()


@pytest.mark.slow
@pytest.mark.extended  # the quick test holds the signal in one process; this sends it to a start
def test_slurms_time_warning_while_the_ranks_load_is_a_save_at_their_first_step(demo, tmp_path):
    """SLURM sends ``--signal=USR1@...`` to every process of a job's step, up to a minute
    before the time asked: on a slow CI machine it reached the torchrun agents and ranks
    while they still loaded torch, which it killed (exit 138, the job failed). Sent here to
    each agent and rank of the first start half a second after it began (still loading):
    held, the ranks save at step 1 and stop to continue (as a SLURM job requeues); the
    launcher starts the next segment at once and the run ends at its last step."""
    from snaketune.train.commands import AGENT

    spec = run_spec(max_steps=12, save_steps=1000)
    proc = launch_train(
        tmp_path, spec, demo / "results/demo/shards", demo / "resources/models/tiny", "zero2"
    )
    live = tmp_path / "results/x/train/checkpoints/metrics.jsonl"
    sent: set[int] = set()
    try:
        while proc.poll() is None and _last_step(live) == 0 and len(sent) < 4:
            for p in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    line = " ".join(p.cmdline())
                    loading = time.time() - p.create_time() > 0.5  # begun, not yet training
                    if ("--worker" in line or AGENT in line) and p.pid not in sent and loading:
                        p.send_signal(signal.SIGUSR1)
                        sent.add(p.pid)
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert len(sent) == 4, (sent, out)  # 2 agents, 2 ranks: each before any step
    assert proc.returncode == 0 and "exited with code 138" not in out, out[-4000:]
    segments = read_jsonl(tmp_path / "results/x/train/checkpoints/segments.jsonl")
    assert [(s["from_step"], s["to_step"], s["reason"]) for s in segments] == [
        (0, 1, "time"), (1, 12, "done")]  # fmt: skip
    assert "stopped at step 1 ahead of the time limit (SIGUSR1)" in out


def test_full_zero3_two_nodes_by_two_sees_every_example_once(full_zero3):
    tmp_path = full_zero3
    shards, ids_dir = tmp_path / "shards", tmp_path / "ids"
    per_rank = {
        int(p.stem.split("-")[1]): p.read_text().split() for p in ids_dir.glob("rank-*.txt")
    }
    assert sorted(per_rank) == [0, 1, 2, 3]
    counts = Counter(i for ids in per_rank.values() for i in ids)
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["packing"] is True  # token-balanced plan: ranks differ in example counts
    planned = {r: [] for r in range(4)}
    for s in manifest["shards"]:
        t = pq.read_table(shards / s["file"], columns=["example_id", "rank"]).to_pydict()
        for i, r in zip(t["example_id"], t["rank"], strict=True):
            planned[r].append(i)
    assert {r: sorted(v) for r, v in per_rank.items()} == {r: sorted(v) for r, v in planned.items()}
    node_ids = [
        set(pq.read_table(shards / s["file"]).column("example_id").to_pylist())
        for s in manifest["shards"]
    ]
    assert set(counts) == node_ids[0] | node_ids[1] and set(counts.values()) == {1}  # exactly once
    # node ranks come from torchrun's rendezvous; both ranks of a node read that node's shard
    nodes_of = [
        {k for k, ids_k in enumerate(node_ids) if set(per_rank[r]) <= ids_k} for r in range(4)
    ]
    assert all(len(n) == 1 for n in nodes_of) and set().union(*nodes_of) == {0, 1}
    assert nodes_of[0] == nodes_of[1] and nodes_of[2] == nodes_of[3]

    metrics = read_jsonl(tmp_path / "results/x/train/metrics.jsonl")
    assert len(metrics) == manifest["steps_per_epoch"] == 32
    assert sum(m["loss"] for m in metrics[-4:]) / 4 < metrics[0]["loss"] - 0.5
    model = tmp_path / "results/x/train/model"
    assert (model / "config.json").is_file() and (
        model / "model.safetensors"
    ).stat().st_size > 500_000


@pytest.mark.extended
def test_packed_and_padded_runs_of_the_same_examples_train_the_same(demo, tmp_path):
    """One epoch of the demo trained packed and with packing: false (same global batches,
    split into padded micro batches at random) logs the same losses and gradient norms.

    One epoch (32 steps) each, not the demo's six: over 192 steps the rounding differences of
    the two layouts grow chaotically once the loss is near 0, which says nothing about packing.
    """
    tokenized = next((demo / "results/tokenized").glob("arith__*/data.parquet"))
    logs = {}
    for packing in (True, False):
        work = tmp_path / ("packed" if packing else "padded")
        work.mkdir()
        subprocess.run(
            [sys.executable, str(ROOT / "scripts/shard_dataset.py"), "--tokenized", str(tokenized),
             "--nodes", "2", "--gpus-per-node", "1", "--micro-batch-size", "32",
             "--gradient-accumulation-steps", "1", "--seed", "42",
             "--packing" if packing else "--no-packing", "--out", str(work / "shards")],
            check=True, env=ENV, capture_output=True,
        )  # fmt: skip
        spec = run_spec(packing=packing, epochs=1)
        proc = launch_train(work, spec, work / "shards", demo / "resources/models/tiny", "zero2")
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out
        # the two layouts: one packed row per micro batch (sdpa one example at a time), one
        # padded row per example
        layout = "sdpa_segments, varlen" if packing else "sdpa, padded"
        assert f"attention {layout} batches" in out, out[-3000:]
        logs[packing] = read_jsonl(work / "results/x/train/metrics.jsonl")
    packed, padded = logs[True], logs[False]
    assert [m["step"] for m in padded] == [m["step"] for m in packed] == list(range(1, 33))
    assert packed[-1]["loss"] < 0.5 * packed[0]["loss"]  # it learned: not a flat comparison
    for a, b in zip(padded, packed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), a["step"]
