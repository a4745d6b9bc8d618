"""GRPO: reinforcement learning with verifiable rewards, on TRL's GRPOTrainer.

A GRPO run trains on the same tokenized copy and the same per-node shards as supervised
fine-tuning: a row's prompt is its tokens before the first trained label (the chat
template's user turn and the assistant header), its reference answer the text of its
trained labels. shard_dataset plans prompts, ``micro_batch_size / num_generations`` per
device and pass, exactly once per epoch, equal steps per node.

Each optimizer step, every device generates ``num_generations`` completions for each of
its prompts (one generation batch per step: TRL's ``steps_per_generation`` is the
accumulation), so each group of completions is scored and normalised where it was
generated; TRL gathers the rewards of every rank before the group statistics, which need
only the groups to be contiguous, as they are here.

Rewards (weights from ``grpo.rewards``): the built-in ``correctness`` and ``format``, the
user's own functions (``"<file.py>:<function>"``), snaketune.methods.rewards, and reward
models (``"model:<run>"``), snaketune.methods.model_rewards.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snaketune.core.errors import ConfigError
from snaketune.core.io import IdsLog
from snaketune.core.lora_targets import exact_targets
from snaketune.core.rows import prompt_and_answer
from snaketune.core.throughput import Counted
from snaketune.methods import model_rewards, rewards
from snaketune.methods.common import Method
from snaketune.methods.rewards import correctness, format_reward  # noqa: F401 (the built-ins)
from snaketune.methods.training import Context, peft_config, training_args

if TYPE_CHECKING:
    from snaketune.data.batches import Data

# Dataset formats that give each prompt a reference answer for the rewards.
ANSWERED_FORMATS = ("prompt_response", "alpaca")


def prompt_rows(table, tokenizer):
    """SFT rows -> GRPO rows: prompt (the decoded prompt tokens), prompt_ids, answer."""
    import datasets

    prompts, ids, answers = [], [], []
    for input_ids, labels in zip(table["input_ids"], table["labels"], strict=True):
        prompt, answer = prompt_and_answer(input_ids, labels)
        ids.append(prompt)
        prompts.append(tokenizer.decode(prompt))
        answers.append(tokenizer.decode(answer, skip_special_tokens=True).strip())
    return datasets.Dataset.from_dict({
        "example_id": list(table["example_id"]), "prompt": prompts, "prompt_ids": ids,
        "answer": answers, "step": list(table["step"]), "micro": list(table["micro"]),
    })  # fmt: skip


class RolloutCounter(Counted):
    """What the step callback reads from a collator, counted over generated rollouts:
    real tokens (prompt + completion), tokens in the model's input (padding included),
    completions, and the squared lengths (attention work). Logs the prompt ids it trains
    on, once per prompt, when asked to."""

    layout = "rollouts"

    def __init__(self, ids_log: Path | None):
        super().__init__()
        self.ids_log = IdsLog(ids_log)

    def count(self, prompt_mask, completion_mask) -> None:
        lengths = (prompt_mask.sum(1) + completion_mask.sum(1)).tolist()
        self.add(lengths, prompt_mask.numel() + completion_mask.numel(), len(lengths))


def data(run: dict[str, Any], table, batches, tokenizer, kernel: str,
         ids_log: Path | None) -> Data:  # fmt: skip
    """This rank's planned prompts with their reference answers, counted per rollout."""
    from snaketune.data.batches import Data

    return Data(prompt_rows(table, tokenizer), batches, RolloutCounter(ids_log))


def group_batches(batches, generations: int):
    """A sampler over GRPO rows from a PlanBatches: per step, the step's prompts (all its
    micro batches), each repeated ``generations`` times in a row, given ``accumulation``
    times (TRL generates on the first and trains each pass on a slice of it)."""
    import numpy as np
    from torch.utils.data import Sampler

    class GroupBatches(Sampler[list[int]]):
        def __iter__(self):
            epoch, batches.epoch = batches.epoch, batches.epoch + 1
            for s in batches.order(epoch):
                rows = [i for micro in batches.batches[s] for i in micro]
                batch = list(np.repeat(rows, generations).tolist())
                for _ in range(batches.accumulation):
                    yield batch

        def __len__(self) -> int:
            return len(batches)

    return GroupBatches()


