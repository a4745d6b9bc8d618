"""tests/touched.py: the map of which library modules each extended test's processes load,
recorded from a tier's logs, and the tests a change selects from it."""

from __future__ import annotations

import json
from pathlib import Path

import touched

DPO = "tests/test_dpo.py::test_killed_dpo_run_resumes_to_the_same_losses"
GRPO = "tests/test_grpo.py::test_grpo_after_sft_learns_on_two_nodes"
SNAKEMAKE = "/venv/bin/python /venv/bin/snakemake"
WORKER = "/venv/bin/python /repo/scripts/train.py"


def logs(folder: Path) -> Path:
    """A tier's logs as tests/run.sh keeps them (SNAKETUNE_KEEP): the processes of two chain
    fixtures (their snakemake parse loads every method; their workers one each) and of two
    tests, each test's fixtures, and the JUnit times."""
    every_method = ",".join(["snaketune.plan.config", *touched.METHOD_MODULES])
    lines = [
        f"fixture:dpo_chain\t{SNAKEMAKE} --snakefile\t{every_method}",
        f"fixture:dpo_chain\t{WORKER} --worker\tsnaketune.methods.dpo,snaketune.train.worker,"
        "scripts/train.py",
        f"fixture:grpo_chain\t{SNAKEMAKE} --snakefile\t{every_method}",
        f"fixture:grpo_chain\t{WORKER} --worker\tsnaketune.methods.grpo,snaketune.train.worker",
        f"{DPO}\t{WORKER} --worker\tsnaketune.methods.dpo,snaketune.core.checkpoints",
        f"{GRPO}\t/venv/bin/python /repo/scripts/evaluate.py\tsnaketune.evaluation.evaluate",
    ]
    (folder / "cpu.tsv.modules").write_text("\n".join(lines) + "\n")
    (folder / "cpu.tsv.fixtures").write_text(
        f"{DPO}\tdpo_chain,tmp_path\n{GRPO}\tgrpo_chain\n"
    )  # fmt: skip
    (folder / "main.xml").write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_dpo" name="test_killed_dpo_run_resumes_to_the_same_losses" time="61.5"/>'
        '<testcase classname="tests.test_grpo" name="test_grpo_after_sft_learns_on_two_nodes" time="30"/>'
        '</testsuite></testsuites>'
    )  # fmt: skip
    return folder


def test_the_map_counts_a_test_s_processes_its_fixtures_and_its_file_s_imports(tmp_path):
    the_map = touched.record(logs(tmp_path))
    dpo, grpo = the_map["tests"][DPO], the_map["tests"][GRPO]
    assert dpo["seconds"] == 61.5 and grpo["seconds"] == 30.0
    # alone, a test pays its chain's build: the slowest user of each fixture, here itself
    assert dpo["alone"] == 123.0 and grpo["alone"] == 60.0
    # its own processes and its fixture's (the snakemake parse without its method modules)
    assert {"snaketune.methods.dpo", "snaketune.core.checkpoints", "snaketune.train.worker",
            "scripts/train.py", "snaketune.plan.config"} <= set(dpo["modules"])  # fmt: skip
    assert "snaketune.methods.grpo" not in dpo["modules"]
    assert "snaketune.methods.dpo" not in grpo["modules"]
    # test_grpo.py's own imports of the library, with what they import
    assert "snaketune.evaluation.rewards" in grpo["modules"]
    assert "snaketune.core.errors" in grpo["modules"]
    assert "snaketune.methods.dpo" in the_map["modules_known"]


def test_a_change_selects_the_tests_that_load_it(tmp_path):
    the_map = json.loads(json.dumps(touched.record(logs(tmp_path))))
    assert touched.select(["scripts/snaketune/methods/dpo.py"], the_map)[0] == [DPO]
    assert touched.select(["scripts/snaketune/methods/grpo.py"], the_map)[0] == [GRPO]
    assert touched.select(["tests/test_grpo.py"], the_map)[0] == [GRPO]
    assert touched.select(["docs/dpo.md", "README.md", ".ci/base"], the_map)[0] == []
    for central in ("scripts/snaketune/train/worker.py", "Snakefile", "tests/conftest.py",
                    "pyproject.toml", "workflow/rules/train.smk"):  # fmt: skip
        tests, why = touched.select([central], the_map)
        assert tests == [DPO, GRPO] and "central" in why[0], central
    tests, why = touched.select(["scripts/snaketune/methods/brand_new.py"], the_map)
    assert tests == [DPO, GRPO] and "newer than the map" in why[0]


def test_the_recorded_map_names_extended_tests_that_exist():
    """tests/touched-map.json, recorded from an extended run, names only extended tests that
    exist (a renamed or removed one would make pytest refuse the whole selection), and most
    of them (record it again when many are new: docs/testing.md)."""
    from test_mutations import collected

    the_map = json.loads(touched.MAP.read_text())
    mapped = {t.split("[")[0] for t in the_map["tests"]}
    extended = collected("extended", ["tests"])
    assert mapped <= extended, mapped - extended
    assert len(mapped) >= 0.8 * len(extended), extended - mapped
