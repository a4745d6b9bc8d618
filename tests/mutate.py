"""Mutation testing of the library: `make mutants` (docs/testing.md, "Mutation testing").

    python tests/mutate.py scripts/snaketune/core/lora_targets.py [MODULE ...]
    python tests/mutate.py --base origin/main      # the modules changed since that commit

cosmic-ray (pinned in the dev extra) lists the one-line slips of a module (a comparison
turned, a number moved by one, a boolean flipped, a `break` made a `continue`, ...); this
tool plants each in place, runs the tests that can see it, and restores the file.

The tests that can see a mutant: the quick tier (`-m "not slow"`) is run once, unmutated,
in a fork under coverage, each test its own context, so each line of the modules
knows the quick tests that run it. A mutant's tests are those of its lines (a line of a
statement that spans several: its first line's; a line run when the module is imported: every
test of the module), fastest first, stopping at the first failure. A mutant inside an
annotation is equivalent (never evaluated under `from __future__ import annotations`): not
run, out of the score. A line no quick test runs in the test process is given the
quick tests of the files that name the module (tests_for, MORE) that start processes (a
CLI, snakemake), since the line may run there; with none, the mutant survives unrun and is
listed as such. Each mutant's tests run in a fork of this process once it has collected
the tests (torch, transformers and the rest loaded, no tensor op run), with the library and the test modules
unloaded, so a mutant costs its tests' own seconds, not pytest's and torch's start.

In place: the library of this checkout is mutated (its scripts/ first on the path of this
process and of every process a test starts: snakemake, a training's ranks), so run it in a
checkout you are not editing (`git worktree add /tmp/mut` and run the tool there).

Writes, under --out (default mutants/, ignored by git): <module>.toml and <module>.sqlite
(cosmic-ray's config and session: `cr-report mutants/<module>.sqlite`, `cr-html ...`),
<module>.survivors.txt (each surviving mutant: its line, operator and change) and
scores.json. Prints a line per module: mutants, killed, survived (of which unrun), timed
out, the score (killed and timed out over all that could run) and the minutes it took.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# test files that test a module under another module's name (module -> more test files)
MORE: dict[str, list[str]] = {
    "scripts/snaketune/data/fullrender.py": ["tests/test_templates.py", "tests/test_toolcalls.py"],
    "scripts/snaketune/data/picture_pairs.py": ["tests/test_pictures.py"],
    "scripts/snaketune/budget/calibrate.py": ["tests/test_config.py", "tests/test_cost.py"],
    "scripts/snaketune/data/tokens.py": ["tests/test_tokenize.py"],
}
QUICK = ["-q", "-p", "no:cacheprovider", "-m", "not slow"]
UNRUN = "no quick test runs this line"


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
    return [sys.executable, "-m", "pytest", "-x", *QUICK, *tests]


def config_text(module: str, tests: list[str], timeout: float) -> str:
    """cosmic-ray's config of one module's session (its test command: the module's test
    files whole, for `cosmic-ray exec` by hand; this tool runs each mutant's own tests)."""
    command = test_command(tests)
    return (
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(module)}\n"
        f"timeout = {timeout:.1f}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(shlex.join(command))}\n\n"
        '[cosmic-ray.distributor]\nname = "local"\n'
    )


class Recorder:
    """A pytest plugin for the unmutated run: each test a coverage context of its own, its
    seconds (setup, call, teardown), and whether it started a process."""

    def __init__(self, cov):
        self.cov, self.seconds, self.spawns, self.failed = cov, defaultdict(float), set(), []
        self.current = ""

    def pytest_runtest_protocol(self, item, nextitem):
        self.current = item.nodeid
        self.cov.switch_context(item.nodeid)

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] += report.duration
        if report.failed:
            self.failed.append(report.nodeid)

    def popen(self, real):
        def started(*args, **kwargs):
            self.spawns.add(self.current)
            return real(*args, **kwargs)

        return started