def reward_setup(ctx: Context, table) -> tuple[list, list[float], dict[str, dict]]:
    """The run's reward functions and weights (its reward models loaded on this rank's
    device), and for the user's functions the source rows' other columns by example id
    (their keywords); refuses code changed since the workflow planned the job (its digest
    is in the spec)."""
    from snaketune.core.qlora import dtype_of

    run = ctx.run
    block = run["grpo"]["rewards"]
    if "code_sha256" in run and run["code_sha256"] != rewards.digests(block):
        raise rewards.RewardError(
            "a reward function's file changed after the workflow planned this job; run "
            "snakemake again (the run retrains with the new code)"
        )
    models = model_rewards.scorers(run["grpo"], list(table["example_id"]),
                                   dtype_of(ctx.precision), ctx.env.local_rank)  # fmt: skip
    funcs, weights = rewards.functions(block, models)
    users = rewards.user_keys(block)
    columns = rewards.source_columns(list(table["example_id"])) if users else {}
    return funcs, weights, columns


def use_vllm(setting: bool | str) -> bool:
    """vLLM for the rollouts: asked for (true), or auto where it is installed on a GPU."""
    if setting == "auto":
        import torch

        from snaketune.data.kernels import installed

        return torch.cuda.is_available() and installed("vllm")
    return bool(setting)


def trainer(ctx: Context, model, data: Data, callbacks: list):
    """TRL's GRPOTrainer on the planned prompts, with the shared settings of training_args."""
    from torch.utils.data import DataLoader
    from trl import GRPOConfig, GRPOTrainer

    from snaketune.data.batches import planned_loader

    grpo = ctx.run["grpo"]
    funcs, weights, columns = reward_setup(ctx, data.table)
    args = training_args(
        ctx, GRPOConfig, num_generations=grpo["num_generations"],
        max_completion_length=grpo["max_completion_length"], temperature=grpo["temperature"],
        top_p=grpo["top_p"], beta=grpo["beta"], epsilon=grpo["epsilon"],
        num_iterations=grpo["num_iterations"], loss_type=grpo["loss_type"],
        reward_weights=weights, steps_per_generation=ctx.run["gradient_accumulation_steps"],
        use_vllm=use_vllm(grpo["use_vllm"]), vllm_mode="colocate",
        vllm_gpu_memory_utilization=grpo["vllm_gpu_memory_utilization"],
        shuffle_dataset=False, log_completions=False, model_init_kwargs=None,
    )  # fmt: skip
    counter: RolloutCounter = data.collator
    prompt_ids = dict(zip(data.table["prompt"], data.table["prompt_ids"], strict=True))
    sampler = group_batches(data.batches, grpo["num_generations"])
    decided: list[bool] = []

    class PlannedGRPOTrainer(GRPOTrainer):
        def get_train_dataloader(self) -> DataLoader:
            # this rank's planned prompts, not TRL's RepeatSampler over a shared dataset
            return planned_loader(data.table, sampler, list)

        def _tokenize_prompts(self, prompts: list):
            # the tokens tokenize wrote (chat template applied), not a re-encoding of them
            return [list(prompt_ids[p]) for p in prompts], None, {}

        def _generate_and_score_completions(self, inputs):
            if not decided:  # ZeRO-3: the whole model per GPU, or generate on the shards
                from snaketune.evaluation.sharded import gather_for_generation, is_sharded

                if is_sharded(self.model):
                    self.args.ds3_gather_for_generation = gather_for_generation(
                        ctx.run.get("gather_for_generation", "auto"), self.model)  # fmt: skip
                decided.append(True)
            rewards.add_columns(inputs, columns)
            try:
                out = super()._generate_and_score_completions(inputs)
            except rewards.RewardError as exc:  # the launcher's one line (health/fatal.json)
                rewards.report(ctx.ckpt_dir, exc, self.state.global_step)
                raise
            if self.model.training:
                counter.count(out["prompt_mask"], out["completion_mask"])
                counter.ids_log.write([x["example_id"] for x in inputs[:: self.num_generations]])
            return out

    with exact_targets():
        return PlannedGRPOTrainer(model=model, reward_funcs=funcs, args=args,
                                  train_dataset=data.table, processing_class=ctx.tokenizer,
                                  peft_config=peft_config(ctx.run, model),
                                  callbacks=callbacks)  # fmt: skip


