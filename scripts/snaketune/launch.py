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
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from snaketune.checkpoints import checkpoint_step, newest_complete
from snaketune.errors import UserError
from snaketune.heartbeat import StallWatch, stall_verdict
from snaketune.io import digest, publish, read_jsonl, sha256_file, write_json
from snaketune.network import RESULT as NETWORK
from snaketune.network import read_result
from snaketune.runlock import RunLock, die_with_parent

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
    procs = [
        subprocess.Popen(c, env=env, start_new_session=True, preexec_fn=die_with_parent)
        for c in commands
    ]
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
        killed = False
        while True:
            codes = [p.poll() for p in procs]
            if not killed and stalled():
                killed, failed = True, failed or 1
                for p in procs:
                    if p.poll() is None:
                        _signal_group(p, signal.SIGKILL)
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
    lock_wait_s: float = 180.0  # how long a second training of the run waits for the first
    time_limit_min: float | None = None  # the job's runtime (used where SLURM gives no end)
    stop_margin_s: float = 120.0  # stop this long (plus a step and a save) before the end

    @property
    def ckpt(self) -> Path:
        return self.out / "checkpoints"


def fingerprint(job: Job) -> dict:
    """What a checkpoint must match to be continued from, and the topology it ran on
    (snaketune.topology)."""
    from snaketune.topology import stamp

    manifest = json.loads((job.shards / "manifest.json").read_text())
    return stamp(job.spec, manifest, sha256_file(job.deepspeed))


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


def check_disk(job: Job) -> None:
    """Refuse a run whose checkpoints and outputs do not fit on its filesystem (one line,
    before any worker starts); tell the workers the estimated checkpoint size."""
    import torch

    from snaketune.diskplan import check_job_disk, format_disk

    plan = check_job_disk(job.spec, job.model, job.deepspeed, job.out.parent,
                          torch.cuda.is_available())  # fmt: skip
    if plan is None:
        return
    log.info("disk plan: %s", format_disk(job.out.parent.name, plan))
    os.environ["SNAKETUNE_CHECKPOINT_BYTES"] = str(plan["need_bytes"]["checkpoint"])


def prepare_checkpoints(job: Job) -> None:
    """Keep the checkpoints a rerun continues from (same math, any topology); move those of
    other settings aside, naming what changed."""
    from snaketune.topology import STAMP, changed_keys, describe, read_stamp

    job.out.mkdir(parents=True, exist_ok=True)
    name, now = job.out.parent.name, fingerprint(job)
    old = read_stamp(job.ckpt) if job.ckpt.exists() else None
    saved = newest_complete(job.ckpt) if job.ckpt.exists() else None
    if job.ckpt.exists() and (old is None or old["math"] != now["math"]):
        changed = changed_keys(old["math"], now["math"]) if old else ["no stamp of this version"]
        aside = job.out / f"checkpoints.previous-{digest(old)[:8]}"
        shutil.rmtree(aside, ignore_errors=True)
        job.ckpt.rename(aside)
        log.warning(
            "run settings changed (%s): old checkpoints moved to %s; starting fresh",
            ", ".join(changed[:6]) + (", ..." if len(changed) > 6 else ""),
            aside,
        )
    elif old is not None:  # the same math: continue, on whatever topology
        if saved is not None and old["topology"] != now["topology"]:
            log.warning(
                "continuing %s at step %d on %s (was %s), global batch %d unchanged",
                name, checkpoint_step(saved), describe(now["topology"]),
                describe(old["topology"]), now["math"]["global_batch"],
            )  # fmt: skip
        now["origin"] = old.get("origin", old["topology"])
    job.ckpt.mkdir(exist_ok=True)
    (job.ckpt / STAMP).write_text(json.dumps(now, sort_keys=True, default=str))
    (job.ckpt / "health" / "fatal.json").unlink(missing_ok=True)  # from an earlier attempt


