"""The library's layout (docs/architecture.md, "Wings" and "Sizes"): snaketune is a few
wings, each a sub-package of at most 20 modules, stacked so that a wing imports only the
wings below it (every import counted, a function's own imports too), no module outside a
wing, none over 400 lines and no function over 60 as the formatter lays them out (no
``# fmt: skip`` in the library: a long module is split by what it does, not compressed)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "scripts/snaketune"
# bottom to top
WINGS = (
    "core",
    "data",
    "evaluation",
    "tools",
    "methods",
    "plan",
    "budget",
    "train",
    "export",
    "app",
)


MODULE_NAME = re.compile(r"snaketune(\.[a-z_0-9]+)+")


def imported(path: Path) -> set[str]:
    """The snaketune modules ``path`` imports (absolute imports: the library uses no other),
    and those it names in a string as a whole (a module imported through its name, as a
    registry or a process's command line imports it)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and MODULE_NAME.fullmatch(str(node.value)):
            found.add(node.value)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            if node.module and node.module.split(".")[0] == "snaketune":
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "snaketune"}
    return found


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else None


def over_cap() -> dict[str, int]:
    """The wings docs/architecture.md says are over 20 modules, and how many they hold."""
    text = (ROOT / "docs/architecture.md").read_text(encoding="utf-8")
    said = re.findall(r"^- wing `(\w+)` holds (\d+) modules: \S", text, re.M)
    return {wing: int(n) for wing, n in said}


def test_the_package_is_its_wings_and_each_holds_at_most_20_modules():
    """A wing over 20 modules only where docs/architecture.md says why, with its count."""
    top = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert top == sorted(["__init__.py", *WINGS]), top
    for wing in WINGS:
        modules = [p for p in (PACKAGE / wing).glob("*.py") if p.name != "__init__.py"]
        assert 1 <= len(modules) <= 20 or over_cap().get(wing) == len(modules), (wing, len(modules))
        assert (PACKAGE / wing / "__init__.py").read_text().startswith('"""'), wing
        assert not [p for p in (PACKAGE / wing).iterdir() if p.is_dir() and p.name != "__pycache__"]


def test_a_wing_imports_only_the_wings_below_it():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        wing = path.relative_to(PACKAGE).parts[0]
        if wing not in WINGS:
            continue
        for module in imported(path):
            other = wing_of(module)
            if other is not None and WINGS.index(other) > WINGS.index(wing):
                upward.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert upward == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """(the check above can fail: a core module importing the train wing, in a function)"""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from snaketune.train.launch import main\n")
    assert {wing_of(m) for m in imported(probe)} == {"train"}
    probe.write_text('import importlib\nSCORER = importlib.import_module("snaketune.app.report")\n')
    assert {wing_of(m) for m in imported(probe)} == {"app"}
    assert WINGS.index("train") > WINGS.index("core")