# TRL's log keys -> metrics.jsonl keys (reward functions' keys are added by name).
LOG_KEYS = {
    "reward": "reward",
    "reward_std": "reward_std",
    "kl": "kl",
    "completions/mean_length": "completion_length",
    "completions/clipped_ratio": "completion_clipped",
}


def step_fields(logs: dict[str, Any]) -> dict[str, float]:
    """The GRPO figures of a step's logs, for metrics.jsonl: total reward, each reward's
    mean and std, KL, completion length."""
    out = {new: logs[old] for old, new in LOG_KEYS.items() if old in logs}
    for key, value in logs.items():  # rewards/<name>/mean: a user's name holds slashes
        head, _, stat = key.rpartition("/")
        if head.startswith("rewards/") and stat in ("mean", "std"):
            out[f"reward_{head[len('rewards/') :]}_{stat}"] = value
    return out


def describe(run: dict[str, Any], manifest: dict[str, Any]) -> str:
    """The start-up line: prompts, generations and completions per step, the rewards."""
    g = run["grpo"]["num_generations"]
    rewards = ", ".join(f"{k} x {v}" for k, v in run["grpo"]["rewards"].items())
    return (f"GRPO: {manifest['global_batch']} prompts per step x {g} generations = "
            f"{manifest['global_batch'] * g} completions; {rewards}")  # fmt: skip


