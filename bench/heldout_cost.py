"""What held-out evaluation while training costs: the demo's run (192 steps on 2 emulated
nodes, LoRA, ZeRO-2) without held-out passes and with one every 50 steps (eval_steps 50,
and before the first step), on the demo's shards and eval set.

    python bench/heldout_cost.py DEMO_WORKDIR           # a finished demo (results/, resources/)
    python bench/heldout_cost.py DEMO_WORKDIR --pairs 3 --answers

Each side is a whole training job (scripts/train.py, as the train rule runs it), run in
turn, ``--pairs`` times. Printed: the training time of each side (the last step's
``elapsed_s``: start of training to the last step, held-out passes included), the summed
``heldout_seconds`` of the passes, and the cost: (with - without) / without, per pair and
the median. ``--answers`` scores greedy exact match at each pass too.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/tokenize.py is named like the stdlib's tokenize module, which Python would import
# from this folder (first on sys.path when a script here runs): take the folder off the path.
if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import json
import os
import statistics
import subprocess
import tempfile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def demo_run(eval_steps: int | None, eval_set: Path, answers: bool, steps: int | None) -> dict:
    """config/config.yaml's demo run, validated, with held-out passes or not (``steps``: that
    many optimizer steps instead of the demo's)."""
    from snaketune.core.heldout import spec_of
    from snaketune.plan.config import load_yaml, validate_config

    config = load_yaml(ROOT / "config" / "config.yaml")
    if steps:
        del config["runs"]["demo"]["epochs"]
        config["runs"]["demo"]["max_steps"] = steps
    if eval_steps:
        config["runs"]["demo"]["eval_steps"] = eval_steps
        config["runs"]["demo"]["eval"]["during_training_answers"] = answers
    run = validate_config(config, ROOT)["runs"]["demo"]
    if eval_steps:
        run["heldout"] = spec_of(run, str(eval_set))
    return run


def train(demo: Path, run: dict, work: Path) -> dict:
    """One training job; its last training row and its held-out rows."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore::FutureWarning", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "scripts/train.py"), "--run-spec", json.dumps(run),
           "--shards", str(demo / "results/demo/shards"),
           "--model", str(demo / "resources/models/tiny"),
           "--deepspeed", str(ROOT / "config/deepspeed/zero2.json"),
           "--out", "results/x/train"]  # fmt: skip
    subprocess.run(cmd, cwd=work, env=env, check=True, capture_output=True)
    rows = [
        json.loads(x) for x in (work / "results/x/train/metrics.jsonl").read_text().splitlines()
    ]
    held = [r for r in rows if "heldout_loss" in r]
    last = [r for r in rows if "loss" in r][-1]
    return {
        "train_s": last["elapsed_s"],
        "passes": len(held),
        "heldout_s": sum(r["heldout_seconds"] for r in held),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("demo", type=Path, help="a finished demo's working directory")
    parser.add_argument("--pairs", type=int, default=3, help="runs of each side, in turn")
    parser.add_argument("--every", type=int, default=50, help="eval_steps of the measured side")
    parser.add_argument("--answers", action="store_true", help="greedy exact match too")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="train this many steps (default: the demo's 192; a smoke run)")  # fmt: skip
    args = parser.parse_args()
    eval_set = next((args.demo / "results/tokenized").glob("arith_test__*/data.parquet"))
    costs = []
    for i in range(args.pairs):
        got = {}
        for name, every in (("without", None), ("with", args.every)):
            with tempfile.TemporaryDirectory() as tmp:
                got[name] = train(args.demo, demo_run(every, eval_set, args.answers, args.max_steps),
                                  Path(tmp))  # fmt: skip
        cost = got["with"]["train_s"] / got["without"]["train_s"] - 1
        costs.append(cost)
        print(f"pair {i + 1}: training {got['without']['train_s']:.1f} s without, "
              f"{got['with']['train_s']:.1f} s with {got['with']['passes']} passes "
              f"({got['with']['heldout_s']:.2f} s in them): cost {100 * cost:+.1f}%")  # fmt: skip
    print(f"median cost of a held-out pass every {args.every} steps: "
          f"{100 * statistics.median(costs):+.1f}% of the training time")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