def resume_environment(job: Job, ranks: int) -> dict[str, str]:
    """What the workers need to resume: when the newest complete checkpoint was written by
    another number of data-parallel ranks, its universal form (made here, once) and the
    flag that has DeepSpeed load it."""
    from snaketune.topology import checkpoint_ranks, make_universal

    saved = newest_complete(job.ckpt)
    written = checkpoint_ranks(saved) if saved else None
    if written is None or written == ranks:
        return {}
    began = time.monotonic()
    made = make_universal(saved)
    log.info("%s: ZeRO states of %d ranks turned into %s for %d ranks (%.1f s)",
             saved.name, written, made.name, ranks, time.monotonic() - began)  # fmt: skip
    return {"SNAKETUNE_LOAD_UNIVERSAL": "1"}


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


def flight_recorder_dir(job: Job) -> Path:
    """Where NCCL's flight recorder dumps each rank's last collectives on a timeout: the
    run's log folder, logs/train/<run>/flight_recorder/rank_<r>."""
    return Path("logs/train").resolve() / job.out.parent.name / "flight_recorder"


def flight_recorder(job: Job) -> dict[str, str]:
    """PyTorch's flight recorder on GPU (NCCL): the last 2000 collectives of every rank kept,
    dumped when a collective times out. Off on CPU: torch 2.13's gloo records nothing on a
    timeout to dump (docs/reliability.md); the heartbeats name the rank there."""
    import torch

    if not torch.cuda.is_available():
        return {}
    folder = flight_recorder_dir(job)
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{folder}/rank_",
    }


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


def start_workers(
    job: Job, nodes: int, gpus: int, deadline: float | None = None
) -> tuple[int, str | None]:
    """Run the workers to the end; (exit code, signal passed on to them, if any). With a
    ``deadline`` (epoch seconds) they stop ahead of it at a step end and save."""
    run_id = f"snaketune-{job.out.parent.name}"
    launcher = choose_launcher(job, nodes)
    env = worker_environment()
    env.pop("SNAKETUNE_DEADLINE", None)
    env.pop("SNAKETUNE_LOAD_UNIVERSAL", None)
    env.update(resume_environment(job, nodes * gpus))
    env.update(flight_recorder(job))
    (job.ckpt / NETWORK).unlink(missing_ok=True)  # measured again by this job's workers
    if deadline is not None:
        env["SNAKETUNE_DEADLINE"] = f"{deadline:.0f}"
        env["SNAKETUNE_STOP_MARGIN"] = f"{job.stop_margin_s:.0f}"
        saves = [s["save_s"] for s in read_segments(job) if s.get("save_s")]
        if saves:  # the save time the last job measured
            env["SNAKETUNE_SAVE_S"] = f"{saves[-1]:.1f}"
    log.info("launching %d node(s) x %d process(es) with the %s launcher", nodes, gpus, launcher)
    watch = StallWatch(job.ckpt, job.spec["timeout_minutes"] * 60).start()
    try:
        return run_workers(job, nodes, gpus, launcher, run_id, env, watch)
    finally:
        watch.stop()


def run_workers(
    job: Job, nodes: int, gpus: int, launcher: str, run_id: str, env: dict[str, str],
    watch: StallWatch,
) -> tuple[int, str | None]:  # fmt: skip
    if launcher == "local":
        # Every emulated node's workers share this machine's cores: one thread pool each
        # of all cores would oversubscribe them (torchrun sets 1 only for 2+ per node).
        env.setdefault(
            "OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // (nodes * gpus)))
        )
        commands = local_commands(nodes, gpus, job.worker_argv, run_id, free_port())
        return supervise(commands, env, stalled=lambda: watch.verdict is not None)
    run_preflight(job, nodes, gpus, env)
    command = slurm_command(nodes, gpus, job.worker_argv, run_id)
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


DISK_FIXES = ("free space on it (lower save_total_limit, set checkpoints.optimizer: last, or "
              "put results/ on a larger filesystem) and rerun to resume")  # fmt: skip


