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


def test_a_hub_corpus_s_chosen_files_are_fetched_one_by_one_and_a_cut_file_resumes(
    tmp_path, monkeypatch
):
    """`files:` globs take two of a Hub dataset's three parquet files (a Hub on localhost:
    tests/hubserver.py); the second is cut off half-way: the download resumes it from the
    byte it reached (a Range request), the rows are both files' in order, the provenance
    lists their sizes, and a second download fetches nothing again. A glob that matches
    nothing is one line naming the files there are."""
    import random
    import subprocess

    import pyarrow as pa
    from conftest import BIN, ENV, ROOT
    from hubserver import COMMIT, FakeHub

    def parquet(seed: int, rows: int) -> bytes:
        rng = random.Random(seed)
        texts = [rng.randbytes(rng.randint(50, 300)).hex() for _ in range(rows)]
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"text": texts}), sink, compression="none")
        return sink.getvalue().to_pybytes()

    # the second file is 24 MB: huggingface_hub writes what it reads in 10 MiB chunks, so a
    # cut past the first chunk leaves that much to resume from
    files = {"sample/10BT/000.parquet": parquet(0, 300), "sample/10BT/001.parquet": parquet(1, 70_000),
             "sample/100BT/000.parquet": parquet(2, 50), "README.md": b"# corpus\n"}  # fmt: skip
    spec = {"source": "hub", "id": "org/corpus", "files": ["sample/10BT/*.parquet"],
            "format": "text"}  # fmt: skip
    out = tmp_path / "resources/datasets/corpus"
    env = {**ENV, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1"}
    env.pop("HF_HUB_OFFLINE", None)

    def download(hub: FakeHub, given: dict) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "python"), str(ROOT / "scripts/download_dataset.py"), "--name", "corpus",
             "--spec", json.dumps(given), "--out-dir", str(out)],
            env={**env, "HF_ENDPOINT": hub.url}, capture_output=True, text=True,
        )  # fmt: skip

    with FakeHub("org/corpus", files, cut=("sample/10BT/001.parquet",)) as hub:
        proc = download(hub, spec)
        assert proc.returncode == 0, proc.stderr[-3000:]
        first, again = hub.gets("sample/10BT/001.parquet")
        resumed = int(again.removeprefix("bytes=").removesuffix("-"))
        assert first is None and 0 < resumed <= len(files["sample/10BT/001.parquet"]) // 2
        assert hub.gets("sample/10BT/000.parquet") == [None]
        assert hub.gets("sample/100BT/000.parquet") == hub.gets("README.md") == []
    got = pq.read_table(out / "data.parquet").column("text").to_pylist()
    want = [t for name in ("000", "001")
            for t in pq.read_table(pa.BufferReader(files[f"sample/10BT/{name}.parquet"]))
            .column("text").to_pylist()]  # fmt: skip
    assert got == want
    for name in ("sample/10BT/000.parquet", "sample/10BT/001.parquet"):
        assert (out / "files" / name).read_bytes() == files[name]
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["commit"] == COMMIT and prov["rows"] == 70_300
    assert prov["files"] == {n: len(files[n]) for n in ("sample/10BT/000.parquet",
                                                        "sample/10BT/001.parquet")}  # fmt: skip
    # the parts are counted from the chosen files' bytes: as the download recorded them, and
    # before it (another directory) as the Hub lists them
    from huggingface_hub import constants

    from snaketune.plan.stages import sources_bytes

    config, chosen = {"datasets": {"corpus": spec}}, sum(prov["files"].values())
    monkeypatch.chdir(tmp_path)
    assert sources_bytes(config, "corpus") == chosen == sum(
        len(files[n]) for n in ("sample/10BT/000.parquet", "sample/10BT/001.parquet"))  # fmt: skip
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert sources_bytes(config, "corpus") is None  # offline: not known yet
    with FakeHub("org/corpus", files) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        assert sources_bytes(config, "corpus") == chosen
    # again (the outputs gone): the complete files are not fetched again
    (out / "data.parquet").unlink()
    with FakeHub("org/corpus", files) as hub:
        assert download(hub, spec).returncode == 0
        assert [m for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p] == []
        proc = download(hub, {**spec, "files": ["sample/1BT/*.parquet"]})
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: datasets.corpus.files: no file of org/corpus at {COMMIT[:12]} matches "
        "sample/1BT/*.parquet (its files include: README.md, sample/100BT/000.parquet, "
        "sample/10BT/000.parquet, sample/10BT/001.parquet); fix the globs"
    )
