"""The one launcher of every multi-process stage: torchrun agents and their supervision.

The train job (snaketune.train.launch) and the reference log-probs stage
(scripts/reference_logps.py) start their workers here (``start``, a ``Workers``), the same
way: the launcher chosen, a preflight on SLURM, the stall watch over the workers'
heartbeats (snaketune.core.heartbeat), a dead rank taking the others down, signals passed on,
one exit code.

Two ways to start ``nodes`` x ``gpus_per_node`` workers, both with torchrun's c10d
rendezvous (node ranks are assigned in arrival order; workers read GROUP_RANK, RANK and
WORLD_SIZE):

- local: ``nodes`` torchrun agents on this machine, rendezvous on 127.0.0.1 (emulated
  nodes; gloo on CPU). This process supervises them (``supervise``): the first agent that
  fails takes the others down, so a dead rank ends the job instead of hanging it.
- slurm: one ``srun`` task per node, each a torchrun agent whose rendezvous endpoint is
  the first host of the allocation, port derived from the job id;
  ``--kill-on-bad-exit=1`` makes SLURM end the step when one task fails. A preflight step
  checks every node first (snaketune.train.preflight).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from snaketune.core.cache import extensions_dir
from snaketune.core.errors import UserError
from snaketune.core.heartbeat import StallWatch
from snaketune.core.runlock import die_with_parent
from snaketune.plan.pipeline import TRAIN
from snaketune.train.commands import (
    free_port,
    local_commands,
    preflight_command,
    slurm_command,
)

log = logging.getLogger(__name__)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class _Agents:
    """The running agents: what supervise watches and stops."""

    def __init__(self, commands: list[list[str]], env: dict[str, str]):
        self.procs = [
            subprocess.Popen(c, env=env, start_new_session=True, preexec_fn=die_with_parent)
            for c in commands
        ]
        self.forwarded: list[str] = []

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                _signal_group(p, sig)

    def forward(self, signum, _frame) -> None:
        """A signal to this process: passed on to every agent (they forward it to their
        workers, which checkpoint before stopping). A second Ctrl-C (SIGINT) stops them at
        once, without the save."""
        name = signal.Signals(signum).name
        if name == "SIGINT" and "SIGINT" in self.forwarded:
            log.warning("a second Ctrl-C: stopping the training processes now, without saving")
            self.signal_all(signal.SIGKILL)
            return
        self.forwarded.append(name)
        if name == "SIGINT":
            log.warning(
                "Ctrl-C: the training saves a checkpoint at the end of this step, then "
                "stops (a second Ctrl-C stops it at once, without saving)"
            )
        else:
            log.warning("received %s: passing it on to the training processes", name)
        self.signal_all(signum)


def supervise(
    commands: list[list[str]],
    env: dict[str, str],
    grace: float = 150.0,
    stalled: Callable[[], bool] = lambda: False,
) -> tuple[int, str | None]:
    """Run the agents; return (exit code, name of the signal passed on, if any).

    The code is 0 when all agents succeed, else the first failure's exit code.

    The first agent to fail makes the others stop (SIGTERM, then SIGKILL after ``grace``
    seconds). When ``stalled()`` says a rank stopped making progress, every agent is killed
    at once (SIGKILL; their workers die with them): the stalled rank would not act on
    SIGTERM, and the ranks waiting for it would only time out one by one.

    SIGTERM, SIGINT and SIGUSR1 sent to this process are passed on to every
    agent, which forward them to their workers (so they checkpoint before stopping).
    """
    agents = _Agents(commands, env)
    log.info(
        "started %d torchrun agents (pids %s)", len(agents.procs), [p.pid for p in agents.procs]
    )
    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    previous = {s: signal.signal(s, agents.forward) for s in handled}
    try:
        failed = _watch(agents, grace, stalled)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    signalled = agents.forwarded[0] if agents.forwarded else None
    if failed is None:
        return 0, signalled
    return (failed if failed > 0 else 128 - failed), signalled  # killed by signal N: 128 + N


def _watch(agents: _Agents, grace: float, stalled: Callable[[], bool]) -> int | None:
    """Poll the agents until all have exited; the first failure's code (None: none)."""
    failed: int | None = None
    deadline = None
    killed = False
    while True:
        codes = [p.poll() for p in agents.procs]
        if not killed and stalled():
            killed, failed = True, failed or 1
            agents.signal_all(signal.SIGKILL)
        if failed is None:
            bad = [c for c in codes if c not in (None, 0)]
            if bad:
                failed = bad[0]
                said = log.info if agents.forwarded else log.error  # a stop asked for
                said("a torchrun agent exited with code %s: stopping the others", failed)
                agents.signal_all(signal.SIGTERM)
                deadline = time.monotonic() + grace
        if all(c is not None for c in codes):
            return failed
        if deadline is not None and time.monotonic() > deadline:
            agents.signal_all(signal.SIGKILL)
            deadline = None
        time.sleep(0.2)


@dataclass(frozen=True)
class Workers:
    """``nodes`` x ``gpus_per_node`` processes of one command, for ``start``."""

    argv: list[str]  # the worker's command line (a script and its arguments)
    nodes: int
    gpus_per_node: int
    run_id: str  # the rendezvous id
    rule: str  # the Snakemake rule that runs the stage (named in its messages)
    out: Path  # the stage's output folder: the preflight's results go under it
    watched: Path  # the folder whose heartbeat/ the stall watch reads (verdict in health/)
    timeout_s: float  # a rank that makes no progress this long is named, the job ended
    launcher: str = "auto"  # auto, local or slurm


