"""Every attempt of a run's training keeps its own log.

Snakemake empties a rule's log (``logs/train/<run>.log``) before each attempt, so a retry,
a requeue or the next invocation would erase what explained the failure before it. Each
start of the train job (an *attempt*) therefore also writes everything it prints (the
launcher, srun, torchrun, every rank) to ``results/<run>/train/logs/attempt-<n>.log``,
which nothing deletes, and records how it began and ended in ``logs/attempts.jsonl``
(exit code and the one-line reason). The rule's log names this attempt's file and the
earlier ones, and ends with every attempt's outcome; provenance and the report list them.

The copy is made by ``tee`` (a process of its own, deaf to the signals that stop a job, so
it keeps what the ranks print while they save): the job's stdout and stderr go into a pipe
that it copies to the attempt's file and to the rule's log.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from snaketune.core.errors import UserError
from snaketune.core.io import host_name
from snaketune.core.redact import redact, secret_values
from snaketune.core.runlock import start_time
from snaketune.plan.pipeline import TRAIN
from snaketune.train.attemptlog import (
    LOGS,
    RECORDS,
    attempt_log,
    describe,
    live_progress,
    logs_dir,
    read_attempts,
    root_cause,
)
from snaketune.train.segments import slurm_restarts

log = logging.getLogger(__name__)

# Set by the Snakefile in a Snakemake that runs a cluster job (remote mode): that job starts
# the train rule once, its retries are the submitting Snakemake's (new jobs).
ONE_START_PER_JOB = "SNAKETUNE_ONE_START_PER_JOB"
LISTED = 20  # attempts the rule's log lists (the newest; attempts.jsonl has them all)
# Signals a job's processes get when it is stopped, ended or requeued: the copy outlives them.
DEAF_TO = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def one_start_per_job(job_side: bool) -> None:
    """Called by the Snakefile: in a Snakemake that runs a cluster job (``job_side``), the
    train jobs it starts refuse a second start of their run inside the same job."""
    if job_side:
        os.environ[ONE_START_PER_JOB] = "1"


def claim(out: Path) -> int:
    """The next attempt number, its log file created (O_EXCL: two jobs starting at once get
    two numbers)."""
    folder = logs_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    taken = [
        int(p.stem.split("-")[1])
        for p in folder.glob("attempt-*.log")
        if p.stem.split("-")[1].isdigit()
    ]
    number = max(taken, default=0) + 1
    while True:
        try:
            os.close(os.open(attempt_log(out, number), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return number
        except FileExistsError:
            number += 1


def _append(out: Path, record: dict) -> None:
    try:
        with open(logs_dir(out) / RECORDS, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as exc:  # a full disk: the job's own outcome is what to report
        log.warning("could not record attempt %s in %s: %s", record["attempt"], RECORDS, exc)


def _deaf() -> None:
    """preexec_fn of the copying process: ignore the signals that stop a job (ignored
    signals stay ignored across exec)."""
    for name in DEAF_TO:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


class Pace:
    """When the training's progress is said on the job's output: its first line with an
    ETA as soon as there is one (however long the start took), then a line every ``every``
    seconds; a line without an ETA before that only once ``every`` seconds have passed."""

    def __init__(self, every: float, began: float):
        self.every, self.began = every, began
        self.said, self.last, self.eta_said = -math.inf, None, False

    def reading(self, now: float) -> bool:
        """Whether to read the live metrics now (until the first ETA, at each beat)."""
        return not self.eta_said or now - self.said >= self.every

    def due(self, line: str | None, now: float) -> bool:
        new = line is not None and line != self.last
        self.last = line
        if not new:
            return False
        eta = "ETA" in line
        if (eta and not self.eta_said) or (
            now - self.said >= self.every and (self.eta_said or now - self.began >= self.every)
        ):
            self.said, self.eta_said = now, self.eta_said or eta
            return True
        return False


class _LastWarning(logging.Handler):
    """The newest warning or error the launcher logged: the reason of an attempt that
    ended without a UserError."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.message: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.message = record.getMessage().splitlines()[0][:300]


