"""Build and supervise the multi-node launch of the training workers.

Two ways to start ``nodes`` x ``gpus_per_node`` workers, both with torchrun's c10d
rendezvous (node ranks are assigned in arrival order; workers read GROUP_RANK):

- local: ``nodes`` torchrun agents on this machine, rendezvous on 127.0.0.1 (emulated
  nodes; gloo on CPU). This process supervises them: the first agent that fails takes
  the others down, so a dead rank ends the job instead of hanging it.
- slurm: one ``srun`` task per node, each a torchrun agent whose rendezvous endpoint is
  the first host of the allocation, port derived from the job id;
  ``--kill-on-bad-exit=1`` makes SLURM end the step when one task fails.

``launch_job`` is the whole train job as scripts/train.py runs it: check the job, keep or
set aside the checkpoints, start the workers, read how they ended, publish the outputs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from snaketune.errors import UserError
from snaketune.io import digest, publish, sha256_file, write_json

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


# ----------------------------------------------------------------------------- the train job


@dataclass(frozen=True)
class Job:
    """One train job: the run's spec and where its inputs and outputs are."""

    spec: dict
    shards: Path
    model: Path
    deepspeed: Path
    out: Path
    launcher: str  # auto, local or slurm
    worker_argv: list[str]  # the worker's command line (scripts/train.py --worker ...)

    @property
    def ckpt(self) -> Path:
        return self.out / "checkpoints"


def fingerprint(job: Job) -> str:
    """What a checkpoint must match to be resumed from."""
    return digest(
        {
            "run": job.spec,
            "manifest": sha256_file(job.shards / "manifest.json"),
            "deepspeed": sha256_file(job.deepspeed),
        }
    )


def check_job(job: Job) -> tuple[int, int]:
    """Refuse a job whose shards or settings cannot run; return (nodes, gpus_per_node)."""
    spec = job.spec
    manifest = json.loads((job.shards / "manifest.json").read_text())
    nodes, gpus = manifest["nodes"], manifest["gpus_per_node"]
    if (nodes, gpus) != (spec["nodes"], spec["gpus_per_node"]):
        raise UserError(
            f"{job.shards} was made for {nodes} x {gpus}, the run asks for "
            f"{spec['nodes']} x {spec['gpus_per_node']}; rerun shard_dataset"
        )
    if manifest.get("packing") != spec["packing"]:
        raise UserError(
            f"{job.shards} was planned with packing {manifest.get('packing')}, the run asks "
            f"for {spec['packing']}; rerun shard_dataset"
        )
    if spec["wandb"]["enabled"] and importlib.util.find_spec("wandb") is None:
        raise UserError(
            "wandb.enabled is set but wandb is not installed: pip install wandb, "
            "or set wandb.enabled: false"
        )
    return nodes, gpus


def prepare_checkpoints(job: Job) -> None:
    """Keep the checkpoints a rerun can resume from; move those of other settings aside."""
    job.out.mkdir(parents=True, exist_ok=True)
    stamp, print_ = job.ckpt / "fingerprint", fingerprint(job)
    if job.ckpt.exists() and (not stamp.exists() or stamp.read_text() != print_):
        aside = job.out / f"checkpoints.previous-{print_[:8]}"
        shutil.rmtree(aside, ignore_errors=True)
        job.ckpt.rename(aside)
        log.warning(
            "run settings or shards changed: old checkpoints moved to %s; starting fresh", aside
        )
    job.ckpt.mkdir(exist_ok=True)
    stamp.write_text(print_)
    (job.ckpt / "health" / "fatal.json").unlink(missing_ok=True)  # from an earlier attempt


