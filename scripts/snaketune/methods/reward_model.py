"""Reward models (config method ``reward``): a score head on a causal language model
(snaketune.evaluation.heads: transformers' sequence classifier with one label), trained on the
planned pairs of a ``preference`` dataset with TRL's RewardTrainer, LoRA or every weight.

The loss of a pair is -log sigmoid(r_chosen - r_rejected - margin) (the margin: 0, or the
dataset column ``reward.margin`` names), plus ``center_rewards_coefficient`` x the mean
squared sum of the two scores when set (TRL's centring). A pair is one planned example:
its chosen side and its rejected side are in the same micro batch, as DPO's
(snaketune.methods.pair_trainer: chosen sides first, padded on the right); the score is
read at each side's last real token. TRL averages a micro batch's pairs; a token-balanced plan
gives micro batches of unequal pair counts, so each micro batch's loss is weighted by its
pairs over ``micro_batch_size``: the step's loss is the mean over every pair of the global
batch.

Its evaluation (snaketune.evaluation.reward_eval) scores the held-out pairs with the
starting model (the model and its new head, drawn from the run's seed: rule
evaluate_start) and with the trained one: pairwise accuracy and mean margin.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snaketune.core.errors import DataError
from snaketune.core.lora_targets import exact_targets
from snaketune.methods.common import Method, RankRows
from snaketune.methods.outputs import PREFERENCE_COLUMNS, PREFERENCE_PANEL, preference_quarter
from snaketune.methods.pair_trainer import PairCollator
from snaketune.methods.training import Context, PlannedPairs, peft_config, training_args

if TYPE_CHECKING:
    from snaketune.data.batches import Data


class ScorePairCollator(PairCollator):
    """Planned pairs as the reward model reads them: both sides' ids and attention mask
    (and each pair's margin)."""

    def __init__(self, pad_token_id: int, margins: dict[str, float] | None, ids_log: Path | None):
        super().__init__(pad_token_id, None, ids_log)
        self.margins = margins

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        batch = super().__call__(examples)
        del batch["completion_mask"]  # the score is of the whole sequence
        if self.margins is not None:
            batch["margin"] = torch.tensor(
                [self.margins[e["example_id"]] for e in examples], dtype=torch.float32
            )
        return batch


def margins_of(column: str, example_ids: list[str]) -> dict[str, float]:
    """Each pair's margin: column ``column`` of its row in the source dataset (read by
    example id, as the download stage wrote it)."""
    import math

    from snaketune.evaluation.rewards import source_columns

    rows = source_columns(example_ids)
    out = {}
    for example_id, row in rows.items():
        if column not in row:
            raise DataError(
                f"reward.margin: the dataset of {example_id.split(':')[0]!r} has no "
                f"column {column!r} (its columns: {', '.join(sorted(row))}); name "
                "its margin column or set reward.margin: null"
            )
        value = row[column]
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise DataError(
                f"reward.margin: pair {example_id} has margin {value!r}; each pair "
                f"needs a finite number in column {column!r}"
            )
        out[example_id] = float(value)
    return out


def data(rows: RankRows) -> Data:
    """This rank's planned pairs (and their margins)."""
    column = rows.run["reward"]["margin"]
    margins = None if column is None else margins_of(column, list(rows.table["example_id"]))
    return rows.collated(ScorePairCollator(rows.pad, margins, rows.ids_log))


def trainer_class():
    """TRL's RewardTrainer reading the planned pairs, each micro batch's loss weighted by
    its pairs (snaketune.methods.training.PlannedPairs)."""
    from trl import RewardTrainer

    class PlannedRewardTrainer(PlannedPairs, RewardTrainer):
        pass

    return PlannedRewardTrainer


def trainer(ctx: Context, model, data: Data, callbacks: list):
    """TRL's RewardTrainer on the planned pairs, with the shared settings of training_args."""
    from trl import RewardConfig

    block = ctx.run["reward"]
    args = training_args(
        ctx,
        RewardConfig,
        max_length=None,
        model_init_kwargs=None,
        center_rewards_coefficient=block["center_rewards_coefficient"],
    )
    with exact_targets():
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
    "accuracy": "reward_accuracy",
    "margin": "reward_margin",
    "mean_reward": "reward_mean",
    "min_reward": "reward_min",
    "max_reward": "reward_max",
}


def step_fields(logs: dict[str, Any]) -> dict[str, float]:
    """A step's training pairs: how often the chosen side scored higher, the mean margin,
    the scores' mean, minimum and maximum."""
    return {new: logs[old] for old, new in LOG_KEYS.items() if old in logs}


def describe(run: dict[str, Any], manifest: dict[str, Any]) -> str:
    block = run["reward"]
    margin = f"margin column {block['margin']!r}" if block["margin"] else "no margin"
    centre = block["center_rewards_coefficient"]
    return (
        f"reward model: {manifest['global_batch']} pairs per step, the score read at each "
        f"side's last real token; {margin}; centring "
        f"{centre if centre is not None else 'off'}"
    )


def check(where: str, run: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """No held-out pass while training (its pass scores next-token losses); a LoRA
    block's modules_to_save: the score head is trained whole by itself, and the model it
    trains has no lm_head to save."""
    from snaketune.core.errors import ConfigError

    if run.get("eval_steps"):
        raise ConfigError(
            f"{where}.eval_steps: a reward model is not scored while it trains "
            "(the held-out pass scores next-token losses); leave eval_steps "
            "out: its evaluate stage scores the held-out pairs"
        )
    saved = (run.get("lora") or {}).get("modules_to_save") or []
    if "lm_head" in saved:
        raise ConfigError(
            f"{where}.lora.modules_to_save: a reward model has no lm_head (its "
            "score head replaces it, trained whole by itself); leave lm_head "
            "out"
        )


# runs.<run>.reward: its keys and defaults (snaketune.methods.compose_schema puts it into
# the run schema).
SCHEMA = """\
description: >-
  Reward model settings; TRL's RewardConfig keys of the same names (docs/rewards.md).
type: object
additionalProperties: false
properties:
  center_rewards_coefficient:
    description: >-
      Weight of the centring term, the mean squared sum of each pair's two scores, added
      to the loss so the scores stay near 0 (TRL's; 0.01 is its recommendation). null:
      off.
    type: [number, "null"]
    minimum: 0
    default: null
  margin:
    description: >-
      A column of the preference dataset holding each pair's margin, subtracted from the
      score difference in the loss (TRL's margin; e.g. a rating gap). null: none.
    type: [string, "null"]
    default: null
"""

METHOD = Method(
    name="reward",
    data=data,
    trainer=trainer,
    step_fields=step_fields,
    rows_per_example=lambda run: 1,
    describe=describe,
    trains_on="pairs",
    adapter="optional",
    block="reward",
    summary=(
        "a reward model (a score head, TRL's RewardTrainer) on a `preference` dataset, LoRA "
        "when the run has a `lora` block, else every weight (docs/rewards.md)"
    ),
    schema=SCHEMA,
    starts_from_runs=True,
    packs=False,  # a pair's sides are scored whole, padded (as DPO's)
    check=check,
    memory=lambda run, on_gpu: {"sequences_per_example": 2},
    head="score",
    eval_settings=lambda run: {"seed": run["seed"]},  # a causal model's new score head
    headline=("preference_accuracy", "reward_margin"),
    writes_text=False,
    panel=PREFERENCE_PANEL,
    summary_figures=preference_quarter,
    summary_columns=PREFERENCE_COLUMNS,
    evaluates_start=True,
)
