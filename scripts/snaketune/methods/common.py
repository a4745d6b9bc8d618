"""What every training method shares, and the interface a method fills in.

A method (snaketune.methods.sft, .grpo) is a ``Method``: its data for this rank (from the
rank's planned rows), its trainer (a transformers Trainer subclass reading the planned
batches through ``batches.planned_loader``, built on ``training_args`` and
``peft_config``), the extra fields of its per-step record, and how many rows of a step one
planned example becomes. The worker (snaketune.worker) does the rest the same way for all.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from snaketune.batches import Data, PlanBatches
from snaketune.heldout_pass import trainer_arguments
from snaketune.job import WorkerEnv
from snaketune.model import load_deepspeed
from snaketune.vocabulary import trains_lora


@dataclass(frozen=True)
class Method:
    """A training method, as the worker uses it."""

    name: str
    # (run, rows, batches, tokenizer, kernel, ids_log) -> Data: this rank's data
    data: Callable[[dict, Any, PlanBatches, Any, str, Path | None], Data]
    # (ctx, model, data, callbacks) -> a Trainer
    trainer: Callable[..., Any]
    # the step's logs -> the method's own figures for metrics.jsonl
    step_fields: Callable[[dict[str, Any]], dict[str, Any]]
    # rows of a step that one planned example becomes (GRPO: its completions)
    rows_per_example: Callable[[dict[str, Any]], int]
    # a start-up log line of what the method does this run ("" for none)
    describe: Callable[[dict[str, Any], dict[str, Any]], str]
    # the held-out figure that decides the best checkpoint and early stopping by default
    # (export.metric: auto; snaketune.heldout): loss, or exact_match of greedy generations
    heldout_metric: str = "loss"


@dataclass
class Context:
    """Everything a method's trainer is built from."""

    run: dict[str, Any]
    env: WorkerEnv
    model_dir: Path
    deepspeed: Path
    ckpt_dir: Path
    out: Path
    precision: str
    liger: bool
    tokenizer: Any
    quantized: dict[str, Any] | None = None  # the 4-bit base's record (snaketune.qlora)
    heldout: Any = None  # the held-out set scored while training (snaketune.heldout.HeldOut)
    start_step: int = 0  # the step this job resumes from (0: a new run)


def training_args(ctx: Context, config_class, **method_args):
    """The settings every method shares (batch, schedule, precision, DeepSpeed, saving,
    logging), as ``config_class`` (a transformers TrainingArguments subclass)."""
    run = ctx.run
    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(ctx.out / "tensorboard"))
    report_to = ["tensorboard"]
    if run["wandb"]["enabled"]:
        os.environ.setdefault("WANDB_MODE", run["wandb"]["mode"])
        os.environ.setdefault("WANDB_PROJECT", run["wandb"]["project"])
        report_to.append("wandb")
    return config_class(
        output_dir=str(ctx.ckpt_dir),
        per_device_train_batch_size=run["micro_batch_size"],
        gradient_accumulation_steps=run["gradient_accumulation_steps"],
        num_train_epochs=run.get("epochs", 1),
        max_steps=run.get("max_steps", -1),
        learning_rate=run["learning_rate"],
        lr_scheduler_type=run["lr_scheduler"],
        warmup_steps=run["warmup_ratio"],
        weight_decay=run["weight_decay"],
        max_grad_norm=run["max_grad_norm"],
        seed=run["seed"],
        data_seed=run["seed"],
        bf16=ctx.precision == "bf16",
        fp16=ctx.precision == "fp16",
        use_cpu=not torch.cuda.is_available(),
        use_liger_kernel=ctx.liger,
        gradient_checkpointing=run["gradient_checkpointing"],
        gradient_checkpointing_kwargs={"use_reentrant": False},
        save_strategy="steps",
        save_steps=run["save_steps"],
        save_total_limit=None,  # pruned by StepCallback, complete checkpoints only
        logging_steps=run["logging_steps"],
        report_to=report_to,
        deepspeed=load_deepspeed(ctx.deepspeed),
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        average_tokens_across_devices=True,  # loss = mean over the global batch's label tokens
        ddp_timeout=int(run["timeout_minutes"] * 60),
        log_level="warning",
        log_level_replica="warning",
        **trainer_arguments(ctx.heldout, run, ctx.start_step),
        **method_args,
    )


def peft_config(run: dict[str, Any]):
    if not trains_lora(run):
        return None
    from peft import LoraConfig

    lora = run["lora"]
    return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      target_modules=lora["target_modules"], task_type="CAUSAL_LM",
                      modules_to_save=lora["modules_to_save"] or None)  # fmt: skip
