"""Overhead of the train stage: tokens/s against a plain PyTorch loop, same model, data, batch.

    python bench/train_overhead.py                 # CPU, one process, the demo fixtures
    python bench/train_overhead.py --steps 200 --repeats 5 --micro-batch-size 8
    python bench/train_overhead.py --interleaved --steps 300   # the engine's share, step by step

All sides train the fixture Llama (full fine-tuning, fp32, AdamW, same learning rate) on
the same shard, in the same example order and batch size, for the same number of optimizer
steps, in one training process with the same threads (OMP_NUM_THREADS = cores):
  ours   scripts/train.py (torchrun agent, DeepSpeed ZeRO-2 engine, SFTTrainer, callbacks,
         metrics) on 1 node x 1 process; tokens/s from its metrics.jsonl
  plain  model(**batch).loss.backward(); optimizer.step() with the stage's padded collator
         over the same planned micro batches (packing: false on both sides), in a fresh
         process of its own
  plain + DeepSpeed
         the plain loop with the model and optimizer in the DeepSpeed engine the stage builds
         from the run's preset (config/deepspeed/zero2.json: ZeRO-2 on a process group of
         one); engine(**batch), engine.backward(loss), engine.step()
tokens/s counts the (unpadded) example tokens of the steps after the first --warmup steps.
The sides run in turn (ours, plain, plain + DeepSpeed, ...) --repeats times and each ratio
is taken pair by pair, so that the speed of a shared machine drifting between runs moves
the sides of a pair alike; a figure is the median pair's ratio. Short runs (60 steps, about
1.5 s timed a side) gave 0.66 to 1.09 for the same code on this machine: time more steps
and pairs. ours / plain is the target's figure; ours / (plain + DeepSpeed) is what the stage
adds to the engine it trains with (the Trainer, callbacks, metrics, data), and
(plain + DeepSpeed) / plain what DeepSpeed's ZeRO-2 adds on its own.
--interleaved: the plain loop, the plain loop in the engine as the stage builds it on this
machine, in the preset's engine as written (on CPU: with contiguous gradients) and in the
stage's engine with ZeRO off (stage 0: what ZeRO-2's partitioning costs a group of one), each on
its own copy of the model, take turns micro batch by micro batch in one process, so that
no shift of the machine's speed between runs lands on one side (whole runs of the same
code here gave ratios from 0.73 to 1.26); the stage itself cannot take part (it runs as its
own job).
Target (issue 3, issue 12): ours / plain >= 0.85; issue 76: 0.95.
"""

from __future__ import annotations

import sys

# bench/tokenize.py is named like the stdlib's tokenize module, which Python would import
# from this folder (first on sys.path when a script here runs): take the folder off the path.
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
ROOT = Path(__file__).resolve().parents[1]


def prepare(tmp: Path, micro: int, steps: int) -> tuple[Path, Path]:
    """Fixtures, tokenized data and a 1-node shard with at least ``steps`` batches."""
    from snaketune.app.fixtures import FixtureSizes, make_sharded_fixture
    from snaketune.data.shard import Layout

    sizes = FixtureSizes(train_rows=max(512, micro * steps), test_rows=8)
    made = make_sharded_fixture(tmp, sizes, Layout(1, 1, micro, 1), packing=False)
    return made["model"], made["shards"]


def training_env() -> dict[str, str]:
    """The environment of both sides' training process: every core to torch's threads."""
    return {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count())}


def run_ours(tmp: Path, model: Path, shards: Path, micro: int, steps: int, lr: float) -> list[dict]:
    from snaketune.app.fixtures import demo_run_spec, run_train_stage

    spec = demo_run_spec(ROOT, method="full", nodes=1, gpus_per_node=1, micro_batch_size=micro,
                         gradient_accumulation_steps=1, max_steps=steps, learning_rate=lr,
                         warmup_ratio=0.0, lr_scheduler="linear", save_steps=10**6,
                         max_grad_norm=0.0, seed=0, packing=False)  # fmt: skip
    return run_train_stage(ROOT, spec, shards, model, tmp / "train", env=training_env())


def run_plain(
    model_dir: Path, shards: Path, micro: int, steps: int, lr: float, engine: bool = False,
    side: str = "--plain-side",
):  # fmt: skip
    """The plain loop (``engine``: in the DeepSpeed engine; ``side`` "--interleaved-side":
    every side in turn, interleaved_steps) in a fresh process with the environment the
    stage's worker gets, so that the sides differ by the stage's own work only (run in the
    bench's own process, which had built the fixtures, the same forward and backward ran up
    to 20% slower)."""
    import subprocess

    from snaketune.train.commands import free_port

    out = model_dir.parent / "plain.json"
    env = training_env()
    if engine or side != "--plain-side":  # a process group of one, as torchrun makes
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                   LOCAL_RANK="0", WORLD_SIZE="1")  # fmt: skip
    subprocess.run([sys.executable, __file__, side, str(model_dir), str(shards),
                    str(micro), str(steps), str(lr), str(out), str(int(engine))], check=True,
                   env=env)  # fmt: skip
    return json.loads(out.read_text())


