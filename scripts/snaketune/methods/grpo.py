"""GRPO: reinforcement learning with verifiable rewards, on TRL's GRPOTrainer.

Each completion's advantage is its reward against its group's, normalised by the group's
spread; the KL term against the starting model (beta) enters the loss per token. What it
shares with RLOO (the planned prompts, the rollouts, the rewards, the block's common keys)
is snaketune.methods.rollouts (the trainer: snaketune.methods.rollout_trainer).
"""

from __future__ import annotations

from snaketune.methods import rollout_trainer, rollouts
from snaketune.methods.training import Context
from snaketune.tools import tooluse

BLOCK = "grpo"


def trainer(ctx: Context, model, data, callbacks: list):
    """TRL's GRPOTrainer on the planned prompts (snaketune.methods.rollout_trainer.planned)."""
    from trl import GRPOConfig, GRPOTrainer

    loss_type = ctx.run[BLOCK]["loss_type"]
    return rollout_trainer.planned(
        GRPOTrainer, ctx, model, data, callbacks, BLOCK, GRPOConfig, loss_type=loss_type
    )


# runs.<run>.grpo: its keys and defaults (snaketune.methods.compose_schema puts it into the
# run schema).
SCHEMA = (
    """\
description: >-
  GRPO settings. Defaults suit GSM8K on a 1B instruct model; docs/grpo.md
  maps a PPO guide's settings onto them.
type: object
additionalProperties: false
properties:
  beta:
    description: >-
      KL coefficient against the starting model. TRL defaults to 0 (no reference
      model, no KL); ours is 0.04 (the GRPO paper's): it keeps the policy near the
      SFT model it starts from and logs the KL, a drift signal worth watching for a
      week-long run. With LoRA the reference is the base without the adapter (no
      extra memory); full fine-tuning holds a second copy of the model. 0 turns it
      off.
    type: number
    minimum: 0
    default: 0.04
  loss_type:
    description: >-
      TRL's loss aggregation (`dapo`: mean over the batch's completion tokens, TRL's
      default and no length bias; `grpo`, `dr_grpo`, `bnpo`).
    enum: [dapo, grpo, dr_grpo, bnpo]
    default: dapo
"""
    + rollouts.SHARED_SCHEMA
    + tooluse.SCHEMA
)

METHOD = rollouts.method(
    BLOCK,
    "GRPO",
    trainer,
    SCHEMA,
    (
        "reinforcement learning with verifiable rewards (TRL's GRPOTrainer) on the dataset's "
        "prompts, scored against its reference answers; LoRA when the run has a `lora` block, "
        "else every weight (docs/grpo.md)"
    ),
)
