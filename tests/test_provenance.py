"""Provenance: every artefact directory of the demo carries a provenance.json, and
`snaketune lineage` follows them from the evaluated model back to the raw dataset."""

from __future__ import annotations

import json
import shutil
import subprocess

from conftest import BIN, ENV, ROOT

from snaketune import __version__

ARTEFACTS = {
    "resources/models/tiny": "download_model",
    "resources/datasets/arith": "download_dataset",
    "resources/datasets/arith_test": "download_dataset",
    "results/demo/shards": "shard_dataset",
    "results/demo/train": "train",
    "results/demo/lora_adapters": "convert_checkpoint",
    "results/demo/merged_model": "merge_lora",
    "results/demo/eval": "evaluate",
}


def lineage(workdir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "snaketune"), "lineage", *args], cwd=workdir, env=ENV,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_every_artefact_directory_has_provenance(demo):
    dirs = dict(ARTEFACTS)
    for tok in (demo / "results/tokenized").iterdir():
        dirs[f"results/tokenized/{tok.name}"] = "tokenize_dataset"
    for base in (demo / "results/base_eval").iterdir():
        dirs[f"results/base_eval/{base.name}"] = "evaluate_base"
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    for path, stage in dirs.items():
        prov = json.loads((demo / path / "provenance.json").read_text())
        assert prov["stage"] == stage, path
        assert prov["artefact"] == path
        assert prov["workflow"]["commit"] == commit
        assert prov["workflow"]["version"] == prov["versions"]["snaketune"] == __version__
        assert {"torch", "transformers", "peft", "deepspeed", "snaketune"} <= set(prov["versions"])
        assert prov["host"] and prov["time"]
        assert prov["outputs"], path  # the sha256 of what the stage wrote
        assert isinstance(prov["config"], dict), path
        for name, entry in prov["inputs"].items():  # each input pinned by a hash
            assert {"sha256", "provenance_sha256", "files"} & set(entry), (path, name)
    assert f"Made by snaketune {__version__}." in (demo / "results/summary.html").read_text()
    train = json.loads((demo / "results/demo/train/provenance.json").read_text())
    assert train["config"]["learning_rate"] == 6e-3 and len(train["hosts"]) == 2
    assert train["inputs"]["shards"]["provenance"] == "results/demo/shards/provenance.json"
    assert "sha256" in train["inputs"]["deepspeed"]


def test_lineage_from_the_merged_model_to_the_raw_dataset(demo):
    proc = lineage(demo, "results/demo/merged_model", "--verify")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    text = proc.stdout
    assert lines[0].startswith("results/demo/merged_model [merge_lora] ")
    chain = ["results/demo/merged_model [merge_lora]",
             "adapter: results/demo/lora_adapters [convert_checkpoint]",
             "checkpoint: results/demo/train [train]",
             "shards: results/demo/shards [shard_dataset]",
             "[tokenize_dataset]",
             "resources/datasets/arith [download_dataset]"]  # fmt: skip
    positions = [text.find(c) for c in chain]
    assert -1 not in positions and positions == sorted(positions), text
    # the raw file the training set came from, with its hash
    raw = text[positions[-1] :].splitlines()[1]
    assert "source: local " in raw and "arith-demo/train.jsonl (1 files, train.jsonl sha256 " in raw
    assert "model: resources/models/tiny [download_model]" in text
    assert "(see above)" in text  # the base model appears once in full
    assert "verify: " in text and "changed" not in text and "missing" not in text
    assert "evaluated in results/demo/eval: exact_match" in text.splitlines()[-1]


def test_lineage_verify_finds_a_changed_file(demo, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(demo / "results", work / "results", symlinks=True)
    shutil.copytree(demo / "resources", work / "resources", symlinks=True)
    stats = next((work / "results/tokenized").glob("arith__*/stats.json"))
    stats.write_text(stats.read_text().replace('"rows"', '"rows" '))
    proc = lineage(work, "results/demo/eval", "--verify")
    assert proc.returncode == 1
    assert "stats.json changed" in proc.stdout
    assert proc.stderr.startswith(
        "error: 1 file(s) differ from their provenance: results/tokenized/"
    )


def test_lineage_of_a_path_without_provenance(demo):
    proc = lineage(demo, "logs")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: logs: no provenance.json in or beside it; give an artefact directory "
        "(e.g. results/RUN/merged_model) made by this workflow"
    ]


def test_report_links_each_run_to_its_lineage(demo):
    html = (demo / "results/summary.html").read_text()
    assert '<a href="demo/eval/provenance.json">provenance</a>' in html
    assert "snaketune lineage results/demo/eval" in html
    assert "merged_model [merge_lora]" in html and "[download_dataset]" in html
