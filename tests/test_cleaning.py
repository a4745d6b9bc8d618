"""Corpus cleaning (``datasets.<d>.clean``, snaketune.data.cleaning): on a corpus with planted
exact duplicates (case, punctuation and spacing changed), near duplicates (a few words
changed), duplicates across a mixture's sources and held-out passages copied into training
documents, the cleaned set has none of them and keeps every other document (counts exact);
documents' overlapping spans cut instead; chat rows; the checks of the block; and the stage
through the workflow in parts, to the tokenized set, its stats and the report's section.

What each test expects is what it planted, by construction, not what the product computes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import snakemake, started

from snaketune.data import cleaning
from snaketune.data.cleaning import Removed
from snaketune.data.conversations import Source

SETTINGS = {
    "exact": True,
    "near": {"threshold": 0.8, "ngram": 5, "num_perm": 128},
    "decontaminate": {"ngram": 13, "min_words": 8, "action": "remove", "against": []},
}
TEXT = {"source": "local", "format": "text"}


class Planted:
    """A corpus of two sources with what was planted in it, by (source, row)."""

    def __init__(self, seed: int = 0, docs: int = 40):
        rng = random.Random(seed)
        vocab = [f"w{i}" for i in range(5000)]
        self.doc = lambda n=200: " ".join(rng.choice(vocab) for _ in range(n))
        self.heldout = [self.doc(100) for _ in range(10)]
        a = [self.doc() for _ in range(docs)]
        b = [self.doc() for _ in range(docs // 2)]
        self.expected: dict[str, set[tuple[str, int]]] = {"exact": set(), "near": set()}
        self.expected["heldout"] = set()
        # exact duplicates of a's first 6: upper case, commas and double spaces between words
        a += [d.upper().replace(" ", " ,  ") for d in a[:6]]
        self.expected["exact"] |= {("a", docs + i) for i in range(6)}
        # near duplicates of a's next 6: two words of 200 changed (5-gram Jaccard about 0.9)
        for d in a[6:12]:
            words = d.split()
            words[50], words[120] = "changed", "again"
            a.append(" ".join(words))
        self.expected["near"] |= {("a", docs + 6 + i) for i in range(6)}
        # a passage of 20 words of each of 5 held-out rows inside a training document
        for h in self.heldout[:5]:
            a.append(f"{self.doc(80)} {' '.join(h.split()[30:50])} {self.doc(80)}")
        self.expected["heldout"] |= {("a", docs + 12 + i) for i in range(5)}
        # across the mixture's sources: b repeats 3 of a's own documents (case changed)
        b += [d.title() for d in a[20:23]]
        self.expected["exact"] |= {("b", docs // 2 + i) for i in range(3)}
        self.sources = {"a": a, "b": b}

    def removed(self) -> set[tuple[str, int]]:
        return set().union(*self.expected.values())

    def write(self, folder: Path) -> dict[str, Path]:
        paths = {}
        for name, rows in [*self.sources.items(), ("heldout", self.heldout)]:
            paths[name] = folder / f"{name}.parquet"
            pq.write_table(pa.table({"text": rows}), paths[name])
        return paths


def clean(paths: dict[str, Path], tmp: Path, settings: dict, parts: int = 2) -> cleaning.Gather:
    """Signatures of the sources in ``parts`` parts, then the gather, as the stage runs them."""
    from snaketune.core.parts import row_range

    sources = [Source(n, paths[n], TEXT) for n in ("a", "b")]
    heldout = cleaning.held_out([Source("heldout", paths["heldout"], TEXT)], settings)
    total = sum(pq.ParquetFile(s.path).metadata.num_rows for s in sources)
    signed = [tmp / f"sig-{p}.parquet" for p in range(parts)]
    for p, path in enumerate(signed):
        cleaning.signatures(sources, row_range(p, parts, total), settings, heldout, path)
    return cleaning.decide(signed, ["a", "b"], settings)


def test_planted_duplicates_and_leaks_are_removed_and_every_other_row_kept(tmp_path):
    planted = Planted()
    gather = clean(planted.write(tmp_path), tmp_path, SETTINGS)
    removed = gather.removed
    got = {why: set() for why in cleaning.REASONS}
    for source, row, why in zip(removed["source"], removed["row"], removed["reason"], strict=True):
        got[why].add((source, row))
    assert got == planted.expected
    report = gather.counts.report(SETTINGS, None)
    rows = sum(len(r) for r in planted.sources.values())
    assert report["rows"] == rows and report["kept"] == rows - len(planted.removed())
    assert report["removed"] == {k: len(v) for k, v in planted.expected.items()}
    assert report["per_heldout"] == {"heldout": 5}
    # each duplicate names the kept row it repeats: exact ones the very document copied
    of = {(s, r): (os, orow) for s, r, os, orow in zip(removed["source"], removed["row"],
          removed["of_source"], removed["of_row"], strict=True)}  # fmt: skip
    assert of[("a", 40)] == ("a", 0) and of[("b", 20)] == ("a", 20) and of[("a", 46)] == ("a", 6)


def test_the_parts_decide_as_one_job(tmp_path):
    """The rows a part signs are its tokenization's: 1 and 3 parts remove the same rows."""
    planted = Planted(seed=1)
    paths = planted.write(tmp_path)
    one = clean(paths, tmp_path, SETTINGS, parts=1).removed
    three = clean(paths, tmp_path, SETTINGS, parts=3).removed
    assert one == three and set(zip(one["source"], one["row"], strict=True)) == planted.removed()


