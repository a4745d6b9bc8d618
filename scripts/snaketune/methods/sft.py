"""Supervised fine-tuning (config methods ``lora`` and ``full``): trl's SFTTrainer on the
planned micro batches, packed or padded (snaketune.data.packing), LoRA through peft.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from snaketune.core.lora_targets import exact_targets
from snaketune.methods.common import Method, RankRows
from snaketune.methods.training import (
    ROUTER_FIELDS,
    Context,
    Lean,
    Router,
    peft_config,
    training_args,
)

if TYPE_CHECKING:
    from snaketune.data.batches import Data


def data(rows: RankRows) -> Data:
    """This rank's rows as planned, collated in the run's layout (packed or padded)."""
    from snaketune.data.kernels import layout_for
    from snaketune.data.kinds import PICTURES
    from snaketune.data.packing import Collator

    length = rows.run["max_length"]
    if PICTURES.holds(rows.table.column_names):  # padded, with the pictures' model inputs
        from snaketune.data.pictures import PictureCollator

        return rows.collated(PictureCollator(rows.pad, length, rows.ids_log, rows.tokenizer))
    layout = layout_for(rows.run["packing"], rows.kernel)
    return rows.collated(Collator(layout, rows.pad, length, rows.ids_log))


def trainer(ctx: Context, model, data: Data, callbacks: list):
    """Supervised fine-tuning: trl's SFTTrainer on the planned micro batches."""
    from torch.utils.data import DataLoader
    from transformers import Trainer
    from trl import SFTConfig, SFTTrainer

    args = training_args(
        ctx,
        SFTConfig,
        dataset_kwargs={"skip_prepare_dataset": True},
        max_length=None,
        packing=False,
        model_init_kwargs=None,
    )

    router = Router.prepare(model, ctx.run)  # a mixture of experts: its balance

    class PlannedSFTTrainer(Lean, SFTTrainer):
        # The model's own loss (transformers' Trainer.compute_loss). SFTTrainer's adds token
        # accuracy and entropy metrics, gathered across all ranks with a host sync four times
        # per micro batch; on the CPU benchmark that alone cost a fifth of the throughput.
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if router is None:
                return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
            loss, outputs = Trainer.compute_loss(self, model, inputs, True, num_items_in_batch)
            if self.model.training:
                loss = loss + router.term(outputs, inputs.get("attention_mask"))
                router.record(self, outputs, inputs)
            return (loss, outputs) if return_outputs else loss

        def get_train_dataloader(self) -> DataLoader:
            from snaketune.data.batches import planned_loader

            return planned_loader(data.table, data.batches, data.collator)

    with exact_targets():
        return PlannedSFTTrainer(
            model=model,
            args=args,
            train_dataset=data.table,
            # a picture set's processor (TRL's vision path), else the tokenizer
            processing_class=getattr(data.collator, "processor", ctx.tokenizer),
            data_collator=data.collator,
            peft_config=peft_config(ctx.run, model),
            callbacks=callbacks,
        )


# Method lora: an adapter on rows; method full: every weight.
LORA = Method(
    name="sft",
    data=data,
    trainer=trainer,
    step_fields=lambda logs: {k: logs[k] for k in ROUTER_FIELDS if k in logs},
    rows_per_example=lambda run: 1,
    describe=lambda run, manifest: "",
    trains_on="rows",
    splits_sequences=True,
    takes_pictures=True,
    starts_from_runs=True,  # chat SFT from a continued pre-training run, say
    adapter="lora",
    summary="supervised fine-tuning of a peft adapter",
)
FULL = replace(LORA, adapter="full", summary="supervised fine-tuning of every weight")
