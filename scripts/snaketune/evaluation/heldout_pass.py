"""A held-out pass inside the training job (snaketune.core.heldout has the settings and what it
does): this rank's share of the eval set, scoring it with the evaluate stage's own code,
the trainer's ``evaluate`` that transformers calls, and when to evaluate or stop early.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from snaketune.core.heldout import ANSWERS, greater_is_better

log = logging.getLogger(__name__)


def eval_rows(path: Path, limit: int | None, seed: int) -> list[dict[str, Any]]:
    """The examples scored at each pass: all, or ``limit`` of them drawn with ``seed`` (in
    file order)."""
    import numpy as np

    from snaketune.evaluation.evaluate import load_examples

    rows = load_examples(path, None)
    if limit is not None and limit < len(rows):
        keep = np.sort(np.random.default_rng(seed).choice(len(rows), limit, replace=False))
        rows = [rows[i] for i in keep]
    return rows


class HeldOut:
    """This rank's share of the eval set and how to score it (``kind``: loss or answers)."""

    def __init__(self, spec: Mapping[str, Any], seed: int, rank: int, world: int, tokenizer):
        from snaketune.core.rows import pad_id
        from snaketune.evaluation.sharded import Share

        self.rows = eval_rows(Path(spec["path"]), spec["limit"], seed)
        self.examples, self.world = len(self.rows), world
        self.share = Share(rank, world)
        self.mine = self.share.mine(self.rows)  # every example on exactly one rank
        self.metric = spec["metric"]
        self.kind = "answers" if spec["metric"] in ANSWERS or spec.get("answers") else "loss"
        self.batch_size, self.max_new_tokens = spec["batch_size"], spec["max_new_tokens"]
        self.gather = spec.get("gather_for_generation", "auto")  # ZeRO-3: whole or sharded
        self.tokenizer, self.pad = tokenizer, pad_id(tokenizer)
        # every rank runs as many forward passes (ZeRO-3 gathers weights collectively)
        self.batches = self.share.batches(self.examples, self.batch_size)

    def describe(self, seconds: float, step_seconds: float | None) -> str:
        cost = f", about {seconds / step_seconds:.1f} training steps" if step_seconds else ""
        return (
            f"held-out pass: {self.examples} examples ({self.kind}: {self.metric}) on "
            f"{self.world} ranks took {seconds:.1f} s{cost}"
        )

    def run(self, model, generation_model=None, synced: bool = False) -> dict[str, float]:
        """The pass's figures, summed over every rank (a collective: all ranks call it), with
        the evaluate stage's own code. ``generation_model``: the whole model to generate
        with (ZeRO-3 gathered); ``synced``: generate on the sharded ``model`` instead, every
        rank as many calls, in step (transformers' synced_gpus)."""
        import torch

        from snaketune.core.collective import gather_combined
        from snaketune.evaluation.evaluate import heldout_loss

        began = time.monotonic()
        figures: dict[str, float] = heldout_loss(
            model, self.rows, self.batch_size, self.pad, self.share
        )
        if self.kind == "answers":  # and greedy generations, checked as evaluate does
            from snaketune.evaluation.evaluate import score
            from snaketune.evaluation.generation import generate

            with torch.no_grad():
                texts, stopped = generate(
                    generation_model or model,
                    self.tokenizer,
                    self.mine,
                    self.batch_size,
                    self.max_new_tokens,
                    self.batches if synced else None,
                )
            got = {"exact_match": 0.0, "math_verify": 0.0}
            if self.mine:
                got = score(self.mine, texts, stopped, self.tokenizer)[1]
            n = len(self.mine)
            correct, verified = gather_combined(
                [got["exact_match"] * n, got["math_verify"] * n], ("sum", "sum")
            )
            figures.update(
                {"exact_match": correct / self.examples, "math_verify": verified / self.examples}
            )
        figures.update({"examples": self.examples, "seconds": time.monotonic() - began})
        return figures


@contextlib.contextmanager
def padded_attention(model):
    """The pass's padded batches under plain sdpa, as the evaluate stage computes them: the
    kernel of packed training on CPU (snaketune.data.kernels' sdpa_segments) takes no padding."""
    from snaketune.data.kernels import SEGMENTS

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base.config._attn_implementation != SEGMENTS:
        yield
        return
    base.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        base.set_attn_implementation(SEGMENTS)


