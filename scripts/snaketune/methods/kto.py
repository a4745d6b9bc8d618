"""KTO (config method ``kto``): tuning on single responses labelled desirable or not (the
``labelled`` kind, snaketune.data.labelled: a ``labelled`` set's responses, or a preference
set's chosen responses desirable and its rejected ones not) with TRL 1.16's stable
KTOTrainer, LoRA or every weight.

KTO's loss (Ethayarajh et al. 2024, eq. 7-8) of a response y to a prompt x, with
r = log p(y|x) - log p_ref(y|x) summed over the response tokens and z the reference point
(below), is ``desirable_weight`` x (1 - sigmoid(beta (r - z))) for a desirable one and
``undesirable_weight`` x (1 - sigmoid(beta (z - r))) for an undesirable one; a micro
batch's loss is their mean. z is KTO's estimate of the KL divergence between the policy and
the reference: the mean of log p - log p_ref over KL sequences (each prompt with another
prompt's response: snaketune.data.labelled), averaged over the ranks' micro batches of
that pass (TRL gathers it), not below 0, with no gradient.

The reference:

- ``reference: precomputed`` (``auto``, the default, on a LoRA run): each response's
  reference log-probs come from rule reference_logps, the stage DPO reads (the same pairs'
  chosen and rejected sides: a DPO and a KTO run from the same start on the same pairs
  share one job); the KL sequences' are computed in the step from the base with the
  adapter off (they depend on the plan, not on the pair alone);
- ``reference: live`` (``auto`` on a full fine-tune): TRL's own, each step: the base with
  the adapter off (LoRA) or a frozen copy of the starting model (full fine-tuning: the
  memory plan counts it).

As for DPO, a token-balanced plan gives micro batches of unequal pair counts: each micro
batch's loss is weighted by its pairs over ``micro_batch_size`` (PlannedPairs), so a step's
loss is the mean over every response of the global batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snaketune.core.errors import ConfigError
from snaketune.core.io import IdsLog
from snaketune.core.lora_targets import exact_targets
from snaketune.core.throughput import Counted
from snaketune.methods.common import Method, RankRows
from snaketune.methods.needs import REFERENCE
from snaketune.methods.outputs import PREFERENCE_COLUMNS, preference_quarter
from snaketune.methods.training import (
    Context,
    PlannedPairs,
    peft_config,
    training_args,
    trl_coef,
)

if TYPE_CHECKING:
    from snaketune.data.batches import Data


class KTOCollator(Counted):
    """Planned examples (labelled responses, or pairs as two of them) with their KL
    sequences (each example's partner: the next example in this rank's rows) and, when
    precomputed, each response's reference log-probs; counting what the step callback
    reports."""

    layout = "padded labelled responses"

    def __init__(
        self,
        table,
        pad_token_id: int,
        reference: dict[str, tuple[float, ...]] | None,
        ids_log: Path | None,
    ):
        super().__init__()
        self.table, self.pad_token_id, self.reference = table, pad_token_id, reference
        ids = [] if table is None else table["example_id"]
        self.row_of = {example_id: k for k, example_id in enumerate(ids)}
        self._ids_log = IdsLog(ids_log)

    def partner(self, example_id: str) -> dict[str, Any]:
        return self.table[(self.row_of[example_id] + 1) % len(self.table)]

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        from snaketune.data.labelled import batch

        ids = [e["example_id"] for e in examples]
        self._ids_log.write(ids)
        out = batch(examples, self.pad_token_id, [self.partner(i) for i in ids])
        if self.reference is not None:  # in the batch's order: by side, then by example
            ref = [self.reference[i] for i in ids]
            out["ref_logps"] = torch.tensor(
                [r[side] for side in range(len(ref[0])) for r in ref], dtype=torch.float32
            )
        self.add(out["attention_mask"].sum(dim=1).tolist(), out["input_ids"].numel(), len(examples))
        return out


def reference(run: Mapping[str, Any]) -> str:
    """The run's reference, ``auto`` resolved: precomputed for a LoRA run, else live."""
    setting = run["kto"]["reference"]
    if setting == "auto":
        return "precomputed" if METHOD.adapter_of(run) == "lora" else "live"
    return setting