class Attempt:
    """This start of a run's train job (or of another stage through the launcher: the
    reference log-probs): its number and log, the copy of everything the job prints into
    that log, and its start and end records."""

    def __init__(
        self,
        out: Path,
        announce_fd: int | None = None,
        copy_output: bool = True,
        stage: str = TRAIN.name,
        name: str | None = None,
    ):
        # ``out``: the stage's output folder (results/<run>/train: the run is its parent);
        # ``stage`` and ``name``: the rule and what it works on, as the log names them
        self.out, self.stage = out, stage
        self.name = name or f"run {out.parent.name}"
        self.number = claim(out)
        self.path = attempt_log(out, self.number)
        self.began = time.time()
        self.earlier = read_attempts(out)
        self._tee: subprocess.Popen | None = None
        self._saved: tuple[int, int] | None = None
        self.restart = slurm_restarts()  # which run of its SLURM job this is (0 off SLURM)
        self._ended = threading.Event()
        self._live: Path | None = None  # the live metrics report_progress reads
        self.last_warning = _LastWarning()
        self._announce(announce_fd)
        if copy_output:
            self._copy_output()
        logging.getLogger().addHandler(self.last_warning)
        _append(
            out,
            {
                "attempt": self.number,
                "log": str(self.path.relative_to(out)),
                "began": round(self.began, 3),
                "host": host_name(),
                "pid": os.getpid(),
                "pid_started": start_time(os.getpid()),
                "job": os.environ.get("SLURM_JOB_ID"),
                "restart": self.restart,
            },
        )
        self._header()

    def refuse_second_start(self) -> None:
        """On the job side of a cluster job (the Snakefile sets ONE_START_PER_JOB there), a
        second start of the run in the same run of the same SLURM job: refused, one line.
        Retries are the submitting Snakemake's, each a new job that resumes."""
        job = os.environ.get("SLURM_JOB_ID")
        if not job or os.environ.get(ONE_START_PER_JOB) != "1":
            return
        same = [a for a in self.earlier if a.get("job") == job and a.get("restart") == self.restart]
        if same:
            first = same[0]
            raise UserError(
                f"{self.out}: attempt {first['attempt']} of this run already started in this "
                f"run of SLURM job {job} ({first.get('reason') or 'no outcome'}); a second "
                "start inside one job is refused: the workflow retries a failed train job as "
                "a new SLURM job, which resumes from the newest checkpoint "
                f"({LOGS}/attempt-{first['attempt']}.log has what happened)"
            )

    def _announce(self, fd: int | None) -> None:
        """One line on the job's own output (on SLURM, the job's stdout file; locally,
        Snakemake's terminal): where this attempt's log is. The fd stays open for ``say``."""
        self._terminal = fd
        self.say(f"attempt {self.number}, its log: {self.path}")

    def report_progress(self, live: Path, every_s: float | None = None) -> None:
        """Every ``every_s`` seconds (SNAKETUNE_PROGRESS_S; 60 by default) while the job
        runs, the training's newest step on the job's own output (``live``: its live
        metrics), so the terminal shows a training move without its whole log."""
        every = float(os.environ.get("SNAKETUNE_PROGRESS_S", 60) if every_s is None else every_s)
        if self._terminal is None or every <= 0:
            return
        self._live = live

        def beat() -> None:
            pace = Pace(every, time.monotonic())
            while not self._ended.wait(min(every, 2.0)):
                if not pace.reading(time.monotonic()):
                    continue
                try:
                    line = live_progress(live)
                except (OSError, ValueError):  # a file moved or torn: the next beat reads it
                    continue
                if pace.due(line, time.monotonic()):
                    self.say(line)

        threading.Thread(target=beat, daemon=True, name="progress").start()

    def say(self, text: str) -> None:
        """A line on the job's own output (the terminal, locally), naming the stage."""
        if self._terminal is None:
            return
        what = self.name.removeprefix("run ")
        with contextlib.suppress(OSError):
            os.write(self._terminal, f"snaketune: {self.stage} {what}: {text}\n".encode())

    def _copy_output(self) -> None:
        """stdout and stderr (this process's and every child's) into a pipe that ``tee``
        copies to the attempt's log and to where they went before."""
        tee = shutil.which("tee")
        if tee is None:
            log.warning("no tee on this host: this attempt's output is only in the rule's log")
            return
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        self._tee = subprocess.Popen(
            [tee, "-a", str(self.path)],
            stdin=read,
            stdout=1,
            stderr=subprocess.DEVNULL,
            preexec_fn=_deaf,
            start_new_session=True,
        )
        os.close(read)
        self._saved = (os.dup(1), os.dup(2))
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        with contextlib.suppress(AttributeError, ValueError):
            sys.stdout.reconfigure(line_buffering=True)
        atexit.register(self._close_copy)

    def _close_copy(self, wait_s: float = 10.0) -> None:
        """At exit: the pipe closed on this side, the copy waited for (it ends once every
        process that printed into it has)."""
        if self._tee is None or self._saved is None:
            return
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._tee.wait(timeout=wait_s)
        self._tee = None

    def _root_cause(self) -> str | None:
        """The failed rank named in this attempt's log (the copy may lag the job by a moment)."""
        for _ in range(10):
            try:
                cause = root_cause(self.path.read_text(errors="replace"))
            except OSError:
                return None
            if cause:
                return cause
            time.sleep(0.2)
        return None

    def _header(self) -> None:
        log.info(
            "%s attempt %d of %s; its full log: %s", self.stage, self.number, self.name, self.path
        )
        if self.earlier:
            names = ", ".join(f"attempt-{a['attempt']}.log" for a in self.earlier[-LISTED:])
            log.info("earlier attempts' logs (in %s): %s", logs_dir(self.out), names)

    def finish(self, code: int, reason: str | None = None) -> None:
        """Record how this attempt ended and print every attempt's outcome (the rule log's
        last lines)."""
        if reason is None:
            reason = self.last_warning.message or f"exit {code}"
            cause = self._root_cause() if code != 0 else None
            if cause:
                reason += f" ({cause})"
        logging.getLogger().removeHandler(self.last_warning)
        self._ended.set()
        reason = redact(reason, secret_values())  # as every log line is (snaketune.core.redact)
        if code != 0:
            self.say(f"{'' if code == 3 else 'failed: '}{reason} (its log: {self.path})")
        elif self._live is not None and (line := live_progress(self._live)):
            self.say(f"done: {line.split(', ETA')[0]}")
        _append(
            self.out,
            {
                "attempt": self.number,
                "ended": round(time.time(), 3),
                "exit": code,
                "reason": reason,
            },
        )
        attempts = read_attempts(self.out)
        lines = [describe(a) for a in attempts[-LISTED:]]
        skipped = len(attempts) - len(lines)
        print(
            f"attempts of {self.name} (logs in {logs_dir(self.out)}"
            + (f"; {skipped} older in {RECORDS}" if skipped else "")
            + "):",
            *(f"  {line}" for line in lines),
            sep="\n",
            file=sys.stderr,
            flush=True,
        )


def done(step: int | None) -> str:
    """The reason of an attempt that finished the run."""
    return f"done at step {step}"
