"""The training worker: one process per device, started by torchrun (see launch.py).

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        scripts/train.py --worker --run-spec ... --shards ... --model ... --deepspeed ... --out ...

A worker runs four named steps, the same for every training method:

1. ``build_data``: its micro batches, exactly as shard_dataset planned them (node
   ``GROUP_RANK``'s shard, the rows of this process's global ``RANK``; GROUP_RANK is the
   node rank torchrun's c10d rendezvous assigned, in arrival order), and the collator of
   the run's layout (snaketune.packing);
2. ``build_model``: the model in the run's precision and attention kernel;
3. ``build_trainer``: the method's trainer (``METHODS``; today ``sft``: trl's SFTTrainer
   with DeepSpeed, peft for LoRA), wired to the shared callback;
4. ``run``: train (resuming from the newest complete checkpoint), then write the outputs.

What every method shares:

- checkpoints in ``<out>/checkpoints/checkpoint-<step>``, each marked complete only after
  every rank wrote its part; a rerun resumes from the newest complete one, with the same
  data order (the plan is fixed; later epochs permute its steps with (seed, epoch));
  Trainer restores the optimizer, scheduler and RNG states and skips the batches seen;
- the loss of a step is the mean over every label token of the global batch (Trainer's
  ``num_items_in_batch``, counted across micro batches and ranks), so packed and padded
  batches of the same examples give the same loss and gradients;
- SIGTERM/SIGUSR1: every rank agrees (the per-step collective) to save at the end of the
  current step, then the job exits with code 3 so a retry resumes from there;
- rank 0 writes one JSON line per step to metrics.jsonl (snaketune.progress).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler
from transformers import TrainerCallback

from snaketune.checkpoints import (  # noqa: F401 (re-exported for the tests and the launcher)
    COMPLETE,
    checkpoint_step,
    checkpoints,
    newest_complete,
    prune,
    truncate_metrics,
)
from snaketune.config import trains_lora
from snaketune.diskplan import DiskGuard
from snaketune.errors import UserError
from snaketune.health import Limits, Watchdog, open_reader
from snaketune.heartbeat import FOLDER as HEARTBEATS
from snaketune.heartbeat import Heartbeat, HeartbeatCallback
from snaketune.io import host_name, write_json
from snaketune.packing import (
    Collator,
    check_packing,
    layout_for,
    resolve_attention,
    resolve_liger,
    training_kernel,
)
from snaketune.progress import (
    Deadline,
    FlopsModel,
    SnaketuneCallback,
    StopRequest,
    any_rank,
    barrier,
)
from snaketune.throughput import matmul_params, peak_tflops

log = logging.getLogger(__name__)

STOPPED_EXIT_CODE = 3
SEGMENT = "segment.json"  # written by rank 0 when this job's training ends: why, at which step
HEALTH_EXIT_CODE = 4  # stopped by the GPU health watchdog (checkpoint saved)
DISK_EXIT_CODE = 5  # stopped before a save the disk had no room for (last checkpoint intact)
NETWORK_EXIT_CODE = 6  # the all-reduce was slower than preflight.min_busbw_gbps


@dataclass(frozen=True)
class WorkerEnv:
    """Where this process sits in the job (from torchrun's environment)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int

    @classmethod
    def from_environ(cls) -> WorkerEnv:
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            node_rank=int(env.get("GROUP_RANK", 0)),
        )


# ----------------------------------------------------------------------------- data


