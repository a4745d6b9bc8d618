"""Distillation (config method ``distill``): a student trained on rows (the SFT data kinds)
with cross-entropy on the labels mixed with a divergence from a teacher's top-k distribution
at each label token, LoRA or every weight.

The teacher never sits in training memory: its top-k log-probs of every training example
are a stage of their own (rule teacher_logps, snaketune.evaluation.topk), computed once per
(teacher, tokenized rows, k) and read here by example id. The collator lays them out target
by target in the order the micro batch's targets come (labels[..., 1:] != -100, row by
row: the same in the padded, padding-free and row-packed layouts), so packing changes
nothing. The loss of a micro batch, with alpha, temperature T and N the step's label tokens
over every rank and micro batch (transformers' token-balanced mean):

    ((1 - alpha) x sum of cross-entropy + alpha x T^2 x sum of divergence) / N

over its targets; alpha = 0 is SFT's loss, token for token. The divergence (forward KL by
default, reverse or a mix) is snaketune.evaluation.topk.divergence. A step logs the token
means of both parts (``ce``, ``kl``) over every rank.

Command (the train stage's, as every method's): see scripts/train.py; the teacher stage:
scripts/teacher_logps.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snaketune.core.lora_targets import exact_targets
from snaketune.methods.common import Method, RankRows
from snaketune.methods.needs import TEACHER_TOPK
from snaketune.methods.teachers import check_teacher
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

BLOCK = "distill"


def teacher_collator(
    layout: str,
    pad_token_id: int,
    row_tokens: int,
    ids_log: Path | None,
    teacher: dict[str, tuple[Any, Any]],
):
    """The run's SFT collation (snaketune.data.packing.Collator) with the teacher's top-k of
    each target beside it: ``teacher_ids`` [targets, k] and ``teacher_logps`` [targets, k],
    in the order the batch's targets come."""
    import numpy as np
    import torch

    from snaketune.data.packing import Collator, example_order

    class TeacherCollator(Collator):
        def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
            batch = super().__call__(examples)
            order = example_order(
                self.layout, [len(e["input_ids"]) for e in examples], self.row_tokens
            )
            top = [teacher[examples[i]["example_id"]] for i in order]
            ids = np.concatenate([t[0] for t in top])
            targets = int((batch["labels"][..., 1:] != -100).sum())
            if targets != len(ids):
                raise RuntimeError(
                    f"the teacher's top-k has {len(ids)} targets for a micro "
                    f"batch of {targets} label tokens (first example "
                    f"{examples[0]['example_id']}): it was computed on other "
                    "tokens; rerun rule teacher_logps"
                )
            batch["teacher_ids"] = torch.as_tensor(ids, dtype=torch.long)
            batch["teacher_logps"] = torch.as_tensor(
                np.concatenate([t[1] for t in top]), dtype=torch.float32
            )
            return batch

    return TeacherCollator(layout, pad_token_id, row_tokens, ids_log)


def data(rows: RankRows) -> Data:
    """This rank's rows as planned, collated in the run's layout, with the teacher's top-k
    of each (the rank's examples only)."""
    from snaketune.data.kernels import layout_for
    from snaketune.evaluation.topk import read_topk

    run, ids = rows.run, list(rows.table["example_id"])
    teacher = rows.scored(TEACHER_TOPK, lambda p: read_topk(p, ids, run[BLOCK]["top_k"]), "rows")
    layout = layout_for(run["packing"], rows.kernel)
    return rows.collated(
        teacher_collator(layout, rows.pad, run["max_length"], rows.ids_log, teacher)
    )


def loss_sums(logits, labels, teacher_ids, teacher_logps, block: Mapping[str, Any]):
    """(summed cross-entropy, summed divergence, targets) of one micro batch: the student's
    ``logits`` [B, T, V] at positions t - 1 for each target t (labels[..., 1:] != -100,
    row by row), the divergence at the run's temperature (times T^2)."""
    import torch

    from snaketune.evaluation.topk import divergence

    shifted = labels[..., 1:]
    keep = shifted != -100
    student = logits[..., :-1, :][keep].float()
    ce = torch.nn.functional.cross_entropy(student, shifted[keep], reduction="sum")
    t = block["temperature"]
    kl = (
        divergence(
            student, teacher_ids, teacher_logps, t, block["divergence"], block["forward_share"]
        ).sum()
        * t
        * t
    )
    return ce, kl, int(keep.sum())


