"""Held-out evaluation while training (``eval_steps``), the best checkpoint and early
stopping: the settings (checked at parse time, handed to the train job). The pass itself,
in the training job, is snaketune.evaluation.heldout_pass.

Every ``eval_steps`` optimizer steps (and at the last step; before the first with
``eval_at_start``) the training job scores the run's eval set, the same tokenized file the
evaluate stage reads, split across every rank so that each example is scored exactly once:

- ``loss`` (SFT and DPO by default; DPO scores its chosen responses): the mean negative
  log-likelihood per response token, summed over the ranks' shares before dividing, so it
  is the evaluate stage's ``loss`` for the same weights;
- ``exact_match`` / ``math_verify`` (GRPO by default, any run that asks): greedy
  generations checked as the evaluate stage checks them
  (snaketune.evaluation.evaluate.score), beside the loss.

``eval.during_training_limit`` scores a fixed subset drawn with the run's seed instead of
the whole set. The figures go through transformers' own path (``Trainer.log`` to
TensorBoard and wandb, ``on_evaluate``, ``state.best_metric`` / ``best_global_step`` and
``state.log_history``, which checkpoints keep and a resume restores); the step callback
writes them to metrics.jsonl as a row of their own (``heldout_loss`` and so on, no
``loss``: readers of the training curve skip it) and into the
completion mark of the checkpoint saved at that step (snaketune.core.checkpoints).

``early_stopping`` ends the run as finished once its figure has not improved by more than
``min_delta`` for ``patience`` evaluations in a row, counted from ``state.log_history`` (so
a resumed run counts the same).

With ``export.checkpoint: best`` the job loads the best evaluated checkpoint's weights
before writing its outputs, so conversion, merge, evaluation, report and publish all use
them; ``save_total_limit`` never prunes that checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ANSWERS = ("exact_match", "math_verify")  # figures of greedy generations
EXPORTED = "exported.json"  # beside the train stage's model: which step it is, and why


def check_run(where: str, run: Mapping[str, Any]) -> str | None:
    """The first problem of a run's held-out settings, as one line (None: fine)."""
    steps = run.get("eval_steps")
    best = (run.get("export") or {}).get("checkpoint", "last") == "best"
    if steps is None:
        if best:
            return (
                f"{where}.export.checkpoint: best needs held-out figures while training; "
                "set eval_steps (and eval_dataset), or checkpoint: last"
            )
        if "early_stopping" in run:
            return f"{where}.early_stopping: needs eval_steps (and eval_dataset); set eval_steps"
        return None
    if "eval_dataset" not in run:
        return (
            f"{where}.eval_steps: nothing to evaluate on; set eval_dataset to a held-out "
            "dataset, or drop eval_steps"
        )
    if best and steps % run["save_steps"]:
        return (
            f"{where}.export.checkpoint: best needs a checkpoint at every evaluation: "
            f"eval_steps ({steps}) must be a multiple of save_steps "
            f"({run['save_steps']})"
        )
    return None


def spec_of(run: Mapping[str, Any], eval_tokenized: str) -> dict[str, Any]:
    """What the training job needs to evaluate (its run spec's ``heldout``)."""
    ev, export = run["eval"], run["export"]
    # the metric as written: `auto` is the method's own (snaketune.methods, heldout_metric)
    spec = {
        "path": eval_tokenized,
        "metric": export["metric"],
        "checkpoint": export["checkpoint"],
        "limit": ev.get("during_training_limit"),
        "batch_size": ev["batch_size"],
        "answers": bool(ev["during_training_answers"]),
        "max_new_tokens": ev["max_new_tokens"],
    }
    if ev.get("gather_for_generation", "auto") != "auto":  # the default is left unsaid
        spec["gather_for_generation"] = ev["gather_for_generation"]
    return spec


def greater_is_better(metric: str) -> bool:
    return metric in ANSWERS


def split_rows(metrics: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl's training rows and held-out rows (``heldout_loss``, no ``loss``)."""
    held = [m for m in metrics if "heldout_loss" in m]
    return [m for m in metrics if "heldout_loss" not in m], held


def start_figure(metrics: list[dict[str, Any]], metric: str) -> float | None:
    """The held-out ``metric`` of the pass before the first step (eval_at_start), from
    metrics.jsonl's rows; None without one."""
    for row in metrics:
        if row.get("step") == 0 and f"heldout_{metric}" in row:
            return row[f"heldout_{metric}"]
    return None


def worse_than_start(metric: str, start: float, best: float, step: int) -> str:
    """The line a run whose start beats every evaluated checkpoint gets (log, report)."""
    return (
        f"the held-out {metric} before training, {start:.4g}, beats every evaluated "
        f"checkpoint (the best: {best:.4g}, step {step}); export.checkpoint: best exports "
        f"step {step} all the same: this run made the model worse on the held-out set by "
        "this figure (compare the base model's evaluation; a lower learning_rate or fewer "
        "steps may keep what it knew)"
    )
