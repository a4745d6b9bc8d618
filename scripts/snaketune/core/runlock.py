"""One training per run: a lock on the run's directory, and processes that die with their
parent.

The lock is a file (``<out>/train.lock``) created with ``O_CREAT | O_EXCL``, which NFS (v3
and later) and Lustre honour, unlike ``flock``. It holds the holder's host, PID, the PID's
start time (so a reused PID is not mistaken for the holder) and the job; a thread touches
its mtime every ``HEARTBEAT_S`` seconds. Another training of the same run:

- takes over at once when the holder is on this host and its process is gone;
- takes over when the heartbeat is older than ``STALE_S`` (a holder on another node that
  died with its node or job);
- otherwise waits up to ``wait_s`` seconds for the holder to finish, then refuses with one
  line naming the holder.

``die_with_parent`` asks the kernel to SIGKILL the calling process when its parent dies
(Linux ``PR_SET_PDEATHSIG``): the launcher sets it for its torchrun agents, and each worker
for itself, so a launcher killed even by SIGKILL takes every training process with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from snaketune.core.errors import UserError
from snaketune.core.io import host_name

log = logging.getLogger(__name__)

HEARTBEAT_S = 10.0
STALE_S = 90.0  # a heartbeat this old means the holder is gone (9 missed beats)
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux only).

    Usable as a ``preexec_fn``. A parent already gone before this ran is not noticed (the
    kernel only watches from now on); ``worker_dies_with_agent`` checks for that.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to ask for
        return


def worker_dies_with_agent() -> None:
    """In a torchrun worker: be killed with the agent that started it. When the agent is
    already gone (this process re-parented before asking), exit now."""
    die_with_parent()
    try:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return
    agents = (b"torch.distributed.run", b"torchrun", b"snaketune.train.torchrun")
    if not any(name in parent for name in agents):
        log.error("the torchrun agent that started this worker is gone: exiting")
        os._exit(1)


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def process_alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = start_time(pid)
    return started is None or now is None or now == started


def describe(holder: dict) -> str:
    job = f", SLURM job {holder['job']}" if holder.get("job") else ""
    return f"host {holder.get('host')}, PID {holder.get('pid')}{job}"


class RunLock:
    """The lock of one run's training (a context manager)."""

    def __init__(self, path: Path, wait_s: float = 180.0, poll_s: float = 1.0):
        self.path = Path(path)
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.token = f"{host_name()}:{os.getpid()}:{time.time_ns()}"
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def _mine(self) -> dict:
        return {
            "host": host_name(),
            "pid": os.getpid(),
            "pid_started": start_time(os.getpid()),
            "job": os.environ.get("SLURM_JOB_ID"),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "token": self.token,
        }

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self._mine(), f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def holder(self) -> tuple[dict | None, float | None]:
        """(the holder's record, seconds since its last heartbeat); (None, None): free."""
        try:
            age = time.time() - self.path.stat().st_mtime
            text = self.path.read_text()
        except FileNotFoundError:
            return None, None
        try:
            return json.loads(text), age
        except json.JSONDecodeError:  # being written right now
            return {}, age

    def stale(self, holder: dict, age: float) -> str | None:
        """Why the holder no longer holds the lock (None: it does)."""
        if holder.get("host") == host_name() and isinstance(holder.get("pid"), int):
            if not process_alive(holder["pid"], holder.get("pid_started")):
                return f"its process {holder['pid']} is gone"
            return None
        if age > STALE_S:
            return f"no heartbeat for {age:.0f}s"
        return None

    def _take_over(self, holder: dict, why: str) -> None:
        """Move the stale lock aside (then O_EXCL decides who takes it). Should another
        taker have replaced it in between, the lock moved aside is theirs: put it back."""
        log.warning("run lock %s: taking it over from %s (%s)", self.path, describe(holder), why)
        aside = self.path.with_name(f"{self.path.name}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            moved = json.loads(aside.read_text())
        except (OSError, json.JSONDecodeError):
            moved = {}
        if moved != holder:
            with contextlib.suppress(FileExistsError, OSError):
                os.link(aside, self.path)  # back in place, unless a lock exists again
        aside.unlink(missing_ok=True)

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.wait_s
        waited = False
        while not self._try_create():
            holder, age = self.holder()
            if holder is None:
                continue  # released between our two calls
            why = self.stale(holder, age)  # an unreadable record goes stale by its age
            if why:
                self._take_over(holder, why)
                continue
            if time.monotonic() >= deadline:
                raise UserError(
                    f"{self.path.parent} is in use by another training of this run "
                    f"({describe(holder)}, since {holder.get('since')}); let it finish or stop "
                    f"it, then rerun (waited {self.wait_s:.0f}s for it)"
                )
            if not waited:
                log.warning(
                    "run lock %s is held by %s: waiting up to %.0fs",
                    self.path,
                    describe(holder),
                    self.wait_s,
                )
                waited = True
            time.sleep(self.poll_s)
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="run-lock", daemon=True)
        self._beat.start()
        log.info("run lock %s taken (%s)", self.path, describe(self._mine()))

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                now = time.time()
                os.utime(self.path, (now, now))

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        holder, _ = self.holder()
        if holder and holder.get("token") == self.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