def record(modules: list[str], files: list[str], root: Path) -> dict:
    """The quick tests of ``files`` run once, unmutated, in a fork of this process (which
    then collects them: torch, transformers and the rest loaded, no tensor op run, so that
    each mutant's fork starts from a process whose OpenMP pool never ran: a fork after it
    has hangs in the child's first parallel op): for each module, line -> the tests that
    ran it; each test's seconds; the tests that start processes."""
    import pytest

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                Path(out.name).write_text(json.dumps(_record(modules, files, root)))
                code = 0
            except SystemExit as exc:
                Path(out.name).write_text(json.dumps({"error": str(exc)}))
            finally:
                os._exit(code)
        os.waitpid(pid, 0)
        recorded = json.loads(Path(out.name).read_text() or '{"error": "the run died"}')
    if "error" in recorded:
        raise SystemExit(recorded["error"])
    pytest.main(["--collect-only", *QUICK, *files])
    return recorded


def _record(modules: list[str], files: list[str], root: Path) -> dict:
    import coverage
    import pytest

    paths = {m: str((root / m).resolve()) for m in modules}
    cov = coverage.Coverage(data_file=None, include=list(paths.values()), config_file=False)
    rec = Recorder(cov)
    real = subprocess.Popen.__init__
    subprocess.Popen.__init__ = rec.popen(real)
    cov.start()
    try:
        code = pytest.main([*QUICK, *files], plugins=[rec])
    finally:
        cov.stop()
        subprocess.Popen.__init__ = real
    if code != 0:
        raise SystemExit(f"mutate: the quick tests fail unmutated (pytest exit {code}): "
                         f"{rec.failed[:5]}")  # fmt: skip
    data = cov.get_data()
    # "" is the collection's context (the test files' imports); `picker` gives a line the
    # module runs when imported every test of the module, whichever context ran it
    lines = {m: {line: sorted(ctx) for line, ctx in data.contexts_by_lineno(p).items()}
             for m, p in paths.items()}  # fmt: skip
    return {"lines": lines, "seconds": dict(rec.seconds), "spawns": sorted(rec.spawns - {""})}


def unload(root: Path) -> None:
    """Forget the library and the test modules (the fork re-imports them, mutated), keeping
    what they loaded (torch, transformers, ...)."""
    tests = str(root / "tests")
    for name, mod in list(sys.modules.items()):
        where = getattr(mod, "__file__", None) or ""
        if name == "__main__":  # this tool (multiprocessing's spawn reads it)
            continue
        if name == "snaketune" or name.startswith("snaketune.") or where.startswith(tests):
            del sys.modules[name]


def run_forked(nodeids: list[str], timeout: float) -> tuple[str, str]:
    """``nodeids`` in a fork of this process, stopping at the first failure: ("killed" or
    "survived" or "timeout", the end of its output)."""
    import pytest

    with tempfile.TemporaryFile() as log:
        pid = os.fork()
        if pid == 0:  # the child: its own process group, so a timeout ends what it started
            os.setsid()
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            code = 1
            try:
                code = int(pytest.main(["-x", *QUICK, *nodeids]))
            finally:
                os._exit(code)
        began, status = time.monotonic(), None
        try:
            while status is None:
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = os.waitstatus_to_exitcode(code)
                elif time.monotonic() - began > timeout:
                    status = "timeout"
                else:
                    time.sleep(0.05)
        finally:  # past its time, or this process stopped: the fork and what it started
            if status is None or status == "timeout":
                with contextlib.suppress(ProcessLookupError, ChildProcessError):
                    os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
        log.seek(0)
        output = log.read().decode("utf-8", "replace")[-3000:]
    if status == "timeout":
        return "timeout", output
    return ("survived" if status == 0 else "killed"), output