def install(trainer, heldout: HeldOut) -> None:
    """Make ``trainer.evaluate`` (which transformers calls at ``eval_on_start`` and when a
    callback sets ``should_evaluate``) score ``heldout``: the figures, prefixed ``eval_``,
    go to ``Trainer.log`` (TensorBoard, wandb; TRL's own ``log`` is bypassed, it would mix
    in its training metrics) and to the callbacks' ``on_evaluate``."""
    import types

    from transformers import Trainer

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        from trl.models import unwrap_model_for_generation

        from snaketune.evaluation.sharded import gather_for_generation, is_sharded

        model = self.model
        training = model.training
        model.eval()
        try:
            with padded_attention(model):
                if heldout.kind != "answers":
                    figures = heldout.run(model)
                elif is_sharded(model) and not gather_for_generation(heldout.gather, model):
                    figures = heldout.run(model, synced=True)  # no GPU holds the whole model
                else:  # the whole model on each rank (ZeRO-3: gathered)
                    with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as whole:
                        figures = heldout.run(model, whole)
        finally:
            model.train(training)
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in figures.items()}
        Trainer.log(self, metrics)
        self.control = self.callback_handler.on_evaluate(
            self.args, self.state, self.control, metrics
        )
        return metrics

    trainer.evaluate = types.MethodType(evaluate, trainer)


def trainer_arguments(
    heldout: HeldOut | None, run: Mapping[str, Any], start_step: int
) -> dict[str, Any]:
    """transformers' settings for it: the best metric (``state.best_metric`` and
    ``best_global_step``, kept in every checkpoint) and the pass before the first step."""
    if heldout is None:
        return {}
    return {
        "metric_for_best_model": f"eval_{heldout.metric}",
        "greater_is_better": greater_is_better(heldout.metric),
        "eval_on_start": bool(run["eval_at_start"]) and start_step == 0,
        "per_device_eval_batch_size": heldout.batch_size,
    }


class Schedule:
    """When to evaluate (every ``eval_steps`` steps and at the last), and early stopping
    from the held-out history transformers keeps (``state.log_history``, restored with a
    checkpoint, so a resumed run counts the same)."""

    def __init__(self, eval_steps: int, metric: str, early: Mapping[str, Any] | None, rank: int):
        self.eval_steps, self.metric, self.rank = eval_steps, metric, rank
        self.patience = early["patience"] if early else None
        self.min_delta = float(early.get("min_delta", 0.0)) if early else 0.0
        self.stopped: str | None = None  # why early stopping ended the run
        self.step_seconds: float | None = None
        self._described = False

    def due(self, step: int, max_steps: int) -> bool:
        return step % self.eval_steps == 0 or step >= max_steps

    def stalled(self, history: list[dict[str, Any]]) -> tuple[int, float, int] | None:
        """(evaluations without improvement, best value, its step) once that reaches the
        patience; None before. Evaluations after step 0 count."""
        key, greater = f"eval_{self.metric}", greater_is_better(self.metric)
        best, at, since = None, 0, 0
        for row in history:
            if key not in row or row.get("step", 0) == 0:
                continue
            value = row[key]
            better = best is None or (
                value - best > self.min_delta if greater else best - value > self.min_delta
            )
            if better:
                best, at, since = value, row["step"], 0
            else:
                since += 1
        if self.patience is not None and best is not None and since >= self.patience:
            return since, best, at
        return None


def callback(schedule: Schedule, heldout: HeldOut):
    """The TrainerCallback of ``schedule``: sets ``should_evaluate``, says once what a pass
    costs, stops the run early (a finished run: the worker writes its outputs)."""
    from transformers import TrainerCallback

    class HeldOutCallback(TrainerCallback):
        def __init__(self) -> None:
            self._last = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.monotonic()
            schedule.step_seconds = now - self._last
            self._last = now
            if schedule.due(state.global_step, state.max_steps):
                control.should_evaluate = True
            return control

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            seconds = (metrics or {}).get("eval_seconds", 0.0)
            if schedule.rank == 0 and not schedule._described:  # until a step is timed
                log.info("%s", heldout.describe(seconds, schedule.step_seconds))
                schedule._described = schedule.step_seconds is not None
            stalled = schedule.stalled(state.log_history)
            if stalled is not None and state.global_step < state.max_steps:
                since, best, at = stalled
                schedule.stopped = (
                    f"early stopping at step {state.global_step}: held-out {schedule.metric} "
                    f"has not improved by more than {schedule.min_delta:g} for {since} "
                    f"evaluations (best {best:.4f} at step {at})"
                )
                control.should_training_stop = True
                control.should_save = True  # the run ends as finished, from this step
            self._last = time.monotonic()  # the pass is not a step
            return control

    return HeldOutCallback()
