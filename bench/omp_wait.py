"""Ranks sharing cores: OpenMP threads that spin while they wait, against threads that sleep.

    python bench/omp_wait.py                       # 40 steps, 1 and 3 runs side by side
    python bench/omp_wait.py --steps 20 --side-by-side 2

The demo's LoRA run (2 emulated nodes x 1 process, ZeRO-2) through the real train stage
(scripts/train.py, the local launcher), each rank with OMP_NUM_THREADS 2 as Snakemake gives
the demo's train job, on this machine's cores: alone, then ``--side-by-side`` copies at
once (as the test suite's runs do), with OMP_WAIT_POLICY ACTIVE (threads spin between
parallel regions: GNU OpenMP's default behaviour, for a while) and PASSIVE (they sleep).
Prints each case's wall time (the slowest run of the case) and the largest relative
difference of the per-step losses against the first case (the same threads sum in the same
order: expected 0).
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
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
ROOT = Path(__file__).resolve().parents[1]


def start(root: Path, spec: dict, shards: Path, model: Path, out: Path, policy: str):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": policy}
    cmd = [sys.executable, str(root / "scripts/train.py"), "--run-spec", json.dumps(spec),
           "--shards", str(shards), "--model", str(model), "--deepspeed",
           str(root / "config/deepspeed/zero2.json"), "--out", str(out)]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def case(tmp: Path, spec: dict, made: dict, policy: str, copies: int) -> tuple[float, list]:
    """``copies`` runs at once; (wall seconds of the slowest, each run's losses)."""
    began = time.monotonic()
    outs = [tmp / f"{policy}-{copies}-{i}" / "train" for i in range(copies)]
    procs = [start(ROOT, spec, made["shards"], made["model"], o, policy) for o in outs]
    for p in procs:
        log, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(log.decode()[-3000:])
    wall = time.monotonic() - began
    losses = [[json.loads(x)["loss"] for x in (o / "metrics.jsonl").read_text().splitlines()
               if "loss" in json.loads(x)] for o in outs]  # fmt: skip
    return wall, losses


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--side-by-side", type=int, default=3, help="runs at once (2nd case)")
    args = parser.parse_args()
    from snaketune.app.fixtures import FixtureSizes, demo_run_spec, make_sharded_fixture
    from snaketune.data.shard import Layout

    spec = demo_run_spec(ROOT, max_steps=args.steps, save_steps=10**6)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sizes = FixtureSizes(train_rows=max(2048, 64 * args.steps), test_rows=8)
        layout = Layout(spec["nodes"], spec["gpus_per_node"], spec["micro_batch_size"],
                        spec["gradient_accumulation_steps"])  # fmt: skip
        made = make_sharded_fixture(tmp, sizes, layout, packing=spec["packing"])
        first = None
        print(f"{os.cpu_count()} cores; the demo's LoRA run, 2 emulated nodes x 1, "
              f"{args.steps} steps, OMP_NUM_THREADS 2 per rank")  # fmt: skip
        print(
            f"{'runs at once':>12} {'OMP_WAIT_POLICY':>16} {'wall s':>8} {'max rel loss diff':>18}"
        )
        for copies in sorted({1, args.side_by_side}):  # --side-by-side 1: the first case only
            for policy in ("ACTIVE", "PASSIVE"):
                wall, losses = case(tmp, spec, made, policy, copies)
                first = first or losses[0]
                diff = max(abs(a - b) / abs(b) for run in losses
                           for a, b in zip(run, first, strict=True))  # fmt: skip
                print(f"{copies:>12} {policy:>16} {wall:>8.1f} {diff:>18.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
