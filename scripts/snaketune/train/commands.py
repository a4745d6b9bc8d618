"""The command lines that start a stage's workers: torchrun's arguments (the c10d
rendezvous, the signals it forwards, its agent), ``nodes`` local agents on emulated nodes,
one ``srun`` task per node on SLURM (its rendezvous on the allocation's first host, a port
from the job id), and the preflight step (snaketune.train.agents runs and supervises them)."""

from __future__ import annotations

import functools
import shlex
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

# Signals the agents forward to the workers: SIGTERM (scancel, time limit) and SIGUSR1
# (SLURM's warning before the time limit, --signal=USR1@...) make workers checkpoint.
FORWARDED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


PORT_BASE = 29500


AGENT = "snaketune.train.torchrun"  # torchrun's main, its stop and shutdown words changed


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
        "--nnodes",
        str(nodes),
        "--nproc-per-node",
        str(gpus_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--max-restarts",
        "0",
        "--monitor-interval",
        "1",
        "--signals-to-handle",
        FORWARDED,
    ] + (
        ["--shutdown-timeout", str(shutdown_timeout)]
        if torchrun_knows("--shutdown-timeout")
        else []
    )


@functools.cache
def torchrun_knows(option: str) -> bool:
    """Whether this torch's torchrun takes ``option`` (--shutdown-timeout came with torch
    2.12: the pinned 2.13 has it; a GPU machine's 2.11 refused the whole launch for it).
    Read from torchrun's source, not by importing torch: that costs the launcher seconds."""
    import importlib.util

    spec = importlib.util.find_spec("torch")  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return False
    run = Path(spec.submodule_search_locations[0]) / "distributed" / "run.py"
    return run.is_file() and f'"{option}"' in run.read_text(encoding="utf-8")


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
    return [[sys.executable, "-m", AGENT, *args, *worker] for _ in range(nodes)]


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
        "srun",
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "bash",
        "-c",
        inner,
    ]


def slurm_command(
    nodes: int, gpus_per_node: int, worker: Sequence[str], run_id: str, shutdown_timeout: int = 120
) -> list[str]:
    """One srun step with a torchrun agent per node.

    The SLURM executor plugin strips SLURM_JOB_NODELIST from the job's shell; inside the
    srun tasks it is back, so the rendezvous host is looked up there.
    """
    args = torchrun_args(nodes, gpus_per_node, "$HEAD:$PORT", run_id, shutdown_timeout)
    args += ["--rdzv-conf", "is_host=$IS_HOST"]
    return _srun(nodes, [sys.executable, "-m", AGENT, *args, *worker])


def preflight_command(nodes: int, gpus_per_node: int, run_dir: str) -> list[str]:
    """The preflight step (snaketune.train.preflight) on every node of the allocation."""
    return _srun(
        nodes,
        [
            sys.executable,
            "-m",
            "snaketune.train.preflight",
            "--run-dir",
            run_dir,
            "--gpus-per-node",
            str(gpus_per_node),
            "--head",
            "$HEAD",
            "--port",
            "$PORT",
            "--nodes",
            str(nodes),
        ],
    )
