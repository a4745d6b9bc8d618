"""What the methods trained on the planned pairs of a ``preference`` dataset through TRL's
DPOTrainer share (DPO's loss family, SimPO; the reward model its collator): the collator of
a pair batch (chosen sides first, then rejected: snaketune.data.pairs.pair_batch, padded
on the right; the precomputed reference's log-probs joined by example id), the DPOTrainer
reading the planned pairs, and its figures of a step."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from snaketune.core.io import IdsLog
from snaketune.core.lora_targets import exact_targets
from snaketune.core.throughput import Counted
from snaketune.methods.training import (
    Context,
    PlannedPairs,
    peft_config,
    training_args,
    trl_coef,
)

if TYPE_CHECKING:
    from snaketune.data.batches import Data


class PairCollator(Counted):
    """Collates planned pairs (and their reference log-probs, when precomputed), counting
    the tokens the step callback reports."""

    layout = "padded pairs"

    def __init__(
        self,
        pad_token_id: int,
        reference: dict[str, tuple[float, float]] | None,
        ids_log: Path | None,
        extra=None,
    ):
        super().__init__()
        self.pad_token_id, self.reference = pad_token_id, reference
        self._ids_log = IdsLog(ids_log)
        # what the data's kind adds to a batch (picture pairs: the pictures' model inputs)
        self.extra = extra

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        from snaketune.data.pairs import pair_batch

        ids = [e["example_id"] for e in examples]
        self._ids_log.write(ids)
        batch = pair_batch(examples, self.pad_token_id)
        if self.extra is not None:
            batch.update(self.extra(examples, batch["input_ids"]))
        if self.reference is not None:
            ref = [self.reference[i] for i in ids]
            batch["ref_chosen_logps"] = torch.tensor([c for c, _ in ref], dtype=torch.float32)
            batch["ref_rejected_logps"] = torch.tensor([r for _, r in ref], dtype=torch.float32)
        self.add(
            batch["attention_mask"].sum(dim=1).tolist(), batch["input_ids"].numel(), len(examples)
        )
        return batch


def extra_of(table, tokenizer):
    """What the data's kind adds to a pair batch (None: nothing): picture pairs' pictures."""
    from snaketune.data.kinds import PICTURE_PAIRS

    if not PICTURE_PAIRS.holds(table.column_names):
        return None
    from snaketune.data.picture_pairs import extra_inputs

    return extra_inputs(tokenizer)


def trainer_class():
    """TRL's DPOTrainer reading the planned pairs, each micro batch's loss weighted by its
    pairs (snaketune.methods.training.PlannedPairs), the reference's log-probs read by the
    collator."""
    from trl import DPOTrainer

    class PlannedDPOTrainer(PlannedPairs, DPOTrainer):
        def _precompute_ref_logps(self, dataset, name, batch_size):
            return dataset  # computed by rule reference_logps, read by the collator

    return PlannedDPOTrainer


def pair_trainer(ctx: Context, model, data: Data, callbacks: list, **dpo_config):
    """TRL's DPOTrainer on the planned pairs with ``dpo_config`` (DPOConfig's loss keys) and
    the shared settings of training_args (a method whose loss the DPO trainer computes:
    DPO's family, SimPO)."""
    from unittest import mock

    from trl import DPOConfig
    from trl.trainer import dpo_trainer

    from snaketune.data.picture_pairs import trainer_table

    args = training_args(
        ctx,
        DPOConfig,
        **dpo_config,
        max_length=None,
        model_init_kwargs=None,
        # a mixture of experts: TRL's DPO adds coefficient x the router's loss per micro
        # batch (auto: the model's own coefficient; docs/moe.md)
        router_aux_loss_coef=trl_coef(ctx.run, model),
    )
    # TRL hashes every weight to key its own cache of precomputed log-probs; the stage's
    # content key replaces that cache, so the hash (minutes on a large model) is skipped.
    with mock.patch.object(dpo_trainer, "hash_module", lambda module: None), exact_targets():
        return trainer_class()(
            model=model,
            args=args,
            train_dataset=trainer_table(data.table),
            processing_class=ctx.tokenizer,
            data_collator=data.collator,
            peft_config=peft_config(ctx.run, model),
            callbacks=callbacks,
            planned=data,
            run=ctx.run,
        )


# TRL's log keys -> metrics.jsonl keys.
LOG_KEYS = {
    "rewards/chosen": "reward_chosen",
    "rewards/rejected": "reward_rejected",
    "rewards/accuracies": "reward_accuracy",
    "rewards/margins": "reward_margin",
    "logps/chosen": "logp_chosen",
    "logps/rejected": "logp_rejected",
    "aux_loss": "aux_loss",  # a mixture of experts: TRL adds the router's loss itself
}


def step_fields(logs: dict[str, Any]) -> dict[str, float]:
    """The DPO figures of a step's logs: rewards of each side, reward accuracy and margin,
    the policy's log-probs."""
    return {new: logs[old] for old, new in LOG_KEYS.items() if old in logs}