def test_each_check_can_be_turned_off(tmp_path):
    planted = Planted(seed=2)
    paths = planted.write(tmp_path)
    off = {"exact": False, "near": False, "decontaminate": False}
    assert clean(paths, tmp_path, off).counts.removed == dict.fromkeys(cleaning.REASONS, 0)
    # exact off, near on: an exact duplicate is also a near one (Jaccard 1)
    only_near = clean(paths, tmp_path, {**SETTINGS, "exact": False, "decontaminate": False})
    assert only_near.counts.removed == {
        "heldout": 0, "exact": 0, "near": len(planted.expected["exact"] | planted.expected["near"])
    }  # fmt: skip


def test_a_documents_overlapping_spans_are_cut_and_the_rest_kept(tmp_path):
    """action: spans: the held-out passage inside a document is cut out, the document's text
    on both sides kept, and the tokenize job reads the text left."""
    planted = Planted(seed=3)
    before, after = planted.doc(60), planted.doc(60)
    passage = " ".join(planted.heldout[0].split()[10:40])
    planted.sources["a"][0] = f"{before} {passage} {after}"
    spans = {**SETTINGS, "decontaminate": {**SETTINGS["decontaminate"], "action": "spans"}}
    paths = planted.write(tmp_path)
    gather = clean(paths, tmp_path, spans)
    cut = {(s, r): t for s, r, t in zip(gather.removed["source"], gather.removed["row"],
           gather.removed["text"], strict=True) if t is not None}  # fmt: skip
    assert cut[("a", 0)] == f"{before} {after}"
    assert gather.counts.removed["heldout"] == 0 and gather.counts.per_heldout == {"heldout": 6}
    cleaning.write_removed(gather, tmp_path / "removed.parquet")
    read = Removed.read(tmp_path / "removed.parquet")
    batch = pa.record_batch({"text": planted.sources["a"][:3]})
    edited = read.edited("a", TEXT, batch, [0, 1, 2])
    assert edited.column("text").to_pylist() == [f"{before} {after}", *planted.sources["a"][1:3]]
    assert read.keep("a", [0, 1, 41, 46]).tolist() == [True, True, False, False]


