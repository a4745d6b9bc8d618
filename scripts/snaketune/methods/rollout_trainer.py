"""The trainer of the methods that learn from their own generations (GRPO, RLOO): TRL's
rollout trainer on this rank's planned prompts (their own tokens, grouped per step), the
run's rewards set up (built-ins, the user's functions, reward models), each step's
rollouts counted and their rewards recorded (snaketune.methods.rollouts counts them)."""

from __future__ import annotations

import atexit
from typing import TYPE_CHECKING, Any

from snaketune.core.lora_targets import exact_targets
from snaketune.evaluation import model_rewards, rewards
from snaketune.methods import rollouts
from snaketune.methods.training import Context, Lean, peft_config
from snaketune.tools.tooluse import Tools, uses_tools

if TYPE_CHECKING:
    from snaketune.data.batches import Data


TRAJECTORIES = "trajectories.jsonl"  # GRPO with tools: a trajectory per step (the train dir)


def group_batches(batches, generations: int):
    """A sampler over rollout rows from a PlanBatches: per step, the step's prompts (all its
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


def reward_setup(ctx: Context, table, block: str) -> tuple[list, list[float], dict[str, dict]]:
    """The run's reward functions and weights (its reward models loaded on this rank's
    device), and for the user's functions the source rows' other columns by example id
    (their keywords); refuses code changed since the workflow planned the job (its digest
    is in the spec)."""
    from snaketune.core.qlora import dtype_of

    run = ctx.run
    named = run[block]["rewards"]
    if "code_sha256" in run and run["code_sha256"] != rollouts.code(block, run):
        raise rewards.RewardError(
            "a reward function's or tool's file changed after the workflow planned this job; run "
            "snakemake again (the run retrains with the new code)"
        )
    models = model_rewards.scorers(
        run[block], list(table["example_id"]), dtype_of(ctx.precision), ctx.env.local_rank
    )
    funcs, weights = rewards.functions(named, models)
    users = rewards.user_keys(named)
    columns = rewards.source_columns(list(table["example_id"])) if users else {}
    return funcs, weights, columns


def use_vllm(setting: bool | str) -> bool:
    """vLLM for the rollouts: asked for (true), or auto where it is installed on a GPU."""
    if setting == "auto":
        import torch

        from snaketune.data.kernels import installed

        return torch.cuda.is_available() and installed("vllm")
    return bool(setting)


def shared_args(ctx: Context, block: str, weights: list[float]) -> dict[str, Any]:
    """The TRL config arguments every rollout method's block sets alike."""
    b = ctx.run[block]
    return dict(
        num_generations=b["num_generations"],
        max_completion_length=b["max_completion_length"],
        temperature=b["temperature"],
        top_p=b["top_p"],
        beta=b["beta"],
        epsilon=b["epsilon"],
        num_iterations=b["num_iterations"],
        reward_weights=weights,
        steps_per_generation=ctx.run["gradient_accumulation_steps"],
        use_vllm=use_vllm(b["use_vllm"]),
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=b["vllm_gpu_memory_utilization"],
        shuffle_dataset=False,
        log_completions=False,
        model_init_kwargs=None,
    )


def planned(
    base, ctx: Context, model, data: Data, callbacks: list, block: str, config_cls, **method_args
):
    """TRL's rollout trainer ``base`` (GRPOTrainer, RLOOTrainer) on this rank's planned
    prompts: its config ``config_cls`` from the shared settings (training_args) and the
    block's, the prompts' own tokens (with tools: their conversations, which TRL renders
    with the tools' block), each step's rollouts counted."""
    from snaketune.data.batches import planned_loader
    from snaketune.methods.training import training_args

    funcs, weights, columns = reward_setup(ctx, data.table, block)
    tools = Tools(ctx.run, block, data.table) if uses_tools(ctx.run[block]) else None
    method_args.update(tools.config_args if tools else {})
    args = training_args(ctx, config_cls, **shared_args(ctx, block, weights), **method_args)
    counter = data.collator  # a RolloutCounter (snaketune.methods.rollouts)
    prompt_ids = dict(zip(data.table["prompt"], data.table["prompt_ids"], strict=True))
    sampler = group_batches(data.batches, ctx.run[block]["num_generations"])
    decided: list[bool] = []
    scored: list = []  # the last _calculate_rewards' values (every rank's rows)

    class Planned(Lean, base):
        def get_train_dataloader(self):
            # this rank's planned prompts, not TRL's RepeatSampler over a shared dataset
            return planned_loader(tools.table if tools else data.table, sampler, list)

        def _tokenize_prompts(self, prompts: list):
            if tools:  # conversations: TRL renders them with the tools
                return super()._tokenize_prompts(prompts)
            # the tokens tokenize wrote (chat template applied), not a re-encoding of them
            return [list(prompt_ids[p]) for p in prompts], None, {}

        def _generate_and_score_completions(self, inputs):
            if not decided:  # ZeRO-3: the whole model per GPU, or generate on the shards
                from snaketune.evaluation.sharded import decide_gather

                decided.append(decide_gather(self, ctx.run))
            rewards.add_columns(inputs, columns)
            try:
                out = super()._generate_and_score_completions(inputs)
            except rewards.RewardError as exc:  # the launcher's one line (health/fatal.json)
                rewards.report(ctx.ckpt_dir, exc, self.state.global_step)
                raise
            if tools:
                tools.figures(self)
            if self.model.training:
                count_rollouts(self, counter, inputs, out, scored[-1])
                if tools:
                    tools.record(self, inputs, out, ctx.out / TRAJECTORIES)
            return out

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            if tools:
                tools.observe(completions)
            scored[:] = [
                super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            ]
            return scored[0]

    Planned.__name__ = f"Planned{base.__name__}"
    return build(Planned, ctx, model, data.table, funcs, args, callbacks, tools)


def build(cls, ctx: Context, model, table, funcs, args, callbacks: list, tools):
    """The trainer ``cls`` made (LoRA targets as the run names them); with ``tools``, their
    functions given to it and their process ended when training ends."""
    from transformers import TrainerCallback

    if tools:

        class EndTools(TrainerCallback):
            def on_train_end(self, *_, **__):
                tools.close()

        atexit.register(tools.close)
        callbacks = [*callbacks, EndTools()]
    with exact_targets():
        return cls(
            model=model,
            reward_funcs=funcs,
            args=args,
            train_dataset=tools.table if tools else table,
            processing_class=ctx.tokenizer,
            peft_config=peft_config(ctx.run, model),
            callbacks=callbacks,
            **(tools.trainer_args if tools else {}),
        )


def count_rollouts(trainer, counter, inputs: list, out: dict, scored) -> None:
    """A training step's rollouts counted (tokens, the example ids) and recorded with this
    rank's rows of the rewards matrix ``scored`` by reward function (NaN, a reward that did
    not score a row, as None); ``counter``: a RolloutCounter (snaketune.methods.rollouts)."""
    counter.count(out["prompt_mask"], out["completion_mask"])
    counter.ids_log.write([x["example_id"] for x in inputs[:: trainer.num_generations]])
    at = trainer.accelerator.process_index * len(inputs)
    mine = scored[at : at + len(inputs)]
    values = {
        name: [None if v != v else v for v in mine[:, i].tolist()]
        for i, name in enumerate(trainer.reward_func_names)
    }
    counter.record(trainer.state.global_step + 1, inputs, out, values)
