"""The training worker: one process per device, started by torchrun (see snaketune.train.launch).

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        scripts/train.py --worker --job results/<run>/train/job.json

``run_worker`` reads top to bottom, the same for every training method:

1. join the job (``join``): the rendezvous, the network check on a multi-node job, the
   checkpoint to resume from;
2. choose the attention kernel and the precision;
3. the method's data for this rank (node ``GROUP_RANK``'s shard, the rows of this
   process's global ``RANK``; GROUP_RANK is the node rank torchrun's c10d rendezvous
   assigned, in arrival order), in the planned order (snaketune.data.batches);
4. the model;
5. the callbacks: the step callback (metrics, stops, checkpoint marks, vitals), the GPU
   health watchdog, the heartbeat, the disk guard;
6. the method's trainer (snaketune.methods);
7. train, resuming from the newest complete checkpoint;
8. how it ended (snaketune.train.ending): the outputs, or the exit code of a stop
   (snaketune.core.job).

What every method shares:

- checkpoints in ``<out>/checkpoints/checkpoint-<step>``, each marked complete only after
  every rank wrote its part; a rerun resumes from the newest complete one, with the same
  data order (the plan is fixed; later epochs permute its steps with (seed, epoch));
  Trainer restores the optimizer, scheduler and RNG states and skips the batches seen;
- the loss of a step is the mean over every label token of the global batch (Trainer's
  ``num_items_in_batch``, counted across micro batches and ranks), so packed and padded
  batches of the same examples give the same loss and gradients;
- SIGTERM/SIGINT/SIGUSR1: every rank agrees (the per-step collective) to save at the end
  of the current step, then the job exits with code 3 so a retry resumes from there;
- only rank 0 logs at info level and writes metrics.jsonl, one JSON line per step, and
  warns within the first steps of a run that cannot learn (snaketune.train.vitals).
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from snaketune.core import qlora
from snaketune.core.checkpoints import (
    checkpoint_step,
    newest_complete,
    prune,
    truncate_metrics,
)
from snaketune.core.collective import barrier, ragged_gather
from snaketune.core.errors import UserError
from snaketune.core.heartbeat import FOLDER as HEARTBEATS
from snaketune.core.heartbeat import Heartbeat
from snaketune.core.io import host_name, write_json
from snaketune.core.job import (
    NETWORK_EXIT_CODE,
    Handoff,
    Job,
    WorkerEnv,
)
from snaketune.core.lora_targets import ADAPTERS, describe, run_dropout
from snaketune.data import sequence
from snaketune.data.batches import Data, PlanBatches, read_rank_rows
from snaketune.data.kernels import (
    resolve_attention,
    resolve_liger,
    resolve_packing,
    training_kernel,
)
from snaketune.evaluation import heldout_pass
from snaketune.evaluation.model import (
    DTYPES,
    UniversalLoadFix,
    build_model,
    flops_model,
    resolve_precision,
    trainable_in,
)
from snaketune.methods.common import Method, RankRows
from snaketune.methods.training import Context
from snaketune.plan.runspec import RunSpec, heldout_metric, kept_best
from snaketune.train.ending import finish, last_step_guard, train_or_export
from snaketune.train.health import start_watchdog
from snaketune.train.progress import Deadline, HeartbeatCallback, StepCallback, StopRequest
from snaketune.train.resume import DiskGuard
from snaketune.train.startup import watch_builds
from snaketune.train.vitals import Vitals

log = logging.getLogger(__name__)


def join(
    run: dict[str, Any], shards: Path, out: Path, min_busbw: float | None = None
) -> tuple[WorkerEnv, dict, Path | None, dict | None]:
    """Join the job, check it matches the shards, time the network (multi-node jobs:
    snaketune.train.network), and find the checkpoint to resume from."""
    import deepspeed as ds

    from snaketune.core.runlock import worker_dies_with_agent

    worker_dies_with_agent()  # never outlive the job: see snaketune.core.runlock
    env = WorkerEnv.from_environ()
    manifest = json.loads((shards / "manifest.json").read_text())
    expected = manifest["nodes"] * manifest["gpus_per_node"]
    if (
        env.world_size != expected
        or env.local_world_size != manifest["gpus_per_node"]
        or manifest.get("sequence_parallel", 1) != sequence.size(run)
    ):
        raise UserError(
            f"launched {env.world_size} processes ({env.local_world_size} per node) but the shards "
            f"are for {manifest['nodes']} nodes x {manifest['gpus_per_node']} (sequence_parallel "
            f"{manifest.get('sequence_parallel', 1)}); rerun shard_dataset"
        )
    watch_builds()  # a first job's op builds are one-time, not this job's start-up
    ds.init_distributed(timeout=timedelta(minutes=run["timeout_minutes"]))
    ckpt_dir = out / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    network = time_network(env, ckpt_dir, min_busbw)
    resume = newest_complete(ckpt_dir)
    if env.rank == 0:
        # half-written checkpoints of a killed run
        prune(ckpt_dir, run["save_total_limit"], run["checkpoints"]["optimizer"], kept_best(run))
        # a new run keeps no line (a held-out pass at step 0 is made again)
        truncate_metrics(ckpt_dir / "metrics.jsonl", checkpoint_step(resume) if resume else -1)
    if env.local_rank == 0:
        hosts = ckpt_dir / "hosts"
        hosts.mkdir(exist_ok=True)
        (hosts / f"node-{env.node_rank}").write_text(host_name())
    barrier()
    return env, manifest, resume, network


def time_network(env: WorkerEnv, ckpt_dir: Path, min_busbw: float | None) -> dict | None:
    """On a multi-node job: the all-reduce bus bandwidth (rank 0 records it); a fabric
    slower than ``min_busbw`` ends the job (the launcher says why, once)."""
    if env.world_size <= env.local_world_size:  # one node
        return None
    from snaketune.train.network import RESULT, allreduce_busbw, too_slow

    network = allreduce_busbw()
    problem = too_slow(network, min_busbw)
    if env.rank == 0:
        write_json(ckpt_dir / RESULT, {**network, "problem": problem})
        log.info(
            "network: all-reduce of %d MiB across %d ranks (%s): bus bandwidth %.2f GB/s",
            network["bytes"] // 2**20,
            network["ranks"],
            network["backend"],
            network["busbw_gbps"],
        )
    if problem:  # the launcher says it, once (snaketune.train.launch.outcome)
        raise SystemExit(NETWORK_EXIT_CODE)
    return network


def rank_data(
    method: Method,
    job: Job,
    manifest: dict[str, Any],
    env: WorkerEnv,
    tokenizer,
    kernel: str,
    start_step: int,
    ids_log: Path | None,
) -> Data:
    """This rank's planned rows and batches, as the method trains on them (with the scoring
    stages' outputs it reads: ``job.inputs``)."""
    run = job.spec
    # a sequence-parallel group's GPUs read their data-parallel rank's rows
    table = read_rank_rows(job.shards, env.node_rank, env.rank // sequence.size(run))
    steps = manifest["steps_per_epoch"]
    batches = PlanBatches(
        np.asarray(table["step"]),
        np.asarray(table["micro"]),
        steps,
        manifest["gradient_accumulation_steps"],
        run["seed"],
        start_epoch=start_step // steps,
    )
    return method.data(RankRows(run, table, batches, tokenizer, kernel, ids_log, job.inputs))


def log_start(
    method: Method,
    ctx: Context,
    manifest: dict[str, Any],
    kernel: str,
    data: Data,
    resume: Path | None,
) -> None:
    """Rank 0's start-up lines: what the method does, the global batch and the settings."""
    run, env = ctx.run, ctx.env
    line = method.describe(run, manifest)
    if line:
        log.info("%s", line)
    log.info(
        "global batch %d = micro %d x %s x %d nodes x accumulation %d; %d steps per "
        "epoch; precision %s; %s; attention %s, %s batches%s; resuming from %s",
        manifest["global_batch"] * method.rows_per_example(run),
        run["micro_batch_size"],
        sequence.devices(run, env.local_world_size),
        env.world_size // env.local_world_size,
        run["gradient_accumulation_steps"],
        manifest["steps_per_epoch"],
        ctx.precision,
        run["method"],
        kernel,
        data.collator.layout,
        ", Liger kernels" if ctx.liger else "",
        resume.name if resume else "scratch",
    )


def held_out(
    run: dict[str, Any], env: WorkerEnv, tokenizer
) -> tuple[heldout_pass.HeldOut | None, heldout_pass.Schedule | None]:
    """This rank's share of the eval set scored while training, and when (eval_steps)."""
    metric = heldout_metric(run)
    if metric is None:
        return None, None
    scored = heldout_pass.HeldOut(
        {**run["heldout"], "metric": metric}, run["seed"], env.rank, env.world_size, tokenizer
    )
    early = run.get("early_stopping")
    return scored, heldout_pass.Schedule(run["eval_steps"], metric, early, env.rank)


def kernel_of(run: dict[str, Any], model_dir: Path, out: Path) -> str:
    """The attention kernel the run trains with (snaketune.data.packing), and whether it packs
    (``packing: auto`` resolved); the model's config is read only for packing (never for
    GRPO: validation turns it off)."""
    attention = resolve_attention(run["attn_implementation"], model_dir)
    where = f"runs.{out.parent.name}"
    # packing: auto resolved here, once a job, for the method's collation to read
    run["packing"], model_config = resolve_packing(run["packing"], model_dir, attention, where)
    kernel = training_kernel(attention, run["packing"], model_config, sequence.size(run) > 1)
    sequence.check_kernel(kernel, run, model_config)
    return kernel


def made_ready(trainer, ctx: Context) -> None:
    """What every method's trainer gets: our step lines instead of the printer's, gathers
    of unequal counts, the held-out pass, a 4-bit base's trainable parts in the run's
    precision."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # our callback logs one line per step
    # a step's examples are split by tokens: ranks may hold unequal counts (collective)
    trainer.accelerator.gather = ragged_gather(trainer.accelerator.gather)
    if ctx.heldout is not None:
        heldout_pass.install(trainer, ctx.heldout)
    if ctx.quantized is not None:
        trainable_in(trainer.model, DTYPES[ctx.precision])
        if ctx.env.rank == 0:
            log.info("%s", qlora.describe(ctx.quantized))
    if not hasattr(trainer.model, "peft_config"):
        return
    said = run_dropout(trainer.model, ctx.run["lora"]["dropout"])  # fused experts: docs/moe.md
    if ctx.env.rank == 0:
        if said:
            log.info("%s", said)
        adapters = describe(trainer.model)  # the provenance reads it (snaketune.train.launch)
        write_json(ctx.ckpt_dir / ADAPTERS, adapters)
        log.info(
            "adapters: %s", ", ".join(f"{k} {v:,}" for k, v in adapters["adapter_params"].items())
        )


def run_worker(job: Job, spec: RunSpec, ids_log: Path | None = None) -> int:
    """Train one run, as its job file says (``job``: read once, from <out>/job.json; ``spec``:
    its settings resolved once); returns 0 when finished, or the exit code of a stop
    (snaketune.core.job)."""
    run, out = job.spec, job.out
    stop = StopRequest()
    stop.install()
    env, manifest, resume, network = join(run, job.shards, out, job.min_busbw)
    handoff = Handoff.from_environ()  # what the launcher handed this start of the workers
    start_step = checkpoint_step(resume) if resume else 0
    kernel = kernel_of(run, job.model, out)
    ctx, model, data, schedule = prepare(
        job, spec, env, manifest, kernel, start_step, handoff, ids_log
    )
    watchdog = start_watchdog(run["health"], env, ctx.ckpt_dir, out.parent.name)
    # one process per node checks the room for each save (the node's view of the folder)
    disk = DiskGuard(ctx.ckpt_dir, float(handoff.checkpoint_bytes)) if env.local_rank == 0 else None
    callback = step_callback(ctx, spec, data, model, stop, (watchdog, disk, network), handoff)
    fixes = [UniversalLoadFix()] if handoff.load_universal else []
    # where this rank is, for the launcher's stall watch (snaketune.core.heartbeat)
    beat = Heartbeat(ctx.ckpt_dir / HEARTBEATS, env.rank, env.node_rank).start(model)
    if ctx.heldout is not None:
        fixes.append(heldout_pass.callback(schedule, ctx.heldout))
    method = spec.method
    callbacks = [last_step_guard(), callback, HeartbeatCallback(beat), *fixes]
    trainer = method.trainer(ctx, model, data, callbacks)
    made_ready(trainer, ctx)
    if env.rank == 0:
        log_start(method, ctx, manifest, kernel, data, resume)
    train_or_export(trainer, resume, callback, env.rank)
    if watchdog is not None:
        watchdog.stop()
    beat.stop()
    return finish(trainer, callback, ctx, disk, watchdog, stop, job.shards, schedule)


def prepare(
    job: Job,
    spec: RunSpec,
    env: WorkerEnv,
    manifest: dict[str, Any],
    kernel: str,
    start_step: int,
    handoff: Handoff,
    ids_log: Path | None,
) -> tuple[Context, Any, Data, heldout_pass.Schedule | None]:
    """This rank's data, the model (its precision, 4-bit base, sequence-parallel split) and
    the held-out pass, as the method's trainer receives them."""
    from transformers import AutoTokenizer

    run, model_dir, out = job.spec, job.model, job.out
    precision = resolve_precision(run["precision"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    data = rank_data(spec.method, job, manifest, env, tokenizer, kernel, start_step, ids_log)
    quantize = qlora.settings(spec.quantization, precision)
    model = build_model(
        model_dir,
        precision,
        kernel,
        quantize,
        run["gradient_checkpointing"],
        head=spec.method.head,
        seed=run["seed"],
    )
    quantized = qlora.record(model, quantize) if quantize else None
    data = sequence.apply(run, env.rank, model, data, kernel, tokenizer)  # sequence_parallel
    scored, schedule = held_out(run, env, tokenizer)
    ctx = Context(
        run,
        env,
        model_dir,
        job.deepspeed,
        out / "checkpoints",
        out,
        precision,
        resolve_liger(run["liger_kernel"]),
        tokenizer,
        quantized,
        scored,
        start_step,
        handoff.load_universal,
        job.inputs,
    )
    return ctx, model, data, schedule


def step_callback(
    ctx: Context,
    spec: RunSpec,
    data: Data,
    model,
    stop: StopRequest,
    watches: tuple,
    handoff: Handoff,
) -> StepCallback:
    """The step callback: metrics, stops, checkpoint marks, vitals; ``watches``: the GPU
    health watchdog, the disk guard and the network figures it reports."""
    run, env = ctx.run, ctx.env
    watchdog, disk, network = watches
    vitals = Vitals(run, ctx.out, fresh=ctx.start_step == 0) if env.rank == 0 else None
    return StepCallback(
        env.rank,
        data.collator,
        stop,
        ctx.ckpt_dir / "metrics.jsonl",
        run["save_total_limit"],
        ctx.start_step,
        watchdog,
        flops_model(run, model, env.world_size, spec.trains_lora),
        Deadline.handed(handoff),
        run["checkpoints"]["optimizer"],
        disk,
        network,
        spec.method.step_fields,
        kept_best(run),
        vitals,
    )
