"""What the training loop reports and obeys at each step: metrics, progress, stop requests,
checkpoint completion. Shared by every training method (a transformers TrainerCallback,
``StepCallback``); a method adds its own figures to the step's record (``step_fields``).

Per optimizer step the callback makes ONE collective: an all-gather of a few numbers per
rank (stop flag, tokens, padding, samples, attention work, peak memory, GPU health), from
which the stop decision and the step's metrics are both taken. Only rank 0 writes.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from snaketune.core.checkpoints import mark_complete, prune
from snaketune.core.collective import barrier, gather_combined
from snaketune.core.heartbeat import Heartbeat
from snaketune.core.imports import hold_time_warning, take_time_warning
from snaketune.core.job import Handoff
from snaketune.core.throughput import FlopsModel, mfu, step_flops
from snaketune.train.health import LEVEL, STATUS, Watchdog
from snaketune.train.resume import DiskGuard
from snaketune.train.vitals import Vitals

log = logging.getLogger(__name__)

# the per-rank numbers of a step: how each is combined across ranks
FIELDS = (
    ("flag", "max"),
    ("timeup", "max"),
    ("tokens", "sum"),
    ("padded", "sum"),
    ("samples", "sum"),
    ("squares", "sum"),
    ("peak", "max"),
    ("status", "max"),
    ("temp", "max"),
    ("disk", "max"),
)


class StopRequest:
    """Set by SIGTERM/SIGINT/SIGUSR1; read by the callback at every step end. SIGUSR1 is
    SLURM's warning ahead of the time limit (``--signal=USR1@<seconds>``): a stop to
    continue in the next job; SIGTERM (scancel, preemption) and SIGINT (Ctrl-C, passed on
    by the launcher) a stop for good. A rank may get a signal more than once (from the
    launcher and from its torchrun agent): each is the same request."""

    STOPS = ("SIGTERM", "SIGINT")  # a stop for good: save at this step's end, then exit

    def __init__(self) -> None:
        self.signal: str | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        hold_time_warning()  # SIGUSR1 held (core.imports: the processes a rank starts live)
        self.poll()  # one that came while the rank was loading: the same request

    def poll(self) -> None:
        """Take SLURM's time warning if it came (held since the entry script's first line);
        called at every step end, before the request is read."""
        if take_time_warning() and self.signal not in self.STOPS:  # a stop for good stays
            self._handle(signal.SIGUSR1, None)

    def _handle(self, signum, _frame) -> None:
        again = self.signal is not None
        self.signal = signal.Signals(signum).name
        if not again:
            log.warning("%s received: saving a checkpoint at the end of this step", self.signal)


class Deadline:
    """When to stop ahead of the allocation's end (epoch seconds ``end``; None: no limit).

    Due at a step end when another step, a checkpoint save and ``margin_s`` would no longer
    fit before the end. The step time is the longest of the last few steps; the save time is
    the last save measured (``save_guess_s`` before the first one), with a quarter more.
    """

    def __init__(self, end: float | None, margin_s: float, save_guess_s: float = 30.0):
        self.end, self.margin_s, self.save_s = end, margin_s, save_guess_s
        self.steps: list[float] = []
        self.train_s = 0.0  # time in training steps (saves and start-up left out)
        self._t = time.time()
        self.began: float | None = None  # when the first step began (epoch seconds)

    @classmethod
    def handed(cls, handoff: Handoff) -> Deadline:
        """The launcher's deadline, stop margin and last measured save time (the first
        job's guess where none was measured yet)."""
        if handoff.save_s is None:
            return cls(handoff.deadline, handoff.stop_margin_s)
        return cls(handoff.deadline, handoff.stop_margin_s, handoff.save_s)

    def restart(self) -> None:
        self._t = time.time()
        if self.began is None:  # the first: training begins
            self.began = self._t

    def step_done(self) -> None:
        now = time.time()
        self.steps = [*self.steps[-4:], now - self._t]
        self.train_s += now - self._t
        self._t = now

    def saved(self, seconds: float) -> None:
        self.save_s = seconds
        self._t = time.time()  # the save is not a step

    def due(self, now: float | None = None) -> bool:
        if self.end is None:
            return False
        now = time.time() if now is None else now
        step = max(self.steps, default=0.0)
        return now + step + 1.25 * self.save_s + self.margin_s >= self.end


def gather_step(values: list[float]) -> dict[str, float]:
    """Every rank's ``values`` (in FIELDS order), combined: one all-gather."""
    combined = gather_combined(values, tuple(how for _, how in FIELDS))
    return {name: value for (name, _), value in zip(FIELDS, combined, strict=True)}


