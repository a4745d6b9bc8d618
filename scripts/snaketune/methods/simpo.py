"""SimPO (config method ``simpo``): preference tuning without a reference model, on the
planned pairs of a ``preference`` dataset (snaketune.data.pairs), LoRA or every weight.

SimPO's loss (Meng, Xia and Chen 2024, eq. 6) of a pair is

    -log sigmoid(beta * (log p(chosen) / |chosen| - log p(rejected) / |rejected|) - gamma)

with each side's log-prob summed over its response tokens and |.| their count. TRL 1.16 has
it only in trl.experimental (CPOTrainer, loss_type simpo). The stable DPOTrainer computes it
exactly: its ``sigmoid_norm`` loss is -log sigmoid(beta * (dc / |chosen| - dr / |rejected|))
with d = log p - log p_ref of each side; with the reference's log-probs 0 for the chosen
side and -(gamma / beta) * |rejected| for the rejected one, that is SimPO's loss. So SimPO
trains on the DPO trainer (snaketune.methods.pair_trainer.pair_trainer), its collator giving each
pair that constant "reference": no reference model, no reference stage, and the DPO
trainer's pair weighting across unequal micro batches and ragged gathers.

Its step figures are the loss and each side's summed log-probs: TRL's reward figures are
DPO's (beta times the summed log-ratio against that constant), not SimPO's, so they are not
logged. Its held-out figure is the likelihood accuracy of the eval pairs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from snaketune.methods.common import Method, RankRows
from snaketune.methods.outputs import PREFERENCE_COLUMNS, preference_quarter
from snaketune.methods.pair_trainer import PairCollator, pair_trainer
from snaketune.methods.pair_trainer import step_fields as dpo_step_fields
from snaketune.methods.training import Context

if TYPE_CHECKING:
    from snaketune.data.batches import Data


class SimPOCollator(PairCollator):
    """Planned pairs with SimPO's margin as their reference log-probs: 0 for each chosen
    side, -(gamma / beta) x its response tokens for each rejected side."""

    def __init__(self, pad_token_id: int, beta: float, gamma: float, ids_log: Path | None):
        super().__init__(pad_token_id, None, ids_log)
        self.margin = gamma / beta

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        batch = super().__call__(examples)
        rejected = batch["completion_mask"][len(examples) :].sum(dim=1)
        batch["ref_chosen_logps"] = torch.zeros(len(examples), dtype=torch.float32)
        batch["ref_rejected_logps"] = -self.margin * rejected.to(torch.float32)
        return batch


def data(rows: RankRows) -> Data:
    simpo = rows.run["simpo"]
    return rows.collated(SimPOCollator(rows.pad, simpo["beta"], simpo["gamma"], rows.ids_log))


def trainer(ctx: Context, model, data: Data, callbacks: list):
    """The DPO trainer with its length-normalised sigmoid loss (see the module's docstring)."""
    beta = ctx.run["simpo"]["beta"]
    return pair_trainer(
        ctx,
        model,
        data,
        callbacks,
        beta=beta,
        loss_type=["sigmoid_norm"],
        loss_weights=None,
        label_smoothing=0.0,
        precompute_ref_log_probs=True,
    )


def step_fields(logs: dict[str, Any]) -> dict[str, float]:
    """The DPO trainer's figures of a step (snaketune.methods.pair_trainer.step_fields) but its
    rewards (DPO's, not SimPO's): each side's log-probs, a mixture of experts' aux_loss."""
    return {k: v for k, v in dpo_step_fields(logs).items() if not k.startswith("reward_")}


def describe(run: dict[str, Any], manifest: dict[str, Any]) -> str:
    simpo = run["simpo"]
    return (
        f"SimPO: {manifest['global_batch']} pairs per step; beta {simpo['beta']}, gamma "
        f"{simpo['gamma']}; no reference (TRL's DPOTrainer, sigmoid_norm loss with "
        "SimPO's margin); padded pairs"
    )


# runs.<run>.simpo: its keys and defaults (snaketune.methods.compose_schema puts it into the
# run schema).
SCHEMA = """\
description: >-
  SimPO settings (the names of TRL's CPOConfig with loss_type simpo: beta, simpo_gamma).
type: object
additionalProperties: false
properties:
  beta:
    description: >-
      Scale of the length-normalised reward beta * log p(response) / |response| (the
      SimPO paper uses 2.0 to 2.5; TRL's CPOConfig defaults to 0.1).
    type: number
    exclusiveMinimum: 0
    default: 2.0
  gamma:
    description: >-
      Target reward margin between the chosen and the rejected response (TRL's
      simpo_gamma; the paper's gamma / beta of about 0.5 gives 1.0 at beta 2.0).
    type: number
    minimum: 0
    default: 1.0
"""

METHOD = Method(
    name="simpo",
    data=data,
    trainer=trainer,
    step_fields=step_fields,
    rows_per_example=lambda run: 1,
    describe=describe,
    trains_on="pairs",
    adapter="optional",
    block="simpo",
    summary=(
        "SimPO, preference tuning without a reference model (length-normalised rewards and "
        "a target margin; the DPO trainer computes its loss) on a `preference` dataset, "
        "LoRA when the run has a `lora` block, else every weight (docs/methods.md)"
    ),
    schema=SCHEMA,
    starts_from_runs=True,
    packs=False,  # the DPO trainer's batches are padded
    memory=lambda run, on_gpu: {"sequences_per_example": 2, "reference": False},
    headline=("likelihood_accuracy",),
    summary_figures=preference_quarter,
    summary_columns=PREFERENCE_COLUMNS,
)
