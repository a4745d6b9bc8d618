"""Raw text (format ``text``, snaketune.data.text): documents tokenized as the model's own
tokenizer makes them with its end-of-text token after each, long documents split into
pieces that keep every token, labels stored once, the bytes each row's predicted tokens
cover, documents beside chat rows in a mixture, bad rows named; and continued
pre-training through the pipeline on 2 emulated nodes, its held-out loss, bits per byte and
first step's loss against plain transformers."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import ROOT as ROOT_DIR
from conftest import snakemake, started, write_jsonl

from snaketune.core.errors import DataError
from snaketune.core.rows import IGNORE_INDEX, with_labels
from snaketune.data.conversations import Source
from snaketune.data.kinds import kind_of_columns
from snaketune.data.sources import download_dataset
from snaketune.data.tokenization import tokenize


def sums(rng: random.Random, n: int) -> str:
    """A document of ``n`` sentences of sums ("12 + 5 = 17.")."""
    pairs = [(rng.randint(0, 49), rng.randint(0, 49)) for _ in range(n)]
    return " ".join(f"{a} + {b} = {a + b}." for a, b in pairs)


# documents of unequal lengths: a word, a sentence or two, and ones far past max_length
DOCS = [sums(random.Random(i), n) for i, n in enumerate((1, 2, 40, 3, 25, 1, 7))] + ["7"]


def tokenized(tmp_path: Path, model: Path, specs: list[tuple[str, dict, list]], max_length=64):
    """``specs`` (name, config entry, rows) tokenized as one mixture: the rows read back
    and the stats."""
    sources = []
    for name, spec, rows in specs:
        spec = {"source": "local", "path": str(write_jsonl(tmp_path / f"{name}.jsonl", rows)),
                **spec}  # fmt: skip
        sources.append(Source(name, download_dataset(name, spec, tmp_path / name), spec))
    out = tmp_path / "out.parquet"
    stats = tokenize(sources, model, out, max_length, "drop")
    return pq.read_table(out), stats


def with_bos(model: Path, out: Path) -> Path:
    """A copy of ``model`` whose tokenizer puts its BOS (id 1) before every text, as
    Llama's and Gemma's do."""
    shutil.copytree(model, out)
    path = out / "tokenizer.json"
    spec = json.loads(path.read_text())
    bos = next(t["content"] for t in spec["added_tokens"] if t["id"] == 1)
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [1], "tokens": [bos]}},
    }  # fmt: skip
    path.write_text(json.dumps(spec))
    return out


def documents_of(rows: list[dict]) -> dict[str, list[list[int]]]:
    """Each document's pieces' tokens, in order, by the document's example id."""
    out: dict[str, list[list[int]]] = {}
    for row in rows:
        out.setdefault(row["example_id"].split("#")[0], []).append(row["input_ids"])
    return out


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "bos"])
def test_documents_are_the_tokenizers_tokens_and_end_of_text_with_every_token_kept(
    tmp_path, tiny_model, bos
):
    from transformers import AutoTokenizer

    model = with_bos(tiny_model, tmp_path / "bos") if bos else tiny_model
    tok = AutoTokenizer.from_pretrained(model)
    table, stats = tokenized(tmp_path, model, [("corpus", {"format": "text"},
                                                [{"text": d} for d in DOCS])])  # fmt: skip
    rows = table.to_pylist()
    docs = documents_of(rows)
    assert list(docs) == [f"corpus:{i}" for i in range(len(DOCS))]
    for i, doc in enumerate(DOCS):  # the pieces laid end to end: the tokenizer's own + EOS
        whole = tok(doc)["input_ids"] + [tok.eos_token_id]
        assert (whole[0] == 1) == bos
        pieces = docs[f"corpus:{i}"]
        assert [t for p in pieces for t in p] == whole
        assert [len(p) for p in pieces[:-1]] == [64] * (len(pieces) - 1)  # 64: max_length
        assert 0 < len(pieces[-1]) <= 64
    longer = [i for i, d in enumerate(DOCS) if len(tok(d)["input_ids"]) + 1 > 64]
    assert len(longer) == stats.documents_split >= 2  # each split, the others whole
    split = {r["example_id"].split("#")[0] for r in rows if "#" in r["example_id"]}
    assert split == {f"corpus:{i}" for i in longer}
    assert stats.documents == len(DOCS) and stats.rows == len(rows) == stats.document_rows
    assert stats.tokens == sum(r["length"] for r in rows)
    assert stats.dropped_overlong == stats.truncated == 0
    # every token trained: no labels stored, read back as the ids
    assert table.column("labels").null_count == len(rows)
    assert with_labels(table).column("labels").to_pylist() == table.column("input_ids").to_pylist()
    assert kind_of_columns(table.column_names).name == "text"
    # each row's bytes: the text its predicted tokens (all but its first) decode to
    for row in rows:
        text = tok.decode(row["input_ids"][1:], skip_special_tokens=True)
        assert row["text_bytes"] == len(text.encode()), row["example_id"]
    if bos:  # a BOS is the first token: every byte of a whole document is predicted
        assert rows[0]["text_bytes"] == len(DOCS[0].encode())


