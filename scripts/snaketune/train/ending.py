"""How a worker's training ended: the segment record the launcher reads, the exit code and
log line of a stop (time, signal, health, disk), or the outputs of a finished run with the
best evaluated checkpoint's weights where ``export.checkpoint: best``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from snaketune.core import heldout, qlora
from snaketune.core.checkpoints import (
    best_checkpoint,
    checkpoint_step,
    heldout_of,
    newest_complete,
)
from snaketune.core.collective import any_rank, barrier
from snaketune.core.io import read_jsonl
from snaketune.core.job import (
    DISK_EXIT_CODE,
    HEALTH_EXIT_CODE,
    STOPPED_EXIT_CODE,
    write_segment,
)
from snaketune.evaluation import heldout_pass
from snaketune.methods.training import Context
from snaketune.plan.runspec import kept_best
from snaketune.train import startup
from snaketune.train.health import report_unhealthy
from snaketune.train.outputs import probe_inputs, save_outputs
from snaketune.train.progress import StepCallback, StopRequest
from snaketune.train.resume import DiskGuard

log = logging.getLogger(__name__)


class NothingToTrain(Exception):
    """The checkpoint resumed is at (or past) the run's last step."""


def last_step_guard():
    """A callback that ends ``train()`` before its first step when the resumed checkpoint is
    already at the run's last step: transformers' loop would otherwise train one step past
    ``max_steps`` when that step falls inside an epoch (it checks the limit only after a
    step). Every rank reads the same step from the checkpoint, so all of them stop."""
    from transformers import TrainerCallback

    class LastStepGuard(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if state.max_steps > 0 and state.global_step >= state.max_steps:
                raise NothingToTrain(state.global_step)

    return LastStepGuard()


def train_or_export(trainer, resume: Path | None, callback: StepCallback, rank: int) -> None:
    """Train from ``resume``; a checkpoint already at the last step trains no step: its
    weights (loaded into the engine) are what finish() writes out again, the records as
    they were (a finished run resumed after a rerun that changed nothing)."""
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    except NothingToTrain as done:
        callback.on_train_end(trainer.args, trainer.state, trainer.control)
        if rank == 0:
            log.info(
                "%s is the run's last step (%s of %d): nothing left to train; its outputs are "
                "written again from it",
                resume.name if resume else "the checkpoint",
                done,
                trainer.state.max_steps,
            )


def finish(
    trainer,
    callback: StepCallback,
    ctx: Context,
    disk: DiskGuard | None,
    watchdog,
    stop: StopRequest,
    shards: Path,
    schedule: heldout_pass.Schedule | None = None,
) -> int:
    """How the training ended: the segment record for the launcher, then the outputs (0) or
    the exit code of the stop, with its log line."""
    env, ckpt_dir = ctx.env, ctx.ckpt_dir
    # a stop asked at the last step leaves nothing to continue: the run is done
    finished = trainer.state.global_step >= trainer.state.max_steps
    if finished and callback.stopped_at is None:  # room for the outputs (~one checkpoint)?
        short = disk.short() if disk is not None else None
        if any_rank(short is not None):
            callback.stopped_at, callback.stop_reason = trainer.state.global_step, "disk"
            callback.disk_short = short
    kept = callback.stopped_for_health or callback.stop_reason == "disk"
    stopped = callback.stopped_at is not None and (kept or not finished)
    if env.rank == 0 and stopped:  # how this job's training ended, for the launcher
        write_segment(
            ckpt_dir,
            callback.stop_reason or "done",
            trainer.state.global_step,
            callback.deadline.train_s,
            callback.deadline.save_s,
            callback.disk_short if callback.stop_reason == "disk" else None,
            startup.figures(callback.deadline.began),
        )
    if stopped or callback.stop_reason == "disk" or callback.stopped_for_health:
        return stop_code(callback, env, ckpt_dir, watchdog, stop)
    if schedule is not None and schedule.stopped and env.rank == 0:
        log.info("%s; the run is finished", schedule.stopped)
    records = {qlora.RECORD: ctx.quantized} if ctx.quantized else {}
    exported = export_best(trainer, ctx)
    if exported is not None:
        records[heldout.EXPORTED] = exported
    save_outputs(
        trainer,
        env,
        ctx.out,
        ckpt_dir / "metrics.jsonl",
        probe_inputs(shards),
        ctx.precision,
        records,
    )
    barrier()  # every rank's part of the outputs written: "done" means all of them are there
    if env.rank == 0:
        write_segment(
            ckpt_dir,
            "done",
            trainer.state.global_step,
            callback.deadline.train_s,
            callback.deadline.save_s,
            startup=startup.figures(callback.deadline.began),
        )
    return 0


def export_best(trainer, ctx: Context) -> dict[str, Any] | None:
    """With export.checkpoint: best, the best evaluated checkpoint's weights loaded back into
    the engine (so every output is written from them); what was exported and why."""
    best_of = kept_best(ctx.run)
    if best_of is None:
        return None
    metric, greater = best_of
    best = best_checkpoint(ctx.ckpt_dir, metric, greater)
    step = trainer.state.global_step
    if best is None:
        if ctx.env.rank == 0:
            log.warning(
                "export.checkpoint: best, but no checkpoint was evaluated; exporting "
                "the last step's weights (step %d)",
                step,
            )
        return {"checkpoint": "last", "step": step, "reason": "no evaluated checkpoint"}
    value = heldout_of(best)[metric]
    if checkpoint_step(best) != step:
        from transformers.integrations.deepspeed import deepspeed_load_checkpoint

        deepspeed_load_checkpoint(trainer.model_wrapped, str(best), load_module_strict=False)
    start = heldout.start_figure(read_jsonl(ctx.ckpt_dir / "metrics.jsonl"), metric)
    worse = start is not None and (start > value if greater else start < value)
    if ctx.env.rank == 0:
        log.info(
            "exporting %s: the best held-out %s, %.4f (the last step is %d)",
            best.name,
            metric,
            value,
            step,
        )
        if worse:
            log.warning(heldout.worse_than_start(metric, start, value, checkpoint_step(best)))
    out = {
        "checkpoint": "best",
        "step": checkpoint_step(best),
        "metric": metric,
        "value": value,
        "last_step": step,
        "reason": f"best held-out {metric} ({'highest' if greater else 'lowest'})",
    }
    if start is not None:
        out.update(start_value=start, worse_than_start=worse)
    return out


def stop_code(callback: StepCallback, env, ckpt_dir: Path, watchdog, stop: StopRequest) -> int:
    """The exit code of a stop, with its one line (rank 0): the disk full (nothing saved),
    a rank found unhealthy, the time limit near, or a signal (a checkpoint saved)."""
    if callback.stop_reason == "disk":
        if env.rank == 0:
            saved = newest_complete(ckpt_dir)
            log.error(
                "disk full: %s; stopped at step %d without saving; %s is complete and resumable",
                callback.disk_short,
                callback.stopped_at,
                saved.name if saved else "no checkpoint",
            )
        return DISK_EXIT_CODE
    if callback.stopped_for_health:
        report_unhealthy(watchdog, env, ckpt_dir, callback.stopped_at)
        return HEALTH_EXIT_CODE
    if env.rank == 0 and callback.stop_reason == "time":
        log.warning(
            "stopped at step %d ahead of the time limit (%s); checkpoint saved, the next "
            "job continues from there",
            callback.stopped_at,
            stop.signal or "deadline",
        )
    elif env.rank == 0:
        log.warning(
            "stopped by %s at step %d; checkpoint saved, a rerun resumes there",
            stop.signal or "a signal on another rank",
            callback.stopped_at,
        )
    return STOPPED_EXIT_CODE