def deepspeed_engine(model, optim, sched, micro: int, form: str = "stage"):
    """``model`` and ``optim`` in the DeepSpeed engine of the stage's preset, its "auto"
    values as the stage's Trainer fills them for this run (no clipping, fp32); ``form``
    "stage": as the stage loads the preset on this machine
    (snaketune.evaluation.model.load_deepspeed: on CPU without contiguous gradients),
    "written": the preset's file as it is, "zero0": as the stage loads it with ZeRO off
    (stage 0: what a process group of one would train with, not partitioning)."""
    import deepspeed

    from snaketune.evaluation.model import load_deepspeed

    preset = ROOT / "config" / "deepspeed" / "zero2.json"
    config = json.loads(preset.read_text()) if form == "written" else load_deepspeed(preset)
    if form == "zero0":
        config["zero_optimization"] = {"stage": 0}
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=1,
                  train_batch_size=micro, gradient_clipping=0.0, bf16={"enabled": False},
                  fp16={"enabled": False})  # fmt: skip
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optim, lr_scheduler=sched, config=config
    )
    return engine


def planned_batches(shards: Path):
    """The stage's planned micro batches of rank 0 in its order, padded by its collator."""
    import numpy as np
    import torch

    from snaketune.data.batches import PlanBatches, read_rank_rows
    from snaketune.data.packing import Collator

    shard = read_rank_rows(shards, 0, 0)
    steps_planned = max(shard["step"]) + 1
    collator = Collator("padded", 0, 512)
    loader = torch.utils.data.DataLoader(
        shard,
        batch_sampler=PlanBatches(np.asarray(shard["step"]), np.asarray(shard["micro"]),
                                  steps_planned, 1, 0),  # the stage's plan and order
        collate_fn=collator,
    )  # fmt: skip
    return loader, collator