def data(rows: RankRows) -> Data:
    """This rank's planned examples (labelled responses, or pairs), with the precomputed
    reference log-probs of each response."""
    from snaketune.evaluation.logps import read_reference

    logps = None
    if reference(rows.run) == "precomputed":
        logps = rows.scored(REFERENCE, read_reference, "examples")
    return rows.collated(KTOCollator(rows.table, rows.pad, logps, rows.ids_log))


def trainer_class():
    """TRL's KTOTrainer reading the planned pairs as labelled responses, each micro batch's
    loss weighted by its pairs (PlannedPairs); with a precomputed reference, the KL
    sequences' reference log-probs from the base with the adapter off, each step."""
    import torch
    from trl import KTOTrainer
    from trl.trainer import kto_trainer

    class PlannedKTOTrainer(PlannedPairs, KTOTrainer):
        def __init__(self, *args, **kwargs):
            from snaketune.data.kinds import kind_of_columns

            # responses a planned example gives: a pair's 2, a labelled response 1
            self.sequences = kind_of_columns(kwargs["train_dataset"].column_names).sequences
            super().__init__(*args, **kwargs)

        def _precompute_ref_logps(self, dataset, name, batch_size):
            return dataset  # computed by rule reference_logps, read by the collator

        def pairs_in(self, inputs) -> int:
            return len(inputs["label"]) // self.sequences  # the micro batch's examples

        def _compute_loss(self, model, inputs, return_outputs):
            if self.precompute_ref_logps and "ref_KL_logps" not in inputs:
                batch = {k: v.to(self.accelerator.device) for k, v in inputs.items()}
                unwrapped = self.accelerator.unwrap_model(self.model)
                with (
                    torch.no_grad(),
                    kto_trainer.disable_gradient_checkpointing(
                        self.model, self.args.gradient_checkpointing_kwargs
                    ),
                    kto_trainer.use_adapter(unwrapped, adapter_name=None),
                ):
                    inputs = {**batch, "ref_KL_logps": self._compute_kl_logps(self.model, batch)}
            return super()._compute_loss(model, inputs, return_outputs)

    return PlannedKTOTrainer


def trainer(ctx: Context, model, data: Data, callbacks: list):
    """TRL's KTOTrainer on the planned pairs, with the shared settings of training_args."""
    from unittest import mock

    from trl import KTOConfig
    from trl.trainer import kto_trainer

    kto = ctx.run["kto"]
    args = training_args(
        ctx,
        KTOConfig,
        beta=kto["beta"],
        desirable_weight=kto["desirable_weight"],
        undesirable_weight=kto["undesirable_weight"],
        max_length=None,
        model_init_kwargs=None,
        precompute_ref_log_probs=reference(ctx.run) == "precomputed",
        router_aux_loss_coef=trl_coef(ctx.run, model),
    )
    # the responses of a device's micro batch: n pairs are 2n (TRL refuses fewer than 2 per
    # device; its KL sequences here need no second example: snaketune.data.labelled)
    args.per_device_train_batch_size = 2 * ctx.run["micro_batch_size"]
    with mock.patch.object(kto_trainer, "hash_module", lambda module: None), exact_targets():
        return trainer_class()(
            model=model,
            args=args,
            train_dataset=data.table,
            processing_class=ctx.tokenizer,
            data_collator=data.collator,
            peft_config=peft_config(ctx.run, model),
            callbacks=callbacks,
            planned=data,
            run=ctx.run,
        )


# TRL's log keys -> metrics.jsonl keys.
LOG_KEYS = {
    "kl": "kl",
    "rewards/chosen": "reward_chosen",
    "rewards/rejected": "reward_rejected",
    "rewards/margins": "reward_margin",
    "logps/chosen": "logp_chosen",
    "logps/rejected": "logp_rejected",
    "aux_loss": "aux_loss",
}