def statement_starts(source: str) -> dict[int, int]:
    """Each line of a statement that spans several, to the statement's first line (the one
    coverage counts: a ``def``'s own line for its arguments' lines); the innermost wins."""
    starts: dict[int, int] = {}
    nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.stmt)]
    for node in sorted(nodes, key=lambda n: n.end_lineno - n.lineno, reverse=True):
        for line in range(node.lineno, node.end_lineno + 1):
            starts[line] = node.lineno
    return starts


def import_time(source: str) -> set[int]:
    """The first lines of the statements a module runs when it is imported (its constants,
    its classes' bodies, each ``def`` line with its defaults and decorators), whichever test
    first imported it: a mutant there is seen by every test of the module."""
    found: set[int] = set()

    def visit(body: list) -> None:
        for node in body:
            found.add(node.lineno)
            found.update(d.lineno for d in getattr(node, "decorator_list", ()))
            if isinstance(node, ast.ClassDef):
                visit(node.body)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):  # a guarded import, say
                visit([n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)])

    visit(ast.parse(source).body)
    return found


def picker(module: str, recorded: dict, root: Path):
    """A function from a mutant to its tests: the quick tests that run its lines (or their
    statements' first lines), fastest first; for a line none runs, the tests of the
    module's files that start processes. The module read and parsed once, unmutated."""
    lines = {int(n): ts for n, ts in recorded["lines"][module].items()}
    source = (root / module).read_text(encoding="utf-8")
    starts, imported = statement_starts(source), import_time(source)
    every = {t for ts in lines.values() for t in ts}
    files = tests_for(module, root)
    spawners = {t for t in recorded["spawns"] if t.split("::")[0] in files}

    def pick(item) -> list[str]:
        spec = item.mutations[0]
        span = range(spec.start_pos[0], spec.end_pos[0] + 1)
        tests = {t for n in span for t in lines.get(n, lines.get(starts.get(n, n), []))}
        if tests and any(starts.get(n, n) in imported for n in span):
            tests = set(every)
        tests.discard("")
        return sorted(tests or spawners, key=lambda t: recorded["seconds"].get(t, 0.0))

    return pick


def in_annotation(spans: list, start, end) -> bool:
    """Whether the mutant at ``start``..``end`` (line, column) lies inside one of
    ``annotations``' spans."""
    return any(a <= tuple(start) and tuple(end) <= b for a, b in spans)


def mutate_module(module: str, recorded: dict, out: Path, root: Path, again: bool) -> dict:
    """Every mutant of ``module`` (``again``: only the last session's survivors): planted,
    its tests run in a fork, the file restored, the outcome stored in its cosmic-ray
    session. The module's figures."""
    import cosmic_ray.mutating as mutating
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    stem = dotted(module)
    cfg, session = out / f"{stem}.toml", out / f"{stem}.sqlite"
    if again and session.is_file():
        import sqlite3

        with sqlite3.connect(session) as db:
            db.execute("DELETE FROM work_results WHERE test_outcome = 'SURVIVED'")
    else:
        cfg.write_text(config_text(module, tests_for(module, root), 60))
        session.unlink(missing_ok=True)
        subprocess.run([sys.executable, "-m", "cosmic_ray.cli", "init", str(cfg), str(session)],
                       cwd=root, check=True)  # fmt: skip
    kept = out / f"{stem}.original"  # the module as it was, while a mutant is planted
    began, unrun = time.monotonic(), 0
    real = mutating.run_tests
    spans = annotations((root / module).read_text(encoding="utf-8"))
    pick = picker(module, recorded, root)
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            spec = item.mutations[0]
            equivalent = in_annotation(spans, spec.start_pos, spec.end_pos)
            tests = [] if equivalent else pick(item)
            if not tests:  # in an annotation (equivalent), or unrun: survived, not run
                unrun += not equivalent
                db.set_result(item.job_id, WorkResult(
                    output="in an annotation" if equivalent else UNRUN,
                    test_outcome=TestOutcome.SURVIVED, worker_outcome=WorkerOutcome.NORMAL))  # fmt: skip
                continue
            timeout = 30 + 5 * sum(recorded["seconds"].get(t, 0.0) for t in tests)
            mutating.run_tests = lambda _cmd, _timeout, t=tests, s=timeout: _outcome(t, s)
            kept.write_bytes((root / module).read_bytes())
            try:
                result = mutating.mutate_and_test(item.mutations, "", timeout)
            finally:
                mutating.run_tests = real
            kept.unlink()
            db.set_result(item.job_id, result)
    return {"minutes": (time.monotonic() - began) / 60, "unrun": unrun}