def choose_launcher(launcher: str, nodes: int, rule: str = TRAIN.name) -> str:
    """local or slurm: slurm inside a SLURM job with srun, unless already one srun task."""
    in_step = bool(os.environ.get("SLURM_STEP_ID"))  # already one task of an srun step
    if launcher == "auto":
        in_job = os.environ.get("SLURM_JOB_ID") and shutil.which("srun")
        launcher = "slurm" if in_job and not (in_step and nodes == 1) else "local"
    if launcher == "slurm" and in_step:
        raise UserError(
            f"{rule} with nodes: {nodes} runs inside a single-task SLURM step, which cannot "
            f"start tasks on other nodes; the {rule} rule must keep its `mpi` resource "
            "(check that the profile's set-resources do not remove it)"
        )
    return launcher


def worker_environment() -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    # this environment's own op builds (snaketune.core.cache.extensions_dir), by its own
    # ninja: two ninja versions (pip's, the system's) cannot read each other's build log,
    # and each rebuilt the op the other had built
    env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    own_bin = str(Path(sys.executable).parent)
    if env.get("PATH", "").split(os.pathsep)[0] != own_bin:
        env["PATH"] = os.pathsep.join([own_bin, env.get("PATH", "")])
    return env


def flight_recorder_dir(run: str) -> Path:
    """Where NCCL's flight recorder dumps each rank's last collectives on a timeout: the
    run's log folder, logs/train/<run>/flight_recorder/rank_<r>."""
    return Path("logs/train").resolve() / run / "flight_recorder"


def flight_recorder(run: str) -> dict[str, str]:
    """PyTorch's flight recorder on GPU (NCCL): the last 2000 collectives of every rank kept,
    dumped when a collective times out. Off on CPU: torch 2.13's gloo records nothing on a
    timeout to dump (docs/reliability.md); the heartbeats name the rank there."""
    from snaketune.train.preflight import cuda_available

    if not cuda_available():
        return {}
    folder = flight_recorder_dir(run)
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{folder}/rank_",
    }


def run_preflight(out: Path, nodes: int, gpus: int, env: dict[str, str]) -> None:
    """On every node before any compute: devices, shared run directory, rendezvous host and
    port. One line and exit 2 on a problem."""
    from snaketune.train.preflight import gather

    shutil.rmtree(out / "preflight", ignore_errors=True)
    step = subprocess.run(preflight_command(nodes, gpus, str(out.resolve())), env=env)
    if step.returncode != 0:  # its tasks always exit 0: srun itself failed
        raise UserError(
            f"preflight: the srun step failed (exit {step.returncode}) before every node "
            "reported; see srun's message above in this log"
        )
    summary = gather(out, nodes)
    log.info(
        "preflight passed: %s",
        "; ".join(
            f"{r['host']}: {r['devices']['count']} devices ({r['devices']['kind']}), "
            f"rendezvous {r.get('head_address')}"
            for r in summary["results"].values()
        ),
    )


def start(workers: Workers, env: dict[str, str]) -> tuple[int, str | None]:
    """Run the workers to the end: (exit code, the signal passed on to them, if any)."""
    w = workers
    launcher = choose_launcher(w.launcher, w.nodes, w.rule)
    log.info(
        "launching %d node(s) x %d process(es) with the %s launcher",
        w.nodes,
        w.gpus_per_node,
        launcher,
    )
    watch = StallWatch(w.watched, w.timeout_s).start()
    try:
        return run_workers(w, launcher, env, watch)
    finally:
        watch.stop()


def wait_policy(env: dict[str, str], ranks: int, cores: int) -> None:
    """OpenMP threads that sleep while they wait (``OMP_WAIT_POLICY=PASSIVE``) where the
    ranks' threads are more than the cores: a rank's threads spinning at a collective would
    take the cores from the ranks it waits for (the tests' emulated nodes; the same sums in
    the same order, no figure changes: docs/benchmarks.md, "Ranks sharing cores"). Where
    each thread has its own core they spin (OpenMP's default): sleeping costs each parallel
    region a wake-up (docs/benchmarks.md, "Training overhead"). The environment's own
    setting wins."""
    threads = ranks * max(1, int(env.get("OMP_NUM_THREADS") or 1))
    if threads > cores:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run_workers(
    workers: Workers, launcher: str, env: dict[str, str], watch: StallWatch
) -> tuple[int, str | None]:
    nodes, gpus = workers.nodes, workers.gpus_per_node
    if launcher == "local":
        # Every emulated node's workers share this machine's cores: one thread pool each
        # of all cores would oversubscribe them (torchrun sets 1 only for 2+ per node).
        cores = len(os.sched_getaffinity(0))
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // (nodes * gpus))))
        wait_policy(env, nodes * gpus, cores)
        commands = local_commands(nodes, gpus, workers.argv, workers.run_id, free_port())
        return supervise(commands, env, stalled=lambda: watch.verdict is not None)
    run_preflight(workers.out, nodes, gpus, env)
    command = slurm_command(nodes, gpus, workers.argv, workers.run_id)
    # SLURM signals the step's tasks itself (scancel, time limit, preemption, --signal) and
    # srun forwards what it gets: here the signal is only noted, and srun waited for.
    got: list[str] = []

    def note(signum, _frame):
        got.append(signal.Signals(signum).name)

    previous = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        proc = subprocess.Popen(command, env=env, preexec_fn=die_with_parent)
        while proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return proc.returncode, got[0] if got else None