def check(where: str, run: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """Whole groups per device; prompts with reference answers; vLLM installed if asked."""
    from snaketune.data.formats import components
    from snaketune.data.kernels import installed

    grpo = run["grpo"]
    if run["micro_batch_size"] % grpo["num_generations"]:
        raise ConfigError(
            f"{where}.grpo.num_generations: {grpo['num_generations']} does not divide "
            f"micro_batch_size {run['micro_batch_size']} (each device generates whole "
            "groups); make micro_batch_size a multiple of it"
        )
    for part in (c["name"] for c in components(config, run["dataset"])):
        fmt = config["datasets"][part]["format"]
        if fmt not in ANSWERED_FORMATS:
            raise ConfigError(
                f"{where}.dataset: {part!r} (format {fmt}) gives no reference answers for the "
                "GRPO rewards; use a prompt_response dataset (columns.response: the answer) "
                "or alpaca"
            )
    rewards.check(where, grpo["rewards"])
    model_rewards.check(where, grpo["rewards"], config)
    if grpo["use_vllm"] is True and not installed("vllm"):
        raise ConfigError(
            f"{where}.grpo.use_vllm: true asked for but vLLM is not installed (no release installs "
            "beside the pinned stack: docs/grpo.md); set use_vllm: auto or false"
        )


def memory(run: Mapping[str, Any], on_gpu: bool) -> dict[str, Any]:
    """The rollouts: completions as long as max_completion_length, a reference model when
    the KL term is on (beta > 0), vLLM's share of the GPU where it generates."""
    grpo = run["grpo"]
    vllm = on_gpu and grpo["use_vllm"] in (True, "auto")
    return {"completion_length": grpo["max_completion_length"], "reference": grpo["beta"] > 0,
            "vllm_share": grpo["vllm_gpu_memory_utilization"] if vllm else 0.0}  # fmt: skip


# runs.<run>.grpo: its keys and defaults (snaketune.methods.compose_schema puts it into the
# run schema).
SCHEMA = """\
description: >-
  GRPO settings. Defaults suit GSM8K on a 1B instruct model; docs/grpo.md
  maps a PPO guide's settings onto them.
type: object
additionalProperties: false
properties:
  num_generations:
    description: >-
      Completions sampled per prompt (the group whose rewards are normalised
      against each other). Must divide micro_batch_size: each device generates
      whole groups, micro_batch_size / num_generations prompts per pass.
    type: integer
    minimum: 2
    default: 8
  max_completion_length:
    description: Longest completion, in tokens (GSM8K's worked answers fit in 256).
    type: integer
    minimum: 1
    default: 256
  temperature:
    description: Sampling temperature of the rollouts.
    type: number
    exclusiveMinimum: 0
    default: 1.0
  top_p:
    description: Nucleus sampling of the rollouts (1.0 keeps every token).
    type: number
    exclusiveMinimum: 0
    maximum: 1
    default: 1.0
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
  epsilon:
    description: PPO-style clipping range of the probability ratio.
    type: number
    exclusiveMinimum: 0
    default: 0.2
  num_iterations:
    description: Optimisation passes over each generated batch (μ in the GRPO paper).
    type: integer
    minimum: 1
    default: 1
  loss_type:
    description: >-
      TRL's loss aggregation (`dapo`: mean over the batch's completion tokens, TRL's
      default and no length bias; `grpo`, `dr_grpo`, `bnpo`).
    enum: [dapo, grpo, dr_grpo, bnpo]
    default: dapo
  rewards:
    description: >-
      Reward functions and their weights. `correctness`: 1 when the completion's final
      answer (its `####` line, else its last number) equals the reference answer's,
      checked with math-verify; `format`: 1 when the completion ends with a
      "#### <number>" line; "<path/to/file.py>:<function>": a function of yours, called
      as TRL calls reward functions (prompts, completions, the dataset's other columns
      as keywords; one float or None per completion), its file found from the directory
      snakemake runs in; "model:<run>": the score of that run's reward model (a run of
      method reward, or a sweep of them: its best member) on the prompt and completion
      in its own chat template (docs/rewards.md).
    type: object
    # other keys: "<path/to/file.py>:<function>" (checked by snaketune.methods.rewards),
    # "model:<run>" (snaketune.methods.model_rewards)
    additionalProperties:
      description: Weight of a reward function of yours or of a reward model.
      type: number
    minProperties: 1
    default: {correctness: 1.0, format: 0.2}
    properties:
      correctness:
        description: Weight of the correctness reward.
        type: number
      format:
        description: Weight of the format reward.
        type: number
  reward_model_normalization:
    description: >-
      How a reward model's score ("model:<run>" rewards) enters the weighted sum:
      `raw`, the score as the model gives it; `group`, z-scored within each prompt's
      completions ((score - mean) / (std + 1e-4)), so its scale does not outweigh the
      other rewards.
    enum: [raw, group]
    default: raw
  use_vllm:
    description: >-
      Generate rollouts with vLLM in TRL's colocate mode (GPU only, where a site
      installed vLLM: no release installs beside the pinned stack, docs/grpo.md).
      auto: where vLLM is installed and a GPU is there; false: transformers'
      generate (CPU, tests); true: vLLM or a config error.
    enum: [auto, true, false]
    default: false
  vllm_gpu_memory_utilization:
    description: Share of each GPU's memory vLLM may take for its weights and KV cache (use_vllm).
    type: number
    exclusiveMinimum: 0
    maximum: 1
    default: 0.3
"""

METHOD = Method(
    plot="reward",
    name="grpo",
    data=data,
    trainer=trainer,
    step_fields=step_fields,
    rows_per_example=lambda run: run["grpo"]["num_generations"],
    describe=describe,
    heldout_metric="exact_match",
    trains_on="prompts",
    adapter="optional",
    block="grpo",
    summary=(
        "reinforcement learning with verifiable rewards (TRL's GRPOTrainer) on the dataset's "
        "prompts, scored against its reference answers; LoRA when the run has a `lora` block, "
        "else every weight (docs/grpo.md)"
    ),
    schema=SCHEMA,
    starts_from_runs=True,
    packs=False,  # GRPO plans prompts; its rollouts are padded batches
    check=check,
    memory=memory,
    code=lambda run: rewards.digests(run["grpo"]["rewards"]),
)