def outcome(job: Job, code: int, signalled: str | None, ended: dict | None = None) -> int | None:
    """The job's exit code when the workers did not finish (None: they did)."""
    from snaketune.checkpoints import drop_incomplete
    from snaketune.diskplan import DiskGuard
    from snaketune.train import STOPPED_EXIT_CODE, newest_complete

    ended = ended or {}
    if ended.get("reason") == "disk":  # the workers stopped before a save with no room
        saved = newest_complete(job.ckpt)
        raise UserError(
            f"disk full: {ended.get('disk')}; stopped at step {ended.get('step')} without "
            f"saving; {saved.name if saved else 'no checkpoint'} is complete and resumable: "
            + DISK_FIXES
        )
    if signalled:
        # The agents exit 1 on a forwarded signal whatever their workers did; report the stop.
        saved = newest_complete(job.ckpt)
        log.warning(
            "stopped by %s; newest complete checkpoint: %s; rerun to resume",
            signalled,
            saved.name if saved else "none",
        )
        return STOPPED_EXIT_CODE
    network = read_result(job.ckpt) or {}
    if code != 0 and network.get("problem"):
        raise UserError(network["problem"])
    stalled = stall_verdict(job.ckpt)
    if code != 0 and stalled:
        saved = newest_complete(job.ckpt)
        dumps = sorted(flight_recorder_dir(job).glob("rank_*"))
        raise UserError(
            f"stalled: {stalled}; every process of the job was stopped; a retry resumes from "
            f"{saved.name if saved else 'the start'} (if it stalls again, take that host out, "
            "e.g. sbatch --exclude)"
            + (f"; flight recorder dumps in {dumps[0].parent}" if dumps else "")
        )
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
        short = DiskGuard(job.ckpt, 0.0).short()
        if short:  # the disk filled while a checkpoint was written (every worker is gone)
            dropped = drop_incomplete(job.ckpt)
            saved = newest_complete(job.ckpt)
            raise UserError(
                f"disk full during a save: {short}; half-written "
                f"{', '.join(p.name for p in dropped) or 'checkpoints: none'} removed; "
                f"{saved.name if saved else 'no checkpoint'} is complete and resumable: "
                + DISK_FIXES
            )
        log.error(
            "training exited with code %d; rerun the rule to resume from the last checkpoint", code
        )
        return code
    return None


def publish_outputs(job: Job) -> None:
    """run_config.json and provenance.json beside the workers' staged outputs, then all of
    them renamed into place at once."""
    import torch

    from snaketune.diskplan import folder_bytes
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
        final_checkpoint_bytes=folder_bytes(final),
        segments=segments_summary(read_segments(job)),
        network=read_result(job.ckpt),
        shards_manifest_sha256=sha256_file(job.shards / "manifest.json"),
    )
    write_json(staged(job.out, "provenance.json"), prov)
    names = (*WORKER_OUTPUTS, "run_config.json", "provenance.json")
    publish([(staged(job.out, n), job.out / n) for n in names])


# ----------------------------------------------------------------------------- continuation

SEGMENTS = "segments.jsonl"  # one line per job of the run: when, where, why it ended


def allocation_end(job: Job, started: float) -> float | None:
    """When this job's allocation ends (epoch seconds): SLURM's end time for a SLURM job,
    else ``started`` plus the rule's runtime; None: no limit known."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id and shutil.which("squeue"):
        try:
            out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True,
                                 text=True, timeout=60).stdout.strip()  # fmt: skip
            if out in ("UNLIMITED", "NONE"):
                return None  # the job has no time limit
            return datetime.fromisoformat(out).timestamp()
        except (subprocess.SubprocessError, ValueError):  # N/A, squeue down
            log.warning("could not read the end time of SLURM job %s from squeue", job_id)
    if job.time_limit_min:
        return started + job.time_limit_min * 60
    return None


def read_segments(job: Job) -> list[dict]:
    path = job.ckpt / SEGMENTS
    if not path.exists():
        return []
    return read_jsonl(path)


def slurm_restarts() -> int:
    """How many times this SLURM job was requeued (scontrol's Restarts; SLURM_RESTART_COUNT
    does not always reach the job's shell)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return 0
    try:
        out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True,
                             text=True, timeout=60).stdout  # fmt: skip
    except (subprocess.SubprocessError, OSError):
        out = ""
    found = re.search(r"\bRestarts=(\d+)", out)
    return int(found.group(1)) if found else int(os.environ.get("SLURM_RESTART_COUNT", "0"))