def test_documents_beside_chat_rows_join_them_and_keep_every_token(tmp_path, tiny_model, tokenizer):
    """Replay: a mixture of documents and chat rows tokenizes each by its kind into one set
    of rows (the chat rows' kind), the documents trained on every token, the chat rows on
    their responses only."""
    chat = [{"prompt": "1 + 2 =", "response": "3"}, {"prompt": "4 + 4 =", "response": "8"}]
    table, stats = tokenized(tmp_path, tiny_model, [
        ("corpus", {"format": "text"}, [{"text": d} for d in DOCS[:3]]),
        ("chat", {"format": "prompt_response"}, chat),
    ])  # fmt: skip
    assert "text_bytes" not in table.column_names  # the rows' kind: no column of its own
    assert kind_of_columns(table.column_names).name == "rows"
    rows = with_labels(table).to_pylist()
    text = [r for r in rows if r["example_id"].startswith("corpus:")]
    talk = [r for r in rows if r["example_id"].startswith("chat:")]
    assert len(talk) == 2 and stats.documents == 3 and stats.conversations == 2
    assert all(r["labels"] == r["input_ids"] for r in text)
    assert [t for r in text if r["example_id"].startswith("corpus:2") for t in r["input_ids"]] == (
        tokenizer(DOCS[2])["input_ids"] + [tokenizer.eos_token_id]
    )
    for r in talk:  # its prompt untrained, its answer trained
        assert r["labels"][0] == IGNORE_INDEX and any(x != IGNORE_INDEX for x in r["labels"])


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"body": "x"}], "datasets.bad: column 'text' not found (columns: body); set `columns:`"),
        ([{"text": "a"}, {"text": None}], "datasets.bad row 1: column 'text' is null"),
        ([{"text": 12}], "datasets.bad row 0: column 'text' is of type int, not text"),
        ([{"text": "a"}, {"text": ""}], "datasets.bad row 1: column 'text' is empty (a document "
         "needs text); clean the data or filter the row out"),
    ],
    ids=["missing", "null", "number", "empty"],
)  # fmt: skip
def test_a_bad_text_row_is_one_line_naming_the_dataset_row_and_column(
    tmp_path, tiny_model, rows, message
):
    with pytest.raises(DataError) as info:
        tokenized(tmp_path, tiny_model, [("bad", {"format": "text"}, rows)])
    assert str(info.value).startswith(message), str(info.value)


def test_validate_names_a_bad_text_row_before_anything_runs(tmp_path):
    """`snaketune validate` and the dry run read a dataset's first rows as tokenize will."""
    from snaketune.data.peek import check_dataset

    path = write_jsonl(tmp_path / "d.jsonl", [{"doc": "12 + 3 = 15."}, {"doc": ""}])
    spec = {"source": "local", "path": str(path), "format": "text", "columns": {"text": "doc"}}
    assert check_dataset("corpus", spec, path, local=True) == (
        "datasets.corpus row 1: column 'doc' is empty (a document needs text); clean the data "
        "or filter the row out"
    )


