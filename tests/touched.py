"""The extended tests a change touches, from a map of which library modules each test's
processes load (`make test-touched`, docs/testing.md)::

    python tests/touched.py --base REV [--list] [--within SECONDS] [pytest arguments]
    python tests/touched.py --record DIR   # write tests/touched-map.json from a tier's logs

The map (tests/touched-map.json) is recorded from a run of the extended tier
(``SNAKETUNE_KEEP=DIR bash tests/run.sh extended``, then ``--record DIR``): every process
a test starts notes the ``snaketune`` modules it loaded and the workflow script it ran
(tests/offline/sitecustomize.py); a session or module fixture's processes count for every
test that uses it; the test file's own imports of the library count too (with what they
import, read from the source). A change (``git diff REV`` and files git does not track yet)
selects each extended test whose map holds a changed module or script, and all of those of
a changed test file. A change to a central file (the worker, the launcher, the Snakefile and
rules, conftest, the pins, the demo configs: CENTRAL) or to a module the map does not know
(a map older than the module) selects every extended test. Documentation selects none.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "tests/touched-map.json"
LIB = ROOT / "scripts"
# A change here can change what any test does: every extended test runs.
CENTRAL = (
    "Snakefile", "workflow/*", "pyproject.toml", "envs/*", "scripts/setup_env.sh",
    "profiles/*", "config/config.yaml", "config/*_demo.yaml", "config/deepspeed/*",
    "config/templates/*", "tests/conftest.py", "tests/oracles.py", "tests/run.sh",
    "tests/offline/*", "tests/slurm/*", "scripts/train.py",
    "scripts/snaketune/train/worker.py", "scripts/snaketune/train/launch.py",
    "scripts/snaketune/train/agents.py", "scripts/snaketune/methods/__init__.py",
)  # fmt: skip
# A snakemake process loads every method's module to compose the config schema
# (snaketune.methods.compose_schema) and runs only the methods of the config's runs at
# parse time: its method modules count through the jobs that train with them, not for it.
METHOD_MODULES = (
    *(f"snaketune.methods.{m}" for m in ("dpo", "grpo", "sft", "reward_model", "moe")),
    "snaketune.evaluation.rewards", "snaketune.evaluation.model_rewards",
)  # fmt: skip
# What no test runs: a change here selects nothing.
# .ci/base: the commit a session started from (which CI reads), not anything a test runs
INERT = ("*.md", "docs/*", "LICENSE", ".gitignore", "tests/touched-map.json", ".ci/base")


def module_of(path: str) -> str | None:
    """The name the map knows a changed file by: a library module (snaketune.a.b), a
    workflow or benchmark script (scripts/x.py, bench/x.py); None for anything else."""
    if path.startswith("scripts/snaketune/") and path.endswith(".py"):
        name = path.removeprefix("scripts/").removesuffix(".py").replace("/", ".")
        return name.removesuffix(".__init__")
    if re.fullmatch(r"(scripts|bench)/[\w.]+\.py", path):
        return path
    return None


def imports_of(module: str) -> set[str]:
    """The library modules ``module``'s source imports (any depth in the file: lazy imports
    inside functions count)."""
    parts = module.split(".")
    path = LIB.joinpath(*parts).with_suffix(".py")
    if not path.is_file():
        path = LIB.joinpath(*parts, "__init__.py")
    if not path.is_file():
        return set()
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:  # the library imports absolutely
            base = node.module
            if base.startswith("snaketune"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("snaketune"))
    return {m for m in found if LIB.joinpath(*m.split(".")).with_suffix(".py").is_file()
            or LIB.joinpath(*m.split("."), "__init__.py").is_file()}  # fmt: skip


def closure(modules: set[str]) -> set[str]:
    """``modules`` and every library module they import, transitively."""
    seen, todo = set(), list(modules)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(imports_of(m) - seen)
    return seen


def known_modules() -> list[str]:
    return sorted(filter(None, (module_of(str(p.relative_to(ROOT)))
                                for p in (ROOT / "scripts").rglob("*.py"))))  # fmt: skip


def extended_tests() -> list[str]:
    """The extended tier's node ids, as pytest collects them."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m",
                           "extended", "-p", "no:cacheprovider"], cwd=ROOT,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return [line for line in proc.stdout.splitlines() if "::" in line]