def step_fields(logs: dict[str, Any]) -> dict[str, float]:
    """KTOTrainer's figures of a step: the KL estimate, each label's mean reward and summed
    log-prob, the margin between the rewards."""
    return {new: logs[old] for old, new in LOG_KEYS.items() if old in logs}


def describe(run: dict[str, Any], manifest: dict[str, Any]) -> str:
    kto = run["kto"]
    return (
        f"KTO: {manifest['global_batch']} examples per step (a labelled response, or a "
        f"pair: a desirable and an undesirable one); beta {kto['beta']}, weights "
        f"{kto['desirable_weight']} / "
        f"{kto['undesirable_weight']}; reference {reference(run)}; padded"
    )


def check(where: str, run: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """A precomputed reference needs an adapter: the KL sequences' reference is the base
    with the adapter off (``auto`` picks live without one)."""
    if run["kto"]["reference"] == "precomputed" and METHOD.adapter_of(run) != "lora":
        raise ConfigError(
            f"{where}.kto.reference: precomputed needs a LoRA run (its KL "
            "term's reference is the base with the adapter off, each step); "
            "set reference: live (a frozen copy of the start, counted in the "
            "memory plan) or add a `lora` block"
        )


# runs.<run>.kto: its keys and defaults (snaketune.methods.compose_schema puts it into the
# run schema).
SCHEMA = """\
description: >-
  KTO settings; TRL's KTOConfig keys of the same names.
type: object
additionalProperties: false
properties:
  beta:
    description: >-
      Strength of the tie to the reference (TRL's beta): higher keeps the tuned model
      closer to the model it starts from.
    type: number
    exclusiveMinimum: 0
    default: 0.1
  desirable_weight:
    description: >-
      Weight of a desirable response's loss. With more undesirable than desirable
      responses, the KTO paper keeps desirable_weight x desirable count over
      undesirable_weight x undesirable count between 1 and 4/3.
    type: number
    exclusiveMinimum: 0
    default: 1.0
  undesirable_weight:
    description: Weight of an undesirable response's loss.
    type: number
    exclusiveMinimum: 0
    default: 1.0
  reference:
    description: >-
      precomputed (LoRA runs): each response's reference log-probs are rule
      reference_logps' (computed once per reference model and tokenized data, shared with
      DPO runs), the KL sequences' the base with the adapter off, each step. live: all
      computed in each step, from the base with the adapter off (LoRA) or a frozen copy
      of the model (full fine-tuning: the memory plan counts it). auto: precomputed for
      a LoRA run, live for a full fine-tune.
    enum: [auto, precomputed, live]
    default: auto
"""

METHOD = Method(
    name="kto",
    data=data,
    trainer=trainer,
    step_fields=step_fields,
    rows_per_example=lambda run: 1,
    describe=describe,
    trains_on="labelled",
    adapter="optional",
    block="kto",
    summary=(
        "KTO, tuning on single responses labelled desirable or not (TRL's KTOTrainer; from "
        "a `preference` dataset, its chosen responses desirable and its rejected ones not), "
        "LoRA when the run has a `lora` block, else every weight (docs/methods.md)"
    ),
    schema=SCHEMA,
    starts_from_runs=True,
    packs=False,  # KTOTrainer's batches are padded
    check=check,
    # a micro batch of n pairs is 2n responses (and 2n KL sequences, without gradient); a
    # live reference of a full fine-tune is a second model
    memory=lambda run, on_gpu: {
        "sequences_per_example": 2,
        "reference": reference(run) == "live",
    },
    needs=lambda run: {REFERENCE: {}} if reference(run) == "precomputed" else {},
    eval_settings=lambda run: {"beta": run["kto"]["beta"]},
    headline=("preference_accuracy",),
    summary_figures=preference_quarter,
    summary_columns=PREFERENCE_COLUMNS,
)