def test_with_labels_fills_only_the_rows_without_labels():
    ids = pa.array([[1, 2, 3], [4, 5]], pa.list_(pa.int32()))
    labels = pa.array([None, [IGNORE_INDEX, 5]], pa.list_(pa.int32()))
    table = pa.table({"input_ids": ids, "labels": labels})
    assert with_labels(table).column("labels").to_pylist() == [[1, 2, 3], [IGNORE_INDEX, 5]]
    whole = pa.table({"input_ids": ids, "labels": ids})
    assert with_labels(whole) is whole  # nothing to fill: the same table


def test_a_text_dataset_trains_with_the_methods_of_rows_only(tmp_path):
    """SFT (lora, full) trains and evaluates on documents; a method of prompts or pairs
    refuses them with the methods that read them."""
    from snaketune.core.errors import ConfigError
    from snaketune.plan.config import validate_config

    docs = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    config = {
        "models": {"m": {"source": "local", "path": str(tmp_path)}},
        "datasets": {"d": {"source": "local", "path": str(docs), "format": "text"},
                     "e": {"source": "local", "path": str(docs), "format": "text"}},
        "runs": {"cpt": {"model": "m", "dataset": "d", "eval_dataset": "e", "method": "full",
                         "nodes": 1, "gpus_per_node": 1, "max_length": 64,
                         "micro_batch_size": 1, "max_steps": 1, "learning_rate": 1e-4}},
    }  # fmt: skip
    run = validate_config(json.loads(json.dumps(config)), Path("."))["runs"]["cpt"]
    assert run["packing"] == "auto"
    config["runs"]["cpt"].update(method="dpo")
    with pytest.raises(ConfigError) as info:
        validate_config(config, Path("."))
    assert "runs.cpt.dataset: 'd' is a text dataset (documents), which only methods" in str(
        info.value
    )


# ----------------------------------------------------------------------------- the pipeline

