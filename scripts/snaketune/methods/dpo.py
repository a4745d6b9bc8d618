"""Preference tuning (config method ``dpo``): TRL's DPOTrainer and its loss family on the
planned pairs of a ``preference`` dataset (snaketune.data.pairs), LoRA or every weight.

A pair is one planned example: both its sides are in the same micro batch (chosen sides
first, then rejected: snaketune.data.pairs.pair_batch), padded on the right. TRL 1.16's
DPOTrainer has no padding-free path (its ``padding_free`` is disabled after a refactor and
falls back to padding), so DPO batches are padded everywhere; the shard plan still
balances each step's pairs across ranks by their tokens.

The reference:

- ``reference: precomputed`` (default): the reference log-probs of every training pair
  come from rule reference_logps (snaketune.evaluation.logps), joined by example id in the collator;
  no training job holds a reference model;
- ``reference: live``: TRL's own, each step: the base with the adapter off (LoRA) or a
  frozen copy of the starting model (full fine-tuning).

The loss of a step is the mean over every pair of the global batch: TRL averages a micro
batch's pairs, and a token-balanced plan gives micro batches of unequal pair counts, so
each micro batch's loss is weighted by its pairs over ``micro_batch_size`` (1 when they are
equal, as TRL does). TRL's step figures gather per-pair tensors across ranks; with unequal
counts those gathers go through snaketune.core.collective.ragged_gather (the worker installs it),
so each figure is the mean over every pair of the micro batch round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from snaketune.core.errors import ConfigError
from snaketune.methods.common import Method, RankRows
from snaketune.methods.needs import REFERENCE
from snaketune.methods.outputs import PREFERENCE_COLUMNS, PREFERENCE_PANEL, preference_quarter
from snaketune.methods.pair_trainer import PairCollator, extra_of, pair_trainer, step_fields
from snaketune.methods.training import (
    Context,
)

if TYPE_CHECKING:
    from snaketune.data.batches import Data


def data(rows: RankRows) -> Data:
    """This rank's planned pairs, with the precomputed reference log-probs of each."""
    from snaketune.evaluation.logps import read_reference

    reference = None
    if rows.run["dpo"]["reference"] == "precomputed":
        reference = rows.scored(REFERENCE, read_reference, "pairs")
    extra = extra_of(rows.table, rows.tokenizer)
    return rows.collated(PairCollator(rows.pad, reference, rows.ids_log, extra))


def losses(dpo: dict[str, Any]) -> list[str]:
    return dpo["loss_type"] if isinstance(dpo["loss_type"], list) else [dpo["loss_type"]]


def trainer(ctx: Context, model, data: Data, callbacks: list):
    """TRL's DPOTrainer on the planned pairs, with the shared settings of training_args."""
    dpo = ctx.run["dpo"]
    return pair_trainer(
        ctx,
        model,
        data,
        callbacks,
        beta=dpo["beta"],
        loss_type=losses(dpo),
        loss_weights=dpo.get("loss_weights"),
        label_smoothing=dpo["label_smoothing"],
        precompute_ref_log_probs=dpo["reference"] == "precomputed",
    )


def describe(run: dict[str, Any], manifest: dict[str, Any]) -> str:
    dpo = run["dpo"]
    return (
        f"DPO: {manifest['global_batch']} pairs per step; loss {'+'.join(losses(dpo))}, "
        f"beta {dpo['beta']}; reference {dpo['reference']}; padded pairs (TRL 1.16's "
        "DPOTrainer has no padding-free path)"
    )


def check(where: str, run: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """Its loss weights match its losses; EXO needs label smoothing."""
    dpo = run["dpo"]
    weights = dpo.get("loss_weights")
    if weights is not None and len(weights) != len(losses(dpo)):
        raise ConfigError(
            f"{where}.dpo.loss_weights: {len(weights)} weights for "
            f"{len(losses(dpo))} loss types; give one weight per loss in "
            "loss_type"
        )
    if "exo_pair" in losses(dpo) and not dpo["label_smoothing"] > 0:
        raise ConfigError(
            f"{where}.dpo.label_smoothing: loss exo_pair needs label_smoothing "
            "> 0 (the EXO paper uses 1e-3)"
        )


# runs.<run>.dpo: its keys and defaults (snaketune.methods.compose_schema puts it into the
# run schema).
SCHEMA = """\
description: >-
  Preference tuning settings; TRL's DPOConfig keys of the same names
  (docs/dpo.md maps a TRL or Axolotl DPO config onto them).
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
  loss_type:
    description: >-
      One of TRL 1.16's DPO losses, or a list of them combined with `loss_weights`:
      sigmoid (DPO), hinge, ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard,
      aot, aot_unpaired, apo_zero, apo_down, discopop, sft, sigmoid_norm.
    oneOf:
      - &loss
        description: A DPO loss of TRL 1.16's DPOTrainer.
        enum: [sigmoid, hinge, ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot,
               aot_unpaired, apo_zero, apo_down, discopop, sft, sigmoid_norm]
      - type: array
        items: *loss
        minItems: 1
    default: sigmoid
  loss_weights:
    description: >-
      Weight of each loss in `loss_type` (a list of the same length); all 1 when left out.
    type: array
    items: {type: number}
    minItems: 1
  label_smoothing:
    description: >-
      Probability that a pair's labels are flipped (conservative DPO, robust); IPO's
      regularisation when loss_type is ipo. 0: none.
    type: number
    minimum: 0
    maximum: 0.5
    default: 0.0
  reference:
    description: >-
      precomputed: the reference model's log-probs of every training pair are a stage
      of their own (rule reference_logps), computed once per (reference model,
      tokenized data) and shared by every run and sweep member that needs them; no
      training job holds a reference. live: computed in each training step, from the
      base with the adapter off (LoRA, no extra memory) or a frozen copy of the model
      (full fine-tuning: the memory plan counts it).
    enum: [precomputed, live]
    default: precomputed
"""

METHOD = Method(
    name="dpo",
    data=data,
    trainer=trainer,
    step_fields=step_fields,
    rows_per_example=lambda run: 1,
    describe=describe,
    trains_on="pairs",
    adapter="optional",
    block="dpo",
    summary=(
        "preference tuning (TRL's DPOTrainer and its loss family) on a `preference` dataset, "
        "LoRA when the run has a `lora` block, else every weight (docs/dpo.md)"
    ),
    schema=SCHEMA,
    starts_from_runs=True,
    packs=False,  # TRL's DPO batches are padded (see above)
    takes_pictures=True,  # picture pairs (snaketune.data.picture_pairs): TRL's vision DPO
    check=check,
    # a micro batch of n pairs is 2n sequences; a live reference of a full fine-tune is a
    # second model (LoRA's is the base with the adapter off)
    memory=lambda run, on_gpu: {
        "sequences_per_example": 2,
        "reference": run["dpo"]["reference"] == "live",
    },
    needs=lambda run: {REFERENCE: {}} if run["dpo"]["reference"] == "precomputed" else {},
    eval_settings=lambda run: {"beta": run["dpo"]["beta"]},
    headline=("preference_accuracy",),
    panel=PREFERENCE_PANEL,
    summary_figures=preference_quarter,
    summary_columns=PREFERENCE_COLUMNS,
)
