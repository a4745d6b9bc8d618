"""What a train job spends before its first step, told apart for the time estimate
(snaketune.budget.calibrate): the one-time cost of a machine's first job (DeepSpeed's
just-in-time ops compiled into torch's extension cache: ~30-60 s each, then loaded from the
cache by every later job) and the job's own start-up (the launcher, the agents and their
rendezvous, the workers' imports, loading the model, building the engine), which every job
pays and which grows with the processes sharing a machine.

Rank 0 records them in its segment (snaketune.core.job.write_segment): when its worker
process started, when its first step began, and the seconds of op builds it waited on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

_BUILDS = {"compile_s": 0.0}

# A process that builds an op holds a lock file in the op's build directory (torch's
# FileBaton) until the build ends; one killed while building (SIGKILL, a job's time limit, a
# lost node) leaves the file, and every later load of that op, on any machine sharing the
# cache, waits on it forever. A lock made before this load began, in a directory where no
# file changed for STALE_BUILD_S (a live build writes its objects and ninja's log), is its
# dead builder's: removed, with a warning; the load then goes on (a rebuild where needed).
STALE_BUILD_S = 900.0
STALE_POLL_S = 10.0


def watch_builds() -> None:
    """Time DeepSpeed's op builds in this process: a load of an op that torch's extension
    cache does not hold yet (it compiles) counts as one-time; a load from the cache does
    not."""
    try:
        from deepspeed.ops.op_builder.builder import OpBuilder
    except ImportError:  # no DeepSpeed: nothing is compiled
        return
    original = OpBuilder.jit_load
    if getattr(original, "snaketune_timed", False):
        return

    def jit_load(self, verbose=True):
        cached = in_cache(self.name)
        began = time.monotonic()
        done = threading.Event()
        watcher = threading.Thread(
            target=_clear_stale, args=(self.name, time.time(), done), daemon=True
        )
        watcher.start()
        try:
            return original(self, verbose)
        finally:
            done.set()
            if not cached:
                _BUILDS["compile_s"] += time.monotonic() - began

    jit_load.snaketune_timed = True
    OpBuilder.jit_load = jit_load


def _clear_stale(name: str, since: float, done: threading.Event) -> None:
    """While op ``name`` loads (until ``done``), remove its stale build lock."""
    directory = build_directory(name)
    if directory is None:  # no lock to find
        return
    while not done.wait(STALE_POLL_S):
        if clear_stale_lock(directory, since):
            return


def clear_stale_lock(directory: Path, since: float, now: float | None = None) -> bool:
    """Remove ``directory``'s build lock when it is a dead builder's: made before ``since``
    (epoch seconds: this process's load began, so not its own) and no file of the directory
    changed for STALE_BUILD_S. Whether it was removed."""
    lock = directory / "lock"
    now = time.time() if now is None else now
    try:
        if lock.stat().st_mtime >= since:
            return False
        newest = max(f.stat().st_mtime for f in directory.iterdir())
        if now - newest < STALE_BUILD_S:
            return False
        lock.unlink()
    except (OSError, ValueError):  # gone meanwhile (its builder ended), or unreadable
        return False
    log.warning(
        "removed %s: a build of this DeepSpeed op stopped %.0f minutes ago without "
        "ending (its process was killed); every load of the op waited on it",
        lock,
        (now - newest) / 60,
    )
    return True


def build_directory(name: str) -> Path | None:
    """Op ``name``'s folder in torch's extension cache (None: a torch without the helper)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, verbose=False))
    except Exception:
        return None


def in_cache(name: str) -> bool:
    """Whether torch's extension cache holds op ``name`` compiled (no cache to read: taken
    as compiled, not one-time)."""
    directory = build_directory(name)
    return directory is None or any(directory.glob(f"{name}*.so"))


def process_started() -> float | None:
    """This process's start (epoch seconds), from the kernel's record; None off Linux."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def figures(first_step_at: float | None) -> dict[str, float | None]:
    """This job's start-up figures for its segment record."""
    return {
        "worker_started": process_started(),
        "first_step_at": first_step_at,
        "compile_s": round(_BUILDS["compile_s"], 3),
    }
