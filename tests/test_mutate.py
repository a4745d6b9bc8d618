"""The mutation-testing tool (tests/mutate.py, `make mutants`): which tests a module gets,
cosmic-ray's session read back, the score."""

from __future__ import annotations

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


def test_a_session_on_a_small_module_counts_its_survivors(tmp_path):
    """cosmic-ray with the tool's config on a module of four lines, its test by hand: the
    mutant `x < lo` -> `x <= lo` survives (an equivalent one: at x == lo both return lo),
    the others are killed, and the file is as it was."""
    source = "def clip(x, lo=0):\n    if x < lo:\n        return lo\n    return x\n"
    (tmp_path / "mod.py").write_text(source)
    (tmp_path / "test_mod.py").write_text(
        "from mod import clip\n\n\ndef test_clip():\n    assert clip(-1) == 0 and clip(3) == 3\n"
    )
    (tmp_path / "cr.toml").write_text(mutate.config_text("mod.py", ["test_mod.py"], 60))
    cosmic = [sys.executable, "-m", "cosmic_ray.cli"]
    for step in ("init", "exec"):
        subprocess.run([*cosmic, step, "cr.toml", "s.sqlite"], cwd=tmp_path, env=ENV,
                       check=True, capture_output=True)  # fmt: skip
    dump = subprocess.run([*cosmic, "dump", "s.sqlite"], cwd=tmp_path, env=ENV, check=True,
                          capture_output=True, text=True).stdout  # fmt: skip
    found = mutate.outcomes(dump)
    survived = [m for m in found if m["outcome"] == "survived"]
    assert [(m["line"], m["change"]) for m in survived if "LtE" in m["operator"]] == [
        (2, ["-    if x < lo:", "+    if x <= lo:"])]  # fmt: skip
    counts = mutate.score(found)
    assert counts["killed"] + counts["survived"] + counts["timeout"] == len(found) >= 6
    assert counts["score"] == (counts["killed"] + counts["timeout"]) / len(found)
    assert (tmp_path / "mod.py").read_text() == source  # restored after every mutant
