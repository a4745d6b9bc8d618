"""How close the plan's time estimate comes to what a run takes: calibrate from one
demo-sized run, predict another with another step count and node count, run it, compare.

    python bench/cost_estimate.py                       # demo (2 x 1, 192 steps), then 1 x 1, 96 steps
    python bench/cost_estimate.py --nodes 2 --steps 48
    python bench/cost_estimate.py --cold --demo-steps 30 --gpus 2 --steps 90   # a machine's first run, then 1 x 2
    python bench/cost_estimate.py --cold --demo-nodes 1 --demo-gpus 2 --demo-steps 90 --nodes 2 --steps 30

``--cold``: torch's extension cache starts empty (TORCH_EXTENSIONS_DIR a new folder), as on
a machine's first run: the calibration's train job compiles DeepSpeed's ops (one-time), the
predicted run's loads them.

1. `snaketune calibrate config/config.yaml demo --steps N` writes the calibration's config
   (run `demo_calibration`: the demo's 2 emulated nodes, 192 steps or --demo-steps), which
   runs through snakemake, every stage, in a new workdir.
2. A second run `other` (the same settings on --nodes nodes for --steps steps) is added
   to the config; `snaketune plan --json`, from the workdir, gives its estimate: the train
   stage's wall seconds, and the run's own stages in all (shard, train, convert, merge,
   evaluate), calibrated from `demo_calibration` (snaketune.budget.calibrate).
3. `other` runs (its own jobs; download, tokenize and the base evaluation are shared and
   done); its train stage's wall seconds and its stages' in all (Snakemake's benchmark
   files) are set against the estimate.
Target (issue 61): within 25% for the train stage and for the run's stages in all.
Prints a table, then the figures as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from snaketune.budget.calibrate import stage_seconds

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("shard_dataset", "train", "convert_checkpoint", "merge_lora", "evaluate")


def snakemake(work: Path, config: Path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"),
           "--profile", str(ROOT / "profiles/local"), "--configfile", str(config),
           "--directory", str(work), *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"snakemake failed:\n{(proc.stdout + proc.stderr)[-4000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the predicted run")
    parser.add_argument("--steps", type=int, default=96, help="max_steps of the predicted run")
    parser.add_argument("--gpus", type=int, default=1, help="gpus_per_node of the predicted run")
    parser.add_argument(
        "--demo-steps",
        type=int,
        default=None,
        help="max_steps of the calibration run (default: its 6 epochs)",
    )
    parser.add_argument("--demo-nodes", type=int, default=2, help="nodes of the calibration run")
    parser.add_argument("--demo-gpus", type=int, default=1, help="its gpus_per_node")
    parser.add_argument("--cold", action="store_true",
                        help="torch's extension cache empty at the start (a first run)")  # fmt: skip
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cost-estimate-"))
    if args.cold:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(work / "torch_extensions")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "scripts")}
    steps = args.demo_steps or 192  # the demo's 6 epochs
    cli = [sys.executable, "-m", "snaketune.app.cli"]
    subprocess.run([*cli, "calibrate", str(ROOT / "config/config.yaml"), "demo", "--steps",
                    str(steps), "--out", "demo.yaml", "--root", str(ROOT)], cwd=work, env=env,
                   check=True)  # fmt: skip
    first = work / "demo.yaml"
    cfg = yaml.safe_load(first.read_text())
    cfg["runs"]["demo_calibration"].update(nodes=args.demo_nodes, gpus_per_node=args.demo_gpus)
    first.write_text(yaml.safe_dump(cfg, sort_keys=False))
    snakemake(work, first)
    other = {k: v for k, v in cfg["runs"]["demo_calibration"].items() if k != "max_steps"}
    other.update(nodes=args.nodes, gpus_per_node=args.gpus, max_steps=args.steps,
                 save_steps=args.steps)  # fmt: skip
    cfg["runs"]["other"] = other
    second = work / "two.yaml"
    second.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "scripts")}
    proc = subprocess.run([*cli, "plan", str(second), "--root", str(ROOT), "--json"], cwd=work,
                          env=env, capture_output=True, text=True)  # fmt: skip
    if proc.returncode:
        sys.exit(f"snaketune plan failed:\n{proc.stdout}{proc.stderr}")
    (plan,) = [p for p in json.loads(proc.stdout) if p["run"] == "other"]
    estimate = plan["estimate"]
    if "wall_s" not in estimate:
        sys.exit(f"no estimate: {estimate['basis']}")
    snakemake(work, second, "results/other/eval/metrics.json")
    took = stage_seconds(work, "other", STAGES)
    took = {rule: took.get(rule, 0.0) for rule in STAGES}
    figures = {
        "steps": plan["steps"]["steps"], "nodes": args.nodes, "gpus_per_node": args.gpus,
        "calibration": f"{args.demo_nodes} x {args.demo_gpus}, {steps} steps"
        + (", cold" if args.cold else ""), "basis": estimate["basis"],
        "train_estimated_s": round(estimate["wall_s"], 1), "train_took_s": took["train"],
        "stages_estimated_s": round(plan["costs"]["total"]["s"], 1),
        "stages_took_s": round(sum(took.values()), 1),
    }  # fmt: skip
    figures["train_error"] = round(figures["train_took_s"] / figures["train_estimated_s"] - 1, 3)
    figures["stages_error"] = round(
        figures["stages_took_s"] / figures["stages_estimated_s"] - 1, 3)  # fmt: skip
    print(f"{'':24}{'estimated':>12}{'took':>10}{'error':>9}")
    for what in ("train", "stages"):
        print(
            f"{what + ' (s)':24}{figures[f'{what}_estimated_s']:>12.1f}"
            f"{figures[f'{what}_took_s']:>10.1f}{100 * figures[f'{what}_error']:>8.0f}%"
        )
    print(f"({figures['steps']} steps on {args.nodes} x {args.gpus}; calibration "
          f"{figures['calibration']}; {figures['basis']}; the "
          f"run's stages: {', '.join(STAGES)})")  # fmt: skip
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
