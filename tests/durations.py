"""Per test file, the seconds its tests took (setup, call and teardown), from the JUnit XML
files pytest wrote (tests/run.sh passes --junitxml): the slowest first. With ``--cpu LOG``
(tests/run.sh writes it: tests/offline/sitecustomize.py), also the CPU seconds of every
process each test file started, and of each kind of process: on this 2-core machine a
side-by-side tier's time is its CPU work over the cores, and wall seconds of tests running
side by side say little about that. With ``--tier`` (and ``--wall``), a closing line with
the tier's wall time and counted CPU seconds.

    python tests/durations.py RUN.xml [RUN.xml ...] [--cpu LOG] [--top 15]
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def per_file(paths: list[str]) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            parts = case.get("classname", "").split(".")  # tests.test_x[.TestClass]
            name = next((p for p in parts if p.startswith("test_")), "?")
            seconds[f"tests/{name}.py"] += float(case.get("time", 0))
    return dict(seconds)


def kind(command: str) -> str:
    """A process's kind from its command: a training's worker, torchrun agent or launcher,
    snakemake, a workflow script, a benchmark, pytest."""
    if "--worker" in command:
        return "train worker"
    if "torch.distributed.run" in command or "train.agents" in command or "--nnodes" in command:
        return "torchrun agent"
    if "pytest" in command:
        return "pytest"
    if "snakemake" in command:
        return "snakemake"
    found = re.search(r"(bench/[\w.]+|[\w.]+\.py)", command)
    return found.group(1) if found else (command.split(" ")[0].rsplit("/", 1)[-1] or "?")


def cpu(log: Path) -> tuple[dict[str, float], dict[str, list[float]]]:
    """CPU seconds per test file, and [processes, CPU seconds] per kind of process."""
    files: dict[str, float] = defaultdict(float)
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        fields = line.split("\t")
        if len(fields) != 4:
            continue
        _, seconds, test, command = fields
        files[test.split("::")[0] or "(outside a test)"] += float(seconds)
        kinds[kind(command)][0] += 1
        kinds[kind(command)][1] += float(seconds)
    return dict(files), dict(kinds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml", nargs="+", help="JUnit XML files of pytest runs")
    parser.add_argument("--cpu", type=Path, help="the CPU log of the runs (SNAKETUNE_CPU_LOG)")
    parser.add_argument("--top", type=int, default=15, help="how many files (default 15)")
    parser.add_argument("--tier", default="", help="the tier these runs were (its closing line)")
    parser.add_argument("--wall", type=float, help="the tier's wall seconds (its closing line)")
    args = parser.parse_args(argv)
    seconds = per_file(args.xml)
    print(f"slowest {args.top} test files (seconds; all {len(seconds)} files: "
          f"{sum(seconds.values()):.0f} s)")  # fmt: skip
    for name, s in sorted(seconds.items(), key=lambda x: -x[1])[: args.top]:
        print(f"{s:8.1f}  {name}")
    if args.cpu and args.cpu.is_file():
        files, kinds = cpu(args.cpu)
        print(f"CPU seconds of the processes each test file started (all: "
              f"{sum(files.values()):.0f} s; a killed process is not counted)")  # fmt: skip
        for name, s in sorted(files.items(), key=lambda x: -x[1])[: args.top]:
            print(f"{s:8.1f}  {name}")
        print("CPU seconds per kind of process (processes, seconds, seconds each)")
        for name, (n, s) in sorted(kinds.items(), key=lambda x: -x[1][1])[: args.top]:
            print(f"{s:8.1f}  {int(n):5d}  {s / n:5.1f}  {name}")
    if args.tier:
        counted = sum(cpu(args.cpu)[0].values()) if args.cpu and args.cpu.is_file() else 0.0
        wall = f"{args.wall // 60:.0f} min {args.wall % 60:.0f} s" if args.wall else "?"
        print(f"tier {args.tier}: {wall} wall, {counted:.0f} CPU-s counted "
              f"({len(seconds)} test files)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