class PlanBatches(Sampler[list[int]]):
    """This rank's micro batches in the planned order: for each step of the epoch, its
    ``accumulation`` micro batches (row indices into this rank's table).

    Epoch 0 runs the steps as planned; epoch e > 0 runs the same steps in an order permuted
    with (seed, e), the same on every rank, so each kept example is trained once per epoch.
    ``start_epoch`` is the epoch a resumed run continues in; each ``iter()`` moves to the
    next epoch, as Trainer calls it once per epoch.
    """

    def __init__(
        self,
        step: np.ndarray,
        micro: np.ndarray,
        steps: int,
        accumulation: int,
        seed: int,
        start_epoch: int = 0,
    ):
        self.steps, self.accumulation, self.seed, self.epoch = (
            steps,
            accumulation,
            seed,
            start_epoch,
        )
        self.batches: list[list[list[int]]] = [
            [[] for _ in range(accumulation)] for _ in range(steps)
        ]
        for i, (s, m) in enumerate(zip(step.tolist(), micro.tolist(), strict=True)):
            self.batches[s][m].append(i)
        empty = [
            (s, m) for s in range(steps) for m in range(accumulation) if not self.batches[s][m]
        ]
        if empty:
            raise UserError(
                f"the shard plans no example for step {empty[0][0]} micro batch {empty[0][1]} "
                "of this rank; rerun shard_dataset with this run's settings"
            )

    def order(self, epoch: int) -> list[int]:
        if epoch == 0:
            return list(range(self.steps))
        return np.random.default_rng([self.seed, epoch]).permutation(self.steps).tolist()

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        return (micro for s in self.order(epoch) for micro in self.batches[s])

    def __len__(self) -> int:
        return self.steps * self.accumulation


@dataclass
class Data:
    """What a method trains on: this rank's rows, their batches and the collator."""

    table: Any  # datasets.Dataset of this rank's rows
    batches: PlanBatches
    collator: Any  # a packing.Collator (SFT) or a grpo.RolloutCounter: what the callback counts


def read_rank_rows(shards: Path, node: int, rank: int):
    """The rows node ``node``'s shard plans for global ``rank``, as a datasets.Dataset."""
    import datasets
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(shards / f"node-{node}.parquet")
    table = table.filter(pc.equal(table.column("rank"), rank))
    return datasets.Dataset(table.select(["example_id", "input_ids", "labels", "step", "micro"]))


def build_data(
    run: dict[str, Any],
    manifest: dict[str, Any],
    shards: Path,
    env: WorkerEnv,
    tokenizer,
    kernel: str,
    start_step: int,
    ids_log: Path | None,
) -> Data:
    table = read_rank_rows(shards, env.node_rank, env.rank)
    steps = manifest["steps_per_epoch"]
    batches = PlanBatches(
        np.asarray(table["step"]),
        np.asarray(table["micro"]),
        steps,
        manifest["gradient_accumulation_steps"],
        run["seed"],
        start_epoch=start_step // steps,
    )
    if run["method"] == "grpo":  # prompts and reference answers, counted per rollout
        from snaketune.grpo import RolloutCounter, prompt_rows

        return Data(prompt_rows(table, tokenizer), batches, RolloutCounter(ids_log))
    layout = layout_for(run["packing"], kernel)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Data(table, batches, Collator(layout, pad, run["max_length"], ids_log))


# ----------------------------------------------------------------------------- model


def resolve_precision(preference: str) -> str:
    """bf16 on GPUs that have it, fp32 on CPU (or what the run forces)."""
    if preference != "auto":
        if preference in ("bf16", "fp16") and not torch.cuda.is_available():
            log.warning("precision %s asked for on CPU: using fp32", preference)
            return "fp32"
        return preference
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def build_model(model_dir: Path, precision: str, attention: str):
    """The base model for training (no KV cache: training never reads one, and with one
    transformers would not see packed sequences)."""
    from transformers import AutoModelForCausalLM

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attention, local_files_only=True
    )
    model.config.use_cache = False
    return model


def flops_model(run: dict[str, Any], model, world_size: int) -> FlopsModel | None:
    """What MFU needs (on GPU only)."""
    if not torch.cuda.is_available():
        return None
    cfg = model.config
    peak = peak_tflops(torch.cuda.get_device_name(), run.get("gpu_peak_tflops"))
    if peak is None:
        log.warning(
            "MFU: peak FLOP/s of %s unknown; set gpu_peak_tflops in the run to report it",
            torch.cuda.get_device_name(),
        )
    return FlopsModel(matmul_params(model), cfg.num_hidden_layers, cfg.hidden_size,
                      trains_lora(run), world_size, peak)  # fmt: skip