def test_chat_rows_are_compared_by_their_turns(tmp_path):
    """A messages dataset: the same conversation with its case changed is an exact duplicate;
    a tool schema or a system prompt is not text that makes two rows alike."""
    turns = [
        [{"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "Paris is the capital of France."}],
        [{"role": "user", "content": "WHAT is the capital of france"},
         {"role": "assistant", "content": "paris is the capital of France!!"}],
        [{"role": "user", "content": "What is the capital of Spain?"},
         {"role": "assistant", "content": "Madrid is the capital of Spain."}],
    ]  # fmt: skip
    pq.write_table(pa.table({"messages": turns}), tmp_path / "chat.parquet")
    spec = {"source": "local", "format": "messages"}
    settings = {**SETTINGS, "near": False, "decontaminate": False}
    sources = [Source("chat", tmp_path / "chat.parquet", spec)]
    cleaning.signatures(sources, (0, 3), settings, None, tmp_path / "sig.parquet")
    gather = cleaning.decide([tmp_path / "sig.parquet"], ["chat"], settings)
    assert list(zip(gather.removed["row"], gather.removed["reason"], strict=True)) == [(1, "exact")]


def test_the_block_is_checked_before_anything_runs(tmp_path):
    from snaketune.core.errors import ConfigError
    from snaketune.plan.config import validate_config

    config = {
        "models": {"m": {"source": "local", "path": str(tmp_path)}},
        "datasets": {
            "chat": {"source": "local", "path": str(tmp_path), "format": "messages",
                     "clean": {"decontaminate": {"action": "spans", "against": ["nosuch"]}}},
        },
        "runs": {"r": {"model": "m", "dataset": "chat", "method": "lora", "nodes": 1,
                       "gpus_per_node": 1, "max_length": 64, "micro_batch_size": 1,
                       "max_steps": 1, "learning_rate": 1e-4}},
    }  # fmt: skip
    config["datasets"]["mix"] = {"source": "mixture", "mixture": [{"dataset": "chat", "weight": 1}]}
    with pytest.raises(ConfigError) as raised:
        validate_config(config)
    lines = str(raised.value).splitlines()
    assert any("datasets.chat.clean: 'chat' is tokenized inside mixture 'mix', which is not "
               "cleaned; set clean on datasets.mix" in x for x in lines)  # fmt: skip
    assert any("datasets.chat.clean.decontaminate.against: no dataset 'nosuch'" in x for x in lines)
    assert any("action: spans cuts overlapping spans out of documents" in x for x in lines)


def test_the_report_shows_what_cleaning_removed_per_reason_and_held_out_set():
    from snaketune.app.report import cleaning_html

    report = {"rows": 100, "kept": 80, "removed": {"heldout": 5, "exact": 9, "near": 6},
              "per_heldout": {"corpus_test": 5}, "spans_cut": 0}  # fmt: skip
    html = cleaning_html(report)
    for label, n in (
        ("rows read", 100),
        ("kept", 80),
        ("overlapping a held-out set", 5),
        ("exact dup.", 9),
        ("near dup.", 6),
        ("held-out set corpus_test", 5),
    ):
        assert f"{label}</td><td class='num'>{n}</td>" in html  # fmt: skip
    assert cleaning_html(None) == ""


# ----------------------------------------------------------------------- through the workflow


@pytest.mark.slow
def test_the_stage_cleans_a_mixture_in_parts_before_it_is_tokenized(tmp_path):
    """A mixture of two text sources with `clean: {}`, in 2 parts, the run's eval set its
    held-out set: two signature jobs and one gather before the tokenize parts; the tokenized
    set is the planted corpus without what was planted (every other document kept), its
    stats say what cleaning removed, and a rerun with nothing changed runs nothing."""
    from snaketune.core import parts

    planted = Planted(seed=4)
    for name, rows in [*planted.sources.items(), ("heldout", planted.heldout)]:
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"body": r}) + "\n" for r in rows)
        )
    source = {"source": "local", "format": "text", "columns": {"text": "body"}}
    config = {
        "models": {"tiny": {"source": "local", "path": "resources/fixtures/tiny-llama"}},
        "datasets": {
            "a": {**source, "path": "a.jsonl"}, "b": {**source, "path": "b.jsonl"},
            "heldout": {**source, "path": "heldout.jsonl"},
            "mix": {"source": "mixture", "parts": 2, "clean": {},
                    "mixture": [{"dataset": "a", "weight": 1.0}, {"dataset": "b", "weight": 1.0}]},
        },
        "runs": {"cpt": {"model": "tiny", "dataset": "mix", "eval_dataset": "heldout",
                         "method": "full", "nodes": 1, "gpus_per_node": 1, "max_length": 512,
                         "micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-4}},
    }  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    args = ("--configfile", str(tmp_path / "c.yaml"), "--directory", str(tmp_path))
    proc = snakemake(*args, "--until", "index_parts")
    out = proc.stdout + proc.stderr
    (cleaned,) = (tmp_path / "results/cleaned").glob("mix__*")
    assert sorted(started(out, "clean_signatures")) == [
        f"ckey={cleaned.name}, part=0000{p}-of-00002" for p in range(2)
    ]
    assert started(out, "clean_dataset") == [f"ckey={cleaned.name}"]
    (index,) = (tmp_path / "results/tokenized").glob("mix__*/parts.json")
    ids = parts.read_table(index, ["example_id"])["example_id"].to_pylist()
    kept = {(i.split(":")[0], i.split(":")[1].split("#")[0]) for i in ids}  # a piece: <id>#k
    every = {(s, str(r)) for s, rows in planted.sources.items() for r in range(len(rows))}
    assert kept == every - {(s, str(r)) for s, r in planted.removed()}
    stats = json.loads(index.read_text())["stats"]
    assert stats["rows_cleaned_out"] == len(planted.removed())
    assert stats["cleaned"]["removed"] == {k: len(v) for k, v in planted.expected.items()}
    assert stats["cleaned"]["per_heldout"] == {"heldout": 5}
    report = json.loads((cleaned / "report.json").read_text())
    assert report == stats["cleaned"]
    again = snakemake(*args, "--until", "index_parts")
    assert "\n0 jobs" in again.stdout + again.stderr  # nothing changed: nothing runs
    # on to the report (2 steps): the run's section says what cleaning removed, and why
    snakemake(*args)
    page = (tmp_path / "results/summary.html").read_text()
    assert "<h3>Cleaning of its training data</h3>" in page
    for label, n in (
        ("removed: exact dup.", len(planted.expected["exact"])),
        ("removed: near dup.", len(planted.expected["near"])),
        ("overlapping held-out set heldout", 5),
    ):
        assert f"<td>{label}</td><td class='num'>{n}</td>" in page, label  # fmt: skip


def test_the_plan_counts_the_cleanings_time_and_disk(tmp_path):
    """Before anything runs: the cleaning's line among the shared stages (one signature job's
    rows at the measured rate, the parts side by side, then the gather), and its signatures'
    bytes in the run's disk figure; none once its output is there."""
    from snaketune.budget import tokenizeplan as plan
    from snaketune.budget.stagecost import shared_stages
    from snaketune.plan.clean import removed_path
    from snaketune.plan.config import validate_config
    from snaketune.plan.stages import run_tokenize_spec

    rows = 3000
    pq.write_table(
        pa.table({"text": [f"document {i}" for i in range(rows)]}), tmp_path / "c.parquet"
    )
    config = validate_config({
        "models": {"m": {"source": "local", "path": str(tmp_path)}},
        "datasets": {"c": {"source": "local", "path": str(tmp_path / "c.parquet"), "format": "text",
                           "parts": 3, "clean": {"near": {"num_perm": 64}}}},
        "runs": {"r": {"model": "m", "dataset": "c", "method": "full", "nodes": 1,
                       "gpus_per_node": 1, "max_length": 64, "micro_batch_size": 1,
                       "max_steps": 1, "learning_rate": 1e-4}},
    })  # fmt: skip
    (line,) = [(k, v) for k, v in shared_stages(config, {"r": None}, tmp_path).items()
               if k.startswith("clean_dataset ")]  # fmt: skip
    sign, gather = plan.CLEAN_S_PER_ROW["sign"], plan.CLEAN_S_PER_ROW["gather"]
    assert line[1]["s"] == pytest.approx(2 * plan.CLEAN_JOB_START_S + 1000 * sign + 3000 * gather)
    assert "3,000 rows" in line[1]["basis"] and "3 signature job(s)" in line[1]["basis"]
    spec = run_tokenize_spec(config, "r")
    with_clean = plan.token_bytes(config, "r", tmp_path)
    removed = tmp_path / removed_path(spec["clean"])
    removed.parent.mkdir(parents=True)
    removed.write_bytes(b"")
    assert not [k for k in shared_stages(config, {"r": None}, tmp_path) if k.startswith("clean")]
    assert with_clean - plan.token_bytes(config, "r", tmp_path) == rows * (
        plan.SIGNATURE_BYTES + 4 * 64
    )


def test_a_gather_too_large_for_its_job_is_refused_before_queueing():
    """A corpus of 50M documents (its card's size, nothing downloaded): the gather holds
    about 6,700 bytes a row (bench/clean_corpus.py), 312 GiB; a profile's 64,000 MB for rule
    clean_dataset is refused before queueing, naming the rule and the memory to ask."""
    from snaketune.budget import tokenizeplan as plan
    from snaketune.budget.memplan import Shape
    from snaketune.budget.stageplan import stage_memory, stage_plans
    from snaketune.plan.config import validate_config

    rows = 50_000_000
    config = validate_config({
        "models": {"m": {"source": "hub", "id": "org/m"}},
        "datasets": {"web": {"source": "hub", "id": "org/web", "format": "text", "parts": 64,
                             "size": {"rows": rows}, "clean": {}}},
        "runs": {"r": {"model": "m", "dataset": "web", "method": "full", "nodes": 1,
                       "gpus_per_node": 1, "max_length": 64, "micro_batch_size": 1,
                       "max_steps": 1, "learning_rate": 1e-4}},
    })  # fmt: skip
    tiny = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}  # fmt: skip
    plans = stage_plans(config, "r", Shape.from_config(tiny), 79.6)
    gib = plans["clean_dataset"]["cpu_gib"]
    assert gib == pytest.approx(plan.CLEAN_LIBRARIES_GIB + rows * 6_700 / 2**30, abs=0.01)
    (line,) = stage_memory("r", plans, {("clean_dataset", "r"): 64000})
    assert line.startswith("runs.r: its clean_dataset job asks 64000 MB of memory (mem_mb)")
    assert "raise set-resources clean_dataset: mem_mb to at least" in line
    assert stage_memory("r", plans, {("clean_dataset", "r"): 400_000}) == []
    # the queued gather job's memory is read as run r's (its dataset's cleaning)
    from snaketune.budget.checks import Job, planned_run, shared_jobs
    from snaketune.plan.clean import clean_key
    from snaketune.plan.stages import run_tokenize_spec

    key = clean_key(run_tokenize_spec(config, "r")["clean"])
    job = Job("clean_dataset", {"ckey": key}, {"mem_mb": 64000}, local=False)
    assert planned_run(job, shared_jobs(config, [job])) == "r"


def test_a_batchs_rows_are_kept_unless_removed(tmp_path):
    """The tokenize jobs' look-up of removed rows against a plain set, batches of any rows."""
    rng = random.Random(5)
    gone = rng.sample(range(10_000), 700)
    removed = {"source": ["s"] * 700, "row": gone, "reason": ["exact"] * 700, "text": [None] * 700}
    pq.write_table(pa.table(removed), tmp_path / "removed.parquet")
    read, plain = Removed.read(tmp_path / "removed.parquet"), set(gone)
    for lo in range(0, 10_000, 1_024):
        index = list(range(lo, min(lo + 1_024, 10_000)))
        assert read.keep("s", index).tolist() == [i not in plain for i in index]
    assert read.keep("other", [1, 2]).tolist() == [True, True]
