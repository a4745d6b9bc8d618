"""Name the rank that stalls: per-rank heartbeats and the launcher's watch over them.

Each worker keeps where it is (step, phase: data, forward, backward, optimizer, step end,
save) in a few Python attributes, set by hooks on the model and a TrainerCallback
(snaketune.train.progress.HeartbeatCallback; this module imports no ML library, as the launcher
reads it): no file
write, no host sync in the step. A daemon thread writes them to
``<checkpoints>/heartbeat/rank-<r>.json`` every ``INTERVAL_S`` seconds, with a counter of
the moves made. A rank stopped whole (SIGSTOP, a frozen node) writes nothing; a rank stuck
in a collective or on its GPU writes the same counter again.

The launcher (``StallWatch``) reads every rank's file and notes, on its own clock, when each
file was last rewritten and when its counter last moved (no clock of another host is
trusted). A rank is named when, for the run's ``timeout_minutes``, either its file was not
rewritten while another rank's was (the whole process is stopped: SIGSTOP, a frozen node;
the ranks waiting for it in a collective still write), or it made no move while another
rank moved after it or stands further on (stuck inside a step while its thread runs: the
others reached the collective it never joined). That rank is the one the others wait for:
one line names it, its host, pid, step and phase, the verdict goes to
``<checkpoints>/health/stall.json``, and the local launcher ends the job at once (the ranks
waiting for it would otherwise time out one by one). On SLURM, the collective timeouts end
the step (``--kill-on-bad-exit``) and the line names the rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from snaketune.core.io import host_name

log = logging.getLogger(__name__)

INTERVAL_S = 1.0  # how often each rank writes its heartbeat
POLL_S = 2.0  # how often the launcher reads them
FOLDER = "heartbeat"
STALL = "stall.json"  # <checkpoints>/health/stall.json: the verdict, for the launcher's outcome


class Heartbeat:
    """This rank's position, written by a daemon thread (see the module's docstring)."""

    def __init__(self, folder: Path, rank: int, node: int):
        self.path = folder / f"rank-{rank}.json"
        self.fixed = {"rank": rank, "node": node, "host": host_name(), "pid": os.getpid()}
        self.step, self.phase, self.moves, self.beats = 0, "start", 0, 0
        self._stop = threading.Event()
        # the daemon's beat and the worker's last write (its "done") share the file and its
        # .tmp: one writer at a time, or one's rename finds the other's .tmp already moved
        self._writing = threading.Lock()
        folder.mkdir(parents=True, exist_ok=True)

    def move(self, phase: str, step: int | None = None) -> None:
        """The hot path: three attribute writes."""
        if step is not None:
            self.step = step
        self.phase = phase
        self.moves += 1

    def write(self) -> None:
        with self._writing:
            self.beats += 1
            record = {
                **self.fixed,
                "step": self.step,
                "phase": self.phase,
                "moves": self.moves,
                "beats": self.beats,
            }
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            with contextlib.suppress(OSError):  # a full disk: the watch just sees no move
                self.write()

    def start(self, model=None) -> Heartbeat:
        """Start writing; with ``model``, forward hooks mark the forward and backward."""
        if model is not None:
            self.watch(model)
        self.write()
        threading.Thread(target=self._run, name="heartbeat", daemon=True).start()
        return self

    def watch(self, model) -> None:
        """Forward hooks on ``model`` mark each forward pass and its end."""
        model.register_forward_pre_hook(lambda *_: self.move("forward"))
        model.register_forward_hook(lambda *_: self.move("backward"))

    def stop(self) -> None:
        self._stop.set()


# The order of a step's phases (progress.HeartbeatCallback, the model's hooks), to tell which of
# two ranks seen moving at the same poll stands further on.
# A worker whose share is done (the reference stage's workers end one by one): never named.
DONE = "done"
PHASES = ("start", "data", "forward", "backward", "optimizer", "save", "step end", "outputs", DONE)


@dataclass(frozen=True)
class Seen:
    """A rank's last heartbeat and when, on the watch's clock, its move counter and its
    write counter last changed."""

    record: dict
    moved: float
    beat: float

    @property
    def position(self) -> tuple[int, int]:
        phase = self.record["phase"]
        return self.record["step"], PHASES.index(phase) if phase in PHASES else 0


class StallWatch:
    """The launcher's reader of every rank's heartbeat (a daemon thread)."""

    def __init__(self, ckpt_dir: Path, limit_s: float):
        self.folder, self.limit_s = ckpt_dir / FOLDER, limit_s
        self.verdict_path = ckpt_dir / "health" / STALL
        self.seen: dict[int, Seen] = {}
        self.verdict: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def start(self) -> StallWatch:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)  # an earlier job's ranks
        self.verdict_path.unlink(missing_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def read(self, now: float) -> None:
        for path in self.folder.glob("rank-*.json"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):  # being replaced right now
                continue
            before = self.seen.get(record["rank"])
            if before is None or before.record["pid"] != record["pid"]:
                self.seen[record["rank"]] = Seen(record, now, now)
                continue
            moved = now if before.record["moves"] != record["moves"] else before.moved
            beat = now if before.record.get("beats") != record.get("beats") else before.beat
            self.seen[record["rank"]] = Seen(record, moved, beat)

    def judge(self, now: float) -> str | None:
        """The line naming the stalled rank, or None."""
        if len(self.seen) < 2:
            return None
        # A rank stopped whole: its file stopped while another rank's is still rewritten (a
        # rank done training stops writing on purpose)
        writing = {r for r, s in self.seen.items() if now - s.beat < self.limit_s}
        frozen = [
            r
            for r, s in self.seen.items()
            if r not in writing and s.record["phase"] not in ("outputs", DONE)
        ]
        if frozen and writing:
            rank = min(frozen, key=lambda r: self.seen[r].beat)
            return self._line(rank, now, len(self.seen) - len(frozen))
        # A rank stuck inside a step: others moved after it or stand further on
        working = {r: s for r, s in self.seen.items() if s.record["phase"] != DONE}
        if not working:
            return None
        rank, behind = min(working.items(), key=lambda kv: (kv[1].moved, kv[1].position))
        if now - behind.moved < self.limit_s:
            return None
        ahead = [
            r
            for r, s in self.seen.items()
            if r != rank and (s.moved > behind.moved or s.position > behind.position)
        ]
        return self._line(rank, now, len(ahead)) if ahead else None

    def _line(self, rank: int, now: float, waiting: int) -> str:
        seen = self.seen[rank]
        record = seen.record
        wait = f"{waiting} ranks wait" if waiting != 1 else "1 rank waits"
        return (
            f"rank {rank} on {record['host']} (pid {record['pid']}) made no progress for "
            f"{now - seen.moved:.0f} s in step {record['step']} ({record['phase']}); "
            f"{wait} for it"
        )

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            now = time.monotonic()
            self.read(now)
            verdict = self.judge(now)
            if verdict and self.verdict is None:
                self.verdict = verdict
                log.error("stalled: %s", verdict)
                self.verdict_path.parent.mkdir(parents=True, exist_ok=True)
                self.verdict_path.write_text(json.dumps({"message": verdict}) + "\n")


def stall_verdict(ckpt_dir: Path) -> str | None:
    """The verdict a watch wrote in this job, if any."""
    path = ckpt_dir / "health" / STALL
    if not path.is_file():
        return None
    return json.loads(path.read_text())["message"]