def load_deepspeed(path: Path) -> dict[str, Any]:
    config = json.loads(path.read_text())
    if not torch.cuda.is_available():
        # On CPU keep DeepSpeed from building fused GPU kernels; the Trainer's AdamW is used.
        config.pop("optimizer", None)
        zero = config.get("zero_optimization", {})
        for key in ("offload_optimizer", "offload_param"):
            zero.pop(key, None)
    if os.environ.get("SNAKETUNE_LOAD_UNIVERSAL") == "1":  # written by another rank count
        config.setdefault("checkpoint", {})["load_universal"] = True
    return config


def untie_optimizer_steps(optimizer) -> int:
    """Give every optimizer state its own ``step`` tensor; returns how many were shared.

    DeepSpeed's ZeRO-3 universal load (0.19) puts one ``step`` tensor object in the state
    of every parameter group, and torch's Adam increments each state's step in place: the
    shared counter then advances once per group and step, and the bias correction of every
    group but the first drifts (measured: losses 1e-3 off four steps after the load)."""
    base = getattr(optimizer, "optimizer", optimizer)
    base = getattr(base, "optimizer", base)  # accelerate's wrapper, then DeepSpeed's
    seen, shared = set(), 0
    for state in getattr(base, "state", {}).values():
        step = state.get("step") if isinstance(state, dict) else None
        if torch.is_tensor(step):
            if id(step) in seen:
                state["step"], shared = step.clone(), shared + 1
            seen.add(id(step))
    return shared


class UniversalLoadFix(TrainerCallback):
    """On a continuation from a universal checkpoint: untie the optimizer steps once the
    checkpoint is loaded, before the first step."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None and untie_optimizer_steps(optimizer):
            log.info("universal checkpoint: the optimizer's shared step counters were untied")


# ----------------------------------------------------------------------------- methods


@dataclass
class Context:
    """Everything a method's trainer is built from."""

    run: dict[str, Any]
    env: WorkerEnv
    model_dir: Path
    deepspeed: Path
    ckpt_dir: Path
    out: Path
    precision: str
    liger: bool
    tokenizer: Any


def training_args(ctx: Context, config_class, **method_args):
    """The settings every method shares (batch, schedule, precision, DeepSpeed, saving,
    logging), as ``config_class`` (a transformers TrainingArguments subclass)."""
    run = ctx.run
    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(ctx.out / "tensorboard"))
    report_to = ["tensorboard"]
    if run["wandb"]["enabled"]:
        os.environ.setdefault("WANDB_MODE", run["wandb"]["mode"])
        os.environ.setdefault("WANDB_PROJECT", run["wandb"]["project"])
        report_to.append("wandb")
    return config_class(
        output_dir=str(ctx.ckpt_dir),
        per_device_train_batch_size=run["micro_batch_size"],
        gradient_accumulation_steps=run["gradient_accumulation_steps"],
        num_train_epochs=run.get("epochs", 1),
        max_steps=run.get("max_steps", -1),
        learning_rate=run["learning_rate"],
        lr_scheduler_type=run["lr_scheduler"],
        warmup_steps=run["warmup_ratio"],
        weight_decay=run["weight_decay"],
        max_grad_norm=run["max_grad_norm"],
        seed=run["seed"],
        data_seed=run["seed"],
        bf16=ctx.precision == "bf16",
        fp16=ctx.precision == "fp16",
        use_cpu=not torch.cuda.is_available(),
        use_liger_kernel=ctx.liger,
        gradient_checkpointing=run["gradient_checkpointing"],
        gradient_checkpointing_kwargs={"use_reentrant": False},
        save_strategy="steps",
        save_steps=run["save_steps"],
        save_total_limit=None,  # pruned by SnaketuneCallback, complete checkpoints only
        logging_steps=run["logging_steps"],
        report_to=report_to,
        deepspeed=load_deepspeed(ctx.deepspeed),
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        average_tokens_across_devices=True,  # loss = mean over the global batch's label tokens
        ddp_timeout=int(run["timeout_minutes"] * 60),
        log_level="warning",
        log_level_replica="warning",
        **method_args,
    )


