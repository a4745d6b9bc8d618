"""A rank that stalls is named (snaketune.core.heartbeat): the watch's verdict, and a worker
stopped with SIGSTOP mid-training on 2 emulated nodes."""

from __future__ import annotations

import re
import signal
import time

import psutil
import pytest
from conftest import launch_train, read_jsonl, run_spec, workers_after

from snaketune.core.checkpoints import COMPLETE
from snaketune.core.heartbeat import Heartbeat, StallWatch
from snaketune.core.io import host_name


def _beats(tmp_path, n: int) -> list[Heartbeat]:
    beats = [Heartbeat(tmp_path / "heartbeat", r, r) for r in range(n)]
    for b in beats:
        b.write()
    return beats


def test_a_worker_s_last_write_beside_its_daemon_s_beat_never_loses_the_file(tmp_path):
    """A scoring worker writes "done" itself while the daemon may be beating: two writers of
    one file and one .tmp. Unserialized, one's rename found the other's .tmp gone
    (FileNotFoundError, a teacher stage failed in CI). Four threads, 300 writes each."""
    import threading

    beat = Heartbeat(tmp_path / "heartbeat", 0, 0)
    failed: list[BaseException] = []

    def writes() -> None:
        try:
            for _ in range(300):
                beat.write()
        except OSError as exc:
            failed.append(exc)

    threads = [threading.Thread(target=writes) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == []
    assert beat.beats == 1200  # no count lost either
    assert [p.name for p in beat.path.parent.iterdir()] == ["rank-0.json"]


def test_the_rank_that_stopped_moving_while_the_others_moved_on_is_named(tmp_path):
    beats = _beats(tmp_path, 4)
    watch = StallWatch(tmp_path, limit_s=60)
    watch.read(0.0)
    beats[1].move("backward", 6)  # rank 1 got to step 6's backward, then stopped
    beats[1].write()
    watch.read(1.0)
    for b in (beats[0], beats[2], beats[3]):  # the others reached the gradient reduction
        b.move("backward", 6)
        b.move("optimizer")
        b.write()
    watch.read(2.0)
    assert watch.judge(50.0) is None  # not yet the run's timeout
    line = watch.judge(61.5)
    assert line == (f"rank 1 on {host_name()} (pid {beats[1].fixed['pid']}) made no progress "
                    "for 60 s in step 6 (backward); 3 ranks wait for it")  # fmt: skip


def test_a_worker_done_with_its_share_is_never_named_but_a_stuck_one_still_is(tmp_path):
    """The reference stage's workers end one by one (snaketune.core.heartbeat.DONE): one that is
    done, silent since, is neither frozen nor stuck while the others work on; of those
    others, one that stops moving is still named."""
    from snaketune.core.heartbeat import DONE

    beats = _beats(tmp_path, 3)
    watch = StallWatch(tmp_path, limit_s=10)
    watch.read(0.0)
    beats[0].move(DONE, 2)  # worker 0's chunks are all written: it exits
    beats[0].write()
    watch.read(1.0)
    for t in range(2, 40):  # workers 1 and 2 go on, rewriting their files
        for b in beats[1:]:
            b.move("forward", t)
            b.write()
        watch.read(float(t))
    assert watch.judge(40.0) is None
    for t in range(40, 60):  # worker 2 stops moving (its thread still writes)
        beats[1].move("forward", t)
        for b in beats[1:]:
            b.write()
        watch.read(float(t))
    line = watch.judge(60.0)
    assert line is not None and line.startswith("rank 2 "), line


def test_ranks_that_are_all_quiet_together_are_not_a_stall(tmp_path):
    """Every rank in the same long phase (a big save, a slow start): no rank is named."""
    beats = _beats(tmp_path, 2)
    watch = StallWatch(tmp_path, limit_s=10)
    watch.read(0.0)
    for b in beats:
        b.move("save", 4)
        b.write()
    watch.read(1.0)
    assert watch.judge(1000.0) is None


def test_a_stopped_process_is_named_though_it_moved_when_the_others_did(tmp_path):
    """Rank 1 stopped whole (SIGSTOP) at the same poll as rank 0 entered the collective
    that waits for it: neither moves again, but rank 0's thread still rewrites its file."""
    beats = _beats(tmp_path, 2)
    watch = StallWatch(tmp_path, limit_s=30)
    for b in beats:
        b.move("save", 4)
        b.write()
    watch.read(1.0)
    for t in range(2, 40):
        beats[0].write()  # waiting in the barrier: same counter, a fresh file
        watch.read(float(t))
        assert watch.judge(float(t)) is None or t >= 31
    assert watch.judge(40.0) == (
        f"rank 1 on {host_name()} (pid {beats[1].fixed['pid']}) made no progress for 39 s "
        "in step 4 (save); 1 rank waits for it"
    )


def test_a_rank_stuck_inside_a_step_behind_the_others_is_named(tmp_path):
    """Every thread alive, rank 0 further on (in the optimizer's collective) than rank 1
    (in its backward), both last seen moving at the same poll."""
    beats = _beats(tmp_path, 2)
    watch = StallWatch(tmp_path, limit_s=30)
    beats[0].move("optimizer", 6)
    beats[1].move("backward", 6)
    for t in range(1, 40):
        for b in beats:
            b.write()
        watch.read(float(t))
    assert "rank 1 " in watch.judge(40.0) and "(backward)" in watch.judge(40.0)


def test_a_rank_done_training_that_stops_writing_is_not_a_stall(tmp_path):
    beats = _beats(tmp_path, 2)
    watch = StallWatch(tmp_path, limit_s=10)
    for b in beats:
        b.move("outputs")
        b.write()
    for t in range(1, 30):
        beats[0].write()  # rank 0's thread not stopped yet; rank 1's is
        watch.read(float(t))
    assert watch.judge(30.0) is None


@pytest.mark.slow
def test_a_stopped_rank_is_named_within_the_timeout_and_the_rerun_is_exact(demo, tmp_path):
    """LoRA on 2 emulated nodes, timeout_minutes 0.5: rank 1 stopped with SIGSTOP after
    checkpoint-4. The job fails within the timeout plus a minute with one line naming rank
    1, its host and pid; no process of the job is left; the rerun resumes from the last
    checkpoint and trains every step once."""
    shards, model = demo / "results/demo/shards", demo / "resources/models/tiny"
    spec = run_spec(max_steps=12, save_steps=4, timeout_minutes=0.5)
    ckpt = tmp_path / "results/x/train/checkpoints"
    proc = launch_train(tmp_path, spec, shards, model, "zero2")
    try:
        workers = workers_after(proc, ckpt / "checkpoint-4" / COMPLETE)
        victim = next(w for w in workers if w.environ().get("RANK") == "1")
        victim.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        out, _ = proc.communicate(timeout=300)
        took = time.monotonic() - stopped
    finally:
        proc.kill()
    assert proc.returncode == 2 and took < 30 + 60, (took, out[-3000:])
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, out[-3000:]
    assert re.match(
        rf"error: stalled: rank 1 on {re.escape(host_name())} \(pid {victim.pid}\) made no "
        r"progress for \d+ s in step \d+ \(\w[\w ]*\); 1 rank waits for it; every process of "
        r"the job was stopped; a retry resumes from checkpoint-\d+",
        errors[0],
    ), errors[0]
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, [p.pid for p in alive]  # no orphan, the stopped rank included
    out, _ = launch_train(tmp_path, spec, shards, model, "zero2").communicate(timeout=600)
    assert "resuming from checkpoint-" in out, out[-3000:]
    steps = [m["step"] for m in read_jsonl(tmp_path / "results/x/train/metrics.jsonl")]
    assert steps == list(range(1, 13))