def stepper(model_dir: Path, micro: int, steps: int, lr: float, engine: str | None = None):
    """One optimizer step of a side on a batch, returning its loss: the plain loop, or
    (``engine``: a form of deepspeed_engine) the plain loop in the DeepSpeed engine."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1 - s / steps)
    if engine is not None:  # the engine steps the optimizer and the schedule
        ds = deepspeed_engine(model, optim, sched, micro, engine)

        def step(batch):
            loss = ds(**batch).loss
            ds.backward(loss)
            ds.step()
            return loss

        return step

    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        return loss

    return step


def plain_loop(
    model_dir: Path, shards: Path, micro: int, steps: int, lr: float, engine: bool = False
) -> list[dict]:
    import torch

    torch.set_num_threads(os.cpu_count())
    loader, collator = planned_batches(shards)
    step_fn = stepper(model_dir, micro, steps, lr, "stage" if engine else None)
    records, start, last_tokens = [], time.perf_counter(), 0
    for step, batch in enumerate(loader, start=1):
        loss = step_fn(batch)
        records.append(
            {
                "step": step,
                "loss": loss.item(),
                "elapsed_s": time.perf_counter() - start,
                "tokens": collator.tokens - last_tokens,
            }
        )
        last_tokens = collator.tokens
        if step == steps:
            break
    return records


SIDES = {"plain": None, "+ DeepSpeed": "stage", "+ DeepSpeed as written": "written",
         "+ DeepSpeed ZeRO-0": "zero0"}  # fmt: skip


def interleaved_steps(model_dir: Path, shards: Path, micro: int, steps: int, lr: float) -> dict:
    """The engine's share without run-to-run shifts: in one process (a process group of
    one), the plain loop, the plain loop in the engine as the stage builds it on this
    machine, in the preset's engine as written and in the stage's with ZeRO off, each on
    its own copy of the model, take turns on every micro batch; each side's step times
    (seconds)."""
    import torch

    torch.set_num_threads(os.cpu_count())
    loader, _ = planned_batches(shards)
    sides = {name: stepper(model_dir, micro, steps, lr, engine) for name, engine in SIDES.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for n, batch in enumerate(loader, start=1):
        for name, step_fn in sides.items():
            began = time.perf_counter()
            step_fn(batch).item()
            times[name].append(time.perf_counter() - began)
        if n == steps:
            break
    return times


def steady_tokens_per_s(records: list[dict], warmup: int, tokens_key: str) -> float:
    """Tokens per second over the steps after ``warmup``."""
    after = records[warmup:]
    seconds = records[-1]["elapsed_s"] - records[warmup - 1]["elapsed_s"]
    if tokens_key == "tokens":
        tokens = sum(r["tokens"] for r in after)
    else:  # metrics.jsonl: tokens_per_s over each step's own interval
        tokens = sum(
            r["tokens_per_s"] * (r["elapsed_s"] - p["elapsed_s"])
            for p, r in zip(records[warmup - 1 :], after, strict=False)
        )
    return tokens / seconds


def one_pair(tmp: Path, model: Path, shards: Path, args) -> tuple[float, float, float, str]:
    """One run of each side in turn: tokens/s of ours, plain and plain + DeepSpeed, and the
    first and last loss (the others' where they differ by more than 0.1%)."""
    micro, steps, lr = args.micro_batch_size, args.steps, args.lr
    ours = run_ours(tmp, model, shards, micro, steps, lr)
    plain = run_plain(model, shards, micro, steps, lr)
    engine = run_plain(model, shards, micro, steps, lr, engine=True)
    losses = f"{ours[0]['loss']:>12.4f}{ours[-1]['loss']:>11.4f}"
    for name, other in (("plain", plain), ("+ DeepSpeed", engine)):
        if not all(
            abs(o["loss"] - p["loss"]) <= 1e-3 * abs(p["loss"])
            for o, p in ((ours[0], other[0]), (ours[-1], other[-1]))
        ):
            losses += f"  ({name}: {other[0]['loss']:.4f} {other[-1]['loss']:.4f})"
    figures = [steady_tokens_per_s(ours, args.warmup, "tokens_per_s")]
    figures += [steady_tokens_per_s(r, args.warmup, "tokens") for r in (plain, engine)]
    return (*figures, losses)


def main() -> int:
    import statistics

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps on each side")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the figure")
    parser.add_argument("--micro-batch-size", type=int, default=16, help="examples per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (both sides)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of runs (one a side)")
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="instead: the plain loop and the engine's two forms step by step in one process",
    )
    parser.add_argument("--plain-side", nargs=7, help=argparse.SUPPRESS)  # run_plain's process
    parser.add_argument("--interleaved-side", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_side or args.interleaved_side:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model, shards, micro, steps, lr, out, engine = args.plain_side or args.interleaved_side
        given = (Path(model), Path(shards), int(micro), int(steps), float(lr))
        if args.plain_side:
            Path(out).write_text(json.dumps(plain_loop(*given, engine == "1")))
        else:
            Path(out).write_text(json.dumps(interleaved_steps(*given)))
        return 0
    if args.interleaved:
        return interleaved(args)
    print(
        f"machine: {os.cpu_count()} cores, CPU, one process; fixture Llama (0.24M params), full "
        f"fine-tuning, fp32, micro batch {args.micro_batch_size}, {args.steps} steps "
        f"(first {args.warmup} left out), {args.repeats} pairs"
    )
    print(f"{'pair':<6}{'ours tokens/s':>15}{'plain tokens/s':>16}{'+ DeepSpeed':>13}"
          f"{'ours/plain':>12}{'ours/+DS':>10}{'+DS/plain':>11}{'first loss':>12}"
          f"{'last loss':>11}")  # fmt: skip
    ratios: dict[str, list[float]] = {"ours / plain": [], "ours / (plain + DeepSpeed)": [],
                                      "(plain + DeepSpeed) / plain": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, shards = prepare(tmp, args.micro_batch_size, args.steps)
        for pair in range(1, args.repeats + 1):
            a, b, c, losses = one_pair(tmp / f"pair{pair}", model, shards, args)
            for key, value in zip(ratios, (a / b, a / c, c / b), strict=True):
                ratios[key].append(value)
            print(f"{pair:<6}{a:>15,.0f}{b:>16,.0f}{c:>13,.0f}{a / b:>12.2f}{a / c:>10.2f}"
                  f"{c / b:>11.2f}{losses}", flush=True)  # fmt: skip
    for key, values in ratios.items():
        print(f"ratio {key}, median of {len(values)} pairs: {statistics.median(values):.2f} "
              f"(min {min(values):.2f}, max {max(values):.2f})")  # fmt: skip
    return 0


def interleaved(args) -> int:
    """The engine's share measured step by step (interleaved_steps): each side's median step
    time after the warm-up, and each ratio of speeds (1 / time) as the median of the
    ratios step by step."""
    import statistics

    print(
        f"machine: {os.cpu_count()} cores, CPU, one process (a process group of one); fixture "
        f"Llama (0.24M params), full fine-tuning, fp32, micro batch {args.micro_batch_size}, "
        f"{args.steps} steps a side taking turns (first {args.warmup} left out)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, shards = prepare(tmp, args.micro_batch_size, args.steps)
        times = run_plain(model, shards, args.micro_batch_size, args.steps, args.lr,
                          side="--interleaved-side")  # fmt: skip
    times = {name: values[args.warmup :] for name, values in times.items()}
    plain = times["plain"]
    print(f"{'side':<26}{'median step':>13}{'speed / plain':>15}")
    for name, values in times.items():
        ratio = statistics.median(p / t for p, t in zip(plain, values, strict=True))
        print(f"{name:<26}{1000 * statistics.median(values):>10.2f} ms{ratio:>15.3f}")
    ratio = statistics.median(
        w / t for w, t in zip(times["+ DeepSpeed as written"], times["+ DeepSpeed"], strict=True)
    )
    print(f"+ DeepSpeed / + DeepSpeed as written: {ratio:.3f} (speed, median step by step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