CPT = {
    "models": {"tiny": {"source": "local", "path": "resources/fixtures/tiny-llama"}},
    "datasets": {
        "corpus": {"source": "local", "path": "train.jsonl", "format": "text",
                   "columns": {"text": "body"}, "parts": 2},
        "corpus_test": {"source": "local", "path": "test.jsonl", "format": "text",
                        "columns": {"text": "body"}},
    },
    "runs": {
        "cpt": {"model": "tiny", "dataset": "corpus", "eval_dataset": "corpus_test",
                "method": "full", "deepspeed": "zero2", "nodes": 2, "gpus_per_node": 1,
                "max_length": 128, "micro_batch_size": 4, "max_steps": 6,
                "learning_rate": 1e-3, "eval": {"batch_size": 8}},
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def cpt(tmp_path_factory) -> Path:
    """Continued pre-training of the tiny Llama (a full fine-tune) on long documents of
    unequal lengths, tokenized in 2 parts, from the schema's defaults (packing: auto), 2
    emulated nodes, to the report."""
    workdir = tmp_path_factory.mktemp("cpt") / "w"
    workdir.mkdir()
    rng = random.Random(0)
    for split, n, sizes in (("train", 96, (1, 2, 3, 5, 8, 30)), ("test", 12, (2, 4, 20))):
        rows = [{"body": sums(rng, rng.choice(sizes))} for _ in range(n)]
        write_jsonl(workdir / f"{split}.jsonl", rows)
    (workdir / "cpt.yaml").write_text(yaml.safe_dump(CPT, sort_keys=False))
    proc = snakemake("--configfile", str(workdir / "cpt.yaml"), "--directory", str(workdir))
    (workdir / "snakemake.out").write_text(proc.stdout + proc.stderr)
    return workdir


@pytest.mark.slow
def test_continued_pretraining_on_documents_is_scored_as_plain_transformers_scores_it(cpt):
    import torch
    from oracles import mean_nll, planned_steps
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from snaketune.core import parts

    results = cpt / "results/cpt"
    (train_set,) = (cpt / "results/tokenized").glob("corpus__*/parts.json")
    (test_set,) = (cpt / "results/tokenized").glob("corpus_test__*/data.parquet")
    tok = AutoTokenizer.from_pretrained(cpt / "resources/fixtures/tiny-llama")
    out = (cpt / "snakemake.out").read_text()
    assert sorted(started(out, "tokenize_part")) == [
        f"key={train_set.parent.name}, part=0000{p}-of-00002" for p in range(2)
    ]
    # the two parts, in order, are the rows one tokenize pass over the corpus writes
    spec = CPT["datasets"]["corpus"] | {"path": str(cpt / "train.jsonl")}
    source = Source("corpus", cpt / "resources/datasets/corpus/data.parquet", spec)
    tokenize([source], cpt / "resources/models/tiny", cpt / "one.parquet", 128)
    stored = pa.concat_tables([pq.read_table(f) for f in parts.files(train_set)])  # as written
    assert stored.equals(pq.read_table(cpt / "one.parquet"))
    # no token of the corpus lost: each document's pieces are its tokens and end-of-text
    raw = [json.loads(x)["body"] for x in (cpt / "train.jsonl").read_text().splitlines()]
    docs = documents_of(parts.read_table(train_set).to_pylist())
    assert len(docs) == len(raw) and any(len(p) > 1 for p in docs.values())
    for i, text in enumerate(raw):
        got = [t for p in docs[f"corpus:{i}"] for t in p]
        assert got == tok(text)["input_ids"] + [tok.eos_token_id]
    # the first step: plain transformers' NLL of every token of the step's rows (both ranks'
    # rows of unequal tokens), each document alone: attention within a document only
    steps = [json.loads(x) for x in (results / "train/metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 7))
    (first,) = planned_steps(results / "shards", 1)
    assert sum(map(len, (r["input_ids"] for r in first[0]))) != sum(
        map(len, (r["input_ids"] for r in first[1]))
    )
    every = [dict(r, labels=r["input_ids"]) for r in first[0] + first[1]]
    base = AutoModelForCausalLM.from_pretrained(cpt / "resources/models/tiny").float().eval()
    assert steps[0]["loss"] == pytest.approx(mean_nll(base, every)[0], rel=1e-4)
    log = (results / "train/logs/attempt-1.log").read_text()
    assert log.count("runs.cpt.packing: auto -> packed") == 1
    # the held-out figures: the exported model's NLL of every token of the tokenized
    # documents, and that in bits over the bytes their predicted tokens decode to
    metrics = json.loads((results / "eval/metrics.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(results / "hf", dtype=torch.float32).eval()
    held = [dict(r, labels=r["input_ids"]) for r in pq.read_table(test_set).to_pylist()]
    loss, count = mean_nll(model, held)
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["response_tokens"] == count
    text_bytes = sum(
        len(tok.decode(r["input_ids"][1:], skip_special_tokens=True).encode()) for r in held
    )
    assert metrics["bits_per_byte"] == pytest.approx(loss * count / math.log(2) / text_bytes)
    assert metrics["format"] == "documents" and metrics["headline"][:2] == ["loss", "bits_per_byte"]
    assert "exact_match" not in metrics  # nothing generated: documents have no prompt
    assert metrics["figures"]["loss"]["base"] > metrics["loss"]  # it learned the sums
    summary = (cpt / "results/summary.tsv").read_text().splitlines()
    header, row = summary[0].split("\t"), summary[1].split("\t")
    assert float(row[header.index("bits_per_byte")]) == pytest.approx(
        metrics["bits_per_byte"], rel=1e-5
    )


# ----------------------------------------------------------------------------- parts


def test_the_parts_of_a_set_cover_every_row_once():
    from snaketune.core.parts import parse_part, part_name, row_range

    for total in (0, 1, 7, 1000, 1001):
        for parts in (1, 2, 3, 8):
            ranges = [row_range(p, parts, total) for p in range(parts)]
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # no gap
            assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1
    assert parse_part(part_name(3, 8)) == (3, 8) == parse_part("00003-of-00008")
    for bad in ("00008-of-00008", "3-of-8", "00001-of-00001x"):
        with pytest.raises(Exception, match="not a part"):
            parse_part(bad)


def test_a_set_tokenized_in_parts_is_the_set_tokenized_whole(tmp_path, tiny_model, caplog):
    """Each part reads its own rows (of sources laid end to end, from the row groups that
    hold them): in part order they are the rows one job writes, a mixture's weights and
    filters included, and the parts' stats sum to the whole's; each part's log has its
    own summary (its rows, documents split, tokens)."""
    import dataclasses

    from snaketune.core.parts import summed
    from snaketune.data.conversations import Stats

    rng = random.Random(3)
    docs = [{"text": sums(rng, rng.choice((1, 2, 12))), "lang": rng.choice("ab")}
            for _ in range(90)]  # fmt: skip
    chat = [{"prompt": f"{i} + 1 =", "response": str(i + 1)} for i in range(40)]
    sources = []
    for name, spec, rows, weight in (
        ("corpus", {"format": "text", "filters": [{"column": "lang", "op": "==", "value": "a"}]},
         docs, 1.0),
        ("chat", {"format": "prompt_response"}, chat, 0.5),
    ):  # fmt: skip
        spec = {"source": "local", "path": str(write_jsonl(tmp_path / f"{name}.jsonl", rows)),
                **spec}  # fmt: skip
        data = download_dataset(name, spec, tmp_path / name)
        small = tmp_path / f"{name}-groups.parquet"  # row groups of 16 rows: a part reads some
        pq.write_table(pq.read_table(data), small, row_group_size=16)
        sources.append(Source(name, small, spec, weight, seed=5))
    whole = tokenize(sources, tiny_model, tmp_path / "whole.parquet", 48)
    stats, tables = [], []
    caplog.set_level("INFO", logger="snaketune.data.tokenization")
    for p in range(3):
        out = tmp_path / f"part-{p}.parquet"
        caplog.clear()
        stats.append(dataclasses.asdict(tokenize(sources, tiny_model, out, 48, part=(p, 3))))
        tables.append(pq.read_table(out))
        said = caplog.text
        assert f"part 0000{p}-of-00003: rows " in said
        assert f"-> {stats[-1]['rows']} examples, {stats[-1]['tokens']} tokens" in said, said
        assert f"{stats[-1]['documents_split']} longer than max_length split into pieces" in said
    assert pa.concat_tables(tables).equals(pq.read_table(tmp_path / "whole.parquet"))
    assert all(t.num_rows for t in tables)
    assert summed(stats, Stats) == {
        k: v for k, v in dataclasses.asdict(whole).items() if k != "longest_overlong"
    } | {"longest_overlong": max(s["longest_overlong"] for s in stats)}


@pytest.mark.slow
@pytest.mark.extended
def test_a_corpus_in_parts_is_the_corpus_in_one_job_and_a_killed_part_runs_again_alone(
    cpt, tmp_path
):
    """``parts: 3`` in place of the pipeline's 2: one part killed mid-run, the rerun starts
    that part and the one never started, not the one done, whose file is untouched; the
    three parts' rows are the two parts' of the pipeline above."""
    import os
    import signal
    import subprocess
    import time

    from conftest import BIN, ENV, ROOT

    from snaketune.core import parts

    workdir = tmp_path / "w"
    shutil.copytree(cpt, workdir, symlinks=True, ignore=shutil.ignore_patterns("results"))
    config = yaml.safe_load((workdir / "cpt.yaml").read_text())
    config["datasets"]["corpus"]["parts"] = 3
    (workdir / "cpt3.yaml").write_text(yaml.safe_dump(config))
    args = [str(BIN / "snakemake"), "--snakefile", str(ROOT / "Snakefile"), "--profile",
            str(ROOT / "profiles/local"), "--configfile", str(workdir / "cpt3.yaml"),
            "--directory", str(workdir), "--cores", "1", "--until", "index_parts"]  # fmt: skip
    proc = subprocess.Popen(args, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    # with one core the parts run one after another: the second to start is killed
    deadline, victim, tokenized = time.monotonic() + 300, None, workdir / "results/tokenized"
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        done = list(tokenized.glob("corpus__*/part-*-of-00003.parquet"))
        found = subprocess.run(["pgrep", "-af", "tokenize_dataset.py.*--part"],
                               capture_output=True, text=True).stdout.splitlines()  # fmt: skip
        running = [(int(f.split()[0]), f.split("--part ")[1].split()[0]) for f in found]
        running = [r for r in running if done and f"part-{r[1]}.parquet" != done[0].name]
        victim = running[0] if running else None
        time.sleep(0.05)
    assert victim is not None, "no second part started"
    os.kill(victim[0], signal.SIGKILL)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode != 0, out[-3000:]
    (done,) = done
    assert not done.with_name(f"part-{victim[1]}.parquet").exists()
    before = done.stat().st_mtime_ns
    rerun = snakemake("--configfile", str(workdir / "cpt3.yaml"), "--directory", str(workdir),
                      "--until", "index_parts")  # fmt: skip
    parts_run = started(rerun.stdout + rerun.stderr, "tokenize_part")
    again = sorted(p.split("part=")[1] for p in parts_run)
    assert victim[1] in again and len(again) == 2 and done.name[5:19] not in again
    assert done.stat().st_mtime_ns == before
    index = done.with_name("parts.json")
    assert [p["file"] for p in json.loads(index.read_text())["parts"]] == [
        f"part-0000{p}-of-00003.parquet" for p in range(3)
    ]
    two = cpt / "results/tokenized" / done.parent.name / "parts.json"
    assert parts.read_table(index).equals(parts.read_table(two))


def test_worker_processes_write_the_rows_one_process_writes(tmp_path, tiny_model):
    """A job's threads as worker processes (each its consecutive rows, spawned): the rows
    and the counts of one process."""
    import dataclasses

    rng = random.Random(4)
    rows = [{"text": sums(rng, rng.choice((1, 3, 9)))} for _ in range(60)]
    spec = {"source": "local", "path": str(write_jsonl(tmp_path / "c.jsonl", rows)),
            "format": "text"}  # fmt: skip
    source = Source("c", download_dataset("c", spec, tmp_path / "c"), spec)
    one = tokenize([source], tiny_model, tmp_path / "one.parquet", 40)
    two = tokenize([source], tiny_model, tmp_path / "two.parquet", 40, workers=2, min_rows=10)
    assert pq.read_table(tmp_path / "two.parquet").equals(pq.read_table(tmp_path / "one.parquet"))
    assert dataclasses.asdict(two) == dataclasses.asdict(one)
    assert not list(tmp_path.glob("two.parquet.worker-*"))  # the workers' files removed


def test_status_counts_a_set_s_parts_done_and_running(tmp_path):
    from base64 import urlsafe_b64encode

    from snaketune.app.status import status

    folder = tmp_path / "results/tokenized/corpus__tiny__0123456789ab"
    folder.mkdir(parents=True)
    for p in (0, 2):
        (folder / f"part-0000{p}-of-00003.parquet").write_bytes(b"")
    running = "results/tokenized/corpus__tiny__0123456789ab/part-00001-of-00003.parquet"
    (tmp_path / ".snakemake/incomplete").mkdir(parents=True)
    (tmp_path / ".snakemake/incomplete" / urlsafe_b64encode(running.encode()).decode()).touch()
    (tmp_path / ".snakemake/locks").mkdir()
    assert status(tmp_path) == ["tokenize corpus__tiny__0123456789ab: 2 of 3 parts done, 1 "
                                "interrupted (rerun to redo them)"]  # fmt: skip
    (tmp_path / ".snakemake/locks/0.input.lock").touch()
    assert status(tmp_path) == ["tokenize corpus__tiny__0123456789ab: 2 of 3 parts done, 1 running"]
    (folder / "parts.json").write_text("{}")
    assert status(tmp_path) == [f"no run has started under {tmp_path / 'results'} yet"]


def test_a_tokenize_job_runs_a_worker_per_cpu_of_its_allocation(monkeypatch):
    """On SLURM a profile's cpus_per_task (above the rule's 8 threads) is what the job has;
    elsewhere its threads; never more than the cores it may run on."""
    import os

    from snaketune.core.parts import job_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert job_cores(8) == 8
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "16")
    assert job_cores(8) == 16
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "64")
    assert job_cores(8) == 32
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert job_cores(8) == 1


def test_reading_a_corpus_holds_one_batch_not_every_row_group_read(tmp_path):
    """A source of many row groups read through to its end: the Arrow memory held stays a
    batch's, not the file's (pre-buffered reads kept every row group read until the file
    closed: a million documents grew a tokenize worker to 2 GB)."""
    import gc

    from snaketune.data.conversations import Stats, iter_conversations

    rng = random.Random(0)
    path = tmp_path / "corpus.parquet"
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        for _ in range(120):  # 120 row groups of 100 documents of 2-4 KB: about 36 MB
            docs = [rng.randbytes(rng.randint(1000, 2000)).hex() for _ in range(100)]
            writer.write_table(pa.table({"text": docs}))
    gc.collect()
    base, held = pa.total_allocated_bytes(), []
    for _, items in iter_conversations([Source("c", path, {"format": "text"})], Stats()):
        del items
        held.append(pa.total_allocated_bytes() - base)
    assert len(held) > 10
    assert max(held) < 8 * 2**20, [round(h / 2**20, 1) for h in held]


def _real_corpora() -> dict[str, list[str]]:
    """Corpora of this machine, real text: 80 of Python's own modules in a seeded draw
    (code: long documents), the licence texts Debian ships (long prose works), and both cut
    at blank lines (paragraphs: short documents); each in a seeded order, as a dataset's
    rows are."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    code = [p.read_text(errors="replace") for p in random.Random(3).sample(files, 80)]
    books = [p.read_text(errors="replace") for p in sorted(Path("/usr/share/common-licenses").glob("*"))
             if p.is_file()]  # fmt: skip
    paragraphs = [p.strip() for doc in code[:30] + books for p in doc.split("\n\n") if p.strip()]
    out = {"code": code, "paragraphs": paragraphs}
    if len(books) >= 10:  # Debian's base-files ships them
        out["books"] = books
    for docs in out.values():
        random.Random(7).shuffle(docs)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("corpus", "max_length"), [("code", 512), ("books", 256),
                                                    ("paragraphs", 128)])  # fmt: skip
def test_a_corpus_s_rows_before_tokenization_are_within_10_percent_from_a_sample(
    corpus, max_length, tmp_path, tiny_model
):
    """Before tokenization the plan reads the first part of the source and tokenizes it
    with the run's tokenizer (snaketune.plan.corpus): a long document is several rows. Its
    estimate from a sample of about a fifth of each corpus against the rows the tokenize
    job writes, and its tokens against theirs: within 10% (a document counted as one row was
    16x off on a code corpus)."""
    from snaketune.plan.corpus import sample

    docs = _real_corpora().get(corpus)
    if docs is None:
        pytest.skip("no licence texts on this machine (Debian's base-files)")
    path = write_jsonl(tmp_path / f"{corpus}.jsonl", [{"text": d} for d in docs])
    spec = {"source": "local", "path": str(path), "format": "text"}
    data = download_dataset(corpus, spec, tmp_path / corpus)
    truth = tokenize([Source(corpus, data, spec)], tiny_model, tmp_path / "t.parquet",
                     max_length)  # fmt: skip
    size = sum(len(d.encode()) for d in docs)
    found = sample(path, "text", tiny_model, max_length, limit=size // 5)
    assert not found.whole and found.documents < len(docs)
    estimate = found.rows_for(len(docs))
    error = estimate / truth.rows - 1
    print(f"{corpus}: {len(docs)} documents, {truth.rows} rows at max_length {max_length}; "
          f"estimated {estimate} from {found.read / size:.0%} of it ({error:+.1%})")  # fmt: skip
    assert abs(error) < 0.10, (corpus, max_length, estimate, truth.rows)
    tokens = found.source_tokens() / truth.tokens - 1  # the plan's tokens a step and in all
    print(f"{corpus}: {truth.tokens} tokens, estimated {found.source_tokens():.0f} ({tokens:+.1%})")
    assert abs(tokens) < 0.10, (corpus, found.source_tokens(), truth.tokens)
    if corpus != "paragraphs":  # long works: far more rows than documents
        assert truth.rows > 1.5 * len(docs)
    whole = sample(path, "text", tiny_model, max_length, limit=size + 1)
    assert whole.whole and whole.rows_for(len(docs)) == truth.rows  # the whole: exact


def test_the_plan_counts_a_corpus_s_rows_from_its_sample_then_its_tokenized_set(
    tmp_path, tiny_model
):
    """`snaketune plan` before tokenization: the steps of a text corpus from its sample
    (said so), not a document a row; the tokenized set's count once there is one."""
    from snaketune.budget.cost import steps_of
    from snaketune.plan.config import validate_config

    docs = _real_corpora()["code"][:15]
    path = write_jsonl(tmp_path / "code.jsonl", [{"text": d} for d in docs])
    config = validate_config({
        "models": {"m": {"source": "local", "path": str(tiny_model)}},
        "datasets": {"code": {"source": "local", "path": str(path), "format": "text"}},
        "runs": {"cpt": {"model": "m", "dataset": "code", "method": "full", "max_length": 256,
                         "micro_batch_size": 4, "nodes": 1, "gpus_per_node": 1, "epochs": 1,
                         "learning_rate": 1e-4}},
    }, ROOT_DIR)  # fmt: skip
    s = steps_of(config, "cpt", tmp_path)
    assert s["basis"].startswith("estimated from a sample of ") and "15 documents" in s["basis"]
    spec = config["datasets"]["code"]
    truth = tokenize([Source("code", download_dataset("code", spec, tmp_path / "d"), spec)],
                     tiny_model, tmp_path / "t.parquet", 256)  # fmt: skip
    assert s["examples"] == truth.rows > 3 * len(docs)  # the sample is the whole file here


def test_a_text_eval_set_is_planned_as_its_pieces_at_max_length(tmp_path, tiny_model):
    """An evaluate stage scores a text eval set's rows after its documents are split at
    max_length: before tokenization the plan counts them from a sample, as a training
    corpus's (not a document a row), and with eval.limit at most the limit."""
    from snaketune.budget.evalplan import eval_examples
    from snaketune.plan.config import validate_config

    docs = _real_corpora()["code"][15:22]
    path = write_jsonl(tmp_path / "held.jsonl", [{"text": d} for d in docs[2:]])
    spec = {"source": "local", "path": str(path), "format": "text"}
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": d} for d in docs[:2]])
    run = {"model": "m", "dataset": "train", "eval_dataset": "held", "method": "full",
           "max_length": 256, "micro_batch_size": 4, "nodes": 1, "gpus_per_node": 1,
           "epochs": 1, "learning_rate": 1e-4}  # fmt: skip
    config = validate_config({
        "models": {"m": {"source": "local", "path": str(tiny_model)}},
        "datasets": {"held": spec, "train": {**spec, "path": str(train)}}, "runs": {"cpt": run},
    }, ROOT_DIR)  # fmt: skip
    truth = tokenize([Source("held", download_dataset("held", spec, tmp_path / "d"), spec)],
                     tiny_model, tmp_path / "t.parquet", 256)  # fmt: skip
    assert truth.rows > 3 * 5
    assert eval_examples(config, "cpt", tmp_path) == truth.rows
    config["runs"]["cpt"]["eval"]["limit"] = 7
    assert eval_examples(config, "cpt", tmp_path) == 7
