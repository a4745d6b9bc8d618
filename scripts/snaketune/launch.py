"""Build and supervise the multi-node launch of the training workers.

Two ways to start ``nodes`` x ``gpus_per_node`` workers, both with torchrun's c10d
rendezvous (node ranks are assigned in arrival order; workers read GROUP_RANK):

- local: ``nodes`` torchrun agents on this machine, rendezvous on 127.0.0.1 (emulated
  nodes; gloo on CPU). This process supervises them: the first agent that fails takes
  the others down, so a dead rank ends the job instead of hanging it.
- slurm: one ``srun`` task per node, each a torchrun agent whose rendezvous endpoint is
  the first host of the allocation, port derived from the job id;
  ``--kill-on-bad-exit=1`` makes SLURM end the step when one task fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

# Signals the agents forward to the workers: SIGTERM (scancel, time limit) and SIGUSR1
# (SLURM's warning before the time limit, --signal=USR1@...) make workers checkpoint.
FORWARDED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
PORT_BASE = 29500


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_args(
    nodes: int, gpus_per_node: int, endpoint: str, run_id: str, shutdown_timeout: int
) -> list[str]:
    """torchrun options shared by both launchers."""
    return [
        "--nnodes", str(nodes),
        "--nproc-per-node", str(gpus_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", run_id,
        "--max-restarts", "0",
        "--monitor-interval", "1",
        "--signals-to-handle", FORWARDED,
        "--shutdown-timeout", str(shutdown_timeout),
    ]  # fmt: skip


def local_commands(
    nodes: int,
    gpus_per_node: int,
    worker: Sequence[str],
    run_id: str,
    port: int,
    shutdown_timeout: int = 120,
) -> list[list[str]]:
    """One torchrun agent per emulated node, all on this machine."""
    args = torchrun_args(nodes, gpus_per_node, f"127.0.0.1:{port}", run_id, shutdown_timeout)
    return [[sys.executable, "-m", "torch.distributed.run", *args, *worker] for _ in range(nodes)]


# Inside an srun task (where SLURM_JOB_NODELIST is back): the rendezvous host and port, and
# whether this task hosts the rendezvous store. The first node of the step hosts it, told
# explicitly (torchrun's own guess compares host names, which fails when the node name is
# not the machine's hostname, and then every agent waits for a store nobody started).
RENDEZVOUS = (
    'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1); '
    f"PORT=$(( {PORT_BASE} + SLURM_JOB_ID % 10000 )); "
    'IS_HOST=$([ "$SLURM_NODEID" = 0 ] && echo 1 || echo 0); '
)
# Arguments the task's shell expands (every other argument is quoted as it is).
EXPANDED = {"$HEAD:$PORT", "$HEAD", "$PORT", "is_host=$IS_HOST"}


def _srun(nodes: int, program: Sequence[str]) -> list[str]:
    """One task per node running ``program`` (``$HEAD``/``$PORT`` left for the shell)."""
    inner = RENDEZVOUS + "exec " + " ".join(a if a in EXPANDED else shlex.quote(a) for a in program)
    return [
        "srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
        "--kill-on-bad-exit=1", "bash", "-c", inner,
    ]  # fmt: skip


def slurm_command(
    nodes: int, gpus_per_node: int, worker: Sequence[str], run_id: str, shutdown_timeout: int = 120
) -> list[str]:
    """One srun step with a torchrun agent per node.

    The SLURM executor plugin strips SLURM_JOB_NODELIST from the job's shell; inside the
    srun tasks it is back, so the rendezvous host is looked up there.
    """
    args = torchrun_args(nodes, gpus_per_node, "$HEAD:$PORT", run_id, shutdown_timeout)
    args += ["--rdzv-conf", "is_host=$IS_HOST"]
    return _srun(nodes, [sys.executable, "-m", "torch.distributed.run", *args, *worker])


def preflight_command(nodes: int, gpus_per_node: int, run_dir: str) -> list[str]:
    """The preflight step (snaketune.preflight) on every node of the allocation."""
    return _srun(nodes, [
        sys.executable, "-m", "snaketune.preflight", "--run-dir", run_dir,
        "--gpus-per-node", str(gpus_per_node), "--head", "$HEAD", "--port", "$PORT",
        "--nodes", str(nodes),
    ])  # fmt: skip


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def supervise(
    commands: list[list[str]], env: dict[str, str], grace: float = 150.0
) -> tuple[int, str | None]:
    """Run the agents; return (exit code, name of the signal passed on, if any).

    The code is 0 when all agents succeed, else the first failure's exit code.

    The first agent to fail makes the others stop (SIGTERM, then SIGKILL after ``grace``
    seconds). SIGTERM, SIGINT and SIGUSR1 sent to this process are passed on to every
    agent, which forward them to their workers (so they checkpoint before stopping).
    """
    procs = [subprocess.Popen(c, env=env, start_new_session=True) for c in commands]
    log.info("started %d torchrun agents (pids %s)", len(procs), [p.pid for p in procs])

    forwarded: list[str] = []

    def forward(signum, _frame):
        forwarded.append(signal.Signals(signum).name)
        log.warning(
            "received %s: passing it on to the training processes", signal.Signals(signum).name
        )
        for p in procs:
            if p.poll() is None:
                _signal_group(p, signum)

    previous = {
        s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    }
    failed: int | None = None
    deadline = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if failed is None:
                bad = [c for c in codes if c not in (None, 0)]
                if bad:
                    failed = bad[0]
                    log.error("a torchrun agent exited with code %s: stopping the others", failed)
                    for p, c in zip(procs, codes, strict=True):
                        if c is None:
                            _signal_group(p, signal.SIGTERM)
                    deadline = time.monotonic() + grace
            if all(c is not None for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        _signal_group(p, signal.SIGKILL)
                deadline = None
            time.sleep(0.2)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    signalled = forwarded[0] if forwarded else None
    if failed is None:
        return 0, signalled
    return (failed if failed > 0 else 128 - failed), signalled  # killed by signal N: 128 + N
