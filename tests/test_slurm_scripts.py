"""The local test cluster's scripts (tests/slurm/) trust a pid file only when its pid is a
live process by the daemon's name: a pid file left by a daemon that died with its machine
may name a process of this boot (the last CI's start.sh took such a pid for MariaDB, did
not start it, and failed; stop.sh would have killed the stranger). These run in a private
directory, never against the cluster the SLURM tests use."""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

from conftest import ROOT

SLURM = ROOT / "tests/slurm"


def _daemon(tmp_path: Path, name: str) -> subprocess.Popen:
    """A process whose name is ``name`` (a copy of sleep), reaped as soon as it ends."""
    exe = tmp_path / "bin" / name
    exe.parent.mkdir(exist_ok=True)
    shutil.copy(shutil.which("sleep"), exe)
    proc = subprocess.Popen([str(exe), "600"])
    threading.Thread(target=proc.wait, daemon=True).start()
    return proc


def test_running_needs_the_daemons_name(tmp_path):
    stranger, mariadbd = subprocess.Popen(["sleep", "600"]), _daemon(tmp_path, "mariadbd")
    try:
        (tmp_path / "stale.pid").write_text(f"{stranger.pid}\n")
        (tmp_path / "live.pid").write_text(f"{mariadbd.pid}\n")
        script = (
            f". {SLURM / 'pids.sh'}; for f in stale live gone; do "
            f'running {tmp_path}/$f.pid mariadbd && echo "$f yes" || echo "$f no"; done'
        )
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
        assert out.stdout.split("\n")[:3] == ["stale no", "live yes", "gone no"]
    finally:
        stranger.kill(), mariadbd.kill(), stranger.wait()


def test_stop_kills_only_the_daemons_its_pid_files_name(tmp_path):
    cluster = tmp_path / "cluster"
    (cluster / "munge").mkdir(parents=True)
    stranger, slurmd = subprocess.Popen(["sleep", "600"]), _daemon(tmp_path, "slurmd")
    try:
        for name in ("slurmctld", "slurmd-tupi2", "slurmdbd", "mariadb", "munge/munged"):
            (cluster / f"{name}.pid").write_text(f"{stranger.pid}\n")
        (cluster / "slurmd-tupi1.pid").write_text(f"{slurmd.pid}\n")
        out = subprocess.run(
            ["bash", str(SLURM / "stop.sh")], capture_output=True, text=True, timeout=60,
            env={"PATH": "/usr/bin:/bin", "SNAKETUNE_SLURM_DIR": str(cluster)},
        )  # fmt: skip
        assert out.stdout == f"stopped slurmd-tupi1 ({slurmd.pid})\n", out.stderr
        assert slurmd.wait(timeout=10) is not None
        assert stranger.poll() is None, "stop.sh killed a process that is not a daemon"
        assert not list(cluster.rglob("*.pid")), "stale pid files stay behind"
    finally:
        stranger.kill(), slurmd.kill(), stranger.wait()
