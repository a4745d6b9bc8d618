"""The train job, as scripts/train.py runs it (one launcher per job, never the worker's
code): check the job, keep or set aside the checkpoints, start the workers on every node
(snaketune.train.agents), again after each stop ahead of the time limit (snaketune.train.segments),
read how they ended (snaketune.core.job's exit codes and segment record), and publish their
outputs once all of them finished.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import time
from pathlib import Path

from snaketune.core.checkpoints import checkpoint_step, newest_complete
from snaketune.core.errors import UserError, error_lines
from snaketune.core.heartbeat import stall_verdict
from snaketune.core.io import publish, sha256_file, write_json
from snaketune.core.job import SEGMENT, WORKER_OUTPUTS, Handoff, Job, read_segment
from snaketune.core.runlock import RunLock
from snaketune.plan.pipeline import TRAIN
from snaketune.plan.runspec import RunSpec
from snaketune.train.agents import Workers, flight_recorder, flight_recorder_dir, worker_environment
from snaketune.train.agents import start as start_agents
from snaketune.train.network import RESULT as NETWORK
from snaketune.train.network import read_result
from snaketune.train.rerun import keep_published, restore_published, resume_words
from snaketune.train.resume import needs_universal, prepare_checkpoints
from snaketune.train.segments import (
    allocation_end,
    read_segments,
    record_segment,
    requeue_self,
    segments_summary,
)

log = logging.getLogger(__name__)

# Every output of the train stage, published at once (a finished run's are kept for a rerun)
PUBLISHED = (*WORKER_OUTPUTS, "run_config.json", "provenance.json")


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
    balanced = RunSpec.of(spec).balances_tokens
    if manifest.get("packing") != balanced:
        raise UserError(
            f"{job.shards} was planned with packing {manifest.get('packing')}, the run asks "
            f"for {balanced}; rerun shard_dataset"
        )
    if spec["wandb"]["enabled"] and importlib.util.find_spec("wandb") is None:
        raise UserError(
            "wandb.enabled is set but wandb is not installed: pip install wandb, "
            "or set wandb.enabled: false"
        )
    check_quantizable(job)
    return nodes, gpus


def check_quantizable(job: Job) -> None:
    """A 4-bit base needs bitsandbytes on this node and a model not quantized already."""
    from snaketune.core.qlora import already_quantized, missing_bitsandbytes

    if not RunSpec.of(job.spec).quantized:
        return
    where = f"runs.{job.out.parent.name}.lora.quantize"
    missing = missing_bitsandbytes()
    if missing:
        raise UserError(f"{where}: {missing}")
    config = job.model / "config.json"
    method = already_quantized(json.loads(config.read_text())) if config.is_file() else None
    if method:
        raise UserError(
            f"{where}: {job.model} is already quantized ({method}); bitsandbytes cannot "
            "quantize it again: use the model's unquantized release, or drop lora.quantize"
        )


def check_disk(job: Job) -> int:
    """Refuse a run whose checkpoints and outputs do not fit on its filesystem (one line,
    before any worker starts); the estimated size of one checkpoint, for the workers' check
    before each save (0: not planned)."""
    from snaketune.budget.diskplan import check_job_disk, format_disk
    from snaketune.train.preflight import cuda_available

    plan = check_job_disk(job.spec, job.model, job.deepspeed, job.out.parent, cuda_available())
    if plan is None:
        return 0
    log.info("disk plan: %s", format_disk(job.out.parent.name, plan))
    return int(plan["need_bytes"]["checkpoint"])


def start_workers(
    job: Job, nodes: int, gpus: int, deadline: float | None = None, checkpoint_bytes: int = 0
) -> tuple[int, str | None]:
    """Run the workers to the end; (exit code, signal passed on to them, if any). With a
    ``deadline`` (epoch seconds) they stop ahead of it at a step end and save."""
    saves = [s["save_s"] for s in read_segments(job) if s.get("save_s")]
    handoff = Handoff(
        deadline=deadline,
        stop_margin_s=job.stop_margin_s,
        save_s=saves[-1] if saves and deadline is not None else None,
        load_universal=needs_universal(job, nodes * gpus),
        checkpoint_bytes=checkpoint_bytes,
    )
    run = job.out.parent.name
    env = handoff.environ(worker_environment())
    env.update(flight_recorder(run))
    (job.ckpt / NETWORK).unlink(missing_ok=True)  # measured again by this job's workers
    workers = Workers(
        job.worker_argv,
        nodes,
        gpus,
        f"snaketune-{run}",
        TRAIN.name,
        job.out,
        job.ckpt,
        job.spec["timeout_minutes"] * 60,
        job.launcher,
    )
    return start_agents(workers, env)


DISK_FIXES = (
    "free space on it (lower save_total_limit, set checkpoints.optimizer: last, or "
    "put results/ on a larger filesystem) and rerun to resume"
)


def outcome(job: Job, code: int, signalled: str | None, ended: dict | None = None) -> int | None:
    """The job's exit code when the workers did not finish (None: they did); one line
    (UserError) naming why when the reason is known."""
    from snaketune.core.job import STOPPED_EXIT_CODE

    ended = ended or {}
    if ended.get("reason") == "disk":  # the workers stopped before a save with no room
        saved = newest_complete(job.ckpt)
        raise UserError(
            f"disk full: {ended.get('disk')}; stopped at step {ended.get('step')} without "
            f"saving; {saved.name if saved else 'no checkpoint'} is complete and resumable: "
            + DISK_FIXES
        )
    if ended.get("reason") == "done" and code != 0:
        # Rank 0 records "done" after every rank wrote its outputs: what failed came after
        # (on SLURM, a --signal that reached torchrun while it shut down).
        log.warning(
            "the workers finished and wrote every output, then the step exited with code %d%s; "
            "publishing",
            code,
            f" ({signalled})" if signalled else "",
        )
        return None
    if signalled:
        # The agents exit 1 on a forwarded signal whatever their workers did; report the stop.
        saved = newest_complete(job.ckpt)
        log.warning(
            "stopped by %s; newest complete checkpoint: %s; %s",
            "Ctrl-C (SIGINT)" if signalled == "SIGINT" else signalled,
            saved.name if saved else "none",
            resume_words(job.out.parent.name),
        )
        return STOPPED_EXIT_CODE
    if code == 0:
        return None
    explain_failure(job)
    log.error(
        "training exited with code %d; rerun the rule to resume from the last checkpoint", code
    )
    return code


def explain_failure(job: Job) -> None:
    """Why the workers failed, when the job left the reason behind (one line, UserError):
    a slow network, a stalled rank, a failing GPU, a disk that filled during a save."""
    from snaketune.core.checkpoints import drop_incomplete
    from snaketune.train.resume import DiskGuard

    saved = newest_complete(job.ckpt)
    network = read_result(job.ckpt) or {}
    if network.get("problem"):
        raise UserError(network["problem"])
    stalled = stall_verdict(job.ckpt)
    if stalled:
        dumps = sorted(flight_recorder_dir(job.out.parent.name).glob("rank_*"))
        raise UserError(
            f"stalled: {stalled}; every process of the job was stopped; a retry resumes from "
            f"{saved.name if saved else 'the start'} (if it stalls again, take that host out, "
            "e.g. sbatch --exclude)"
            + (f"; flight recorder dumps in {dumps[0].parent}" if dumps else "")
        )
    fatal = job.ckpt / "health" / "fatal.json"
    if fatal.is_file():  # torchrun's own exit code is 1 whatever the workers'
        report = json.loads(fatal.read_text())
        raise UserError(
            report.get("line")  # a user's code (a reward function), else a GPU
            or f"GPU health: {'; '.join(report['messages'])}; stopped at step {report['step']} "
            f"(checkpoint {saved.name if saved else 'none'}); take the node out (e.g. sbatch "
            "--exclude) and rerun to resume"
        )
    short = DiskGuard(job.ckpt, 0.0).short()
    if short:  # the disk filled while a checkpoint was written (every worker is gone)
        dropped = drop_incomplete(job.ckpt)
        saved = newest_complete(job.ckpt)
        raise UserError(
            f"disk full during a save: {short}; half-written "
            f"{', '.join(p.name for p in dropped) or 'checkpoints: none'} removed; "
            f"{saved.name if saved else 'no checkpoint'} is complete and resumable: " + DISK_FIXES
        )


def read_exported(model: Path) -> dict | None:
    """Which step the model is and why (export.checkpoint: best; snaketune.core.heldout)."""
    from snaketune.core.heldout import EXPORTED

    path = model / EXPORTED
    return json.loads(path.read_text()) if path.is_file() else None


def publish_outputs(job: Job, attempt: int = 0) -> None:
    """run_config.json and provenance.json beside the workers' staged outputs, then all of
    them renamed into place at once. ``attempt``: this one (snaketune.train.attempts), recorded
    as done."""
    from snaketune.budget.diskplan import folder_bytes
    from snaketune.core.job import staged
    from snaketune.core.lora_targets import read_description
    from snaketune.core.provenance import output_hashes, record
    from snaketune.train import attemptlog, attempts
    from snaketune.train.preflight import cuda_available

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
    segments = read_segments(job)
    prov = record(
        TRAIN.name,
        job.out,
        job.spec,
        {"shards": job.shards, "model": job.model, "deepspeed": job.deepspeed},
        outputs,
        hosts={h.name: h.read_text() for h in hosts},
        device="cuda" if cuda_available() else "cpu",
        final_checkpoint_bytes=folder_bytes(final),
        segments=job_summary(segments),
        network=read_result(job.ckpt),
        adapters=read_description(job.ckpt),
        shards_manifest_sha256=sha256_file(job.shards / "manifest.json"),
        exported=read_exported(staged(job.out, "model")),
        attempts=[
            {**a, "exit": 0, "reason": attempts.done(segments[-1].get("to_step"))}
            if a["attempt"] == attempt
            else a
            for a in attemptlog.summary(job.out)
        ],
    )
    write_json(staged(job.out, "provenance.json"), prov)
    publish([(staged(job.out, n), job.out / n) for n in PUBLISHED])
    keep_published(job.ckpt, job.out, PUBLISHED, segments[-1].get("to_step"))


def job_summary(segments: list[dict]) -> dict:
    """The segments' summary, and for a run of one job the seconds its process ran before
    the launcher began (its Python and imports), which its benchmark counted: kept in the
    provenance, so that a rerun that puts its outputs back (snaketune.train.rerun) leaves
    the summary's wall time that run's."""
    from snaketune.train.segments import process_started

    out = segments_summary(segments)
    began = process_started()
    if out.get("jobs") == 1 and began is not None:
        out["before_launcher_s"] = round(max(0.0, segments[0]["began"] - began), 1)
    return out


# ----------------------------------------------------------------------------- continuation


def train_segments(
    job: Job, nodes: int, gpus: int, attempt: int = 0, checkpoint_bytes: int = 0
) -> int | str:
    """Run the workers until the run is done, failed, or (on SLURM) its job must go back to
    the queue: 0, an exit code, or "requeue". Off SLURM, a stop ahead of the time limit is
    followed at once by the next segment, with a fresh limit."""

    limit = job.spec["max_continuations"]
    while True:
        began = time.time()
        deadline = allocation_end(job, began)
        saved = newest_complete(job.ckpt)
        from_step = checkpoint_step(saved) if saved else 0
        (job.ckpt / SEGMENT).unlink(missing_ok=True)
        code, signalled = start_workers(job, nodes, gpus, deadline, checkpoint_bytes)
        ended = read_segment(job.ckpt)
        record_segment(job, began, from_step, ended, attempt)
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
        publish_outputs(job, attempt)
        return 0


def launch_job(job: Job, announce_fd: int | None = None) -> int:
    """The train job, as one attempt of the run (snaketune.train.attempts: its own log, its
    outcome recorded): check, keep or set aside checkpoints, run the workers on every node
    (again after each stop ahead of the time limit), and publish their outputs when all of
    them finished. On SLURM, a stop ahead of the limit requeues the job (lock released
    first)."""
    from snaketune.core.errors import print_error
    from snaketune.core.job import STOPPED_EXIT_CODE
    from snaketune.train.attempts import Attempt, done

    attempt = Attempt(job.out, announce_fd)
    attempt.report_progress(job.ckpt / "metrics.jsonl")
    try:
        attempt.refuse_second_start()
        result = train_job(job, attempt)
    except UserError as exc:
        print_error(exc)
        attempt.finish(2, "; ".join(error_lines(exc)))
        return 2
    except BaseException as exc:
        attempt.finish(1, f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        raise
    step = (read_segments(job) or [{}])[-1].get("to_step")
    if result != "requeue":
        attempt.finish(result, done(step) if result == 0 else None)
        return result
    attempt.finish(
        STOPPED_EXIT_CODE,
        f"stopped ahead of the time limit at step {step}; the "
        f"SLURM job goes back to the queue to continue",
    )
    if requeue_self():
        time.sleep(300)  # SLURM ends this run of the job now; the next one resumes
    return STOPPED_EXIT_CODE


def train_job(job: Job, attempt) -> int | str:
    """Check the job, take the run's lock, train (a resume said): 0, an exit code or "requeue"."""
    log.info(
        "train job started: host %s, PID %d%s",
        socket.gethostname(),
        os.getpid(),
        f", SLURM job {os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else "",
    )
    nodes, gpus = check_job(job)
    checkpoint_bytes = check_disk(job)
    with RunLock(job.out / "train.lock", job.lock_wait_s):
        if (set_aside := prepare_checkpoints(job)) is not None:
            attempt.say(set_aside)
        job.write()  # <out>/job.json: what every worker of this start reads, once
        if (resume := newest_complete(job.ckpt)) is not None:
            if restore_published(job.ckpt, job.out, PUBLISHED, checkpoint_step(resume)):
                attempt.say(
                    f"{resume.name} is the run's last step: its outputs put back as they "
                    "were (the same shards, model and settings), no step trained"
                )
                return 0
            attempt.say(f"resuming from {resume.name}")
        return train_segments(job, nodes, gpus, attempt.number, checkpoint_bytes)
