"""Per test file, the seconds its tests took (setup, call and teardown), from the JUnit XML
files pytest wrote (tests/run.sh passes --junitxml): the slowest first.

    python tests/durations.py RUN.xml [RUN.xml ...] [--top 15]
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def per_file(paths: list[str]) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            parts = case.get("classname", "").split(".")  # tests.test_x[.TestClass]
            name = next((p for p in parts if p.startswith("test_")), "?")
            seconds[f"tests/{name}.py"] += float(case.get("time", 0))
    return dict(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml", nargs="+", help="JUnit XML files of pytest runs")
    parser.add_argument("--top", type=int, default=15, help="how many files (default 15)")
    args = parser.parse_args(argv)
    seconds = per_file(args.xml)
    print(f"slowest {args.top} test files (seconds; all {len(seconds)} files: "
          f"{sum(seconds.values()):.0f} s)")  # fmt: skip
    for name, s in sorted(seconds.items(), key=lambda x: -x[1])[: args.top]:
        print(f"{s:8.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