def record_segment(job: Job, began: float, from_step: int, ended: dict) -> None:
    line = {
        "job": os.environ.get("SLURM_JOB_ID"),
        "restart": slurm_restarts(),
        "host": socket.gethostname(),
        "began": round(began, 3),
        "ended": round(time.time(), 3),
        "from_step": from_step,
        "to_step": ended.get("step"),
        "reason": ended.get("reason", "failed"),
        "train_s": ended.get("train_s", 0.0),
        "save_s": ended.get("save_s"),
    }
    try:
        with open(job.ckpt / SEGMENTS, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    except OSError as exc:  # a full disk: the job's own outcome is what to report
        log.warning("could not record this job in %s: %s", SEGMENTS, exc)


def segments_summary(segments: list[dict]) -> dict:
    """Jobs the run took, its wall time from the first start to the last end (queue waits
    between jobs included) and the part of it spent outside training steps."""
    if not segments:
        return {"jobs": 0}
    wall = segments[-1]["ended"] - segments[0]["began"]
    train = sum(s.get("train_s") or 0.0 for s in segments)
    return {
        "jobs": len(segments),
        "continuations": sum(s["reason"] == "time" for s in segments),
        "wall_s": round(wall, 1),
        "train_s": round(train, 1),
        "outside_training_s": round(wall - train, 1),
    }


def requeue_self() -> bool:
    """Put this SLURM job back in the queue (``scontrol requeue``): SLURM ends this run of
    it and starts it again, same job id, which resumes from the checkpoint just saved."""
    job_id = os.environ["SLURM_JOB_ID"]
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job_id, proc.stderr.strip())
        return False
    log.warning("SLURM job %s requeued: it continues from the checkpoint when it starts again",
                job_id)  # fmt: skip
    return True


def train_segments(job: Job, nodes: int, gpus: int) -> int | str:
    """Run the workers until the run is done, failed, or (on SLURM) its job must go back to
    the queue: 0, an exit code, or "requeue". Off SLURM, a stop ahead of the time limit is
    followed at once by the next segment, with a fresh limit."""
    from snaketune.train import SEGMENT, checkpoint_step, newest_complete

    limit = job.spec.get("max_continuations", 50)
    while True:
        began = time.time()
        deadline = allocation_end(job, began)
        saved = newest_complete(job.ckpt)
        from_step = checkpoint_step(saved) if saved else 0
        segment = job.ckpt / SEGMENT
        segment.unlink(missing_ok=True)
        code, signalled = start_workers(job, nodes, gpus, deadline)
        ended = json.loads(segment.read_text()) if segment.exists() else {}
        record_segment(job, began, from_step, ended)
        if ended.get("reason") == "time" and signalled in (None, "SIGUSR1"):
            used = segments_summary(read_segments(job))["continuations"]
            if used > limit:
                raise UserError(
                    f"runs.{job.out.parent.name}: stopped at the time limit {used} times, more "
                    f"than max_continuations ({limit}); at step {ended.get('step')}; raise "
                    "max_continuations or the train rule's runtime, then rerun to continue"
                )
            if os.environ.get("SLURM_JOB_ID"):
                return "requeue"
            log.warning("continuation %d of at most %d: starting the next segment", used, limit)
            continue
        failed = outcome(job, code, signalled, ended)
        if failed is not None:
            return failed
        publish_outputs(job)
        return 0


def launch_job(job: Job) -> int:
    """The train job: check, keep or set aside checkpoints, run the workers on every node
    (again after each stop ahead of the time limit), and publish their outputs when all of
    them finished. On SLURM, a stop ahead of the limit requeues the job (lock released
    first)."""
    from snaketune.train import STOPPED_EXIT_CODE

    log.info(
        "train job started: host %s, PID %d%s",
        socket.gethostname(), os.getpid(),
        f", SLURM job {os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else "",
    )  # fmt: skip
    nodes, gpus = check_job(job)
    check_disk(job)
    with RunLock(job.out / "train.lock", job.lock_wait_s):
        prepare_checkpoints(job)
        result = train_segments(job, nodes, gpus)
    if result != "requeue":
        return result
    if requeue_self():
        time.sleep(300)  # SLURM ends this run of the job now; the next one resumes
    return STOPPED_EXIT_CODE
