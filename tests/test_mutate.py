"""The mutation-testing tool (tests/mutate.py, `make mutants`): which tests a module gets,
cosmic-ray's session read back, the score."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ENV, ROOT

sys.path.insert(0, str(ROOT / "tests"))
import mutate  # noqa: E402


def test_a_modules_tests_are_the_files_that_name_it():
    assert mutate.dotted("scripts/snaketune/data/chat.py") == "snaketune.data.chat"
    chat = mutate.tests_for("scripts/snaketune/data/chat.py")
    assert "tests/test_templates.py" in chat  # `from snaketune.data.chat import ...`
    assert "tests/test_mutate.py" not in chat
    # a name that is a prefix of another's is not it (data.chat is not data.chatx)
    assert all("chatx" not in f for f in chat)
    targets = mutate.tests_for("scripts/snaketune/core/lora_targets.py")
    assert "tests/test_moe.py" in targets and "tests/test_templates.py" not in targets


TINY = """from __future__ import annotations

LIMIT = 3


def clip(
    x, lo=min(0, LIMIT), hi=LIMIT
) -> int | None:
    if x < lo:
        return lo
    return min(x, hi)


def unused(x):
    return x + 1
"""


def test_the_tool_gives_each_mutant_the_tests_that_run_its_line(tmp_path):
    """`tests/mutate.py` on a checkout of one module of fifteen lines and its test: the line
    map from the unmutated run, each mutant's tests in a fork. The equivalent `x < lo` ->
    `x <= lo` survives; the constant's mutants (a line run only at import) are killed by the
    test that uses it (the module first put back as it was: a run that died mid-mutant left
    it mutated), as are those on a line of a `def` coverage does not count (its
    statement's first line does); an unused function's survive unrun (no test runs them); those in an
    annotation never evaluated are equivalent, out of the score; the file is as it was."""
    (tmp_path / "scripts/snaketune").mkdir(parents=True)
    (tmp_path / "scripts/snaketune/__init__.py").write_text("")
    (tmp_path / "scripts/snaketune/tiny.py").write_text(TINY)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_tiny.py").write_text(
        "from snaketune.tiny import clip\n\n\n"
        "def test_clip():\n    assert (clip(-1), clip(2), clip(9)) == (0, 2, 3)\n"
    )
    out = tmp_path / "out"
    # a run that died with a mutant planted left the module mutated and its original kept
    out.mkdir()
    (out / "snaketune.tiny.original").write_text(TINY)
    (tmp_path / "scripts/snaketune/tiny.py").write_text(TINY.replace("LIMIT = 3", "LIMIT = 4"))
    command = [sys.executable, str(ROOT / "tests/mutate.py"), "scripts/snaketune/tiny.py",
               "--root", str(tmp_path), "--tests", "tests/test_tiny.py", "--out", str(out)]  # fmt: skip
    subprocess.run(command, env=ENV, check=True, capture_output=True, text=True)
    [row] = json.loads((out / "scores.json").read_text())
    survivors = (out / "snaketune.tiny.survivors.txt").read_text()
    lines = {int(line.split(":")[1].split()[0]) for line in survivors.splitlines()
             if line.startswith("scripts/")}  # fmt: skip
    # `x < lo` turned to `x <= lo`; the unused function's (none on line 7: the def's tests)
    assert lines == {9, 15}, survivors
    assert "if x <= lo:" in survivors and "[no quick test runs this line]" in survivors
    assert row["unrun"] == survivors.count("[no quick test runs this line]") >= 3
    assert row["killed"] >= 6 and row["survived"] == row["unrun"] + 1
    assert row["equivalent"] >= 5 and "int & None" not in survivors  # the annotation's
    assert row["score"] == row["killed"] / (row["killed"] + row["survived"])
    assert (tmp_path / "scripts/snaketune/tiny.py").read_text() == TINY
    # a test of the unused function, then --again: only the survivors run, those now killed
    with open(tmp_path / "tests/test_tiny.py", "a") as f:
        f.write("\n\ndef test_unused():\n    from snaketune.tiny import unused\n\n"
                "    assert unused(5) == 6\n")  # fmt: skip
    subprocess.run([*command, "--again"], env=ENV, check=True, capture_output=True, text=True)
    [again] = json.loads((out / "scores.json").read_text())
    assert (again["survived"], again["unrun"]) == (1, 0)
    assert again["killed"] == row["killed"] + row["unrun"]
