"""The training worker: one process per device, started by torchrun (see launch.py).

Each node reads only its own shard, ``node-{GROUP_RANK}.parquet`` (GROUP_RANK is the node
rank torchrun's c10d rendezvous assigned, in arrival order); the ranks of a node split it.
Every epoch reshuffles the node's shard with (seed, epoch) and gives local rank r the
r-th of every ``gpus_per_node`` examples, so each kept example is seen exactly once per
epoch and every rank runs the same number of steps.

Training is trl's SFTTrainer (transformers' Trainer) with its DeepSpeed integration, which
fills the ``auto`` values of the DeepSpeed JSON from the run's batch sizes and precision,
and peft for LoRA. This module adds what a week-long job on a shared cluster needs:

- checkpoints in ``<out>/checkpoints/checkpoint-<step>``, each marked complete only after
  every rank wrote its part; a rerun resumes from the newest complete one, with the same
  data order (the sampler is a pure function of seed and epoch; Trainer restores the
  optimizer, scheduler and RNG states and skips the batches already seen);
- SIGTERM/SIGUSR1: every rank agrees (an all-reduce per step) to save at the end of the
  current step, then the job exits with code 3 so a retry resumes from there;
- rank 0 writes one JSON line per step to metrics.jsonl and a progress line with an ETA;
  TensorBoard events (and wandb when enabled) come from the Trainer's own reporters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import shutil
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler
from transformers import TrainerCallback

from snaketune.errors import UserError
from snaketune.health import LEVEL, STATUS, Limits, Watchdog, open_reader
from snaketune.io import host_name

log = logging.getLogger(__name__)

COMPLETE = "snaketune-complete.json"
STOPPED_EXIT_CODE = 3
HEALTH_EXIT_CODE = 4  # stopped by the GPU health watchdog (checkpoint saved)


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


class NodeShardSampler(Sampler[int]):
    """This rank's part of its node's shard, reshuffled every epoch.

    The order is a pure function of (seed, epoch), the same on every rank of a node; local
    rank r takes positions r, r + G, r + 2G, ... of it. ``start_epoch`` is the epoch a
    resumed run continues in; each ``iter()`` moves to the next epoch, as Trainer calls it
    once per epoch.
    """

    def __init__(
        self, n_rows: int, local_rank: int, local_world_size: int, seed: int, start_epoch: int = 0
    ):
        if n_rows % local_world_size:
            raise UserError(
                f"the node's shard has {n_rows} rows, not a multiple of its {local_world_size} "
                "processes; rerun shard_dataset with this gpus_per_node"
            )
        self.n_rows, self.local_rank, self.local_world_size = n_rows, local_rank, local_world_size
        self.seed, self.epoch = seed, start_epoch

    def indices(self, epoch: int) -> list[int]:
        order = np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
        return order[self.local_rank :: self.local_world_size].tolist()

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        return iter(self.indices(epoch))

    def __len__(self) -> int:
        return self.n_rows // self.local_world_size


class Collator:
    """trl's padding collator, counting tokens and (optionally) logging example ids."""

    def __init__(self, pad_token_id: int, ids_log: Path | None = None):
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        self._collate = DataCollatorForLanguageModeling(pad_token_id=pad_token_id)
        self.tokens = 0
        self.samples = 0
        self._ids_log = open(ids_log, "a", encoding="utf-8") if ids_log else None  # noqa: SIM115

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        self.tokens += sum(len(e["input_ids"]) for e in examples)
        self.samples += len(examples)
        if self._ids_log is not None:
            self._ids_log.write("".join(f"{e['example_id']}\n" for e in examples))
            self._ids_log.flush()
        return self._collate(
            [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
        )


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_step(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[1])


def checkpoints(directory: Path) -> list[Path]:
    """checkpoint-<step> directories, oldest first."""
    found = [
        p for p in directory.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()
    ]
    return sorted(found, key=checkpoint_step)


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def newest_complete(directory: Path) -> Path | None:
    """The checkpoint a rerun resumes from (half-written ones are ignored)."""
    done = [p for p in checkpoints(directory) if is_complete(p)]
    return done[-1] if done else None


def prune(directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop older and half-written ones."""
    done = [p for p in checkpoints(directory) if is_complete(p)]
    newest = checkpoint_step(done[-1]) if done else -1
    for p in checkpoints(directory):
        stale = p in done[:-keep] if is_complete(p) else checkpoint_step(p) <= newest
        if stale:
            shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------- callback


class StopRequest:
    """Set by SIGTERM/SIGUSR1; read by the callback at every step end."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signal = signal.Signals(signum).name
        log.warning("%s received: saving a checkpoint at the end of this step", self.signal)


def _all_reduce(values: list[float], op: str = "sum") -> list[float]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.tolist()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def peak_memory_mib() -> float:
    """Peak device memory of this process (CUDA), or its peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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


class SnaketuneCallback(TrainerCallback):
    """Metrics, progress, stop-on-signal and checkpoint completion marks."""

    def __init__(
        self,
        env: WorkerEnv,
        collator: Collator,
        stop: StopRequest,
        metrics: Path,
        keep: int,
        start_step: int,
        watchdog: Watchdog | None = None,
    ):
        self.env, self.collator, self.stop = env, collator, stop
        self.metrics, self.keep, self.watchdog = metrics, keep, watchdog
        self.stopped_at: int | None = None
        self.stopped_for_health = False
        self._start = self._last = time.monotonic()
        self._start_step = start_step
        self._tokens = self._samples = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = self._last = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        # One collective per step: 1 = a rank got a stop signal, 2 = a rank's GPU is failing.
        unhealthy = self.watchdog is not None and self.watchdog.fatal is not None
        (flag,) = _all_reduce([2.0 if unhealthy else 1.0 if self.stop.signal else 0.0], "max")
        if flag:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
            self.stopped_for_health = flag >= 2
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        now = time.monotonic()
        tokens, samples = _all_reduce(
            [self.collator.tokens - self._tokens, self.collator.samples - self._samples]
        )
        self._tokens, self._samples = self.collator.tokens, self.collator.samples
        last = self.watchdog.last if self.watchdog is not None else None
        status = LEVEL[last["status"]] if last else -1
        temp = last.get("temperature_c", -1) if last else -1
        peak, status, temp = _all_reduce([peak_memory_mib(), status, temp], op="max")
        seconds = max(now - self._last, 1e-9)
        self._last = now
        if self.env.rank != 0 or not logs or "loss" not in logs:
            return
        record = {
            "step": state.global_step,
            "epoch": round(state.epoch or 0.0, 4),
            "loss": logs.get("loss"),
            "lr": logs.get("learning_rate"),
            "grad_norm": logs.get("grad_norm"),
            "tokens_per_s": round(tokens / seconds, 1),
            "samples_per_s": round(samples / seconds, 2),
            "peak_memory_mib": round(peak, 1),
            "elapsed_s": round(now - self._start, 3),
        }
        if status >= 0:  # the worst GPU of the job at its last sample
            record["gpu_health"] = STATUS[int(status)]
            if temp >= 0:
                record["gpu_max_temp_c"] = temp
        with open(self.metrics, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        done = state.global_step - self._start_step
        left = state.max_steps - state.global_step
        eta = (now - self._start) / done * left if done > 0 else float("nan")
        log.info(
            "step %d/%d (%.0f%%) epoch %.2f loss %.4f lr %.2e grad %.3f | %.0f tok/s | ETA %s",
            state.global_step,
            state.max_steps,
            100 * state.global_step / max(state.max_steps, 1),
            record["epoch"],
            record["loss"],
            record["lr"] or 0.0,
            record["grad_norm"] or 0.0,
            record["tokens_per_s"],
            _duration(eta),
        )

    def on_save(self, args, state, control, **kwargs):
        _barrier()  # every rank has written its part of the checkpoint
        if self.env.rank == 0:
            path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            (path / COMPLETE).write_text(
                json.dumps({"step": state.global_step, "time": time.time()})
            )
            prune(Path(args.output_dir), self.keep)
            log.info("checkpoint %s complete", path.name)
        _barrier()


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    return str(timedelta(seconds=int(seconds)))


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines after ``step`` (a resumed run writes them again)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
    path.write_text("".join(f"{ln}\n" for ln in lines))


# ----------------------------------------------------------------------------- settings


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


def resolve_attention(preference: str) -> str:
    if preference == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            log.warning("flash_attention_2 asked for but flash-attn is not installed: using sdpa")
            return "sdpa"
    return preference


def load_deepspeed(path: Path) -> dict[str, Any]:
    config = json.loads(path.read_text())
    if not torch.cuda.is_available():
        # On CPU keep DeepSpeed from building fused GPU kernels; the Trainer's AdamW is used.
        config.pop("optimizer", None)
        zero = config.get("zero_optimization", {})
        for key in ("offload_optimizer", "offload_param"):
            zero.pop(key, None)
    return config


# ----------------------------------------------------------------------------- main


def run_worker(
    run: dict[str, Any],
    shards: Path,
    model_dir: Path,
    deepspeed: Path,
    out: Path,
    ids_log: Path | None = None,
) -> int:
    """Train one run; returns 0 when finished, STOPPED_EXIT_CODE when stopped by a signal."""
    import datasets
    import deepspeed as ds
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer
    from trl import SFTConfig, SFTTrainer

    env = WorkerEnv.from_environ()
    stop = StopRequest()
    stop.install()
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
    resume = newest_complete(ckpt_dir)
    start_step = checkpoint_step(resume) if resume else 0
    steps_per_epoch = manifest["steps_per_epoch"]
    live_metrics = ckpt_dir / "metrics.jsonl"
    if env.rank == 0:
        prune(ckpt_dir, run["save_total_limit"])  # half-written checkpoints of a killed run
        truncate_metrics(live_metrics, start_step)
    if env.local_rank == 0:
        hosts = ckpt_dir / "hosts"
        hosts.mkdir(exist_ok=True)
        (hosts / f"node-{env.node_rank}").write_text(host_name())
    _barrier()

    shard = datasets.Dataset.from_parquet(str(shards / f"node-{env.node_rank}.parquet"))
    shard = shard.select_columns(["example_id", "input_ids", "labels"])
    sampler = NodeShardSampler(
        len(shard),
        env.local_rank,
        env.local_world_size,
        run["seed"],
        start_epoch=start_step // steps_per_epoch,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    collator = Collator(
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        ids_log,
    )

    precision = resolve_precision(run["precision"])
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    cpu = not torch.cuda.is_available()
    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(out / "tensorboard"))
    report_to = ["tensorboard"]
    if run["wandb"]["enabled"]:
        os.environ.setdefault("WANDB_MODE", run["wandb"]["mode"])
        os.environ.setdefault("WANDB_PROJECT", run["wandb"]["project"])
        report_to.append("wandb")
    args = SFTConfig(
        output_dir=str(ckpt_dir),
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
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=cpu,
        gradient_checkpointing=run["gradient_checkpointing"],
        gradient_checkpointing_kwargs={"use_reentrant": False},
        save_strategy="steps",
        save_steps=run["save_steps"],
        save_total_limit=None,  # pruned by SnaketuneCallback, complete checkpoints only
        logging_steps=run["logging_steps"],
        report_to=report_to,
        deepspeed=load_deepspeed(deepspeed),
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True},
        max_length=None,
        packing=False,
        ddp_timeout=int(run["timeout_minutes"] * 60),
        log_level="warning",
        log_level_replica="warning",
        model_init_kwargs=None,
    )
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=dtype,
        attn_implementation=resolve_attention(run["attn_implementation"]),
        local_files_only=True,
    )
    peft_config = None
    if run["method"] == "lora":
        lora = run["lora"]
        peft_config = LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=lora["target_modules"],
            task_type="CAUSAL_LM",
        )
    watchdog = start_watchdog(run["health"], env, ckpt_dir, out.parent.name)
    callback = SnaketuneCallback(
        env, collator, stop, live_metrics, run["save_total_limit"], start_step, watchdog
    )

    class ShardTrainer(SFTTrainer):
        # The model's own loss (transformers' Trainer.compute_loss). SFTTrainer's adds token
        # accuracy and entropy metrics, gathered across all ranks with a host sync four times
        # per micro batch; on the CPU benchmark that alone cost a fifth of the throughput.
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

        def get_train_dataloader(self) -> DataLoader:
            return DataLoader(
                self.train_dataset,
                batch_size=self._train_batch_size,
                sampler=sampler,
                collate_fn=collator,
                drop_last=True,
                num_workers=0,
                pin_memory=not cpu,
            )

    trainer = ShardTrainer(
        model=model,
        args=args,
        train_dataset=shard,
        processing_class=tokenizer,
        data_collator=collator,
        peft_config=peft_config,
        callbacks=[callback],
    )
    if env.rank == 0:
        total = run["micro_batch_size"] * env.world_size * run["gradient_accumulation_steps"]
        log.info(
            "global batch %d = micro %d x %d devices x %d nodes x accumulation %d; "
            "%d steps per epoch; precision %s; %s; resuming from %s",
            total,
            run["micro_batch_size"],
            env.local_world_size,
            env.world_size // env.local_world_size,
            run["gradient_accumulation_steps"],
            steps_per_epoch,
            precision,
            run["method"],
            resume.name if resume else "scratch",
        )
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    if watchdog is not None:
        watchdog.stop()
    if callback.stopped_for_health:
        report_unhealthy(watchdog, env, ckpt_dir, callback.stopped_at)
        return HEALTH_EXIT_CODE
    if callback.stopped_at is not None:
        if env.rank == 0:
            log.warning(
                "stopped by %s at step %d; checkpoint saved, a rerun resumes there",
                stop.signal or "a signal on another rank",
                callback.stopped_at,
            )
        return STOPPED_EXIT_CODE

    save_outputs(trainer, env, out, live_metrics, probe_inputs(shards), precision)
    return 0


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
    _barrier()
    trainer.model_wrapped.save_checkpoint(str(final_tmp), tag="final")
    trainer.save_model(str(model_tmp))
    record_probe(trainer.model_wrapped, probe, probe_tmp, env.rank, precision)
    if env.rank == 0:
        shutil.copyfile(live_metrics, metrics_tmp)
    _barrier()
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        dist.destroy_process_group()