def test_no_module_over_400_lines_and_no_function_over_60():
    over = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 400:
            over.append(f"{path.relative_to(PACKAGE)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    over.append(f"{path.relative_to(PACKAGE)}: {node.name} {length} lines")
    assert over == []


def test_the_formatter_owns_the_layout():
    """No ``# fmt: skip`` (nor ``fmt: off``) in the library: the sizes above are read on the
    formatter's layout, so a module meets them by being split, not squeezed."""
    skipped = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert skipped == []


def documented_modules() -> dict[str, set[str]]:
    """The modules docs/architecture.md's wings table lists, by wing."""
    import re

    text = (ROOT / "docs/architecture.md").read_text(encoding="utf-8")
    table = text.split("## Wings: what each module owns")[1].split("\n## ")[0]
    listed: dict[str, set[str]] = {}
    wing = None
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 4 or not cells[2].startswith("`"):
            continue
        wing = cells[1].strip("*") or wing
        listed.setdefault(wing, set()).update(re.findall(r"`([a-z_0-9]+)`", cells[2]))
    return listed


def test_the_architecture_doc_lists_every_module_and_no_other():
    """docs/architecture.md stays true: each module of each wing is in its table, under its
    wing, and every module the table names exists."""
    listed = documented_modules()
    assert set(listed) == set(WINGS), set(listed) ^ set(WINGS)
    for wing in WINGS:
        modules = {p.stem for p in (PACKAGE / wing).glob("*.py")} - {"__init__"}
        named = listed[wing] - {"__init__"}
        missing, stale = modules - named, named - modules
        assert not missing and not stale, (wing, "not listed:", missing, "no such:", stale)


def method_layout(imports: dict[str, set[str]], registered: set[str]) -> list[str]:
    """What breaks "``methods/`` holds methods" in a map of each methods/ module to the
    snaketune modules it imports: a method (a module the registry names) importing another
    method, or a module that is no method and that fewer than two methods import (a tool,
    a scorer, one method's helper: it belongs in its own wing or in its method)."""
    wrong = []
    for name, modules in sorted(imports.items()):
        if name in registered:
            wrong += [f"method {name} imports method {m}" for m in sorted(modules & registered)]
        elif name != "snaketune.methods":
            users = [m for m in registered if name in imports.get(m, set())]
            if len(users) < 2:
                wrong.append(f"{name} is no method and is shared by {len(users)} method(s)")
    return wrong


def test_methods_holds_methods_and_no_method_imports_another():
    from snaketune.methods import REGISTRY

    registered = {module for module, _ in REGISTRY.values()}
    imports = {}
    for path in sorted((PACKAGE / "methods").glob("*.py")):
        name = f"snaketune.methods.{path.stem}".removesuffix(".__init__")
        imports[name] = {m for m in imported(path) if m.startswith("snaketune.methods.")}
    assert registered <= set(imports)
    assert method_layout(imports, registered) == []


def test_the_method_layout_check_sees_a_method_importing_another_and_a_stray_module():
    """(the check above can fail: SimPO importing DPO's collator, a tool runner in methods/)"""
    m = "snaketune.methods."
    imports = {
        f"{m}dpo": {f"{m}training"},
        f"{m}simpo": {f"{m}dpo", f"{m}dpo.PairCollator", f"{m}training"},
        f"{m}grpo": {f"{m}training", f"{m}toolrunner"},
        f"{m}training": set(),
        f"{m}toolrunner": set(),
    }
    assert method_layout(imports, {f"{m}dpo", f"{m}simpo", f"{m}grpo"}) == [
        f"method {m}simpo imports method {m}dpo",
        f"{m}toolrunner is no method and is shared by 1 method(s)",
    ]


def stage_names_written(source: str, names: set[str]) -> list[str]:
    """The code sites of ``source`` that write one of ``names`` (a scoring stage's rule): a
    string (a docstring aside: prose may name a rule) or an identifier containing it, as
    ``line: what``."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = None if id(node) in docstrings else node.value
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, (ast.arg, ast.keyword)):
            text = node.arg
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            text = node.name
        else:
            continue
        if text and any(name in text for name in names):
            found.append(f"{node.lineno}: {text!r}")
    return found


def test_the_scoring_stages_rule_names_are_written_only_in_the_registry_and_its_methods():
    """The registry of needs (snaketune.methods.needs) names each stage need's rule; a plan,
    check or stage asks the record. The methods that declare a need may read its output
    by that name; no other library module writes it."""
    from snaketune.methods import REGISTRY
    from snaketune.methods.needs import STAGE_NEEDS

    names = {need.name for need in STAGE_NEEDS}
    allowed = {PACKAGE / "methods/needs.py"} | {
        PACKAGE / f"{module.replace('.', '/').removeprefix('snaketune/')}.py"
        for module, _ in REGISTRY.values()
    }
    assert all(path.is_file() for path in allowed), allowed
    written = {
        str(path.relative_to(PACKAGE)): sites
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in allowed and (sites := stage_names_written(path.read_text(), names))
    }
    assert written == {}


def test_the_stage_name_check_sees_a_string_and_a_name_but_not_a_docstring():
    """(the check above can fail: a plan keyed by the rule's name, a variable named for it)"""
    source = '''"""The teacher stage (rule teacher_logps)."""
def plan(run):
    """Keyed by reference_logps."""
    teacher_logps_plan = {}  # rule teacher_logps
    return {"reference_logps": run, "x": teacher_logps_plan}
'''
    assert stage_names_written(source, {"reference_logps", "teacher_logps"}) == [
        "4: 'teacher_logps_plan'",
        "5: 'reference_logps'",
        "5: 'teacher_logps_plan'",
    ]


def test_one_reader_of_tokenized_rows_gives_every_row_its_labels():
    """A text row stores no labels (every token is trained); the one reader of tokenized sets
    and shards (snaketune.core.parts.read_table) fills them, so no stage has to remember:
    no other library module calls ``with_labels`` or reads a tokenized set's parquet itself
    with its labels."""
    callers = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if any(
            isinstance(n, ast.Name)
            and n.id == "with_labels"
            or isinstance(n, ast.Attribute)
            and n.attr == "with_labels"
            for n in ast.walk(ast.parse(path.read_text()))
        )
    )
    assert callers == ["core/parts.py"]


def test_the_reader_fills_a_text_rows_labels(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from snaketune.core import parts

    labels = pa.array([None, [-100, 7]], pa.list_(pa.int32()))
    table = pa.table({"input_ids": pa.array([[1, 2, 3], [6, 7]], pa.list_(pa.int32())),
                      "labels": labels, "rank": [0, 1]})  # fmt: skip
    pq.write_table(table, tmp_path / "node-0.parquet")
    read = parts.read_table(tmp_path / "node-0.parquet", ["input_ids", "labels"])
    assert read.column("labels").to_pylist() == [[1, 2, 3], [-100, 7]]
    mine = parts.read_table(tmp_path / "node-0.parquet", ["labels"], filters=[("rank", "==", 1)])
    assert mine.column("labels").to_pylist() == [[-100, 7]]


def workflow_rules() -> set[str]:
    """The rules (and checkpoints) workflow/ declares, ``all`` aside."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "workflow").rglob("*.smk")))
    text += (ROOT / "workflow/Snakefile").read_text()
    named = re.findall(r"^(?:rule|checkpoint) (\w+):", text, re.M)
    named += re.findall(r"^use rule \w+ as (\w+)", text, re.M)
    return set(named) - {"all"}


# Words that are rule names and mean something else where these modules write them (a
# module, the word, what it means there); every other string equal to a rule's name is the
# registry's to write
OTHER_MEANINGS = {
    ("app/agentdemo.py", "train"): "the demo dataset's split",
    ("app/fixtures.py", "train"): "the fixtures' split",
    ("data/sources.py", "train"): "the Hub's default split",
    ("plan/corpus.py", "train"): "the Hub's default split",
    ("methods/distill.py", "train"): "TRL's metrics of the training mode",
    ("methods/training.py", "train"): "TRL's metrics of the training mode",
    ("tools/tooluse.py", "train"): "the model's mode",
    ("methods/needs.py", "train"): "a need's place: held inside the train job (below the plans)",
    ("budget/calibrate.py", "publish"): "a run's config key",
    ("plan/schema.py", "publish"): "a run's config key",
    ("plan/sweep.py", "publish"): "a run's config key",
    ("plan/targets.py", "publish"): "a run's config key",
    ("plan/trainjob.py", "publish"): "a run's config key",
}


def rule_names_written(source: str, names: set[str]) -> list[tuple[int, str]]:
    """The strings of ``source`` (docstrings aside) that are one of ``names``, as (line, name)."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings
    )


def test_the_stage_registry_is_the_workflows_rules_and_the_only_module_naming_them():
    """One registry of the pipeline's stages (snaketune.plan.pipeline): its rules are the
    workflow's, and no other library module writes a rule's name in a string (the scoring
    stages' are their needs' records', snaketune.methods.needs); a plan, check, status or
    target asks a stage's record."""
    from snaketune.methods.needs import STAGE_NEEDS
    from snaketune.plan import pipeline

    assert pipeline.rules() == workflow_rules()
    # the scoring stages' names: the test of the needs above
    rules = workflow_rules() - {need.name for need in STAGE_NEEDS}
    written = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(PACKAGE))
        own = module == "plan/pipeline.py"
        for line, name in [] if own else rule_names_written(path.read_text(), rules):
            if (module, name) not in OTHER_MEANINGS:
                written.append(f"{module}:{line}: {name!r}")
    assert written == []


