"""Loss masks from the families' real chat templates (tests/templates/, their sources in
SOURCES.md): two-exchange rows with and without reasoning, tokenized by the product, checked
against transformers' own apply_chat_template on the same messages: the last assistant turn
trains exactly what the model writes after the generation prompt (through its end of turn),
each earlier one its content and its end of turn, and no system or user text is trained."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import BIN, ENV, ROOT
from families import FAMILIES, TEMPLATES, build, chat_rows

from snaketune.app.fixtures import make_arith
from snaketune.data.chat import ChatRenderer
from snaketune.data.conversations import Source
from snaketune.data.tokenization import tokenize

SPANS_BY = {"smollm3": "generation", "llama3": "prefix"}  # the rest: "full"
ARITH = make_arith(64, 8)
CORPUS = [f"{r['question']} {r['answer']}" for r in ARITH["train"]] + [
    "Answer with the sum. Add the two numbers."
]


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> Path:
    """Each family's tiny model and its rows, tokenized: <family>.parquet beside it."""
    import pandas as pd

    out = tmp_path_factory.mktemp("families")
    rows = chat_rows(ARITH["train"][:16], reasoning=True)
    pd.DataFrame(rows).to_parquet(out / "chat.parquet")
    (out / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in FAMILIES:
        build(name, CORPUS, out / name)
        source = Source("chat", out / "chat.parquet", {"format": "messages"})
        tokenize([source], out / name, out / f"{name}.parquet", 1024, model_name=name)
    return out


def trained_pieces(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The runs of trained tokens of a row, decoded."""
    pieces, run = [], []
    for token, label in zip(ids, labels, strict=True):
        if label != -100:
            assert label == token
            run.append(token)
        elif run:
            pieces.append(tokenizer.decode(run))
            run = []
    return pieces + ([tokenizer.decode(run)] if run else [])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_familys_template_trains_the_assistant_turns_as_transformers_renders_them(
    families, name
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(families / name)
    rows = [json.loads(line) for line in (families / "chat.jsonl").read_text().splitlines()]
    tokenized = pq.read_table(families / f"{name}.parquet").to_pylist()
    assert len(tokenized) == len(rows)
    special = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    for row, done in zip(rows, tokenized, strict=True):
        messages = row["messages"]
        pieces = trained_pieces(tokenizer, done["input_ids"], done["labels"])
        assert len(pieces) == 2, pieces  # one span per assistant turn
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt = tokenizer.apply_chat_template(
            messages[:-1], tokenize=False, add_generation_prompt=True
        )
        if full.startswith(prompt) and name != "smollm3":  # its marks also train its header
            written = full[len(prompt) :]  # what the model writes, served this prompt
            if name == "glm-4.5":  # closes no turn: the model's stop token is added
                written += "<eos>"
            assert pieces[-1] == written.rstrip("\n"), (pieces[-1], written)
        for piece, message in zip(pieces, messages[2::2], strict=True):
            assert message["content"] in piece
            assert any(piece.rstrip("\n").endswith(t) for t in special), piece  # end of turn
        for message in (m for m in messages if m["role"] != "assistant"):  # system, users
            assert not any(message["content"] in piece for piece in pieces)
    reasoned = [
        p for r in tokenized[:1] for p in trained_pieces(tokenizer, r["input_ids"], r["labels"])
    ]
    if FAMILIES[name].thinking:  # the last turn's reasoning is trained
        assert "Add the two numbers." in reasoned[-1], reasoned
    template = (TEMPLATES / FAMILIES[name].template).read_text()
    assert ChatRenderer(tokenizer, template).spans_by == SPANS_BY.get(name, "full")


def test_marked_templates_use_their_generation_marks(families):
    """A template with {% generation %} marks (TRL's Qwen3.5 training template) trains
    exactly the marked text, as transformers' assistant mask does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(families / "qwen3.5")
    template = (TEMPLATES / "qwen3_5_think_training.jinja").read_text()
    renderer = ChatRenderer(tokenizer, template)
    assert renderer.spans_by == "generation"
    turns = (("user", "2 + 3?"), ("assistant", "5", "add"), ("user", "1 + 1?"), ("assistant", "2"))
    text, spans = renderer.spans(turns)
    messages = [
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "5", "reasoning_content": "add"},
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "2"},
    ]
    out = tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    marked = [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    ours = "".join(text[s:e] for s, e in spans)
    assert tokenizer.decode(marked) == ours
    assert "add" in ours and "2 + 3?" not in ours


def test_validate_shows_a_row_with_its_trained_tokens_marked(families, tmp_path):
    """`snaketune validate --show-row N` prints how the template's masks are made and the
    row with its trained tokens between « and »."""
    config = {
        "models": {"qwen": {"source": "local", "path": str(families / "qwen3.5")}},
        "datasets": {
            "chat": {"source": "local", "path": str(families / "chat.jsonl"), "format": "messages"}
        },
        "runs": {
            "r": {
                "model": "qwen",
                "dataset": "chat",
                "method": "lora",
                "nodes": 1,
                "gpus_per_node": 1,
                "micro_batch_size": 2,
                "learning_rate": 1e-4,
                "max_steps": 2,
                "max_length": 512,
            }
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    proc = subprocess.run(
        [str(BIN / "snaketune"), "validate", str(path), "--show-row", "0"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "models.qwen: assistant tokens found by each assistant message's span" in proc.stderr
    shown = proc.stderr.split("row 0 (trained: « »):\n")[1]
    assert "<|im_start|>assistant\n«#### " in shown  # the earlier turn: its content on
    assert "<think>\n«Add the two numbers.\n</think>\n\n#### " in shown  # the last: reasoning on
    assert "«" not in shown.split("<|im_start|>assistant")[0]  # system and user text off


DATED = {"gpt-oss": "%Y-%m-%d", "llama3": "%d %b %Y", "smollm3": "%d %B %Y"}


@pytest.mark.parametrize("name", list(DATED))
def test_a_template_that_prints_today_renders_a_fixed_day_recorded_in_the_stats(
    families, name, tmp_path
):
    """gpt-oss's, Llama 3's and SmolLM3's templates print today's date (``strftime_now``):
    the rows render 2024-07-26 (or the model's ``template_date``) on any day, the rest as
    transformers renders it today, and the stats say which day."""
    import datetime

    from transformers import AutoTokenizer

    from snaketune.data.chat import TEMPLATE_DATE

    fmt = DATED[name]
    tokenizer = AutoTokenizer.from_pretrained(families / name)
    row = json.loads((families / "chat.jsonl").read_text().splitlines()[0])
    today = datetime.datetime.now().strftime(fmt)
    day = datetime.datetime(2024, 7, 26).strftime(fmt)
    assert TEMPLATE_DATE == "2024-07-26" and today != day
    oracle = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    assert today in oracle
    tokenized = pq.read_table(families / f"{name}.parquet").to_pylist()[0]
    decoded = tokenizer.decode(tokenized["input_ids"])
    assert decoded == tokenizer.decode(tokenizer(oracle.replace(today, day))["input_ids"])
    # another day given: only the date moves, and the stats record it
    source = Source("chat", families / "chat.parquet", {"format": "messages"})
    stats = tokenize([source], families / name, tmp_path / "x.parquet", 1024, model_name=name,
                     template_date="2025-03-04")  # fmt: skip
    assert stats.template_date == "2025-03-04"
    other = pq.read_table(tmp_path / "x.parquet").to_pylist()[0]
    assert tokenizer.decode(other["input_ids"]) == decoded.replace(
        day, datetime.datetime(2025, 3, 4).strftime(fmt)
    )


def test_the_tokenize_job_records_the_day_in_its_provenance(families, tmp_path):
    """The job as the rule runs it: the model's template_date in the spec, the set's
    provenance.json and stats.json say the day its rows were rendered on."""
    spec = {"dataset": "chat", "model": "gpt-oss", "chat_template": None, "max_length": 1024,
            "overlong": "drop", "template_date": "2025-03-04",
            "sources": [{"name": "chat", "spec": {"format": "messages"}, "weight": 1.0,
                         "seed": 0}]}  # fmt: skip
    out = tmp_path / "set/data.parquet"
    subprocess.run(
        [str(BIN / "python"), str(ROOT / "scripts/tokenize_dataset.py"), "--spec",
         json.dumps(spec), "--data", str(families / "chat.parquet"), "--model",
         str(families / "gpt-oss"), "--out", str(out), "--stats", str(out.parent / "stats.json")],
        env=ENV, check=True, capture_output=True,
    )  # fmt: skip
    provenance = json.loads((out.parent / "provenance.json").read_text())
    assert provenance["template_date"] == "2025-03-04"
    assert json.loads((out.parent / "stats.json").read_text())["template_date"] == "2025-03-04"


def test_a_template_without_a_date_records_none(families, tmp_path):
    source = Source("chat", families / "chat.parquet", {"format": "messages"})
    stats = tokenize([source], families / "qwen3.5", tmp_path / "x.parquet", 1024)
    assert stats.template_date is None


def test_a_model_s_template_date_keys_its_sets_and_unset_keeps_the_key_as_before():
    from snaketune.plan.stages import tokenize_key, tokenize_spec

    config = {"models": {"m": {"source": "local", "path": "m"}},
              "datasets": {"d": {"source": "local", "path": "d.jsonl", "format": "messages",
                                 "parts": 1}}}  # fmt: skip
    plain = tokenize_spec(config, "d", "m", 1024, "drop")
    assert "template_date" not in plain
    config["models"]["m"]["template_date"] = "2025-03-04"
    dated = tokenize_spec(config, "d", "m", 1024, "drop")
    assert dated["template_date"] == "2025-03-04"
    assert tokenize_key(dated) != tokenize_key(plain)
