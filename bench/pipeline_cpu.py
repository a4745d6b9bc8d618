"""The CPU seconds of each kind of process in the demo pipeline, run through Snakemake on
the local profile from a project folder (a fresh working directory, not the clone), as a
user runs it: a dry run first, then the pipeline to its report. Each Python process it
starts appends its own CPU seconds (user + system, from the kernel's accounting) as it
exits, as in the test tiers (tests/offline/sitecustomize.py, ``$SNAKETUNE_CPU_LOG``); the
table sums them by kind as tests/durations.py does.

    python bench/pipeline_cpu.py                        # this checkout
    python bench/pipeline_cpu.py --root /path/to/other  # another checkout's workflow

``--root`` runs that checkout's Snakefile and library with this environment's packages:
two checkouts in turn are the before and after of a change to what the jobs pay to start.
``--steps N`` trains the demo N steps (default 16: its stages, not its learning).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

sys.path[:0] = [str(ROOT / "tests")]
from durations import cpu  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to run")
    parser.add_argument("--steps", type=int, default=16, help="the demo's training steps")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    work = Path(tempfile.mkdtemp(prefix="pipeline-cpu-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SNAKETUNE_CACHE": str(work / "cache"),
           "PYTHONPATH": f"{ROOT / 'tests/offline'}{os.pathsep}{root / 'scripts'}"}  # fmt: skip
    project = work / "project"
    project.mkdir()
    config = yaml.safe_load((root / "config/config.yaml").read_text())
    del config["runs"]["demo"]["epochs"]
    config["runs"]["demo"]["max_steps"] = args.steps
    (project / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    snakemake = [str(Path(sys.executable).with_name("snakemake")), "--snakefile",
                 str(root / "Snakefile"), "--profile", str(root / "profiles/local"),
                 "--configfile", str(project / "config.yaml")]  # fmt: skip
    start = time.monotonic()
    for name, extra in (("dry", ["-n"]), ("run", [])):  # each its own CPU log
        run_env = {**env, "SNAKETUNE_CPU_LOG": str(work / f"{name}.tsv")}
        proc = subprocess.run([*snakemake, *extra], cwd=project, env=run_env, capture_output=True,
                              text=True)  # fmt: skip
        if proc.returncode:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return 1
    wall = time.monotonic() - start
    dry = sum(seconds for _, seconds in cpu(work / "dry.tsv")[1].values())
    kinds = cpu(work / "run.tsv")[1]
    print(f"the demo pipeline ({args.steps} steps) from a project folder, workflow {root}")
    print(f"  a dry run first: {dry:.2f} CPU-s (its snakemake process)")
    print(f"  {'kind of process':24s} {'processes':>9s} {'CPU-s':>8s} {'each':>7s}")
    for name, (count, seconds) in sorted(kinds.items(), key=lambda k: -k[1][1]):
        print(f"  {name:24s} {count:9d} {seconds:8.1f} {seconds / count:7.2f}")
    total = sum(seconds for _, seconds in kinds.values())
    print(f"  in all: {total:.1f} CPU-s, {wall:.0f} s wall (the dry run's too)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
