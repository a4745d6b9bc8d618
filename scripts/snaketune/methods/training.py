"""What every method's trainer is built from: the ``Context`` the worker gives it, the
settings every method shares (``training_args``), what each trainer takes off transformers'
per-step work (``Lean``), the LoRA adapter (``peft_config``) and a mixture of experts' router
term (``Router``, ``trl_coef``).
Worker side: torch, transformers and peft are imported where they are used, so a method
module that imports this one stays light for the config side."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from snaketune.core.job import WorkerEnv
    from snaketune.data.batches import Data


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
    quantized: dict[str, Any] | None = None  # the 4-bit base's record (snaketune.core.qlora)
    heldout: Any = None  # the held-out set scored while training (snaketune.core.heldout.HeldOut)
    start_step: int = 0  # the step this job resumes from (0: a new run)
    load_universal: bool = False  # it resumes from a universal checkpoint (snaketune.core.job)
    # the scoring stages' outputs it reads, by stage name (reference_logps, teacher_logps)
    inputs: Mapping[str, str] = field(default_factory=dict)


def training_args(ctx: Context, config_class, **method_args):
    """The settings every method shares (batch, schedule, precision, DeepSpeed, saving,
    logging), as ``config_class`` (a transformers TrainingArguments subclass)."""
    import torch

    from snaketune.evaluation.heldout_pass import trainer_arguments
    from snaketune.evaluation.model import load_deepspeed

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
        deepspeed=load_deepspeed(ctx.deepspeed, ctx.load_universal),
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


def peft_config(run: dict[str, Any], model):
    """The run's LoRA config for ``model`` (its targets resolved on a mixture of experts:
    snaketune.core.lora_targets); None for a run that trains every weight. Build the trainer
    that applies it under snaketune.core.lora_targets.exact_targets."""
    from snaketune.methods import method_of

    if method_of(run).adapter_of(run) != "lora":
        return None
    from peft import LoraConfig

    from snaketune.core.lora_targets import resolve

    lora = run["lora"]
    # a score head (a reward model): peft trains the new head whole (modules_to_save)
    task = "SEQ_CLS" if method_of(run).head == "score" else "CAUSAL_LM"
    targets = resolve(model, lora)
    # peft refuses any dropout in a config with adapters on fused experts' parameters: the
    # config says none, and made_ready puts the run's dropout on the other adapters
    dropout = 0.0 if targets.get("target_parameters") else lora["dropout"]
    return LoraConfig(
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=dropout,
        task_type=task,
        modules_to_save=lora["modules_to_save"] or None,
        **targets,
    )


class Lean:
    """What every method's trainer (``class T(Lean, TRLTrainer)``) takes off transformers'
    per-step work, the figures unchanged: the FLOP count (``total_flos``) reads the model's
    parameter count once, where Trainer counts every weight tensor again each micro batch; in
    a job of one rank it is kept without a broadcast."""

    _counted_params: int | None = None

    def floating_point_ops(self, inputs) -> int:
        main = getattr(self.model, "main_input_name", "input_ids")
        if main not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        if self._counted_params is None:  # the weights trained or not: fixed for the run
            self._counted_params = self.model.num_parameters(exclude_embeddings=True)
        return 6 * inputs[main].numel() * self._counted_params

    def store_flos(self) -> None:
        if self.args.world_size > 1:
            return super().store_flos()
        self.state.total_flos += self.current_flos
        self.current_flos = 0


class PlannedPairs(Lean):
    """What a trainer on planned pairs (DPO's, a reward model's) adds to its TRL trainer
    (``class T(PlannedPairs, TRLTrainer)``): the pairs as tokenized and planned
    (``planned``: this rank's Data, read in the plan's order), and each micro batch's loss
    weighted by its pairs over the run's ``micro_batch_size`` (``run``: the run's settings;
    the pairs one micro batch plans, not a step's: gradient accumulation sums the micro
    batches). TRL averages a micro batch's pairs; a token-balanced plan gives micro batches
    of unequal pair counts, so weighted, a step's loss is the mean over every pair of the
    global batch (1 when the counts are equal)."""

    def __init__(self, *args, planned: Data | None, run: dict[str, Any], **kwargs):
        self.planned, self.micro_batch_size = planned, run["micro_batch_size"]
        super().__init__(*args, **kwargs)

    def _prepare_dataset(self, dataset, *args, **kwargs):
        return dataset  # tokenized by tokenize_dataset (snaketune.data.pairs)

    def get_train_dataloader(self):
        from snaketune.data.batches import planned_loader

        d = self.planned
        return planned_loader(d.table, d.batches, d.collator)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            return loss
        return loss * self.pairs_in(inputs) / self.micro_batch_size

    def pairs_in(self, inputs) -> int:
        """The pairs of a micro batch: its sequences are the chosen sides, then the rejected."""
        return inputs["input_ids"].shape[0] // 2


# ----------------------------------------------------------------------------- router
# A mixture of experts' router kept in balance while training: the load-balancing
# auxiliary loss in the loss, and each step's expert load in the metrics.
#
# transformers' MoE models compute the auxiliary loss (``output_router_logits``; Switch
# Transformer's: experts x the sum over experts of the fraction of routing choices sent to it
# times its mean router probability, over the micro batch's tokens and every MoE layer) and
# add ``router_aux_loss_coef`` times it to their loss. Under the trainer that loss is then
# scaled for the token-balanced cross-entropy (times the ranks, gradients summed over the
# micro batches of a step), which would weigh the auxiliary term ranks x accumulation times
# too much. So the model's own addition is switched off and the term is added here at
# coefficient / accumulation per micro batch: what the step optimises, and the ``aux_loss``
# it logs, is the cross-entropy's token mean plus the coefficient times the mean of the
# micro batches' auxiliary losses over every rank (tests/test_moe.py checks both against a
# computation written out from the router's logits).
#
# ``router_aux_loss_coef`` (the run's key): `auto` is the model's config.json value; 0 turns
# the term off (the load is still logged).
def trl_coef(run: dict[str, Any], model) -> float | None:
    """The ``router_aux_loss_coef`` a TRL preference trainer (DPO's, KTO's) takes, which adds
    coefficient x the router's loss per micro batch itself: None (the model's own) for
    ``auto`` or a model without router logits, else the run's."""
    setting = run["router_aux_loss_coef"]
    if setting == "auto" or not hasattr(model.config, "output_router_logits"):
        return None
    return setting


