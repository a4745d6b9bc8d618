"""Check that a run fits its GPUs before its train job is queued (the memory_plan rule).

    python scripts/memory_plan.py --run demo --run-spec "$(cat spec.json)" \
        --model resources/models/tiny --deepspeed config/deepspeed/zero2.json \
        [--gpu h100-80gb] [--local] [--skip] --out results/demo/memory_plan.json

Writes the plan (snaketune.memplan) as JSON; exit 2 with the plan's line when the run does
not fit, unless --skip. Without --gpu: --local checks a CPU run against this machine's
memory, otherwise the check is skipped with a log line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.cli import run


def main(argv: Sequence[str] | None = None) -> int:
    from snaketune.io import write_json
    from snaketune.memplan import check_before_queueing

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", required=True, help="the run's name")
    parser.add_argument("--run-spec", required=True, help="the run's config entry, as JSON")
    parser.add_argument("--model", required=True, type=Path, help="model directory (config.json)")
    parser.add_argument("--deepspeed", required=True, type=Path, help="DeepSpeed JSON")
    parser.add_argument("--gpu", default=None, help="GPU type from the table, or GiB")
    parser.add_argument("--local", action="store_true", help="jobs run on this machine")
    parser.add_argument("--skip", action="store_true", help="skip_memory_check is set")
    parser.add_argument("--out", required=True, type=Path, help="the plan, JSON")
    args = parser.parse_args(argv)
    gpu = args.gpu
    if gpu is not None and gpu.replace(".", "", 1).isdigit():
        gpu = float(gpu)
    plan = check_before_queueing(
        args.run, json.loads(args.run_spec), args.model,
        json.loads(args.deepspeed.read_text()), gpu, args.local, args.skip,
    )  # fmt: skip
    write_json(args.out, plan)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
