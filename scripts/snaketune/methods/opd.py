"""On-policy distillation (config method ``opd``), on TRL's DistillationTrainer: the student
samples a completion of each prompt, a teacher scores every token of it live on the same
ranks, and the student learns the per-token divergence from the teacher's whole next-token
distribution where it actually goes (Agarwal et al., 2024; Thinking Machines, 2025).

The prompts are the dataset's (a ``prompt_response``, ``alpaca`` or ``messages`` set: the
conversation without its last assistant turn), planned and tokenized as GRPO's are
(snaketune.methods.rollouts: this rank's prompts, their own tokens). The teacher is a model
of the config or a run's final model (a sweep's best member) with the student's tokenizer
(snaketune.methods.teachers, refused before any job otherwise); the train job holds it on
every GPU beside the student, sharded with it under ZeRO-3 (the run's need of a live
teacher: snaketune.methods.needs.LIVE_TEACHER, which the memory plan counts).

The loss of a completion token is TRL's generalized Jensen-Shannon divergence at
``opd.temperature`` between the student's and the teacher's distributions over the whole
vocabulary: ``beta`` 0 is the forward KL(teacher || student), 1 the reverse KL(student ||
teacher) (the default: mode-seeking, the on-policy recipe), between the two a JSD; the
step's loss is its mean over every completion token of every rank. ``lmbda`` is the share of
steps trained on the student's own samples; the others (chosen by the step, the same on
every rank) take the dataset's responses as the completions (GKD's mix).

A step logs (metrics.jsonl): ``divergence`` (the token mean of that divergence over every
rank), ``teacher_nll`` (the teacher's mean negative log-likelihood of the completion tokens
at temperature 1: how likely the teacher finds what the student wrote), the student's
``completion_length`` and ``on_policy`` (1 for a step on the student's samples, 0 for one
on the dataset's responses).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snaketune.core.errors import ConfigError
from snaketune.core.lora_targets import exact_targets
from snaketune.methods import rollout_trainer, rollouts
from snaketune.methods.common import Method, RankRows
from snaketune.methods.needs import LIVE_TEACHER
from snaketune.methods.teachers import check_teacher
from snaketune.methods.training import Context, Lean, peft_config, training_args

if TYPE_CHECKING:
    from snaketune.data.batches import Data

BLOCK = "opd"
# the step's figures (the trainer's own sums, over every rank) -> metrics.jsonl keys
FIGURES = ("divergence", "teacher_nll", "completion_length", "on_policy")


def data(rows: RankRows) -> Data:
    """This rank's planned prompts (their own tokens) and the dataset's response tokens of
    each (an off-policy step's completions), counted per completion."""
    from snaketune.core.rows import prompt_and_answer

    table = rows.table
    answers = [
        prompt_and_answer(i, labels)[1]
        for i, labels in zip(table["input_ids"], table["labels"], strict=True)
    ]
    prompts = rollouts.prompt_rows(table, rows.tokenizer).add_column("answer_ids", answers)
    return rows.collated(rollouts.RolloutCounter(rows.ids_log), prompts)


def on_policy(seed: int, step: int, lmbda: float) -> bool:
    """Whether optimizer step ``step`` trains on the student's samples: a draw of the step
    (the same on every rank), true with probability ``lmbda``."""
    return lmbda >= 1.0 or random.Random(f"{seed}:{step}").random() < lmbda


def token_nll(head_logits, targets, mask):
    """(sum, count) of the negative log-likelihood of ``targets`` [B, K] under ``head_logits``
    [B, K, V] at the positions ``mask`` [B, K] marks, in float32."""
    import torch

    logp = torch.log_softmax(head_logits.float(), dim=-1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    keep = mask.bool()
    return nll[keep].sum(), keep.sum()


def head_logits(model, hidden):
    """The model's next-token logits from its last hidden states, as its own forward gives
    them (a logit scale, Gemma's final soft cap)."""
    import torch

    config = model.config.get_text_config()
    logits = model.get_output_embeddings()(hidden)
    scale = getattr(config, "logit_scale", None)
    if scale is not None:
        logits = logits * scale
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def off_policy(trainer, inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """The batch TRL's generation would give, with the dataset's responses as completions
    (prompts left-padded, completions right-padded, as TRL lays them out)."""
    import torch
    from trl.trainer.utils import pad

    device, pad_id = trainer.accelerator.device, trainer._tokenizer.pad_token_id
    prompts = [torch.tensor(list(x["prompt_ids"])) for x in inputs]
    answers = [torch.tensor(list(x["answer_ids"])) for x in inputs]

    def padded(rows, side, value):
        return pad(rows, padding_value=value, padding_side=side).to(device)

    completion_mask = padded([torch.ones_like(a) for a in answers], "right", 0)
    return {
        "prompt_ids": padded(prompts, "left", pad_id),
        "prompt_mask": padded([torch.ones_like(p) for p in prompts], "left", 0),
        "completion_ids": padded(answers, "right", pad_id),
        "completion_mask": completion_mask,
        "num_items_in_batch": trainer.accelerator.gather(completion_mask.sum()).sum(),
    }


class OnPolicy:
    """What the trainer adds to TRL's DistillationTrainer (``class T(OnPolicy, Lean,
    DistillationTrainer)``): this rank's planned prompts and their own tokens, the step's
    on-policy draw, its completions counted and logged, and its figures summed over every
    rank. Set after construction: ``planned`` (the Data), ``block`` (the run's opd block),
    ``seed``, ``sums``."""

    planned: Data
    block: dict[str, Any]
    seed: int
    sums: dict[str, float]

    def get_train_dataloader(self):
        from snaketune.data.batches import planned_loader

        sampler = rollout_trainer.group_batches(self.planned.batches, 1)
        return planned_loader(self.planned.table, sampler, list)

    def _tokenize_prompts(self, prompts: list):
        # the tokens tokenize wrote (chat template applied), not a re-encoding of them
        if not hasattr(self, "_prompt_ids"):
            table = self.planned.table
            self._prompt_ids = dict(zip(table["prompt"], table["prompt_ids"], strict=True))
        return [list(self._prompt_ids[p]) for p in prompts], None, {}

    def _generate_and_score_completions(self, inputs):
        import torch

        step = self.state.global_step + 1
        mine = on_policy(self.seed, step, self.block["lmbda"]) or not self.model.training
        out = super()._generate_and_score_completions(inputs) if mine else off_policy(self, inputs)
        if self.model.training:
            counter = self.planned.collator  # a RolloutCounter
            counter.count(out["prompt_mask"], out["completion_mask"])
            counter.ids_log.write([x["example_id"] for x in inputs])
            counter.record(step, inputs, out, {"on_policy": [float(mine)] * len(inputs)})
            lengths = out["completion_mask"].sum(1).float()
            here = torch.stack([lengths.sum(), lengths.new_tensor(float(len(lengths)))])
            every = self.accelerator.gather(here.unsqueeze(0)).sum(0)
            self.sums["completion_length"] += float(every[0])
            self.sums["completions"] += float(every[1])
            self.sums["on_policy"] += float(mine)
            self.sums["steps"] += 1
        return out

    def _get_last_hidden_state(self, unwrapped_model, input_ids, attention_mask, keep, **kw):
        import torch

        hidden = super()._get_last_hidden_state(
            unwrapped_model, input_ids, attention_mask, keep, **kw
        )
        if self.model.training and unwrapped_model is self.accelerator.unwrap_model(
            self.teacher_model
        ):  # the teacher's NLL of the completion tokens at temperature 1 (no collective here:
            # inside the teacher's forward)
            with torch.no_grad():
                self.nll = token_nll(
                    head_logits(unwrapped_model, hidden),
                    input_ids[:, -keep:],
                    attention_mask[:, -keep:],
                )
        return hidden

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        loss, entropy, valid = super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)
        # this micro batch's summed divergence: TRL's loss is it over the generation batch's
        # tokens (num_items_in_batch) or, without them, over its own (valid)
        scale = valid if num_items_in_batch is None else num_items_in_batch
        self.divergence = loss.detach().float() * scale
        return loss, entropy, valid

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        import torch

        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.model.training:  # summed over every rank, after the wrapped forward
            nll, count = self.nll
            device = self.divergence.device
            here = torch.stack(
                [self.divergence.reshape(()), nll.to(device), count.to(device).float()]
            )
            every = self.accelerator.gather(here.unsqueeze(0)).sum(0)
            self.sums["divergence"] += float(every[0])
            self.sums["teacher_nll"] += float(every[1])
            self.sums["tokens"] += float(every[2])
        return out

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        s = self.sums
        if self.model.training and s["tokens"]:
            logs["divergence"] = s["divergence"] / s["tokens"]
            logs["teacher_nll"] = s["teacher_nll"] / s["tokens"]
            logs["completion_length"] = s["completion_length"] / max(s["completions"], 1.0)
            logs["on_policy"] = s["on_policy"] / max(s["steps"], 1.0)
            self.sums = dict.fromkeys(s, 0.0)
        super().log(logs, start_time)


def trainer(ctx: Context, model, data: Data, callbacks: list):
    """TRL's DistillationTrainer on this rank's planned prompts (OnPolicy), the teacher held
    beside the student."""
    from trl import DistillationConfig, DistillationTrainer

    from snaketune.data.kernels import resolve_attention
    from snaketune.evaluation.model import build_model

    b = ctx.run[BLOCK]
    args = training_args(
        ctx,
        DistillationConfig,
        max_completion_length=b["max_completion_length"],
        temperature=b["temperature"],
        beta=b["beta"],
        shuffle_dataset=False,
        log_completions=False,
        model_init_kwargs=None,
        disable_dropout=True,
    )
    folder = Path(ctx.inputs[LIVE_TEACHER.name])
    attention = resolve_attention(ctx.run["attn_implementation"], folder)
    teacher = build_model(folder, ctx.precision, attention)

    class Planned(OnPolicy, Lean, DistillationTrainer):
        pass

    with exact_targets():
        t = Planned(
            model=model,
            teacher_model=teacher,
            args=args,
            train_dataset=data.table,
            processing_class=ctx.tokenizer,
            peft_config=peft_config(ctx.run, model),
            callbacks=callbacks,
        )
    t.planned, t.block, t.seed = data, b, ctx.run["seed"]
    t.sums = dict.fromkeys((*FIGURES, "tokens", "completions", "steps"), 0.0)
    return t


def step_fields(logs: dict[str, Any]) -> dict[str, float]:
    """The step's figures (see the module's docstring) for metrics.jsonl."""
    return {k: logs[k] for k in FIGURES if k in logs}


def describe(run: dict[str, Any], manifest: dict[str, Any]) -> str:
    b = run[BLOCK]
    kind = {0.0: "forward KL", 1.0: "reverse KL"}.get(float(b["beta"]), f"JSD (beta {b['beta']})")
    mix = "" if b["lmbda"] >= 1 else f"; {b['lmbda']:.0%} of steps on its samples"
    return (
        f"on-policy distillation from {b['teacher']}: {manifest['global_batch']} prompts per "
        f"step, completions of up to {b['max_completion_length']} tokens, {kind} at "
        f"temperature {b['temperature']}{mix}"
    )


def check(where: str, run: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """The teacher (snaketune.methods.teachers: a model or run of the config, generating
    text, with the student's tokenizer)."""
    check_teacher(f"{where}.{BLOCK}.teacher", run[BLOCK]["teacher"], run, config)
    lora = run.get("lora") or {}
    for key in ("target_modules", "modules_to_save"):
        if "lm_head" in (lora.get(key) or []):
            raise ConfigError(
                f"{where}.lora.{key}: lm_head trained in on-policy distillation, whose "
                "divergence reads the output head's weights directly (TRL's chunked loss), "
                "so an adapter on it would never train; leave lm_head out"
            )


# runs.<run>.opd: its keys and defaults (snaketune.methods.compose_schema puts it into the
# run schema).
SCHEMA = """\
description: >-
  On-policy distillation settings (docs/distillation.md): the teacher that scores
  the student's own samples, the divergence, the completions.
type: object
additionalProperties: false
required: [teacher]
properties:
  teacher:
    description: >-
      A key of `models` or of `runs` (a run or sweep: its final model, a sweep's
      best member) with the student's tokenizer. The train job holds it on every
      GPU beside the student (sharded with it under ZeRO-3).
    type: string
  beta:
    description: >-
      The divergence of each completion token (TRL's generalized JSD): 0 the
      forward KL(teacher || student), 1 the reverse KL(student || teacher), the
      on-policy recipe's; between the two a JSD.
    type: number
    minimum: 0
    maximum: 1
    default: 1.0
  lmbda:
    description: >-
      The share of steps trained on the student's own samples; the others take
      the dataset's responses as the completions (GKD's mix). 1: every step
      on-policy.
    type: number
    minimum: 0
    maximum: 1
    default: 1.0
  max_completion_length:
    description: Longest sampled completion, in tokens.
    type: integer
    minimum: 1
    default: 256
  temperature:
    description: >-
      Sampling temperature of the completions, and of both distributions in the
      divergence.
    type: number
    exclusiveMinimum: 0
    default: 1.0
"""

METHOD = Method(
    name=BLOCK,
    block=BLOCK,
    data=data,
    trainer=trainer,
    step_fields=step_fields,
    rows_per_example=lambda run: 1,
    describe=describe,
    heldout_metric="loss",
    summary=(
        "on-policy distillation: the student samples each prompt's completion and a teacher "
        "scores every token of it live (TRL's DistillationTrainer), LoRA when the run has a "
        "`lora` block, else every weight (docs/distillation.md)"
    ),
    schema=SCHEMA,
    trains_on="prompts",
    starts_from_runs=True,
    packs=False,  # it plans prompts; its completions are padded batches
    check=check,
    # completions as long as max_completion_length; the divergence never holds whole logits
    # (TRL's chunked loss); the teacher's weights: its need (snaketune.budget.scoring)
    # generated_share: the steps that generate (the cost estimate's, budget.rolloutcost)
    memory=lambda run, on_gpu: {
        "completion_length": run[BLOCK]["max_completion_length"],
        "generated_share": run[BLOCK]["lmbda"],
    },
    needs=lambda run: {LIVE_TEACHER: {"teacher": run[BLOCK]["teacher"]}},
    # the teacher's NLL of the student's greedy completions of the held-out prompts
    # (snaketune.evaluation.teacher_nll), then the data's figures
    headline=("teacher_nll",),
)
