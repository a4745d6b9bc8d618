"""A method owns its whole story (snaketune.methods): outside the methods package nothing
names a method. Config validation, the plans, the stages, the report and publish ask the
run's Method; these tests read the code to keep it so, and check the registry's methods
answer what the config side asks."""

from __future__ import annotations

import ast
import re

import pytest
from conftest import ROOT

from snaketune.data.kinds import KINDS
from snaketune.methods import REGISTRY, method_named, methods
from snaketune.methods.common import ADAPTERS

LIBRARY = ROOT / "scripts"
WORKFLOW = [ROOT / "Snakefile", *sorted((ROOT / "workflow").rglob("*.smk"))]


def outside_methods() -> list:
    return [
        p for p in sorted(LIBRARY.rglob("*.py")) if "methods" not in p.relative_to(LIBRARY).parts
    ]


def method_tests(tree: ast.AST) -> list[int]:
    """Lines comparing a run's method (``x["method"]``, ``x.get("method")``, ``x.method``)
    with anything."""

    def is_method(node: ast.AST) -> bool:
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            return node.slice.value == "method"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            args = node.args
            return (
                node.func.attr == "get" and bool(args) and getattr(args[0], "value", 0) == "method"
            )
        return isinstance(node, ast.Attribute) and node.attr == "method"

    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Compare) and any(is_method(x) for x in (n.left, *n.comparators))]  # fmt: skip


def test_no_method_is_named_outside_the_methods_package():
    """No comparison with a run's method, and no method's own name or config block as a
    literal (``"dpo"``, ``run["grpo"]``), in the library, its scripts or the workflow."""
    own = {name for name, m in methods().items() if m.adapter == "optional"}  # not lora/full:
    own |= {m.block for m in methods().values() if m.block}  # those are also adapter kinds
    found = []
    for path in outside_methods():
        found += named_in(path, own)
    named = re.compile(r"""["'](""" + "|".join(sorted(own)) + r""")["']|\["method"\]""")
    for path in WORKFLOW:
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if named.search(line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert found == [], "\n".join(found)


def named_in(path, own: set[str]) -> list[str]:
    """A file's comparisons with a run's method and its literals naming one (a method's name
    or block, wherever it stands: a key, a default, a comparison), with no exemption: a
    metrics key a method's name shares (GRPO's total ``reward``) is the method's to read."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = [f"{where}:{line}: compares a method" for line in method_tests(tree)]
    literals = (n for n in ast.walk(tree) if isinstance(n, ast.Constant))
    return found + [f"{where}:{n.lineno}: {n.value!r}" for n in literals if n.value in own]


def test_the_check_finds_a_method_named_in_code(tmp_path):
    """The scan above catches the forms it looks for, the one that escaped the regex of old
    (a metrics key read by a method's name: ``m.get("reward") is not None``) included."""
    code = 'if run["method"] == "dpo": pass\nif spec.get("method") in X: pass\nif s.method: pass'
    assert method_tests(ast.parse(code)) == [1, 2]
    probe = tmp_path / "probe.py"
    probe.write_text('rows = [m for m in metrics if m.get("reward") is not None]\n')
    assert named_in(probe, {"reward", "grpo"}) == ["probe.py:1: 'reward'"]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_each_method_answers_the_config_side(name):
    m = method_named(name)
    assert m.trains_on in KINDS and m.adapter in ADAPTERS
    assert m.block is None or m.block == name  # a method's block is named after it
    assert not (m.needs is None or m.memory is None or m.check is None)


def test_no_data_kind_is_asked_outside_the_kinds():
    """Nothing asks "is it pairs?" outside the data kinds (snaketune.data.kinds and each
    kind's modules): no comparison with a method's ``trains_on`` and no kind's own column
    name as a literal; the plans, tokenization, batches and evaluation ask the kind."""
    from snaketune.data.kinds import KINDS

    own = {"data/kinds.py"}
    for kind in KINDS.values():
        own |= {m.removeprefix("snaketune.").replace(".", "/") + ".py"
                for m in (kind.module, kind.heldout and f"evaluation.{kind.heldout}") if m}  # fmt: skip
    columns = {c for kind in KINDS.values() for c in kind.columns}
    found = []
    for path in sorted((LIBRARY / "snaketune").rglob("*.py")):
        if str(path.relative_to(LIBRARY / "snaketune")) in own:
            continue
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Compare) and any(
                isinstance(x, ast.Attribute) and x.attr == "trains_on"
                for x in (n.left, *n.comparators)
            ):
                found.append(f"{path.relative_to(ROOT)}:{n.lineno}: compares trains_on")
            if isinstance(n, ast.Constant) and n.value in columns:
                found.append(f"{path.relative_to(ROOT)}:{n.lineno}: {n.value!r}")
    assert found == []
    assert {"data/kinds.py", "data/pairs.py", "evaluation/preference.py"} <= own  # scanned above