def _outcome(tests: list[str], timeout: float):
    """cosmic-ray's (TestOutcome, output) of a forked run (a timeout is a kill)."""
    from cosmic_ray.work_item import TestOutcome

    outcome, output = run_forked(tests, timeout)
    return (TestOutcome.SURVIVED if outcome == "survived" else TestOutcome.KILLED,
            "timeout" if outcome == "timeout" else output)  # fmt: skip


def outcomes(dump: str) -> list[dict]:
    """Each mutant of a session (``cosmic-ray dump``'s lines): its line, operator, change
    and outcome (killed, survived, timeout or incompetent; unrun: no test runs its line)."""
    found = []
    for line in dump.splitlines():
        if not line.strip():
            continue
        item, result = json.loads(line)
        mutation = item["mutations"][0]
        result = result or {}
        outcome = result.get("test_outcome") or "not run"
        if result.get("worker_outcome") == "timeout" or result.get("output") == "timeout":
            outcome = "timeout"
        change = [ln for ln in (result.get("diff") or "").splitlines()
                  if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]  # fmt: skip
        found.append({
            "line": mutation["start_pos"][0],
            "operator": mutation["operator_name"],
            "function": mutation.get("definition_name"),
            "outcome": outcome,
            "unrun": result.get("output") == UNRUN,
            "span": (tuple(mutation["start_pos"]), tuple(mutation["end_pos"])),
            "change": change,
        })  # fmt: skip
    return found


def score(found: list[dict]) -> dict:
    """Counts by outcome and the score: killed (a test failed or it ran past its time)
    over every mutant that could run."""
    count = {k: sum(m["outcome"] == k for m in found)
             for k in ("killed", "survived", "timeout", "incompetent", "not run",
                       "equivalent")}  # fmt: skip
    count["unrun"] = sum(bool(m.get("unrun")) for m in found)
    ran = count["killed"] + count["survived"] + count["timeout"]
    count["score"] = (count["killed"] + count["timeout"]) / ran if ran else None
    return count