def peft_config(run: dict[str, Any]):
    if not trains_lora(run):
        return None
    from peft import LoraConfig

    lora = run["lora"]
    return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      target_modules=lora["target_modules"], task_type="CAUSAL_LM",
                      modules_to_save=lora["modules_to_save"] or None)  # fmt: skip


def sft_trainer(ctx: Context, model, data: Data, callbacks: list):
    """Supervised fine-tuning: trl's SFTTrainer on the planned micro batches."""
    from transformers import Trainer
    from trl import SFTConfig, SFTTrainer

    args = training_args(
        ctx, SFTConfig, dataset_kwargs={"skip_prepare_dataset": True}, max_length=None,
        packing=False, model_init_kwargs=None,
    )  # fmt: skip
    pin = torch.cuda.is_available()

    class PlannedSFTTrainer(SFTTrainer):
        # The model's own loss (transformers' Trainer.compute_loss). SFTTrainer's adds token
        # accuracy and entropy metrics, gathered across all ranks with a host sync four times
        # per micro batch; on the CPU benchmark that alone cost a fifth of the throughput.
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

        def get_train_dataloader(self) -> DataLoader:
            return DataLoader(data.table, batch_sampler=data.batches, collate_fn=data.collator,
                              num_workers=0, pin_memory=pin)  # fmt: skip

    return PlannedSFTTrainer(model=model, args=args, train_dataset=data.table,
                             processing_class=ctx.tokenizer, data_collator=data.collator,
                             peft_config=peft_config(ctx.run), callbacks=callbacks)  # fmt: skip


# A method builds its trainer from the shared context, model, data and callbacks; the rest
# of the worker (launch, data plan, checkpoints, resume, callback, outputs) is shared.
def grpo_trainer(ctx: Context, model, data: Data, callbacks: list):
    """Reinforcement learning with verifiable rewards (snaketune.grpo)."""
    from snaketune.grpo import grpo_trainer as build

    return build(ctx, model, data, callbacks)


METHODS: dict[str, Callable] = {"sft": sft_trainer, "grpo": grpo_trainer}


def method_of(run: dict[str, Any]) -> str:
    """The training method of a run (LoRA and full fine-tuning are both ``sft``)."""
    return "grpo" if run["method"] == "grpo" else "sft"


# ----------------------------------------------------------------------------- health


def start_watchdog(
    cfg: dict[str, Any], env: WorkerEnv, ckpt_dir: Path, run: str
) -> Watchdog | None:
    """This process's GPU watchdog (snaketune.health), or None (off, said once in the log)."""
    if not cfg["enabled"]:
        return None
    reader, how = open_reader(torch.cuda.is_available())
    if reader is None:
        if env.rank == 0:
            log.info("GPU health watchdog: off (%s)", how)
        return None
    index = env.local_rank
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    mine = visible[env.local_rank].strip() if len(visible) > env.local_rank else ""
    if torch.cuda.is_available() and mine.isdigit():  # NVML numbers GPUs physically
        index = int(mine)
    limits = Limits(cfg["temperature_margin_c"], cfg["throttle_samples"],
                    cfg["memory_warn_fraction"])  # fmt: skip
    records = ckpt_dir / "health" / f"node-{env.node_rank}-rank-{env.local_rank}.jsonl"
    webhook = os.environ.get(cfg["webhook_env"]) or None
    if env.rank == 0:
        log.info("GPU health watchdog: every %gs (%s)%s", cfg["interval_seconds"], how,
                 ", webhook set" if webhook else "")  # fmt: skip
    context = {"run": run, "node": env.node_rank, "rank": env.rank}
    return Watchdog(reader, index, cfg["interval_seconds"], limits, records, webhook,
                    context).start()  # fmt: skip