def record(folder: Path, tests: list[str] | None = None) -> dict:
    """The map from a tier's logs in ``folder`` (tests/run.sh with SNAKETUNE_KEEP), for
    ``tests`` (default: those its JUnit files name). A test with no JUnit time (its run did
    not finish) has none: ``--within`` never counts it as fitting."""
    loaded: dict[str, set[str]] = defaultdict(set)
    for log in folder.glob("*.modules"):
        for line in log.read_text(encoding="utf-8").splitlines():
            who, command, modules = (line.split("\t") + ["", ""])[:3]
            names = set(filter(None, modules.split(",")))
            if "snakemake" in command:  # the parse: every method's module, for its schema
                names = {m for m in names if not m.startswith(METHOD_MODULES)}
            loaded[who] |= names
    fixtures: dict[str, list[str]] = {}
    for log in folder.glob("*.fixtures"):
        for line in log.read_text(encoding="utf-8").splitlines():
            test, _, names = line.partition("\t")
            fixtures[test] = names.split(",")
    seconds: dict[str, float] = {}
    for xml in folder.glob("*.xml"):
        for case in ET.parse(xml).getroot().iter("testcase"):
            test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            seconds[test] = float(case.get("time", 0))
    # a session or module fixture of the suite costs about what its slowest user took in the
    # recorded run (where the build was paid); run alone, a test pays its fixtures too
    builds = set()  # the suite's own session and module fixtures (pipelines, trainings)
    for source in (ROOT / "tests").glob("*.py"):
        builds |= set(re.findall(r'@pytest\.fixture\(scope="(?:session|module)"\)\ndef (\w+)',
                                 source.read_text(encoding="utf-8")))  # fmt: skip
    paid = {f: max(((seconds.get(t) or 0.0) for t, names in fixtures.items() if f in names),
                   default=0.0) for f in builds}  # fmt: skip
    known = set(known_modules())
    out = {}
    for test in sorted(seconds if tests is None else tests):
        secs = seconds.get(test)
        alone = None if secs is None else secs + sum(paid.get(f, 0.0) for f in
                                                     set(fixtures.get(test, ())) & builds)  # fmt: skip
        file = test.split("::")[0]
        text = (ROOT / file).read_text(encoding="utf-8")
        static = set(re.findall(r"\b(snaketune(?:\.\w+)*)", text))
        static &= known
        modules = set(loaded.get(test, ())) | closure(static)
        for name in fixtures.get(test, ()):
            modules |= loaded.get(f"fixture:{name}", set())
        out[test] = {"seconds": None if secs is None else round(secs, 1),
                     "alone": None if alone is None else round(alone, 1),
                     "modules": sorted(modules)}  # fmt: skip
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    return {"recorded_at": head, "modules_known": known_modules(), "tests": out}


def changed(base: str) -> list[str]:
    """Files the change since ``base`` touches: committed, staged, in the working tree, and
    files git does not track yet (and does not ignore)."""

    def git(*args: str) -> list[str]:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
        return out.stdout.split()

    return sorted(set(git("diff", "--name-only", base))
                  | set(git("ls-files", "--others", "--exclude-standard")))  # fmt: skip


def select(files: list[str], the_map: dict) -> tuple[list[str], list[str]]:
    """(the extended tests to run, why) for a change to ``files``."""
    tests = the_map["tests"]
    known = set(the_map["modules_known"])
    why, chosen = [], set()
    for f in files:
        if any(fnmatch.fnmatch(f, p) for p in INERT):
            continue
        if any(fnmatch.fnmatch(f, p) for p in CENTRAL):
            return sorted(tests), [f"{f} is central: every extended test"]
        if f.startswith("tests/") and f.endswith(".py"):
            mine = [t for t in tests if t.split("::")[0] == f]
            chosen.update(mine)
            why.append(f"{f}: its {len(mine)} extended tests")
            continue
        module = module_of(f)
        if module is None:
            if f.startswith("config/examples/"):
                continue  # the examples' tests are in the quick and CI tiers
            return sorted(tests), [f"{f}: no test maps it: every extended test"]
        if module not in known and module.startswith("snaketune"):
            return sorted(tests), [f"{f}: newer than the map ({the_map['recorded_at']}): "
                                   "every extended test (record the map again)"]  # fmt: skip
        mine = [t for t, v in tests.items() if module in v["modules"]]
        chosen.update(mine)
        why.append(f"{f} ({module}): {len(mine)} extended tests load it")
    return sorted(chosen), why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the revision the change is against")
    parser.add_argument("--list", action="store_true", help="print the tests, run nothing")
    parser.add_argument("--within", type=float, help="seconds: run only what the map's "
                        "recorded times (fixtures' builds included) say fits, in order")  # fmt: skip
    parser.add_argument("--record", type=Path, help="write the map from a tier's logs there")
    args, pytest_args = parser.parse_known_args(argv)
    if args.record:
        the_map = record(args.record, extended_tests())
        MAP.write_text(json.dumps(the_map, indent=1, sort_keys=True) + "\n")
        print(f"{MAP.relative_to(ROOT)}: {len(json.loads(MAP.read_text())['tests'])} tests")
        return 0
    if not MAP.is_file():
        print(f"touched: no {MAP.relative_to(ROOT)}: record it first (docs/testing.md)")
        return 2
    the_map = json.loads(MAP.read_text(encoding="utf-8"))
    files = changed(args.base)
    tests, why = select(files, the_map)
    for line in why:
        print(f"touched: {line}")
    if args.within is not None:
        fits, spent = [], 0.0
        for t in tests:  # what it would take alone: its fixtures' builds included
            secs = the_map["tests"][t].get("alone")
            if secs is not None and spent + secs <= args.within:
                fits.append(t)
                spent += secs
        if len(fits) < len(tests):
            print(f"touched: {len(tests) - len(fits)} of {len(tests)} left out: over the "
                  f"{args.within:.0f} s left (make test-touched runs them)")  # fmt: skip
        tests = fits
    print(f"touched: {len(tests)} extended tests for {len(files)} changed files since {args.base}")
    for t in tests:
        print(f"  {t}")
    if args.list or not tests:
        return 0
    env = {**os.environ, "SNAKETUNE_TIER": "extended"}
    return subprocess.run([sys.executable, "-m", "pytest", *tests, *pytest_args], cwd=ROOT,
                          env=env).returncode  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