def test_the_rule_name_check_sees_a_string_but_not_a_docstring():
    """(the check above can fail: a stage list, a comparison with a job's rule)"""
    source = '''"""Rule merge_lora's plan."""
ORDER = ("shard_dataset", "train")
def planned(job):
    """Asks merge_lora."""
    return job.rule == "merge_lora" or "merge_lora_x"
'''
    found = rule_names_written(source, {"shard_dataset", "train", "merge_lora"})
    assert found == [(2, "shard_dataset"), (2, "train"), (5, "merge_lora")]


def test_a_new_stage_is_one_record(monkeypatch, tmp_path):
    """A stage added to the registry is in a run's order (before training where listed
    there), in `snaketune status`, among the jobs whose memory is checked and the stages a
    calibration measures: nothing else is edited."""
    from snaketune.app import status
    from snaketune.budget import calibrate
    from snaketune.plan import pipeline

    probe = pipeline.Stage(
        "probe_stage", "a probe", "run", done=("probe/done.json",), memory_checked=True,
        calibrated=True,
    )  # fmt: skip
    at = pipeline.STAGES.index(pipeline.TRAIN)
    monkeypatch.setattr(pipeline, "STAGES", (*pipeline.STAGES[:at], probe, *pipeline.STAGES[at:]))
    order = pipeline.run_order()
    assert order.index("probe_stage") < order.index("train")
    assert "probe_stage" in pipeline.memory_checked() and "probe_stage" in pipeline.calibrated()
    run = tmp_path / "results/demo"
    (run / "probe").mkdir(parents=True)
    (run / "probe/done.json").write_text("{}")
    lines = status.run_status(run, {}, ([], False))
    assert [line.split()[0] for line in lines[1:]] == [s.name for s in pipeline.with_status()]
    assert "  probe_stage        done" in lines
    (tmp_path / "benchmarks/probe_stage").mkdir(parents=True)
    (tmp_path / "benchmarks/probe_stage/demo.tsv").write_text("s\th:m:s\n2.5\t0:00:02\n")
    assert calibrate.stage_seconds(tmp_path, "demo") == {"probe_stage": 2.5}
