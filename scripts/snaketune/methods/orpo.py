"""ORPO (config method ``orpo``): preference tuning without a reference model that is also
supervised tuning on the chosen responses, on the planned pairs of a ``preference``
dataset (snaketune.data.pairs), LoRA or every weight.

ORPO's loss (Hong, Lee and Thorne 2024, eq. 6-7) of a micro batch is

    NLL of the chosen sides - lambda * mean over pairs of log sigmoid(log odds(chosen) -
    log odds(rejected)),  odds(y) = P(y) / (1 - P(y)),

with P(y) the geometric mean of the response tokens' probabilities (exp of their mean
log-prob). The odds need log(1 - P) of the policy's own probability, which no loss of the
stable DPOTrainer computes, so ORPO trains on TRL 1.16's ``trl.experimental.orpo``
ORPOTrainer through this one thin adapter: its tokenization is the identity (the pairs
come tokenized by rule tokenize), its batches are the planned pairs in its layout
(``chosen_``/``rejected_`` input ids, attention masks and labels), and its loss, figures
and gathers are TRL's own. Its loss is what TRL computes, checked by
tests/test_dpo.py's oracle written out from the paper with TRL's one choice: the NLL term
is the mean over the micro batch's chosen tokens, prompt tokens included ("computed over
the full prompt and response", where the paper's L_SFT is over the response).

As for DPO, a token-balanced plan gives micro batches of unequal pair counts: each micro
batch's loss is weighted by its pairs over ``micro_batch_size``
(snaketune.methods.training.PlannedPairs), and TRL's per-pair gathers of its figures go
through the ragged gather. Its step figures: each side's mean per-token log-prob, the
rewards (lambda x those) and how often the chosen's is higher, the NLL term and the log
odds ratio. Its held-out figure is the likelihood accuracy of the eval pairs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snaketune.core.io import IdsLog
from snaketune.core.lora_targets import exact_targets
from snaketune.core.rows import IGNORE_INDEX
from snaketune.core.throughput import Counted
from snaketune.methods.common import Method, RankRows
from snaketune.methods.outputs import PREFERENCE_COLUMNS, PREFERENCE_PANEL, preference_quarter
from snaketune.methods.training import Context, PlannedPairs, peft_config, training_args

if TYPE_CHECKING:
    from snaketune.data.batches import Data


class ORPOCollator(Counted):
    """Planned pairs in ORPOTrainer's layout: each side right-padded, its own input ids,
    attention mask and labels (-100 outside the response), counting what the step callback
    reports."""

    layout = "padded pairs"

    def __init__(self, pad_token_id: int, ids_log: Path | None):
        super().__init__()
        self.pad_token_id = pad_token_id
        self._ids_log = IdsLog(ids_log)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        self._ids_log.write([e["example_id"] for e in examples])
        batch = {}
        for side, prefix in (("chosen", ""), ("rejected", "rejected_")):
            seqs = [(e[f"{prefix}input_ids"], e[f"{prefix}labels"]) for e in examples]
            width = max(len(ids) for ids, _ in seqs)
            ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
            labels = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for i, (seq, lab) in enumerate(seqs):
                ids[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
                labels[i, : len(seq)] = torch.as_tensor(lab, dtype=torch.long)
                mask[i, : len(seq)] = 1
            batch.update(
                {f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels}
            )
            self.add(mask.sum(dim=1).tolist(), ids.numel(), 0)
        self.samples += len(examples)
        return batch


def data(rows: RankRows) -> Data:
    return rows.collated(ORPOCollator(rows.pad, rows.ids_log))


def trainer_class():
    """TRL's experimental ORPOTrainer reading the planned pairs (its own tokenization left
    out), each micro batch's loss weighted by its pairs (PlannedPairs)."""
    from trl.experimental.orpo import ORPOTrainer

    class PlannedORPOTrainer(PlannedPairs, ORPOTrainer):
        def tokenize_row(self, feature, model=None):
            return feature  # tokenized by rule tokenize (snaketune.data.pairs)

        def pairs_in(self, inputs) -> int:
            return inputs["chosen_input_ids"].shape[0]

    return PlannedORPOTrainer


def trainer(ctx: Context, model, data: Data, callbacks: list):
    """ORPOTrainer on the planned pairs with the run's lambda (TRL's ``beta``) and the shared
    settings of training_args. It maps its train set through its own preprocessing when it
    is built: it is given none of the rows (they are read through the planned loader)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # said once, by describe
    from trl.experimental.orpo import ORPOConfig

    args = training_args(ctx, ORPOConfig, beta=ctx.run["orpo"]["lambda"])
    with exact_targets():
        built = trainer_class()(
            model=model,
            args=args,
            train_dataset=data.table.select([]),
            processing_class=ctx.tokenizer,
            data_collator=data.collator,
            peft_config=peft_config(ctx.run, model),
            callbacks=callbacks,
            planned=data,
            run=ctx.run,
        )
    built.train_dataset = data.table
    return built


# TRL's log keys -> metrics.jsonl keys.
LOG_KEYS = {
    "rewards/chosen": "reward_chosen",
    "rewards/rejected": "reward_rejected",
    "rewards/accuracies": "reward_accuracy",
    "rewards/margins": "reward_margin",
    "logps/chosen": "mean_logp_chosen",
    "logps/rejected": "mean_logp_rejected",
    "nll_loss": "nll_loss",
    "log_odds_ratio": "log_odds_ratio",
}


def step_fields(logs: dict[str, Any]) -> dict[str, float]:
    """ORPOTrainer's figures of a step: each side's mean per-token log-prob and the rewards
    (lambda x those), the NLL term, the mean log sigmoid of the log odds ratio."""
    return {new: logs[old] for old, new in LOG_KEYS.items() if old in logs}


def describe(run: dict[str, Any], manifest: dict[str, Any]) -> str:
    return (
        f"ORPO: {manifest['global_batch']} pairs per step; lambda {run['orpo']['lambda']}; "
        "no reference (trl.experimental's ORPOTrainer); padded pairs"
    )


# runs.<run>.orpo: its keys and defaults (snaketune.methods.compose_schema puts it into the
# run schema).
SCHEMA = """\
description: >-
  ORPO settings (TRL's ORPOConfig calls lambda beta).
type: object
additionalProperties: false
properties:
  lambda:
    description: >-
      Weight of the odds-ratio term against the NLL of the chosen response (the ORPO
      paper's lambda, 0.1 to 0.25 in its runs; TRL's ORPOConfig beta, default 0.1).
    type: number
    exclusiveMinimum: 0
    default: 0.1
"""

METHOD = Method(
    name="orpo",
    data=data,
    trainer=trainer,
    step_fields=step_fields,
    rows_per_example=lambda run: 1,
    describe=describe,
    trains_on="pairs",
    adapter="optional",
    block="orpo",
    summary=(
        "ORPO, supervised and preference tuning in one loss without a reference model (an "
        "odds ratio of the chosen over the rejected response; trl.experimental's "
        "ORPOTrainer) on a `preference` dataset, LoRA when the run has a `lora` block, else "
        "every weight (docs/methods.md)"
    ),
    schema=SCHEMA,
    starts_from_runs=True,
    packs=False,  # ORPOTrainer's batches are padded
    # its loss reads the whole logits (no fused head, with Liger too)
    memory=lambda run, on_gpu: {
        "sequences_per_example": 2,
        "reference": False,
        "fused_loss": False,
    },
    headline=("likelihood_accuracy",),
    panel=PREFERENCE_PANEL,
    summary_figures=preference_quarter,
    summary_columns=PREFERENCE_COLUMNS,
)