def choose_launcher(job: Job, nodes: int) -> str:
    """local or slurm: slurm inside a SLURM job with srun, unless already one srun task."""
    in_step = bool(os.environ.get("SLURM_STEP_ID"))  # already one task of an srun step
    launcher = job.launcher
    if launcher == "auto":
        in_job = os.environ.get("SLURM_JOB_ID") and shutil.which("srun")
        launcher = "slurm" if in_job and not (in_step and nodes == 1) else "local"
    if launcher == "slurm" and in_step:
        raise UserError(
            f"train with nodes: {nodes} runs inside a single-task SLURM step, which cannot "
            "start tasks on other nodes; the train rule must keep its `mpi` resource "
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
    return env


def run_preflight(job: Job, nodes: int, gpus: int, env: dict[str, str]) -> None:
    """On every node before any compute: devices, shared run directory, rendezvous host and
    port. One line and exit 2 on a problem."""
    from snaketune.preflight import gather

    shutil.rmtree(job.out / "preflight", ignore_errors=True)
    step = subprocess.run(preflight_command(nodes, gpus, str(job.out.resolve())), env=env)
    if step.returncode != 0:  # its tasks always exit 0: srun itself failed
        raise UserError(
            f"preflight: the srun step failed (exit {step.returncode}) before every node "
            "reported; see srun's message above in this log"
        )
    summary = gather(job.out, nodes)
    log.info(
        "preflight passed: %s",
        "; ".join(
            f"{r['host']}: {r['devices']['count']} devices ({r['devices']['kind']}), "
            f"rendezvous {r.get('head_address')}"
            for r in summary["results"].values()
        ),
    )


def start_workers(job: Job, nodes: int, gpus: int) -> tuple[int, str | None]:
    """Run the workers to the end; (exit code, signal passed on to them, if any)."""
    run_id = f"snaketune-{job.out.parent.name}"
    launcher = choose_launcher(job, nodes)
    env = worker_environment()
    log.info("launching %d node(s) x %d process(es) with the %s launcher", nodes, gpus, launcher)
    if launcher == "local":
        return supervise(local_commands(nodes, gpus, job.worker_argv, run_id, free_port()), env)
    run_preflight(job, nodes, gpus, env)
    command = slurm_command(nodes, gpus, job.worker_argv, run_id)
    return subprocess.run(command, env=env).returncode, None


def outcome(job: Job, code: int, signalled: str | None) -> int | None:
    """The job's exit code when the workers did not finish (None: they did)."""
    from snaketune.train import STOPPED_EXIT_CODE, newest_complete

    if signalled:
        # The agents exit 1 on a forwarded signal whatever their workers did; report the stop.
        saved = newest_complete(job.ckpt)
        log.warning(
            "stopped by %s; newest complete checkpoint: %s; rerun to resume",
            signalled,
            saved.name if saved else "none",
        )
        return STOPPED_EXIT_CODE
    fatal = job.ckpt / "health" / "fatal.json"
    if code != 0 and fatal.is_file():  # torchrun's own exit code is 1 whatever the workers'
        report = json.loads(fatal.read_text())
        saved = newest_complete(job.ckpt)
        raise UserError(
            f"GPU health: {'; '.join(report['messages'])}; stopped at step {report['step']} "
            f"(checkpoint {saved.name if saved else 'none'}); take the node out (e.g. sbatch "
            "--exclude) and rerun to resume"
        )
    if code != 0:
        log.error(
            "training exited with code %d; rerun the rule to resume from the last checkpoint", code
        )
        return code
    return None


def publish_outputs(job: Job) -> None:
    """run_config.json and provenance.json beside the workers' staged outputs, then all of
    them renamed into place at once."""
    import torch

    from snaketune.provenance import output_hashes, record
    from snaketune.train import WORKER_OUTPUTS, staged

    missing = [n for n in WORKER_OUTPUTS if not staged(job.out, n).exists()]
    if missing:
        raise RuntimeError(f"the workers exited 0 without writing {missing}")
    hosts = sorted((job.ckpt / "hosts").glob("node-*"))
    write_json(staged(job.out, "run_config.json"), job.spec)
    outputs = {
        n: sha256_file(staged(job.out, n))
        for n in ("probe.safetensors", "metrics.jsonl", "run_config.json")
    }
    for n, h in output_hashes(staged(job.out, "model")).items():
        outputs[f"model/{n}"] = h
    final = staged(job.out, "final_checkpoint")
    prov = record(
        "train",
        job.out,
        job.spec,
        {"shards": job.shards, "model": job.model, "deepspeed": job.deepspeed},
        outputs,
        hosts={h.name: h.read_text() for h in hosts},
        device="cuda" if torch.cuda.is_available() else "cpu",
        final_checkpoint_bytes=sum(f.stat().st_size for f in final.rglob("*") if f.is_file()),
        shards_manifest_sha256=sha256_file(job.shards / "manifest.json"),
    )
    write_json(staged(job.out, "provenance.json"), prov)
    names = (*WORKER_OUTPUTS, "run_config.json", "provenance.json")
    publish([(staged(job.out, n), job.out / n) for n in names])


def launch_job(job: Job) -> int:
    """The train job: check, keep or set aside checkpoints, run the workers on every node,
    and publish their outputs when all of them finished."""
    nodes, gpus = check_job(job)
    prepare_checkpoints(job)
    code, signalled = start_workers(job, nodes, gpus)
    failed = outcome(job, code, signalled)
    if failed is not None:
        return failed
    publish_outputs(job)
    return 0