def report_unhealthy(
    watchdog: Watchdog | None, env: WorkerEnv, ckpt_dir: Path, step: int | None
) -> None:
    """Gather the failing GPUs' messages on rank 0 and write checkpoints/health/fatal.json."""
    import torch.distributed as dist

    mine = watchdog.fatal if watchdog is not None else None
    messages = [mine]
    if dist.is_available() and dist.is_initialized():
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, mine)
    if env.rank == 0:
        found = list(dict.fromkeys(m for m in messages if m))
        (ckpt_dir / "health").mkdir(exist_ok=True)
        (ckpt_dir / "health" / "fatal.json").write_text(
            json.dumps({"step": step, "messages": found}, indent=2) + "\n"
        )
        log.error("GPU health: stopped at step %s after saving a checkpoint: %s", step,
                  "; ".join(found))  # fmt: skip


# ----------------------------------------------------------------------------- the worker


def start(
    run: dict[str, Any], shards: Path, out: Path, min_busbw: float | None = None
) -> tuple[WorkerEnv, dict, Path | None, dict | None]:
    """Join the job, check it matches the shards, time the network (multi-node jobs:
    snaketune.network), and find the checkpoint to resume from."""
    import deepspeed as ds

    from snaketune.runlock import worker_dies_with_agent

    worker_dies_with_agent()  # never outlive the job: see snaketune.runlock
    env = WorkerEnv.from_environ()
    manifest = json.loads((shards / "manifest.json").read_text())
    expected = manifest["nodes"] * manifest["gpus_per_node"]
    if env.world_size != expected or env.local_world_size != manifest["gpus_per_node"]:
        raise UserError(
            f"launched {env.world_size} processes ({env.local_world_size} per node) but the shards "
            f"are for {manifest['nodes']} nodes x {manifest['gpus_per_node']}; rerun shard_dataset"
        )
    ds.init_distributed(timeout=timedelta(minutes=run["timeout_minutes"]))
    ckpt_dir = out / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    network = None
    if env.world_size > env.local_world_size:  # more than one node
        from snaketune.network import RESULT, allreduce_busbw, too_slow

        network = allreduce_busbw()
        problem = too_slow(network, min_busbw)
        if env.rank == 0:
            write_json(ckpt_dir / RESULT, {**network, "problem": problem})
            log.info("network: all-reduce of %d MiB across %d ranks (%s): bus bandwidth %.2f "
                     "GB/s", network["bytes"] // 2**20, network["ranks"], network["backend"],
                     network["busbw_gbps"])  # fmt: skip
        if problem:  # the launcher says it, once (snaketune.launch.outcome)
            raise SystemExit(NETWORK_EXIT_CODE)
    resume = newest_complete(ckpt_dir)
    if env.rank == 0:
        # half-written checkpoints of a killed run
        prune(ckpt_dir, run["save_total_limit"], run["checkpoints"]["optimizer"])
        truncate_metrics(ckpt_dir / "metrics.jsonl", checkpoint_step(resume) if resume else 0)
    if env.local_rank == 0:
        hosts = ckpt_dir / "hosts"
        hosts.mkdir(exist_ok=True)
        (hosts / f"node-{env.node_rank}").write_text(host_name())
    barrier()
    return env, manifest, resume, network


