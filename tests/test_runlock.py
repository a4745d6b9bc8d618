"""One training per run: the run lock (taken, waited for, refused, taken over when its
holder is gone) and processes that die with their parent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import ENV, ROOT

from snaketune.core import runlock
from snaketune.core.errors import UserError
from snaketune.core.io import host_name
from snaketune.core.runlock import RunLock


def _write_holder(path: Path, **fields) -> None:
    path.write_text(json.dumps({"host": host_name(), "since": "earlier", **fields}))


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_lock_is_taken_and_released(tmp_path):
    path = tmp_path / "train.lock"
    with RunLock(path) as lock:
        holder, age = lock.holder()
        assert holder["pid"] == os.getpid() and holder["host"] == host_name()
        assert age < 5
    assert not path.exists()


def test_second_training_waits_then_refuses_naming_the_holder(tmp_path):
    path = tmp_path / "train.lock"
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        _write_holder(path, pid=sleeper.pid, pid_started=runlock.start_time(sleeper.pid), job="77")
        began = time.monotonic()
        with pytest.raises(UserError) as err:
            RunLock(path, wait_s=1.5, poll_s=0.1).acquire()
        waited = time.monotonic() - began
    finally:
        sleeper.kill()
    msg = str(err.value)
    assert f"host {host_name()}, PID {sleeper.pid}, SLURM job 77" in msg
    assert "in use by another training of this run" in msg and "\n" not in msg
    assert waited >= 1.5  # its wait, then the refusal (not a hang: pytest's own limit)
    assert json.loads(path.read_text())["pid"] == sleeper.pid  # the holder's lock is untouched


def test_lock_is_taken_when_the_holder_finishes_within_the_wait(tmp_path):
    path = tmp_path / "train.lock"
    first = RunLock(path)
    first.acquire()
    second = RunLock(path, wait_s=10, poll_s=0.1)
    waiter = threading.Thread(target=second.acquire)
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive()  # still waiting for the first
    first.release()
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    assert json.loads(path.read_text())["token"] == second.token
    second.release()


def test_dead_holder_on_this_host_is_taken_over_at_once(tmp_path):
    path = tmp_path / "train.lock"
    _write_holder(path, pid=_dead_pid(), pid_started="1")
    began = time.monotonic()
    with RunLock(path, wait_s=30, poll_s=0.1):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert time.monotonic() - began < 5


def test_reused_pid_is_not_the_holder(tmp_path):
    path = tmp_path / "train.lock"  # our own PID, but a process that started at another time
    _write_holder(path, pid=os.getpid(), pid_started="1")
    with RunLock(path, wait_s=30, poll_s=0.1) as lock:
        assert json.loads(path.read_text())["token"] == lock.token


def test_holder_on_another_host_is_stale_only_without_heartbeat(tmp_path):
    path = tmp_path / "train.lock"
    _write_holder(path, host="node-elsewhere", pid=123)
    with pytest.raises(UserError, match="host node-elsewhere, PID 123"):
        RunLock(path, wait_s=0.3, poll_s=0.1).acquire()
    old = time.time() - runlock.STALE_S - 5
    os.utime(path, (old, old))
    with RunLock(path, wait_s=0.3, poll_s=0.1) as lock:
        assert json.loads(path.read_text())["token"] == lock.token


def test_heartbeat_keeps_the_lock_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.1)
    path = tmp_path / "train.lock"
    with RunLock(path):
        old = time.time() - 1000
        os.utime(path, (old, old))
        deadline = time.monotonic() + 20  # a loaded CI machine may be slow to schedule it
        while time.time() - path.stat().st_mtime > 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert time.time() - path.stat().st_mtime < 5  # the heartbeat touched it again


def test_child_dies_with_its_parent_even_by_sigkill(tmp_path):
    """The launcher's agents (and each worker, for its agent) ask the kernel for SIGKILL on
    their parent's death; here a parent killed with SIGKILL takes its child along."""
    pidfile = tmp_path / "child.pid"
    parent_code = (
        "import subprocess, sys, time\n"
        "from snaketune.core.runlock import die_with_parent\n"
        "c = subprocess.Popen(['sleep', '60'], start_new_session=True, preexec_fn=die_with_parent)\n"
        f"open({str(pidfile)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], env={**ENV, "PYTHONPATH": str(ROOT / "scripts")}
    )
    try:
        for _ in range(100):
            if pidfile.exists() and pidfile.read_text():
                break
            time.sleep(0.1)
        child = psutil.Process(int(pidfile.read_text()))
        assert child.is_running()
        parent.kill()
        parent.wait()
        child.wait(timeout=5)  # raises psutil.TimeoutExpired if it outlived its parent
    finally:
        parent.kill()


def test_a_lock_taken_over_in_between_is_put_back(tmp_path):
    """Two takers judged the same stale lock; the first already holds a fresh one: the
    second, moving the fresh one aside, sees it is not the stale one and puts it back."""
    path = tmp_path / "train.lock"
    first = RunLock(path)
    first.acquire()
    fresh = json.loads(path.read_text())
    second = RunLock(path)
    second._take_over({"host": host_name(), "pid": _dead_pid()}, "its process is gone")
    assert json.loads(path.read_text()) == fresh
    assert [p.name for p in tmp_path.iterdir()] == ["train.lock"]
    first.release()


def test_an_unreadable_lock_goes_stale_by_its_age(tmp_path):
    path = tmp_path / "train.lock"
    path.write_text("")  # a writer that died between creating and writing it
    with pytest.raises(UserError):
        RunLock(path, wait_s=0.3, poll_s=0.1).acquire()
    old = time.time() - runlock.STALE_S - 5
    os.utime(path, (old, old))
    with RunLock(path, wait_s=0.3, poll_s=0.1) as lock:
        assert json.loads(path.read_text())["token"] == lock.token
