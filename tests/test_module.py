"""The workflow as a guest in a user's project: used as a Snakemake module, with a prefix
(``use rule * from snaketune as snaketune_*``) and as ``snakedeploy deploy-workflow`` lays a
project out, it finds its own files from its folder, writes only into the project, and runs
with the interpreter Snakemake runs in, the environment not activated."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import BIN, ENV, ROOT, quick_config, started

from snaketune.plan.rulenames import local_name, local_names

# what a run of the workflow may write under the clone whatever the test: tools' caches
CLONE_CACHES = (".venv", ".pytest_cache", ".ruff_cache", ".hypothesis", ".snakemake", ".git",
                "bench/wheels", ".gpu-site")  # fmt: skip


def test_our_rule_names_are_read_back_through_a_module_s_prefix_or_suffix():
    assert local_name("snaketune_train", "snaketune_all") == "train"
    assert local_name("snaketune_evaluate_base", "snaketune_all") == "evaluate_base"
    assert local_name("train_st", "all_st") == "train"
    assert local_name("train", "all") == "train"  # no module, or no prefix
    assert local_name("my_rule", "snaketune_all") is None  # the project's own rule
    assert local_name("snaketune_", "snaketune_all") is None
    assert local_names(["snaketune_train", "curate"], "snaketune_all") == {"train"}


def clone_files() -> set[str]:
    """Every file under the clone but the tools' caches (and the tests' own writes)."""
    found = set()
    for top, dirs, files in os.walk(ROOT):
        rel = Path(top).relative_to(ROOT)
        dirs[:] = [d for d in dirs if str(rel / d).removeprefix("./") not in CLONE_CACHES
                   and d != "__pycache__"]  # fmt: skip
        found |= {str(rel / f) for f in files}
    return found


def project(where: Path, snakefile: str) -> Path:
    """A user's project: config/config.yaml (the demo's, runs short) and ``snakefile``."""
    quick_config(where / "config/config.yaml")
    (where / "Snakefile").write_text(snakefile)
    return where


def run(where: Path, *args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    """snakemake in ``where`` by its path in the environment, which is not on PATH (the
    environment not activated): the rules must still find its python."""
    env = {**ENV, "PATH": "/usr/bin:/bin"}
    cmd = [str(BIN / "snakemake"), "--profile", str(ROOT / "profiles/local"), "-c2", *args]
    return subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


MODULE = """configfile: "config/config.yaml"


module snaketune:
    snakefile:
        {snakefile}
    config:
        config


use rule * from snaketune as snaketune_*
"""


@pytest.mark.slow
def test_a_project_using_the_workflow_as_a_prefixed_module_runs_to_the_report(tmp_path):
    """From a directory holding only config/config.yaml and a Snakefile importing the
    workflow with a prefix: the demo (short) runs to its report there, checked before
    anything runs as a plain run is, and nothing is written into the clone."""
    before = clone_files()
    where = project(tmp_path / "lab", MODULE.format(snakefile=json.dumps(str(ROOT / "Snakefile"))))
    proc = run(where)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert started(out, "snaketune_train") == ["run=demo"]
    assert "plan: demo:" in out  # the checks before queueing ran (no onstart in a module)
    metrics = json.loads((where / "results/demo/eval/metrics.json").read_text())
    assert metrics["examples"] == 8
    assert (where / "results/summary.html").is_file()
    assert clone_files() == before


def deployed(tmp_path: Path) -> Path:
    """`snakedeploy deploy-workflow <clone> <dest>`, its module pointed at the clone's
    workflow/Snakefile (as github(...) points at the repository's), the demo's config (runs
    short): the project's folder."""
    # from a shallow clone of the clone's last commit: snakedeploy reads a local path's whole
    # folder (the clone's .venv too: 94 s, most of it the kernel's), as GitHub's would not be
    source = tmp_path / "source"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(source)],
                   check=True)  # fmt: skip
    commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    dest = tmp_path / "deployed"
    subprocess.run([str(BIN / "snakedeploy"), "deploy-workflow", str(source), str(dest),
                    "--commit", commit], env=ENV, check=True, capture_output=True)  # fmt: skip
    assert (dest / "config/config.yaml").is_file() and (dest / "profiles/local").is_dir()
    snakefile = dest / "workflow/Snakefile"
    text = snakefile.read_text()
    assert 'configfile: "config/config.yaml"' in text and "use rule * from" in text
    module = re.search(r'snakefile:\s*\n\s*("[^"]*")', text)  # snakedeploy's local path
    assert module and module.group(1).endswith('Snakefile"'), text
    clone = json.dumps(str(ROOT / "workflow/Snakefile"))
    snakefile.write_text(text[: module.start(1)] + clone + text[module.end(1) :])
    quick_config(dest / "config/config.yaml")
    return dest


def test_the_project_snakedeploy_lays_out_plans_every_stage(tmp_path):
    """The project snakedeploy lays out, dry run (the CI tier's share of the test below):
    the workflow's config/ and profiles/ are there, and its Snakefile plans every stage of
    the demo through the module, its checks before queueing passed, nothing written into
    the clone."""
    before = clone_files()
    dest = deployed(tmp_path)
    proc = run(dest, "-n")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    for rule in ("make_fixtures", "tokenize_dataset", "train", "merge_lora", "report"):
        assert re.search(rf"^rule {rule}:$", out, re.MULTILINE), (rule, out[-3000:])
    assert "plan: demo:" in out and clone_files() == before


@pytest.mark.slow
@pytest.mark.extended  # the CI tier's budget: the dry run above and the prefixed module's run
def test_the_project_snakedeploy_lays_out_runs_the_workflow_from_workflow_snakefile(tmp_path):
    """The project snakedeploy lays out runs the stages into the project."""
    before = clone_files()
    dest = deployed(tmp_path)
    proc = run(dest, "--until", "shard_dataset")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert started(out, "shard_dataset") == ["run=demo"]
    assert (dest / "results/demo/shards/manifest.json").is_file()
    assert clone_files() == before