def annotations(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The spans (line, column) of a module's annotations where they are never evaluated
    (``from __future__ import annotations``): a mutant inside one is equivalent."""
    tree = ast.parse(source)
    future = any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
                 and any(a.name == "annotations" for a in n.names) for n in tree.body)  # fmt: skip
    found = []
    for node in ast.walk(tree) if future else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            args = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
            found += [node.returns, *(arg.annotation for arg in args if arg is not None)]
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
    return [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in found if n]


def report(module: str, out: Path, root: Path) -> dict:
    """A module's session read back: mutants inside an annotation never evaluated marked
    equivalent, its survivors written, its counts."""
    stem = dotted(module)
    dump = subprocess.run([sys.executable, "-m", "cosmic_ray.cli", "dump",
                           str(out / f"{stem}.sqlite")], cwd=root, capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    found = outcomes(dump)
    spans = annotations((root / module).read_text(encoding="utf-8"))
    for m in found:
        if in_annotation(spans, *m["span"]):
            m["outcome"] = "equivalent"
    (out / f"{stem}.survivors.txt").write_text("".join(
        f"{module}:{m['line']} ({m['function']}) {m['operator']}"
        + (f" [{UNRUN}]" if m["unrun"] else "") + "\n"
        + "".join(f"    {c}\n" for c in m["change"])
        for m in sorted(found, key=lambda m: m["line"]) if m["outcome"] == "survived"))  # fmt: skip
    return {"module": module, **score(found)}


def put_back(modules: list[str], out: Path, root: Path) -> None:
    """Each module a run that died with a mutant planted left mutated, as it was (its
    original is kept under ``out`` while a mutant is planted)."""
    for module in modules:
        kept = out / f"{dotted(module)}.original"
        if kept.is_file():
            (root / module).write_bytes(kept.read_bytes())
            kept.unlink()
            print(f"mutate: {module} put back as it was before a run that died mid-mutant")


def line_of(r: dict) -> str:
    """A module's figures in a line."""
    shown = "-" if r["score"] is None else f"{100 * r['score']:.0f}%"
    return (f"{r['module']}: {r['killed']} killed, {r['survived']} survived ({r['unrun']} on "
            f"lines no quick test runs), {r['timeout']} timed out, {r['equivalent']} in "
            f"annotations (equivalent), {r['incompetent']} incompetent: {shown}")  # fmt: skip


def prepare(root: Path, out: Path) -> None:
    """This process and those the tests start import the library of ``root``; the shared
    demo pipeline a quick test reads is built once, unmutated, under ``out``."""
    scripts = str(root / "scripts")
    sys.path.insert(0, scripts)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [scripts, *filter(None, [os.environ.get("PYTHONPATH")])])  # fmt: skip
    (out / "shared").mkdir(parents=True, exist_ok=True)
    os.environ.update(SNAKETUNE_SHARED_DIR=str(out / "shared"), PYTHONDONTWRITEBYTECODE="1",
                      PYTHONWARNINGS="ignore::FutureWarning")  # fmt: skip
    os.chdir(root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("modules", nargs="*", help="scripts/snaketune/... modules")
    parser.add_argument("--base", help="the modules changed since this commit")
    parser.add_argument("--tests", nargs="+", default=["tests"],
                        help="the test files run unmutated to map lines to tests "
                             "(default: the whole quick tier)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "mutants")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to mutate")
    parser.add_argument("--again", action="store_true",
                        help="run only the survivors of the sessions under --out (after new "
                             "tests: the others were killed already)")  # fmt: skip
    parser.add_argument("--report", action="store_true",
                        help="read the sessions under --out back; run nothing")  # fmt: skip
    args = parser.parse_args(argv)
    root = args.root.resolve()
    modules = args.modules or (changed_modules(args.base, root) if args.base else [])
    if not modules:
        parser.error("name modules, or --base REV for those changed since REV")
    out = args.out.resolve()
    # a stop (kill, ^C) leaves through the restoring `finally`s, not with a mutant planted
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.report:
        rows = [report(m, out, root) for m in modules]
        for r in rows:
            print(line_of(r))
        return 0
    put_back(modules, out, root)
    prepare(root, out)
    began = time.monotonic()
    recorded = record(modules, args.tests, root)
    (out / "coverage.json").write_text(json.dumps(recorded))
    unload(root)
    print(f"mutate: the quick tests ran unmutated in {(time.monotonic() - began) / 60:.1f} min")
    rows = []
    for module in modules:
        sample = sorted({t for ts in recorded["lines"][module].values() for t in ts} - {""},
                        key=lambda t: recorded["seconds"].get(t, 0.0))[:20]  # fmt: skip
        outcome, output = run_forked(sample, 600) if sample else ("survived", "")
        if outcome != "survived":  # said, and the other modules go on
            print(f"mutate: {module}: its tests fail in a fork, unmutated; skipped:\n{output}")
            continue
        figures = mutate_module(module, recorded, out, root, args.again)
        rows.append({**report(module, out, root), **figures})
        print(f"{line_of(rows[-1])} ({rows[-1]['minutes']:.1f} min)", flush=True)
        (out / "scores.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
