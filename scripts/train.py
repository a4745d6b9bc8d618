"""Train a run on its per-node shards: N nodes x G devices, DeepSpeed, LoRA or full.

    python scripts/train.py --run-spec "$(cat spec.json)" --shards results/demo/shards \
        --model resources/models/tiny --deepspeed config/deepspeed/zero2.json \
        --out results/demo/train

This launches the workers (see snaketune/train/launch.py and snaketune/train/agents.py): on a SLURM
allocation one srun task per node, elsewhere N torchrun agents on this machine. The
launcher writes the job as it resolved it to <out>/job.json (the run's settings, its
inputs, its launch settings); each worker is this script again, run by torchrun with
--worker and the path of that file, its one read of them. By hand on a node:

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        scripts/train.py --worker --job results/demo/train/job.json

Each start is an attempt with its own log, kept by every retry and requeue:
<out>/logs/attempt-<n>.log (snaketune/train/attempts.py); the output's last lines list every
attempt's outcome.

A rerun resumes from the newest complete checkpoint in <out>/checkpoints/ when the run's
settings and shards are unchanged (otherwise the old checkpoints are moved aside). Ahead of
the job's time limit (SLURM's end time, else --time-limit) the workers stop at a step end
and save; the job then continues: on SLURM it requeues itself, elsewhere it starts the next
segment at once (at most max_continuations times). One training per run: the run's
directory is locked (train.lock) while one trains.
Exit codes: 0 done, 2 bad input or a failing GPU (the GPU health watchdog stopped the run
after saving a checkpoint), 3 stopped by SIGTERM/SIGUSR1 after saving a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.app.cli import run


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-spec", help="the run's config entry (defaults filled), as JSON")
    parser.add_argument(
        "--shards", type=Path, help="shard directory (node-k.parquet, manifest.json)"
    )
    parser.add_argument("--model", type=Path, help="base model directory")
    parser.add_argument("--deepspeed", type=Path, help="DeepSpeed JSON (preset or file)")
    parser.add_argument("--out", type=Path, help="results/<run>/train")
    parser.add_argument(
        "--stage-input",
        action="append",
        default=[],
        metavar="STAGE=PATH",
        help="what the run's method needs, by the need's name: a scoring stage's output "
        "(reference_logps=..., teacher_logps=...), a live teacher's model (teacher=...)",
    )
    parser.add_argument(
        "--launcher",
        choices=["auto", "local", "slurm"],
        default="auto",
        help="auto: slurm inside a SLURM job with srun available, else local",
    )
    parser.add_argument(
        "--log-example-ids",
        type=Path,
        default=None,
        help="directory: each rank appends the example ids it trains on to rank-<r>.txt",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="MINUTES",
        help="the job's time limit, where SLURM does not give its end (the rule's runtime)",
    )
    parser.add_argument(
        "--stop-margin",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop this long before the time limit, besides a step and a save (default: "
        "the config schema's stop_margin_seconds)",
    )
    parser.add_argument(
        "--lock-wait",
        type=float,
        default=180.0,
        help="seconds a second training of the same run waits for the first to end, then "
        "refuses (default 180)",
    )
    parser.add_argument(
        "--min-busbw",
        type=float,
        default=None,
        metavar="GBPS",
        help="fail a multi-node job whose all-reduce bus bandwidth is under this (GB/s)",
    )
    parser.add_argument(
        "--announce-fd",
        type=int,
        default=None,
        metavar="FD",
        help="write one line naming this attempt's log to this file descriptor (the rule "
        "passes the job's own stderr as 3: SLURM's job output, Snakemake's terminal)",
    )
    parser.add_argument(
        "--worker", action="store_true", help="run as a torchrun worker (set by the launcher)"
    )
    parser.add_argument("--job", type=Path, help="a worker's job file (<out>/job.json)")
    args = parser.parse_args(argv)
    needed = ["job"] if args.worker else ["run_spec", "shards", "model", "deepspeed", "out"]
    missing = [f"--{k.replace('_', '-')}" for k in needed if getattr(args, k) is None]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    return args


def worker(args: argparse.Namespace) -> int:
    from snaketune.core.imports import hold_time_warning, load, loading

    hold_time_warning()  # held (and in what the rank starts) until its StopRequest takes it
    from snaketune.core.job import Job
    from snaketune.core.qlora import hide_bitsandbytes
    from snaketune.plan.runspec import RunSpec

    job = Job.read(args.job)  # the one read of the job's settings
    spec = RunSpec.of(job.spec)  # resolved once, passed on
    hide_bitsandbytes(spec.quantization is not None)  # before peft is imported
    with loading():  # torch, transformers, peft, TRL, DeepSpeed: no collections meanwhile
        from snaketune.train.worker import run_worker

        load("deepspeed", "datasets")  # every rank's join and trainer import them

    ids_log = None
    if job.ids_dir:
        job.ids_dir.mkdir(parents=True, exist_ok=True)
        ids_log = job.ids_dir / f"rank-{os.environ.get('RANK', '0')}.txt"
    return run_worker(job, spec, ids_log)


def stage_inputs(given: list[str]) -> dict[str, str]:
    """``--stage-input NAME=PATH`` by need name (snaketune.methods.needs)."""
    from snaketune.core.errors import UserError
    from snaketune.methods.needs import PASSED_NEEDS

    out = {}
    names = [n.name for n in PASSED_NEEDS]
    for item in given:
        name, _, path = item.partition("=")
        if name not in names or not path:
            raise UserError(f"--stage-input {item}: give NEED=PATH, NEED one of {', '.join(names)}")
        out[name] = path
    return out


def launch(args: argparse.Namespace) -> int:
    from snaketune.core.job import Job
    from snaketune.plan.schema import top_default
    from snaketune.train.launch import launch_job

    if args.stop_margin is None:
        args.stop_margin = top_default("stop_margin_seconds")
    job = Job(
        json.loads(args.run_spec),
        args.shards,
        args.model,
        args.deepspeed,
        args.out,
        args.launcher,
        [str(Path(__file__).resolve()), "--worker", "--job", str(args.out / "job.json")],
        args.lock_wait,
        args.time_limit,
        args.stop_margin,
        inputs=stage_inputs(args.stage_input),
        min_busbw=args.min_busbw,
        ids_dir=args.log_example_ids,
    )
    return launch_job(job, args.announce_fd)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.worker:
        return worker(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(run(main))
