"""The CPU seconds of each kind of process in the demo pipeline, run through Snakemake on
the local profile from a project folder (a fresh working directory, not the clone), as a
user runs it: a dry run first, then the pipeline to its report. Each Python process it
starts appends its own CPU seconds (user + system, from the kernel's accounting) as it
exits, through a sitecustomize this script writes; the table sums them by kind.

    python bench/pipeline_cpu.py                        # this checkout
    python bench/pipeline_cpu.py --root /path/to/other  # another checkout's workflow

``--root`` runs that checkout's Snakefile and library with this environment's packages:
two checkouts in turn are the before and after of a change to what the jobs pay to start.
``--steps N`` trains the demo N steps (default 16: its stages, not its learning).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

RECORDER = """
import atexit, os, resource, sys
def _note():
    use = resource.getrusage(resource.RUSAGE_SELF)
    line = f"{use.ru_utime + use.ru_stime:.3f}\\t{' '.join(sys.argv[:2])[:160]}\\n"
    fd = os.open(os.environ["PIPELINE_CPU_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, line.encode())
    os.close(fd)
atexit.register(_note)
"""

KINDS = (  # (what the command holds, its kind), the first match
    ("train.py --worker", "train worker"),
    ("torchrun.py", "torchrun agent"),
    ("snakemake", "snakemake"),
)


def kind(command: str) -> str:
    for part, name in KINDS:
        if part in command:
            return name
    script = command.split()[0] if command.split() else "?"
    return Path(script).name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to run")
    parser.add_argument("--steps", type=int, default=16, help="the demo's training steps")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    work = Path(tempfile.mkdtemp(prefix="pipeline-cpu-"))
    site = work / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(RECORDER)
    log = work / "cpu.tsv"
    env = {**os.environ, "PIPELINE_CPU_LOG": str(log), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": f"{site}{os.pathsep}{root / 'scripts'}",
           "SNAKETUNE_CACHE": str(work / "cache")}  # fmt: skip
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
    dry = subprocess.run([*snakemake, "-n"], cwd=project, env=env, capture_output=True)
    dry_cpu = sum(float(line.split("\t")[0]) for line in log.read_text().splitlines())
    proc = subprocess.run(snakemake, cwd=project, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    if dry.returncode or proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        return 1
    total, count = collections.defaultdict(float), collections.Counter()
    for line in log.read_text().splitlines()[1:]:  # the dry run's line apart
        seconds, command = line.split("\t", 1)
        total[kind(command)] += float(seconds)
        count[kind(command)] += 1
    print(f"the demo pipeline ({args.steps} steps) from a project folder, workflow {root}")
    print(f"  a dry run first: {dry_cpu:.2f} CPU-s (its snakemake process)")
    print(f"  {'kind of process':24s} {'processes':>9s} {'CPU-s':>8s} {'each':>7s}")
    for name in sorted(total, key=total.get, reverse=True):
        each = total[name] / count[name]
        print(f"  {name:24s} {count[name]:9d} {total[name]:8.1f} {each:7.2f}")
    print(f"  in all: {sum(total.values()):.1f} CPU-s, {wall:.0f} s wall (the dry run's too)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