def trainer_class(block: Mapping[str, Any], router: Router | None):
    """trl's SFTTrainer reading the planned micro batches, its loss the distillation loss
    (``block``: the run's distill settings; ``router``: a mixture of experts' balance)."""
    from torch.utils.data import DataLoader
    from trl import SFTTrainer

    alpha = block["alpha"]

    class PlannedDistillTrainer(Lean, SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids, logps = inputs.pop("teacher_ids"), inputs.pop("teacher_logps")
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            ce, kl, n = loss_sums(outputs.logits, labels, ids, logps, block)
            items = num_items_in_batch if num_items_in_batch is not None else max(n, 1)
            loss = ((1 - alpha) * ce + alpha * kl) / items
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * self.accelerator.num_processes  # as transformers' own loss
            if self.model.training:
                self.record(ce, kl, n)
                if router is not None:
                    loss = loss + router.term(outputs, inputs.get("attention_mask"))
                    router.record(self, outputs, inputs)
            return (loss, outputs) if return_outputs else loss

        def record(self, ce, kl, n: int) -> None:
            """The micro batch's token means over every rank (TRL's log averages a step's)."""
            import torch

            sums = torch.stack(
                [ce.detach().float(), kl.detach().float(), torch.tensor(float(n), device=ce.device)]
            )
            total = self.accelerator.reduce(sums, reduction="sum")
            metrics = self._metrics["train"]
            metrics["ce"].append((total[0] / total[2].clamp(min=1)).item())
            metrics["kl"].append((total[1] / total[2].clamp(min=1)).item())

        def get_train_dataloader(self) -> DataLoader:
            from snaketune.data.batches import planned_loader

            d = self.planned
            return planned_loader(d.table, d.batches, d.collator)

    return PlannedDistillTrainer


def trainer(ctx: Context, model, data: Data, callbacks: list):
    """trl's SFTTrainer on the planned micro batches, its loss the distillation loss."""
    from trl import SFTConfig

    args = training_args(
        ctx,
        SFTConfig,
        dataset_kwargs={"skip_prepare_dataset": True},
        max_length=None,
        packing=False,
        model_init_kwargs=None,
    )
    router = Router.prepare(model, ctx.run)  # a mixture of experts: its balance
    with exact_targets():
        t = trainer_class(ctx.run[BLOCK], router)(
            model=model,
            args=args,
            train_dataset=data.table,
            processing_class=ctx.tokenizer,
            data_collator=data.collator,
            peft_config=peft_config(ctx.run, model),
            callbacks=callbacks,
        )
    t.planned = data
    return t


def describe(run: dict[str, Any], manifest: dict[str, Any]) -> str:
    b = run[BLOCK]
    return (
        f"distillation from {b['teacher']}: top-{b['top_k']} {b['divergence']} KL at "
        f"temperature {b['temperature']}, alpha {b['alpha']}"
    )


def check(where: str, run: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """The teacher is a model or another run of the config, generating text, with the
    student's tokenizer (where both are on this machine already)."""
    check_teacher(f"{where}.{BLOCK}.teacher", run[BLOCK]["teacher"], run, config)


# runs.<run>.distill: its keys and defaults (snaketune.methods.compose_schema puts it into
# the run schema).
SCHEMA = """\
description: >-
  Distillation settings (docs/distillation.md): the teacher, how much of its
  distribution is kept, and how the loss mixes it with the labels.
type: object
additionalProperties: false
required: [teacher]
properties:
  teacher:
    description: >-
      The model that teaches: a key of `models`, or a run (or sweep) of this config
      whose final model teaches (a larger model tuned first). It must use the
      student's tokenizer. Its top-k log-probs of every training example are
      computed once, in rule teacher_logps, and never held in training memory.
    type: string
  top_k:
    description: >-
      Log-probs kept per token: the teacher's k most likely next tokens. The stage
      stores k x 8 bytes per label token (k = 32: 256 MB per million tokens before
      compression).
    type: integer
    minimum: 1
    maximum: 1024
    default: 32
  temperature:
    description: >-
      Softens both distributions before they are compared (Hinton et al.); the
      divergence is multiplied by its square, so its gradients keep their scale.
    type: number
    exclusiveMinimum: 0
    default: 1.0
  alpha:
    description: >-
      Weight of the divergence in the loss; 1 - alpha weighs the cross-entropy on the
      labels. 0 is supervised fine-tuning; 1 learns from the teacher alone.
    type: number
    minimum: 0
    maximum: 1
    default: 0.5
  divergence:
    description: >-
      forward: KL(teacher || student), the student covers every likely teacher token
      (the usual choice); reverse: KL(student || teacher), the student settles on the
      teacher's main mode; mixed: forward_share x forward + the rest x reverse.
    enum: [forward, reverse, mixed]
    default: forward
  forward_share:
    description: The forward KL's share of a mixed divergence.
    type: number
    minimum: 0
    maximum: 1
    default: 0.5
"""

METHOD = Method(
    name="distill",
    data=data,
    trainer=trainer,
    step_fields=lambda logs: {k: logs[k] for k in ("ce", "kl", *ROUTER_FIELDS) if k in logs},
    rows_per_example=lambda run: 1,
    describe=describe,
    trains_on="rows",
    adapter="optional",
    block=BLOCK,
    summary=(
        "distillation: labels and a teacher's top-k distribution (computed once, in its own "
        "stage), LoRA when the run has a `lora` block, else every weight "
        "(docs/distillation.md)"
    ),
    schema=SCHEMA,
    starts_from_runs=True,
    check=check,
    # its loss reads the logits (no fused cross-entropy); the teacher is not in memory
    memory=lambda run, on_gpu: {"fused_loss": False},
    needs=lambda run: {TEACHER_TOPK: {k: run[BLOCK][k] for k in ("teacher", "top_k")}},
    # the KL to the teacher; the data's figures and held-out loss follow, the teacher's own
    # held-out loss beside them (snaketune.evaluation.figures)
    headline=("heldout_kl", "teacher_loss"),
)
