"""Evaluation across several GPUs, for models that do not fit one (``eval.nodes`` x
``eval.gpus_per_node`` processes, started by the shared launcher, snaketune.train.agents).

The weights are sharded over the processes with DeepSpeed ZeRO-3: transformers loads the
checkpoint under ``deepspeed.zero.Init`` (``HfDeepSpeedConfig``), so each process holds
1/N of every weight from the start and never the whole model; a layer's weights are
gathered for its forward pass and released after. This works for any Hugging Face causal
LM (no per-architecture plan) and on CPU with gloo, where the tests run it.

ZeRO-3 is data parallel: every process runs the model on its own examples (example i on
rank i mod N, each scored once). The forward passes are collective, so every rank runs as
many of them: a rank short of examples repeats one and keeps nothing of it, and greedy
generation is synchronised (transformers' ``synced_gpus``: a rank whose sequences all
stopped keeps taking part until every rank's have). Rank 0 collects the results in the
eval set's order and writes the stage's outputs.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DUMMY = {"input_ids": [0, 0], "labels": [-100, 0]}  # a forward pass that counts nothing


@dataclass(frozen=True)
class Share:
    """This process's part of an evaluation: rank of world, and how many batches every rank
    runs (the most any rank needs)."""

    rank: int = 0
    world: int = 1

    @classmethod
    def from_environ(cls) -> Share:
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))

    def mine(self, rows: list[Any]) -> list[Any]:
        return rows[self.rank :: self.world]

    def batches(self, total: int, batch_size: int) -> int:
        return math.ceil(math.ceil(total / self.world) / batch_size)

    def in_order(self, mine: list[Any]) -> list[Any] | None:
        """Every rank's ``mine`` joined back in the eval set's order, on rank 0 (None on the
        others); one process: ``mine`` itself. A collective."""
        if self.world == 1:
            return mine
        import torch.distributed as dist

        every: list[list[Any]] = [[] for _ in range(self.world)]
        dist.all_gather_object(every, mine)
        return self.join(every) if self.rank == 0 else None

    def join(self, every: list[list[Any]]) -> list[Any]:
        """Every rank's share (rank order) back in the eval set's order: example i is share
        i mod world's (i div world)-th."""
        total = sum(len(part) for part in every)
        return [every[i % self.world][i // self.world] for i in range(total)]


ONE = Share()  # a single process: every example, no collective


def zero3_config(dtype) -> dict[str, Any]:
    """The DeepSpeed config of a sharded evaluation: ZeRO-3 without optimizer or offload,
    parameters gathered a layer at a time (no persistence threshold: every weight sharded)."""
    import torch

    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
        },
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
    }


def load_sharded(model_dir: Path, dtype, base: Path | None = None):
    """The tokenizer and the model, its weights sharded over this job's processes (ZeRO-3
    from the load on), in eval mode; and the object that keeps transformers' view of the
    DeepSpeed config alive (generation reads it to synchronise the ranks). ``base``:
    ``model_dir`` is a LoRA adapter, put on that base before the sharding."""
    import deepspeed
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed()
    config = zero3_config(dtype)
    keep = HfDeepSpeedConfig(config)  # from_pretrained under zero.Init: shards from the start
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        base or model_dir, dtype=dtype, local_files_only=True
    )
    if base is not None:
        from snaketune.core.lora_targets import load_adapter

        model = load_adapter(model, model_dir)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return tokenizer, engine.module, keep


@contextlib.contextmanager
def whole_output_layer(model, sharded: bool):
    """The output layer's weight gathered for TRL's fused LM head, which reads it outside the
    layer's own forward (ZeRO-3 gathers a weight only for its module's forward)."""
    if not sharded:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.get_output_embeddings().parameters())):
        yield


def is_sharded(model) -> bool:
    """Whether ``model``'s weights are ZeRO-3 partitions (DeepSpeed marks each with ds_id)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def gather_for_generation(setting: bool | str, model) -> bool:
    """Whether a ZeRO-3 model is gathered whole onto each GPU to generate while training
    (faster) or generates sharded (every layer gathered at every token: no GPU ever holds
    the whole model). ``setting``: the run's ``eval.gather_for_generation``; `auto` gathers
    where every rank's GPU has the whole model's bytes free, with a tenth to spare (on a CPU,
    always). All ranks decide together (a collective): one gathering alone would hang."""
    import torch

    if setting != "auto":
        return bool(setting)
    if not torch.cuda.is_available():
        return True
    from snaketune.core.collective import gather_combined

    whole = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())
    short = float(torch.cuda.mem_get_info()[0] < 1.1 * whole)
    return gather_combined([short], ("max",))[0] == 0.0


def decide_gather(trainer, run) -> bool:
    """Under ZeRO-3, whether a rollout ``trainer`` (TRL's GRPO, RLOO) gathers the whole model
    to generate (the run's gather_for_generation, auto: where it fits) or generates on the
    shards; sets its ds3_gather_for_generation."""
    if is_sharded(trainer.model):
        trainer.args.ds3_gather_for_generation = gather_for_generation(
            run.get("gather_for_generation", "auto"), trainer.model
        )
    return True
