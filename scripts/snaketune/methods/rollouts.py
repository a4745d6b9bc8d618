"""What the methods that learn from their own generations share (GRPO, RLOO): the prompts
they plan, the rollouts they count, the rewards they score with, their trainer's planned
data path, their step figures, checks, memory and the config keys of their blocks.

A row's prompt is its tokens before the first trained label (the chat template's user turn
and the assistant header), its reference answer the text of its trained labels;
shard_dataset plans ``micro_batch_size / num_generations`` prompts per device and pass.
Each step, every device generates ``num_generations`` completions of each of its prompts
(TRL's ``steps_per_generation`` is the accumulation); TRL gathers every rank's rewards
before the group statistics (GRPO's normalised advantages, RLOO's leave-one-out
baselines), which need only each group contiguous, as it is here. Rewards: the built-ins,
the user's ``"<file.py>:<function>"`` (snaketune.evaluation.rewards) and reward models'
``"model:<run>"`` (snaketune.evaluation.model_rewards).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snaketune.core.errors import ConfigError
from snaketune.core.io import IdsLog
from snaketune.core.rows import prompt_and_answer
from snaketune.core.throughput import Counted
from snaketune.evaluation import model_rewards, rewards
from snaketune.methods import reward_model_runs
from snaketune.methods.common import Method, RankRows
from snaketune.methods.needs import REWARD_MODELS, Need
from snaketune.methods.outputs import WINDOW, Panel, holds, quarters
from snaketune.tools import tooluse

if TYPE_CHECKING:
    from snaketune.data.batches import Data

# Dataset formats that give each prompt a reference answer for the rewards.
ANSWERED_FORMATS = ("prompt_response", "alpaca")


def prompt_rows(table, tokenizer):
    """SFT rows -> rollout rows: prompt (the decoded prompt tokens), prompt_ids, answer."""
    import datasets

    prompts, ids, answers = [], [], []
    for input_ids, labels in zip(table["input_ids"], table["labels"], strict=True):
        prompt, answer = prompt_and_answer(input_ids, labels)
        ids.append(prompt)
        prompts.append(tokenizer.decode(prompt))
        answers.append(tokenizer.decode(answer, skip_special_tokens=True).strip())
    return datasets.Dataset.from_dict(
        {
            "example_id": list(table["example_id"]),
            "prompt": prompts,
            "prompt_ids": ids,
            "answer": answers,
            "step": list(table["step"]),
            "micro": list(table["micro"]),
        }
    )


class RolloutCounter(Counted):
    """What the step callback reads from a collator, counted over generated rollouts:
    real tokens (prompt + completion), tokens in the model's input (padding included),
    completions, and the squared lengths (attention work). Logs the prompt ids it trains
    on, once per prompt, when asked to."""

    layout = "rollouts"

    def __init__(self, ids_log: Path | None):
        super().__init__()
        self.ids_log = IdsLog(ids_log)
        # beside the ids (--log-example-ids): each step's rollouts, for the per-step oracles
        self.rollouts = Path(ids_log).with_suffix(".rollouts.jsonl") if ids_log else None

    def count(self, prompt_mask, completion_mask) -> None:
        lengths = (prompt_mask.sum(1) + completion_mask.sum(1)).tolist()
        self.add(lengths, prompt_mask.numel() + completion_mask.numel(), len(lengths))

    def record(self, step: int, inputs: list[dict], out: dict, rewards: dict) -> None:
        """With --log-example-ids: this rank's rollouts of optimizer step ``step`` (one line:
        per completion its example id, prompt and completion tokens, and each reward
        function's value, None where it gave none)."""
        if self.rollouts is not None:
            ids = {
                k: [
                    row[m.bool()].tolist()
                    for row, m in zip(out[f"{k}_ids"], out[f"{k}_mask"], strict=True)
                ]
                for k in ("prompt", "completion")
            }
            line = {
                "step": step,
                "example_ids": [x["example_id"] for x in inputs],
                "prompt_ids": ids["prompt"],
                "completion_ids": ids["completion"],
                "rewards": rewards,
            }
            with open(self.rollouts, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")


def data(rows: RankRows) -> Data:
    """This rank's planned prompts with their reference answers, counted per rollout."""
    return rows.collated(RolloutCounter(rows.ids_log), prompt_rows(rows.table, rows.tokenizer))


# TRL's log keys -> metrics.jsonl keys (reward functions' keys are added by name).
LOG_KEYS = {
    "reward": "reward",
    "reward_std": "reward_std",
    "kl": "kl",
    "completions/mean_length": "completion_length",
    "completions/clipped_ratio": "completion_clipped",
    # GRPO with tools (snaketune.tools.tooluse): calls per completion, the share that
    # failed, the runner's timeouts, dead processes and cut outputs, assistant turns
    "tools/call_frequency": "tool_calls",
    "tools/failure_frequency": "tool_failures",
    "tools/timeouts": "tool_timeouts",
    "tools/died": "tool_died",
    "tools/cut": "tool_cut",
    "tools/turns": "tool_turns",
}


def step_fields(logs: dict[str, Any]) -> dict[str, float]:
    """The rollout figures of a step's logs, for metrics.jsonl: total reward, each reward's
    mean and std, KL, completion length."""
    out = {new: logs[old] for old, new in LOG_KEYS.items() if old in logs}
    for key, value in logs.items():  # rewards/<name>/mean: a user's name holds slashes
        head, _, stat = key.rpartition("/")
        if head.startswith("rewards/") and stat in ("mean", "std"):
            out[f"reward_{head[len('rewards/') :]}_{stat}"] = value
    return out


def describe(name: str, block: str, run: dict[str, Any], manifest: dict[str, Any]) -> str:
    """The start-up line: prompts, generations and completions per step, the rewards."""
    g = run[block]["num_generations"]
    named = ", ".join(f"{k} x {v}" for k, v in run[block]["rewards"].items())
    return (
        f"{name}: {manifest['global_batch']} prompts per step x {g} generations = "
        f"{manifest['global_batch'] * g} completions; {named}"
    )


def check(
    block: str, name: str, where: str, run: Mapping[str, Any], config: Mapping[str, Any]
) -> None:
    """Whole groups per device; prompts with reference answers; vLLM installed if asked."""
    from snaketune.data.formats import components
    from snaketune.data.kernels import installed

    b = run[block]
    if run["micro_batch_size"] % b["num_generations"]:
        raise ConfigError(
            f"{where}.{block}.num_generations: {b['num_generations']} does not divide "
            f"micro_batch_size {run['micro_batch_size']} (each device generates whole "
            "groups); make micro_batch_size a multiple of it"
        )
    for part in (c["name"] for c in components(config, run["dataset"])):
        fmt = config["datasets"][part]["format"]
        if fmt not in ANSWERED_FORMATS:
            raise ConfigError(
                f"{where}.dataset: {part!r} (format {fmt}) gives no reference answers for "
                f"the {name} rewards; use a prompt_response dataset (columns.response: "
                "the answer) or alpaca"
            )
    rewards.check(where, b["rewards"], f"{block}.rewards")
    tooluse.check(where, b)
    model_rewards.check(
        where, b["rewards"], config, f"{block}.rewards", reward_model_runs(config["runs"])
    )
    if b["use_vllm"] is True and not installed("vllm"):
        raise ConfigError(
            f"{where}.{block}.use_vllm: true asked for but vLLM is not installed (no "
            "release installs beside the pinned stack: docs/grpo.md); set use_vllm: auto "
            "or false"
        )


def memory(block: str, run: Mapping[str, Any], on_gpu: bool) -> dict[str, Any]:
    """The rollouts: completions as long as max_completion_length, a reference model when
    the KL term is on (beta > 0), vLLM's share of the GPU where it generates."""
    b = run[block]
    vllm = on_gpu and b["use_vllm"] in (True, "auto")
    return {
        "completion_length": b["max_completion_length"],
        "reference": b["beta"] > 0,
        "vllm_share": b["vllm_gpu_memory_utilization"] if vllm else 0.0,
    }


def reward_names(metrics: list[dict[str, Any]]) -> list[str]:
    """The rewards a run logged on its own (``reward_<key>_mean``), first seen first."""
    return list(
        dict.fromkeys(
            k[len("reward_") : -len("_mean")]
            for m in metrics
            for k in m
            if k.startswith("reward_") and k.endswith("_mean")
        )
    )


def reward_series(metrics: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each reward's mean per step, as the plot's series (key, label), by name."""
    return [(f"reward_{name}_mean", name) for name in sorted(reward_names(metrics))]


REWARD_PANEL = Panel(
    title="reward",
    ylabel="mean reward per completion",
    series=(("reward", "total", "tab:blue"),),
    more=reward_series,
    heldout="exact_match",
)


def reward_quarters(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """The run's mean total reward over its first and last quarter of steps (at least one
    step each), and each reward's by its key (``reward_last_quarter:<key>``); nothing for a
    run that logged no reward."""
    rewards = [m["reward"] for m in metrics if m.get("reward") is not None]
    if not rewards:
        return {}
    out = dict(zip(("reward_first_quarter", "reward_last_quarter"), quarters(rewards), strict=True))
    for name in reward_names(metrics):
        key = f"reward_{name}_mean"
        first, last = quarters([m[key] for m in metrics if m.get(key) is not None])
        out[f"reward_first_quarter:{name}"], out[f"reward_last_quarter:{name}"] = first, last
    return out


def vitals(block: str, run: Mapping[str, Any], first: list[dict[str, Any]]) -> dict[str, str]:
    """The early warnings of a run that learns from its own generations (its first steps'
    rows): rewards equal within every group (no advantage, no gradient), or completions all
    cut at their maximum length."""
    completion = run[block]["max_completion_length"]
    clipped = holds(first, "completion_clipped", lambda v: v >= 0.99)
    cut = (
        f"every completion is cut at {block}.max_completion_length ({completion}) "
        "(completion_clipped 1.0): its answers never finish"
    )
    if holds(first, "reward_std", lambda v: v == 0):
        fix = (
            f"{cut}; raise it"
            if clipped
            else f"check the rewards on a few completions ({block}.rewards), raise "
            f"{block}.temperature, or give prompts the model can sometimes answer"
        )
        return {
            "reward_std": f"no learning signal: reward_std 0 in each of the first {WINDOW} "
            "steps: every completion of a prompt gets the same reward, so the advantages and "
            f"the gradient are zero; {fix}"
        }
    if clipped:
        return {"completion_clipped": f"{cut} in each of the first {WINDOW} steps; raise it"}
    return {}


def method(name: str, label: str, trainer, schema: str, summary: str) -> Method:
    """A rollout method's Method (``name``: its config name and block; ``label``: how its
    lines and refusals name it): its trainer, schema and summary its own, the rest shared."""
    return Method(
        name=name,
        block=name,
        trainer=trainer,
        schema=schema,
        summary=summary,
        panel=REWARD_PANEL,
        summary_figures=reward_quarters,
        summary_columns=("reward_first_quarter", "reward_last_quarter"),
        vitals=partial(vitals, name),
        data=data,
        step_fields=step_fields,
        heldout_metric="exact_match",
        trains_on="prompts",
        adapter="optional",
        starts_from_runs=True,
        packs=False,  # it plans prompts; its rollouts are padded batches
        rows_per_example=lambda run: run[name]["num_generations"],
        describe=partial(describe, label, name),
        check=partial(check, name, label),
        memory=partial(memory, name),
        code=partial(code, name),
        needs=partial(needs, name),
    )


def needs(block: str, run: Mapping[str, Any]) -> dict[Need, dict[str, Any]]:
    """A rollout run's reward models (the ``model:`` keys of its rewards), held whole on its
    GPUs beside the policy (snaketune.evaluation.model_rewards)."""
    runs = model_rewards.model_runs(run.get(block, {}).get("rewards", {}))
    return {REWARD_MODELS: {"runs": runs}} if runs else {}


def code(block: str, run: Mapping[str, Any]) -> dict[str, str]:
    """The user's code a rollout run calls (its reward functions, its tools), by key."""
    return {**rewards.digests(run[block]["rewards"]), **tooluse.digests(run[block])}


# The block keys every rollout method has (snaketune.methods.grpo and .rloo add theirs: the
# KL coefficient's default, the loss).
SHARED_SCHEMA = """\
  num_generations:
    description: >-
      Completions sampled per prompt (the group whose rewards are compared with each
      other). Must divide micro_batch_size: each device generates whole groups,
      micro_batch_size / num_generations prompts per pass.
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
    # other keys: "<path/to/file.py>:<function>" (checked by snaketune.evaluation.rewards),
    # "model:<run>" (snaketune.evaluation.model_rewards)
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
