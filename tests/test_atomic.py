"""Atomic outputs: every stage, killed with SIGKILL at the worst moment, leaves none of its
declared outputs, and a rerun completes.

The worst moment is when all of a stage's data is written but nothing is renamed into
place yet: ``SNAKETUNE_KILL_BEFORE_PUBLISH`` (snaketune.core.io.fault_point) makes the stage's
process SIGKILL itself there. Snakemake runs with --keep-incomplete, so it deletes nothing
after the failure: what is left on disk is what the stage left.
"""

from __future__ import annotations

import pytest
from conftest import ENV, quick_config, snakemake

# (rule, text in the path of the output being published, the rule's declared outputs)
STAGES = [
    ("make_fixtures", "resources/fixtures/",
     ["resources/fixtures/tiny-llama", "resources/fixtures/gsm8k-demo/*.jsonl"]),
    ("download_model", "resources/models/tiny", ["resources/models/tiny"]),
    ("download_dataset", "resources/datasets/",
     ["resources/datasets/*/data.parquet", "resources/datasets/*/provenance.json"]),
    ("tokenize_dataset", "results/tokenized/",
     ["results/tokenized/*/data.parquet", "results/tokenized/*/stats.json",
      "results/tokenized/*/provenance.json"]),
    ("shard_dataset", "results/demo/shards", ["results/demo/shards"]),
    ("train", "results/demo/train/final_checkpoint",
     ["results/demo/train/final_checkpoint", "results/demo/train/model",
      "results/demo/train/metrics.jsonl", "results/demo/train/run_config.json",
      "results/demo/train/provenance.json", "results/demo/train/probe.safetensors"]),
    ("convert_checkpoint", "results/demo/lora_adapters", ["results/demo/lora_adapters"]),
    ("merge_lora", "results/demo/merged_model", ["results/demo/merged_model"]),
    ("evaluate_base", "results/base_eval/",
     ["results/base_eval/*/metrics.json", "results/base_eval/*/samples.jsonl",
      "results/base_eval/*/provenance.json"]),
    ("evaluate", "results/demo/eval",
     ["results/demo/eval/metrics.json", "results/demo/eval/samples.jsonl",
      "results/demo/eval/provenance.json"]),
    ("report", "results/summary",
     ["results/summary.tsv", "results/summary.html", "results/loss_curves"]),
]  # fmt: skip


def complete(workdir, patterns: list[str]) -> list[str]:
    """What is missing for the stage's outputs to be whole: a pattern with no match, or a
    wildcard value (e.g. one tokenized folder) that has some of the stage's files and not
    the others ([] when whole)."""
    missing, values = [], {}
    for pat in patterns:
        found = [p for p in workdir.glob(pat) if not p.name.startswith(".")]
        if not found:
            missing.append(pat)
        parts = pat.split("/")
        if "*" in parts:  # a folder per wildcard value (e.g. results/tokenized/*/...)
            star = parts.index("*")
            values[pat] = {p.relative_to(workdir).parts[star] for p in found}
    every = set().union(*values.values()) if values else set()
    for pat, have in values.items():
        missing += [f"{pat} for {v}" for v in sorted(every - have)]
    return missing


def existing(workdir, patterns: list[str]) -> list[str]:
    """Paths matching ``patterns`` (not the hidden temporaries beside them)."""
    found = [p.relative_to(workdir) for pat in patterns for p in workdir.glob(pat)]
    return [str(p) for p in found if not any(part.startswith(".") for part in p.parts)]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The demo on one node, 2 optimizer steps (the kill, not the run, is tested)."""
    return quick_config(tmp_path_factory.mktemp("atomic_config") / "quick.yaml", nodes=1)


@pytest.mark.extended
@pytest.mark.slow
def test_sigkill_before_publish_leaves_no_output_and_a_rerun_completes(
    tmp_path, quick, monkeypatch
):
    def run(rule: str | None, fault: str | None):
        if fault:
            monkeypatch.setitem(ENV, "SNAKETUNE_KILL_BEFORE_PUBLISH", fault)
        else:
            monkeypatch.delitem(ENV, "SNAKETUNE_KILL_BEFORE_PUBLISH", raising=False)
        until = ("--until", rule) if rule else ()
        return snakemake("--configfile", str(quick), "--directory", str(tmp_path),
                         "--keep-incomplete", *until, check=False)  # fmt: skip

    for rule, needle, outputs in STAGES:
        # the stage, and whatever it needs that an earlier kill left undone, until killed
        proc = run(rule, needle)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, f"{rule}: not killed\n{out[-3000:]}"
        assert f"Error in rule {rule}:" in out, f"{rule}: another job failed\n{out[-3000:]}"
        assert existing(tmp_path, outputs) == [], f"{rule}: killed, yet its outputs exist"
    proc = run(None, None)  # the rerun: every killed stage is redone, the pipeline completes
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rule, _, outputs in STAGES:
        assert complete(tmp_path, outputs) == [], f"{rule}: rerun incomplete"
    leftovers = [str(p) for p in tmp_path.rglob("*.tmp-*")] + [
        str(p) for p in tmp_path.rglob("*.staged")
    ]
    assert leftovers == [], "temporaries of killed writers were not cleaned up"
    print(f"faults injected: {len(STAGES)} SIGKILL (one per stage), each left no output")


def test_complete_finds_a_folder_missing_one_of_its_files(tmp_path):
    """The check of the rerun above: two tokenized folders, one without stats.json."""
    patterns = STAGES[3][2]
    for key in ("a", "b"):
        folder = tmp_path / "results/tokenized" / key
        folder.mkdir(parents=True)
        for name in ("data.parquet", "provenance.json", "stats.json"):
            (folder / name).write_text("")
    assert complete(tmp_path, patterns) == []
    (tmp_path / "results/tokenized/b/stats.json").unlink()
    assert complete(tmp_path, patterns) == ["results/tokenized/*/stats.json for b"]
    assert complete(tmp_path, ["results/demo/shards"]) == ["results/demo/shards"]
    fixtures = STAGES[0][2]  # a folder and files matched by a name pattern (*.jsonl)
    assert complete(tmp_path, fixtures) == fixtures
    (tmp_path / "resources/fixtures/tiny-llama").mkdir(parents=True)
    (tmp_path / "resources/fixtures/gsm8k-demo").mkdir(parents=True)
    (tmp_path / "resources/fixtures/gsm8k-demo/train.jsonl").write_text("")
    assert complete(tmp_path, fixtures) == []
