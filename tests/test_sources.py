"""download_model / download_dataset: local conversion and provenance; the hub code path
with the network replaced by local stand-ins for huggingface_hub and datasets."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import huggingface_hub
import pyarrow.parquet as pq
import pytest
from conftest import write_jsonl

from snaketune.core.errors import DataError
from snaketune.core.io import sha256_file
from snaketune.data.sources import download_dataset, download_model

ROWS = [{"question": f"q{i}", "answer": f"a{i}", "n": i} for i in range(5)]


@pytest.mark.parametrize("fmt", ["jsonl", "json-lines", "json-array", "csv", "parquet"])
def test_local_dataset_formats_become_parquet(tmp_path, fmt):
    src = tmp_path / "in"
    if fmt == "jsonl":
        path = write_jsonl(src.with_suffix(".jsonl"), ROWS)
    elif fmt == "json-lines":
        path = write_jsonl(src.with_suffix(".json"), ROWS)
    elif fmt == "json-array":
        path = src.with_suffix(".json")
        path.write_text(json.dumps(ROWS))
    elif fmt == "csv":
        path = src.with_suffix(".csv")
        path.write_text("question,answer,n\n" + "".join(f"q{i},a{i},{i}\n" for i in range(5)))
    else:
        path = src.with_suffix(".parquet")
        pq.write_table(datasets.Dataset.from_list(ROWS).data.table, path)
    spec = {"source": "local", "path": str(path), "format": "prompt_response"}
    out = download_dataset("d", spec, tmp_path / "out")
    assert pq.read_table(out).to_pylist() == ROWS
    prov = json.loads((tmp_path / "out" / "provenance.json").read_text())
    assert prov["files"] == {path.name: sha256_file(path)}
    assert prov["output"] == {"data.parquet": sha256_file(out)} and prov["rows"] == 5


def test_local_dataset_errors(tmp_path):
    spec = {"source": "local", "format": "prompt_response"}
    with pytest.raises(DataError, match=r"^datasets.d.path: .*missing.jsonl does not exist; fix"):
        download_dataset("d", {**spec, "path": str(tmp_path / "missing.jsonl")}, tmp_path / "o")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(DataError, match="cannot tell the format from the extension"):
        download_dataset("d", {**spec, "path": str(tmp_path / "x.txt")}, tmp_path / "o")
    (tmp_path / "bad.jsonl").write_bytes(b'{"question": "q", "answer": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl is not valid UTF-8 \(byte 0xff at offset 29"):
        download_dataset("d", {**spec, "path": str(tmp_path / "bad.jsonl")}, tmp_path / "o")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError):
        download_dataset("d", {**spec, "path": str(tmp_path / "empty.jsonl")}, tmp_path / "o")
    assert not (tmp_path / "o" / "data.parquet").exists()


def test_local_model_is_linked_with_provenance(tmp_path, tiny_model):
    out = tmp_path / "models" / "tiny"
    download_model("tiny", {"source": "local", "path": str(tiny_model)}, out)
    assert (out / "model.safetensors").is_symlink()
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["files"]["model.safetensors"] == sha256_file(tiny_model / "model.safetensors")
    with pytest.raises(DataError, match="has no config.json"):
        download_model("x", {"source": "local", "path": str(tmp_path)}, tmp_path / "m2")
    assert not (tmp_path / "m2").exists()


class FakeInfo:
    sha = "0123456789abcdef0123456789abcdef01234567"


def test_hub_model_downloads_the_resolved_commit(tmp_path, tiny_model, monkeypatch):
    calls = {}

    def model_info(self, repo_id, revision=None):
        calls["info"] = (repo_id, revision)
        return FakeInfo()

    def snapshot_download(repo_id, revision=None, local_dir=None, ignore_patterns=None):
        calls["download"] = (repo_id, revision)
        Path(local_dir).mkdir(parents=True)
        for f in tiny_model.iterdir():
            (Path(local_dir) / f.name).write_bytes(f.read_bytes())
        return local_dir

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    out = tmp_path / "m"
    download_model("llama", {"source": "hub", "id": "org/llama", "revision": "v1"}, out)
    assert calls == {"info": ("org/llama", "v1"), "download": ("org/llama", FakeInfo.sha)}
    prov = json.loads((out / "provenance.json").read_text())
    assert (prov["id"], prov["revision"], prov["commit"]) == ("org/llama", "v1", FakeInfo.sha)
    assert "config.json" in prov["files"]


def test_hub_dataset_downloads_the_resolved_commit(tmp_path, monkeypatch):
    calls = {}

    def dataset_info(self, repo_id, revision=None):
        calls["info"] = (repo_id, revision)
        return FakeInfo()

    def load_dataset(repo_id, subset, split=None, revision=None):
        calls["load"] = (repo_id, subset, split, revision)
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    spec = {"source": "hub", "id": "openai/gsm8k", "subset": "main", "format": "prompt_response"}
    out = download_dataset("gsm8k", spec, tmp_path / "d")
    assert calls == {
        "info": ("openai/gsm8k", "main"),
        "load": ("openai/gsm8k", "main", "train", FakeInfo.sha),
    }
    assert pq.read_table(out).num_rows == 5
    prov = json.loads((tmp_path / "d" / "provenance.json").read_text())
    assert prov["commit"] == FakeInfo.sha and prov["split"] == "train"
