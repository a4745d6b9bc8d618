"""Disk of the kept checkpoints: `checkpoints.optimizer: last` against `all`, full fine-tuning.

    python bench/checkpoint_disk.py              # CPU: the fixture Llama, measured
    python bench/checkpoint_disk.py --keep 3

Measured: the fixture Llama, full fine-tuning with ZeRO-2 on 1 node x 2 processes (fp32),
a checkpoint every 2 steps, ``--keep`` kept, trained once with each setting; the bytes of
results/<run>/train/checkpoints at the end. Estimated (snaketune.budget.diskplan, the formula
tests/test_diskplan.py checks within 10% of real checkpoints): Llama-3-8B and Qwen2.5-32B
in bf16 with ZeRO-3 on 2 x 8 GPUs, the kept checkpoints at rest and the most on the disk
while one is written.
"""

from __future__ import annotations

import sys

# bench/tokenize.py is named like the stdlib's tokenize module: take this folder off the path.
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3


def measure(tmp: Path, model: Path, shards: Path, keep: int, optimizer: str) -> int:
    """Bytes of the checkpoints folder at the end."""
    from snaketune.app.fixtures import demo_run_spec, run_train_stage
    from snaketune.budget.diskplan import folder_bytes

    spec = demo_run_spec(ROOT, method="full", nodes=1, gpus_per_node=2, micro_batch_size=8,
                         gradient_accumulation_steps=1, max_steps=2 * (keep + 2), save_steps=2,
                         save_total_limit=keep, checkpoints={"optimizer": optimizer},
                         packing=False)  # fmt: skip
    out = tmp / optimizer / "train"
    run_train_stage(ROOT, spec, shards, model, out)
    return folder_bytes(out / "checkpoints")


def estimates(keep: int) -> list[tuple[str, float, float, float, float, float]]:
    """(model, one checkpoint, at rest with all, with last, while saving with all, with
    last) in GiB."""
    from snaketune.budget.diskplan import checkpoint_size, run_need
    from snaketune.budget.memplan import Setup, Shape

    shapes = {
        "Llama-3-8B": Shape(4096, 14336, 32, 32, 8, 128, 128256, False, False),
        "Qwen2.5-32B": Shape(5120, 27648, 64, 40, 8, 128, 152064, False, True),
    }
    rows = []
    for name, shape in shapes.items():
        s = Setup("full", 3, False, False, 2, 8, 1, 4096, True, "sdpa", False, 2)
        one = checkpoint_size(shape, s)
        every = run_need(shape, s, keep, "all")["checkpoints"] / GIB
        last = run_need(shape, s, keep, "last")["checkpoints"] / GIB
        rest_all = keep * one.whole / GIB
        rest_last = (one.whole + (keep - 1) * one.reduced) / GIB
        rows.append((name, one.whole / GIB, rest_all, rest_last, every, last))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=int, default=3, help="save_total_limit (default 3)")
    args = parser.parse_args()
    from snaketune.app.fixtures import FixtureSizes, make_sharded_fixture
    from snaketune.data.shard import Layout

    with tempfile.TemporaryDirectory() as tmp:
        made = make_sharded_fixture(Path(tmp), FixtureSizes(train_rows=512, test_rows=8),
                                    Layout(1, 2, 8, 1), packing=False)  # fmt: skip
        results = {o: measure(Path(tmp), made["model"], made["shards"], args.keep, o)
                   for o in ("all", "last")}  # fmt: skip
    print(f"fixture Llama, full fine-tuning, ZeRO-2, 1 x 2, fp32, save_total_limit {args.keep}")
    for o, end in results.items():
        print(f"  optimizer {o:4}: checkpoints {end / 2**20:7.2f} MiB at the end")
    saved = 1 - results["last"] / results["all"]
    print(f"  last saves {100 * saved:.0f}% of the kept checkpoints' disk")
    print(f"estimated, bf16, ZeRO-3, 2 x 8 GPUs, save_total_limit {args.keep}:")
    for name, one, rest_all, rest_last, every, last in estimates(args.keep):
        print(f"  {name:12}: one checkpoint {one:6.1f} GiB; at rest all {rest_all:7.1f} GiB, "
              f"last {rest_last:7.1f} GiB ({100 * (1 - rest_last / rest_all):.0f}% less); "
              f"while saving all {every:7.1f} GiB, last {last:7.1f} GiB "
              f"({100 * (1 - last / every):.0f}% less)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