def run_worker(
    run: dict[str, Any],
    shards: Path,
    model_dir: Path,
    deepspeed: Path,
    out: Path,
    ids_log: Path | None = None,
    min_busbw: float | None = None,
) -> int:
    """Train one run; returns 0 when finished, STOPPED_EXIT_CODE when stopped by a signal,
    HEALTH_EXIT_CODE when the GPU watchdog stopped it, DISK_EXIT_CODE when the disk had no
    room for a save."""
    from transformers import AutoTokenizer

    stop = StopRequest()
    stop.install()
    env, manifest, resume, network = start(run, shards, out, min_busbw)
    ckpt_dir, start_step = out / "checkpoints", checkpoint_step(resume) if resume else 0

    attention = resolve_attention(run["attn_implementation"])
    model_config = {}  # read only for packing (never for GRPO: validation turns it off)
    if run["packing"]:
        model_config = check_packing(model_dir, attention, f"runs.{out.parent.name}")
    kernel = training_kernel(attention, run["packing"], model_config)  # see snaketune.packing
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    data = build_data(run, manifest, shards, env, tokenizer, kernel, start_step, ids_log)

    precision = resolve_precision(run["precision"])
    model = build_model(model_dir, precision, kernel)
    ctx = Context(run, env, model_dir, deepspeed, ckpt_dir, out, precision,
                  resolve_liger(run["liger_kernel"]), tokenizer)  # fmt: skip
    watchdog = start_watchdog(run["health"], env, ckpt_dir, out.parent.name)
    # one process per node checks the room for each save (the node's view of the folder)
    disk = None
    if env.local_rank == 0:
        disk = DiskGuard(ckpt_dir, float(os.environ.get("SNAKETUNE_CHECKPOINT_BYTES", 0)))
    callback = SnaketuneCallback(env.rank, data.collator, stop, ckpt_dir / "metrics.jsonl",
                                 run["save_total_limit"], start_step, watchdog,
                                 flops_model(run, model, env.world_size),
                                 Deadline.from_environ(), run["checkpoints"]["optimizer"],
                                 disk, network)  # fmt: skip
    fixes = [UniversalLoadFix()] if os.environ.get("SNAKETUNE_LOAD_UNIVERSAL") == "1" else []
    # where this rank is, for the launcher's stall watch (snaketune.heartbeat)
    beat = Heartbeat(ckpt_dir / HEARTBEATS, env.rank, env.node_rank).start(model)
    trainer = METHODS[method_of(run)](ctx, model, data,
                                      [callback, HeartbeatCallback(beat), *fixes])  # fmt: skip
    # our callback logs one line per step; Trainer's printer would add each step's raw dict
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    if env.rank == 0 and run["method"] == "grpo":
        g = run["grpo"]["num_generations"]
        log.info("GRPO: %d prompts per step x %d generations = %d completions; %s",
                 manifest["global_batch"], g, manifest["global_batch"] * g,
                 ", ".join(f"{k} x {v}" for k, v in run["grpo"]["rewards"].items()))  # fmt: skip
    if env.rank == 0:
        log.info(
            "global batch %d = micro %d x %d devices x %d nodes x accumulation %d; %d steps per "
            "epoch; precision %s; %s; attention %s, %s batches%s; resuming from %s",
            manifest["global_batch"] * (run["grpo"]["num_generations"] if "grpo" in run else 1),
            run["micro_batch_size"], env.local_world_size,
            env.world_size // env.local_world_size, run["gradient_accumulation_steps"],
            manifest["steps_per_epoch"], precision, run["method"], kernel,
            data.collator.layout, ", Liger kernels" if ctx.liger else "",
            resume.name if resume else "scratch",
        )  # fmt: skip
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    if watchdog is not None:
        watchdog.stop()
    beat.stop()
    # a stop asked at the last step leaves nothing to continue: the run is done
    finished = trainer.state.global_step >= trainer.state.max_steps
    if finished and callback.stopped_at is None:  # room for the outputs (~one checkpoint)?
        short = disk.short() if disk is not None else None
        if any_rank(short is not None):
            callback.stopped_at, callback.stop_reason = trainer.state.global_step, "disk"
            callback.disk_short = short
    kept = callback.stopped_for_health or callback.stop_reason == "disk"
    stopped = callback.stopped_at is not None and (kept or not finished)
    if env.rank == 0:  # how this job's training ended, for the launcher (snaketune.launch)
        write_json(ckpt_dir / SEGMENT, {
            "reason": (callback.stop_reason or "done") if stopped else "done",
            "step": trainer.state.global_step,
            "train_s": round(callback.deadline.train_s, 3),
            "save_s": round(callback.deadline.save_s, 3),
            **({"disk": callback.disk_short} if callback.stop_reason == "disk" else {}),
        })  # fmt: skip
    if callback.stop_reason == "disk":
        if env.rank == 0:
            saved = newest_complete(ckpt_dir)
            log.error("disk full: %s; stopped at step %d without saving; %s is complete and "
                      "resumable", callback.disk_short, callback.stopped_at,
                      saved.name if saved else "no checkpoint")  # fmt: skip
        return DISK_EXIT_CODE
    if callback.stopped_for_health:
        report_unhealthy(watchdog, env, ckpt_dir, callback.stopped_at)
        return HEALTH_EXIT_CODE
    if stopped:
        if env.rank == 0 and callback.stop_reason == "time":
            log.warning(
                "stopped at step %d ahead of the time limit (%s); checkpoint saved, the next "
                "job continues from there", callback.stopped_at, stop.signal or "deadline",
            )  # fmt: skip
        elif env.rank == 0:
            log.warning(
                "stopped by %s at step %d; checkpoint saved, a rerun resumes there",
                stop.signal or "a signal on another rank",
                callback.stopped_at,
            )
        return STOPPED_EXIT_CODE
    save_outputs(trainer, env, out, ckpt_dir / "metrics.jsonl", probe_inputs(shards), precision)
    return 0


