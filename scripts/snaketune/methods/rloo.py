"""RLOO: REINFORCE with a leave-one-out baseline, on TRL's RLOOTrainer (stable).

Each prompt's ``num_generations`` completions are scored with the same rewards as GRPO's
(built-in, the user's ``file.py:function``, ``model:<run>``); a completion's advantage is
its reward less the mean reward of the other completions of its prompt (Ahmadian et al.,
2024). With ``beta > 0`` the KL against the starting model enters as a penalty on each
completion's reward (the summed per-token log-ratio, TRL's choice after the paper), not as
GRPO's per-token loss term; the reference is the base without the adapter for a LoRA run,
a second copy of the model for a full one. The loss is per sequence: minus the clipped
ratio times the advantage, the mean over the micro batch's completions (with one pass
over each generation, num_iterations 1, the ratio is 1 and the loss's value is 0 when a
micro batch holds whole groups, as it does here: the gradient carries the signal, and
the logged grad_norm is the figure to check).

What it shares with GRPO (the planned prompts, the rollouts, the rewards, the block's
common keys) is snaketune.methods.rollouts.
"""

from __future__ import annotations

from snaketune.methods import rollout_trainer, rollouts
from snaketune.methods.training import Context

BLOCK = "rloo"


def trainer(ctx: Context, model, data, callbacks: list):
    """TRL's RLOOTrainer on the planned prompts (snaketune.methods.rollout_trainer.planned)."""
    from trl import RLOOConfig, RLOOTrainer

    normalize = ctx.run[BLOCK]["normalize_advantages"]
    return rollout_trainer.planned(
        RLOOTrainer, ctx, model, data, callbacks, BLOCK, RLOOConfig, normalize_advantages=normalize
    )


# runs.<run>.rloo: its keys and defaults (snaketune.methods.compose_schema puts it into the
# run schema).
SCHEMA = (
    """\
description: >-
  RLOO settings (docs/methods.md): the same rollouts and rewards as GRPO's, a
  leave-one-out baseline in place of GRPO's group normalisation.
type: object
additionalProperties: false
properties:
  beta:
    description: >-
      KL coefficient against the starting model, a penalty on each completion's
      reward (its summed per-token log-ratio); TRL's default 0.05. With LoRA the
      reference is the base without the adapter (no extra memory); full
      fine-tuning holds a second copy of the model. 0 turns it off.
    type: number
    minimum: 0
    default: 0.05
  normalize_advantages:
    description: >-
      Scale the generation batch's advantages to mean 0 and standard deviation 1
      (TRL's option; off by default, as in the paper).
    type: boolean
    default: false
"""
    + rollouts.SHARED_SCHEMA
)

METHOD = rollouts.method(
    BLOCK,
    "RLOO",
    trainer,
    SCHEMA,
    (
        "REINFORCE with a leave-one-out baseline (TRL's RLOOTrainer) on the dataset's prompts, "
        "with GRPO's rewards; LoRA when the run has a `lora` block, else every weight "
        "(docs/methods.md)"
    ),
)
