"""Pick a sweep's best member: results/<sweep>/best.json (snaketune.plan.sweep).

    python scripts/select_sweep.py --sweep demo --members '{"demo-learning_rate_0p003": {...}}' \\
        --out results/demo/best.json

Reads each member's results/<member>/train/metrics.jsonl (its last training loss) and, when
it has an evaluation, results/<member>/eval/metrics.json; writes the best member by the
sweep's ``sweep_select`` with its values and figures, and every member's figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.app.cli import run
from snaketune.app.selection import best_member
from snaketune.core.io import atomic_paths, read_jsonl


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", required=True, help="the swept run's name")
    parser.add_argument("--members", required=True, help="{member: run config}, as JSON")
    parser.add_argument("--results", type=Path, default=Path("results"), help="results directory")
    parser.add_argument("--out", type=Path, required=True, help="results/<sweep>/best.json")
    args = parser.parse_args(argv)
    members = json.loads(args.members)
    evals = {name: json.loads((args.results / name / "eval/metrics.json").read_text())
             for name, spec in members.items() if "eval_dataset" in spec}  # fmt: skip
    curves = {name: read_jsonl(args.results / name / "train/metrics.jsonl") for name in members}
    best = {"sweep": args.sweep, **best_member(members, evals, curves)}
    with atomic_paths(args.out) as (tmp,):
        tmp.write_text(json.dumps(best, indent=2) + "\n")
    if "metric_chosen" in best:
        print(best["metric_chosen"])
    if "tied" in best:
        print(f"{args.sweep}: {len(best['tied'])} members tie on {best['metric']} "
              f"({best['value']:.6g}): {', '.join(best['tied'])}; broken by "
              f"{best['tie_broken_by']}")  # fmt: skip
    print(f"{args.sweep}: best {best['metric']} ({best['mode']}) {best['value']:.6g}: "
          f"{best['best']} {best['values']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