def peak_memory_mib() -> float:
    """Peak device memory of this process (CUDA), or its peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    return str(timedelta(seconds=int(seconds)))


def planned_note(run_dir: Path) -> str:
    """The progress line's word on the plan: the steps' time estimated when the run was
    queued (results/<run>/estimate.json, snaketune.budget.cost), "" without one."""
    from snaketune.budget.cost import ESTIMATE, duration

    path = run_dir / ESTIMATE
    if not path.is_file():
        return ""
    e = json.loads(path.read_text())
    return f" (planned: {duration(e['train_s'])} for {e['steps']} steps)"


class StepCallback(TrainerCallback):
    """At every optimizer step: the step's metrics line (rank 0; the method's own figures
    from ``step_fields``), the progress line, the decision to stop (signal, time limit, GPU
    health, no room for a save) and, after a save, the checkpoint's completion mark."""

    def __init__(
        self,
        rank: int,
        collator,
        stop: StopRequest,
        metrics: Path,
        keep: int,
        start_step: int,
        watchdog: Watchdog | None = None,
        flops: FlopsModel | None = None,
        deadline: Deadline | None = None,
        optimizer: str = "all",
        disk: DiskGuard | None = None,
        network: dict | None = None,
        step_fields: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        best: tuple[str, bool] | None = None,
        vitals: Vitals | None = None,
    ):
        self.rank, self.collator, self.stop = rank, collator, stop
        self.optimizer, self.disk = optimizer, disk  # older checkpoints' states; space check
        self.disk_short: str | None = None  # why the run stopped without its save
        self.network = network  # the job's all-reduce figure, on its first metrics line
        self.step_fields = step_fields or (lambda logs: {})  # the method's own figures
        self.vitals = vitals  # rank 0: whether the run can learn, from its first steps
        self.deadline = deadline or Deadline(None, 0.0)
        self.stop_reason: str | None = None  # time (continue in the next job), signal, health
        self._save_began: float | None = None
        self.metrics, self.keep, self.watchdog, self.flops = metrics, keep, watchdog, flops
        self.stopped_at: int | None = None
        self.stopped_for_health = False
        self._start = self._last = time.monotonic()
        self._start_step = start_step
        self._seen = {"tokens": 0, "padded": 0, "samples": 0, "squares": 0}
        self._window = dict.fromkeys(self._seen, 0.0)  # summed over ranks since the last log
        self._latest: dict[str, float] = {}
        self._out = None
        # the last held-out figures (snaketune.core.heldout) and their step; the checkpoint kept
        # for export.checkpoint: best (its held-out metric, greater is better)
        self.heldout: tuple[int, dict[str, Any]] | None = None
        self.best = best
        self._planned = ""  # the estimate made when the run was queued, for the ETA

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = self._last = time.monotonic()
        self.deadline.restart()
        if self.rank == 0:
            self._out = open(self.metrics, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
            self._planned = planned_note(self.metrics.parent.parent)

    def on_train_end(self, args, state, control, **kwargs):
        if self._out is not None:
            self._out.close()
            self._out = None

    def on_step_end(self, args, state, control, **kwargs):
        # flag: 1 = a rank got a stop signal, 2 = a rank's GPU is failing; timeup: the time
        # limit is near (a rank's deadline or SIGUSR1): stop, save, continue in the next job
        self.deadline.step_done()
        self.stop.poll()
        unhealthy = self.watchdog is not None and self.watchdog.fatal is not None
        last = self.watchdog.last if self.watchdog is not None else None
        counts = {k: getattr(self.collator, k) - v for k, v in self._seen.items()}
        self._seen = {k: getattr(self.collator, k) for k in self._seen}
        mine = {
            "flag": 2.0 if unhealthy else 1.0 if self.stop.signal in StopRequest.STOPS else 0.0,
            "timeup": 1.0 if self.stop.signal == "SIGUSR1" or self.deadline.due() else 0.0,
            **counts,
            "peak": peak_memory_mib(),
            "status": LEVEL[last["status"]] if last else -1,
            "temp": last.get("temperature_c", -1) if last else -1,
        }
        # Room for the save this step may make (checked only then: no cost on other steps)
        saving = control.should_save or mine["flag"] or mine["timeup"]
        short = self.disk.short() if self.disk is not None and saving else None
        mine["disk"] = 1.0 if short else 0.0
        got = gather_step([float(mine[name]) for name, _ in FIELDS])
        for k in self._window:
            self._window[k] += got[k]
        self._latest = got
        if got["flag"] or got["timeup"]:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
            self.stopped_for_health = got["flag"] >= 2
            self.stop_reason = {2: "health", 1: "signal"}.get(int(got["flag"]), "time")
        if got["disk"] and control.should_save:  # stop without writing a checkpoint
            control.should_save = False
            control.should_training_stop = True
            self.stopped_at = state.global_step
            self.stop_reason = "disk"
            self.disk_short = short or "a node's checkpoint folder has no room for the next save"
        if control.should_save:
            self._save_began = time.time()
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        """A held-out pass (snaketune.core.heldout): its row in metrics.jsonl, kept for the
        progress line and the completion mark of a checkpoint saved at this step."""
        figures = {k[5:]: v for k, v in (metrics or {}).items() if k.startswith("eval_")}
        self.heldout = (state.global_step, figures)
        if self.rank == 0 and self._out is not None:
            row = {"step": state.global_step, **{f"heldout_{k}": v for k, v in figures.items()}}
            self._out.write(json.dumps(row) + "\n")
            log.info(
                "held-out at step %d: %s",
                state.global_step,
                ", ".join(
                    f"{k} {v:.4f}"
                    for k, v in figures.items()
                    if k not in ("examples", "seconds", "response_tokens")
                ),
            )
        self._last = time.monotonic()  # the pass is no training time (tokens/s, ETA)
        self.deadline.restart()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.rank != 0 or not logs or "loss" not in logs:
            return
        now = time.monotonic()
        seconds = max(now - self._last, 1e-9)
        self._last = now
        w, got = self._window, self._latest
        self._window = dict.fromkeys(self._window, 0.0)
        record: dict[str, Any] = {
            "step": state.global_step,
            "max_steps": state.max_steps,
            "epoch": round(state.epoch or 0.0, 4),
            "loss": logs.get("loss"),
            "lr": logs.get("learning_rate"),
            "grad_norm": logs.get("grad_norm"),
            "tokens_per_s": round(w["tokens"] / seconds, 1),
            "padding": round(1 - w["tokens"] / w["padded"], 4) if w["padded"] else 0.0,
            "samples_per_s": round(w["samples"] / seconds, 2),
            "peak_memory_mib": round(got.get("peak", 0.0), 1),
            "elapsed_s": round(now - self._start, 3),
        }
        if self.flops is not None:
            f = self.flops
            flops = step_flops(f.n_params, w["tokens"], w["squares"], f.layers, f.hidden, f.lora)
            value = mfu(flops, seconds, f.gpus, f.peak_tflops)
            if value is not None:
                record["mfu"] = round(value, 4)
        if got.get("status", -1) >= 0:  # the worst GPU of the job at its last sample
            record["gpu_health"] = STATUS[int(got["status"])]
            if got["temp"] >= 0:
                record["gpu_max_temp_c"] = got["temp"]
        if self.network is not None:
            record["allreduce_busbw_gbps"] = self.network["busbw_gbps"]
            self.network = None
        record.update(self.step_fields(logs))
        self._out.write(json.dumps(record) + "\n")
        for warning in self.vitals.see(record) if self.vitals is not None else ():
            log.warning("%s", warning)
        done = state.global_step - self._start_step
        left = state.max_steps - state.global_step
        eta = (now - self._start) / done * left if done > 0 else float("nan")
        log.info(
            "step %d/%d (%.0f%%) epoch %.2f loss %.4f lr %.2e grad %.3f | %.0f tok/s, "
            "padding %.0f%%%s | ETA %s%s",
            state.global_step,
            state.max_steps,
            100 * state.global_step / max(state.max_steps, 1),
            record["epoch"],
            record["loss"],
            record["lr"] or 0.0,
            record["grad_norm"] or 0.0,
            record["tokens_per_s"],
            100 * record["padding"],
            f", MFU {100 * record['mfu']:.1f}%" if "mfu" in record else "",
            _duration(eta),
            self._planned + self._heldout_note(),
        )

    def _heldout_note(self) -> str:
        """The last held-out figure, for the progress line ("" before the first pass)."""
        if self.heldout is None:
            return ""
        step, figures = self.heldout
        shown = next((k for k in ("loss", "exact_match") if k in figures), None)
        return f" | held-out {shown} {figures[shown]:.4f} (step {step})" if shown else ""

    def on_save(self, args, state, control, **kwargs):
        barrier()  # every rank has written its part of the checkpoint
        if self.rank == 0:
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            here = self.heldout is not None and self.heldout[0] == state.global_step
            figures = self.heldout[1] if here else None
            mark_complete(path, state.global_step, time.time(), figures)
            prune(Path(args.output_dir), self.keep, self.optimizer, self.best)
            log.info("checkpoint %s complete", path.name)
        barrier()
        if self._save_began is not None:
            self.deadline.saved(time.time() - self._save_began)
            self._save_began = None


class HeartbeatCallback(TrainerCallback):
    """The phases Trainer's loop goes through (added after the shared callback, so a save
    that callback asked for is seen as one)."""

    def __init__(self, beat: Heartbeat):
        self.beat = beat

    def on_step_begin(self, args, state, control, **kwargs):
        self.beat.move("data", state.global_step + 1)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.beat.move("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        self.beat.move("save" if control.should_save else "step end")

    def on_save(self, args, state, control, **kwargs):
        self.beat.move("step end")

    def on_train_end(self, args, state, control, **kwargs):
        self.beat.move("outputs")