class Router:
    """The auxiliary loss and the expert load of one training job's MoE model."""

    def __init__(self, coef: float, experts: int, top_k: int, accumulation: int):
        self.coef, self.experts, self.top_k = coef, experts, top_k
        self.accumulation = accumulation

    @classmethod
    def prepare(cls, model, run: dict[str, Any]) -> Router | None:
        """Router logits on for ``model`` (its own addition of the term off); None for a
        dense model."""
        config = model.config
        top_k = getattr(config, "num_experts_per_tok", None)
        if not top_k or not hasattr(config, "output_router_logits"):
            return None
        setting = run.get("router_aux_loss_coef", "auto")
        coef = getattr(config, "router_aux_loss_coef", None) if setting == "auto" else setting
        if coef is None:  # DeepSeek-V3, GLM-4.5: a bias on the router balances the experts
            import logging

            logging.getLogger(__name__).info(
                "model_type %s balances its experts without an auxiliary loss: no balance "
                "term added to the loss (router_aux_loss_coef sets one)",
                config.model_type,
            )
            coef = 0.0
        config.output_router_logits = True
        for module in model.modules():  # the causal LM reads its coefficient at build time
            if hasattr(module, "router_aux_loss_coef"):
                module.router_aux_loss_coef = 0.0
        from snaketune.core.configfields import experts_of

        experts = experts_of(config.to_dict())
        return cls(float(coef), int(experts), int(top_k), run["gradient_accumulation_steps"])

    def aux(self, outputs, mask=None):
        """The micro batch's auxiliary loss: the model's own, or, for a family whose model
        computes none (it balances its experts otherwise), the same Switch Transformer
        load-balancing loss over its router logits, by transformers' function."""
        if outputs.aux_loss is not None:
            return outputs.aux_loss
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        return load_balancing_loss_func(outputs.router_logits, self.experts, self.top_k, mask)

    def term(self, outputs, mask=None):
        """What one micro batch adds to the loss the trainer returns (nothing where the
        coefficient is 0)."""
        if not self.coef:
            return 0.0
        return self.coef * self.aux(outputs, mask) / self.accumulation

    def load(self, outputs, mask=None):
        """Routing choices per expert over the micro batch's tokens (padding left out) and
        every MoE layer."""
        import torch

        counts = torch.zeros(self.experts, device=outputs.logits.device)
        keep = None if mask is None else mask.reshape(-1).bool()
        for logits in outputs.router_logits or ():
            chosen = logits.topk(self.top_k, dim=-1).indices
            if keep is not None and chosen.shape[0] == keep.shape[0]:
                chosen = chosen[keep]
            counts += torch.bincount(chosen.reshape(-1), minlength=self.experts).to(counts)
        return counts

    def record(self, trainer, outputs, inputs) -> None:
        """The micro batch's auxiliary loss (mean over ranks) and expert load (summed over
        ranks: the busiest expert's share over an even share, 1.0 balanced) into the
        trainer's metrics, which TRL's log averages over the step's micro batches."""
        aux = self.aux(outputs, inputs.get("attention_mask"))
        aux = trainer.accelerator.gather(aux.detach().float().reshape(1))
        counts = trainer.accelerator.gather(self.load(outputs, inputs.get("attention_mask"))[None])
        total = counts.reshape(-1, self.experts).sum(0)
        even = total.sum() / self.experts
        metrics = trainer._metrics["train"]
        metrics["aux_loss"].append(aux.mean().item())
        metrics["expert_load"].append((total.max() / even).item() if even > 0 else 0.0)


ROUTER_FIELDS = ("aux_loss", "expert_load")  # the step's metrics.jsonl fields of an MoE run