# ----------------------------------------------------------------------------- outputs

PROBE_ROWS, PROBE_TOKENS = 2, 32


def probe_inputs(shards: Path) -> torch.Tensor:
    """Fixed probe input ids: the first tokens of the first rows of node 0's shard."""
    import pyarrow.parquet as pq

    rows = pq.read_table(shards / "node-0.parquet", columns=["input_ids"]).slice(0, PROBE_ROWS)
    ids = [r[:PROBE_TOKENS] for r in rows.column("input_ids").to_pylist()]
    n = min(len(r) for r in ids)
    return torch.tensor([r[:n] for r in ids], dtype=torch.long)


def record_probe(engine, probe: torch.Tensor, path: Path, rank: int, precision: str) -> None:
    """Logits of the trained model on the probe inputs (every rank runs the forward pass:
    under ZeRO-3 the parameters are gathered layer by layer). Later stages compare the
    converted and merged models against these."""
    from safetensors.torch import save_file

    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=probe.to(engine.device)).logits.float().cpu()
    if rank == 0:
        save_file(
            {"input_ids": probe, "logits": logits.contiguous()},
            str(path),
            metadata={"precision": precision},
        )


def staged(out: Path, name: str) -> Path:
    """Where a finished output of the train step waits until the launcher publishes it."""
    return out / f".{name}.staged"


# Outputs the workers write (staged); the launcher adds run_config.json and provenance.json
# and renames all of them into place at once, after every worker has exited 0.
WORKER_OUTPUTS = ("final_checkpoint", "model", "probe.safetensors", "metrics.jsonl")


def save_outputs(
    trainer, env: WorkerEnv, out: Path, live_metrics: Path, probe: torch.Tensor, precision: str
) -> None:
    """Final DeepSpeed checkpoint, model (adapter) directory, probe logits and metrics,
    each written to its staged name (see :func:`staged`)."""
    final_tmp, model_tmp = staged(out, "final_checkpoint"), staged(out, "model")
    probe_tmp, metrics_tmp = staged(out, "probe.safetensors"), staged(out, "metrics.jsonl")
    if env.rank == 0:
        for p in (final_tmp, model_tmp, probe_tmp, metrics_tmp):
            if p.is_dir():
                shutil.rmtree(p)
            p.unlink(missing_ok=True)
    barrier()
    trainer.model_wrapped.save_checkpoint(str(final_tmp), tag="final")
    trainer.save_model(str(model_tmp))
    record_probe(trainer.model_wrapped, probe, probe_tmp, env.rank, precision)
    if env.rank == 0:
        shutil.copyfile(live_metrics, metrics_tmp)
    barrier()
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        dist.destroy_process_group()
