"""Mutation testing of the library: `make mutants` (docs/testing.md, "Mutation testing").

    python tests/mutate.py scripts/snaketune/core/lora_targets.py [MODULE ...]
    python tests/mutate.py --base origin/main      # the modules changed since that commit

cosmic-ray (pinned in the dev extra) plants one-line slips in a module, one at a time, in
place (a comparison turned, a number moved by one, a boolean flipped, a `break` made a
`continue`, ...), runs the module's tests against each and restores the file. A module's
tests are the quick tier's (`-m "not slow"`) of the test files that name it (its dotted
name, or `from snaketune.<wing> import <module>`), and the test files MORE adds where a
module is tested under another's name. In place: the processes the tests start (snakemake,
a training's ranks) run the mutated module too; do not edit the tree while it runs.

Writes, under --out (default mutants/, ignored by git): <module>.toml and <module>.sqlite
(cosmic-ray's config and session: `cr-report mutants/<module>.sqlite`, `cr-html ...`), and
<module>.survivors.txt (each surviving mutant: its line, operator and change). Prints a
line per module: mutants, killed, survived, timed out, the score (killed and timed out over
all but the incompetent ones, which cannot run) and the minutes it took.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# test files that test a module under another module's name (module -> more test files)
MORE: dict[str, list[str]] = {}


def dotted(module: str) -> str:
    """scripts/snaketune/data/chat.py -> snaketune.data.chat"""
    return ".".join(Path(module).with_suffix("").parts[1:])


def tests_for(module: str, root: Path = ROOT) -> list[str]:
    """The test files that name ``module`` (its dotted name, or an import of it from its
    wing), and MORE's, relative to ``root``."""
    name = dotted(module)
    wing, _, last = name.rpartition(".")
    names = re.compile(
        rf"\b{re.escape(name)}\b|from {re.escape(wing)} import [^\n]*\b{re.escape(last)}\b"
    )
    found = sorted(
        str(p.relative_to(root))
        for p in (root / "tests").glob("test_*.py")
        if p.name != "test_mutate.py" and names.search(p.read_text(encoding="utf-8"))
    )
    return sorted(set(found) | set(MORE.get(module, [])))


def changed_modules(base: str, root: Path = ROOT) -> list[str]:
    """The library's modules changed since ``base`` (committed or not)."""
    out = subprocess.run(["git", "-C", str(root), "diff", "--name-only", base, "--",
                          "scripts/snaketune"], capture_output=True, text=True, check=True)  # fmt: skip
    return sorted(
        p for p in out.stdout.split() if p.endswith(".py") and not p.endswith("__init__.py")
        and (root / p).is_file()
    )  # fmt: skip


def test_command(tests: list[str]) -> list[str]:
    """The quick tier's tests of ``tests``, stopping at the first failure."""
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
            "-m", "not slow", *tests]  # fmt: skip


def config_text(module: str, tests: list[str], timeout: float) -> str:
    """cosmic-ray's config of one module's session."""
    command = test_command(tests)
    return (
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(module)}\n"
        f"timeout = {timeout:.1f}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(shlex.join(command))}\n\n"
        '[cosmic-ray.distributor]\nname = "local"\n'
    )


def outcomes(dump: str) -> list[dict]:
    """Each mutant of a session (``cosmic-ray dump``'s lines): its line, operator, change
    and outcome (killed, survived, timeout or incompetent)."""
    found = []
    for line in dump.splitlines():
        if not line.strip():
            continue
        item, result = json.loads(line)
        mutation = item["mutations"][0]
        result = result or {}
        outcome = result.get("test_outcome") or "not run"
        if result.get("worker_outcome") == "timeout":
            outcome = "timeout"
        change = [ln for ln in (result.get("diff") or "").splitlines()
                  if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]  # fmt: skip
        found.append({
            "line": mutation["start_pos"][0],
            "operator": mutation["operator_name"],
            "function": mutation.get("definition_name"),
            "outcome": outcome,
            "change": change,
        })  # fmt: skip
    return found


def score(found: list[dict]) -> dict:
    """Counts by outcome and the score: killed (a test failed or it ran past its time)
    over every mutant that could run."""
    count = {k: sum(m["outcome"] == k for m in found)
             for k in ("killed", "survived", "timeout", "incompetent", "not run")}  # fmt: skip
    ran = count["killed"] + count["survived"] + count["timeout"]
    count["score"] = (count["killed"] + count["timeout"]) / ran if ran else None
    return count


def run_module(module: str, out: Path) -> dict:
    """One module's session: its tests once unmutated (they must pass: their time sets the
    timeout; the shared demo pipeline a quick test reads is built then, from the unmutated
    tree, and read by every mutant's run), every mutant, the survivors written. The
    module's figures."""
    import os

    env = {**os.environ, "SNAKETUNE_SHARED_DIR": str(out / "shared"),
           "PYTHONWARNINGS": "ignore::FutureWarning"}  # fmt: skip
    (out / "shared").mkdir(exist_ok=True)
    tests = tests_for(module)
    if not tests:
        raise SystemExit(f"mutate: no test file names {dotted(module)}; add one to MORE")
    stem = dotted(module)
    cfg, session = out / f"{stem}.toml", out / f"{stem}.sqlite"
    began = time.monotonic()
    base = subprocess.run(test_command(tests), cwd=ROOT, env=env, capture_output=True, text=True)
    if base.returncode != 0:
        raise SystemExit(f"mutate: {module}: its tests fail unmutated:\n{base.stdout[-3000:]}")
    timeout = max(60.0, 3 * (time.monotonic() - began))
    cfg.write_text(config_text(module, tests, timeout))
    session.unlink(missing_ok=True)
    cosmic = [sys.executable, "-m", "cosmic_ray.cli"]
    for step in (["init", str(cfg), str(session)], ["exec", str(cfg), str(session)]):
        subprocess.run([*cosmic, *step], cwd=ROOT, env=env, check=True)
    dump = subprocess.run([*cosmic, "dump", str(session)], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    found = outcomes(dump)
    survivors = [m for m in found if m["outcome"] == "survived"]
    (out / f"{stem}.survivors.txt").write_text("".join(
        f"{module}:{m['line']} ({m['function']}) {m['operator']}\n"
        + "".join(f"    {c}\n" for c in m["change"])
        for m in survivors))  # fmt: skip
    return {"module": module, "tests": tests, **score(found),
            "minutes": (time.monotonic() - began) / 60}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("modules", nargs="*", help="scripts/snaketune/... modules")
    parser.add_argument("--base", help="the modules changed since this commit")
    parser.add_argument("--out", type=Path, default=ROOT / "mutants")
    args = parser.parse_args(argv)
    modules = args.modules or (changed_modules(args.base) if args.base else [])
    if not modules:
        parser.error("name modules, or --base REV for those changed since REV")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [run_module(m, args.out) for m in modules]
    for r in rows:
        shown = "-" if r["score"] is None else f"{100 * r['score']:.0f}%"
        print(f"{r['module']}: {r['killed']} killed, {r['survived']} survived, "
              f"{r['timeout']} timed out, {r['incompetent']} incompetent: {shown} "
              f"({r['minutes']:.1f} min; tests: {' '.join(r['tests'])})")  # fmt: skip
    (args.out / "scores.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
