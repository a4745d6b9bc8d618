"""Tokenization: masking per format against transformers' own chat templating, length
policies, filters, mixtures, reproducibility and errors."""

from __future__ import annotations

import csv
import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_jsonl

from snaketune.core.errors import DataError
from snaketune.core.rows import IGNORE_INDEX
from snaketune.data.conversations import Source
from snaketune.data.sources import download_dataset
from snaketune.data.tokenization import tokenize


def oracle(tokenizer, turns: list[tuple[str, str]], template: str | None = None):
    """input_ids and labels computed independently with apply_chat_template."""
    msgs = [{"role": r, "content": c} for r, c in turns]

    def ids_of(messages, gen=False):
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen, chat_template=template
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids = ids_of(msgs)
    labels = [IGNORE_INDEX] * len(ids)
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            start, end = ids_of(msgs[:i], gen=True), ids_of(msgs[: i + 1])
            assert ids[: len(start)] == start and ids[: len(end)] == end  # oracle is sound
            labels[len(start) : len(end)] = ids[len(start) : len(end)]
    return ids, labels


def run_tokenize(
    tmp_path,
    name,
    spec,
    rows_or_file,
    tiny_model,
    max_length=512,
    overlong="drop",
    template=None,
    weight=1.0,
):
    src = (
        rows_or_file
        if isinstance(rows_or_file, Path)
        else write_jsonl(tmp_path / f"{name}.jsonl", rows_or_file)
    )
    spec = {"source": "local", "path": str(src), **spec}
    data = download_dataset(name, spec, tmp_path / name)
    out = tmp_path / f"{name}.tok.parquet"
    stats = tokenize(
        [Source(name, data, spec, weight)], tiny_model, out, max_length, overlong, template
    )
    return pq.read_table(out).to_pylist(), stats


QA = [
    {"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}
    for i in range(20)
]


def check_against_oracle(rows, convs, tokenizer, template=None):
    assert len(rows) == len(convs)
    for row, turns in zip(rows, convs, strict=True):
        ids, labels = oracle(tokenizer, turns, template)
        assert row["input_ids"] == ids
        assert row["labels"] == labels
        assert row["length"] == len(ids)
        assert any(x != IGNORE_INDEX for x in labels)


def test_prompt_response_with_column_mapping(tmp_path, tiny_model, tokenizer):
    spec = {"format": "prompt_response", "columns": {"prompt": "question", "response": "answer"}}
    rows, stats = run_tokenize(tmp_path, "qa", spec, QA, tiny_model)
    convs = [[("user", r["question"]), ("assistant", r["answer"])] for r in QA]
    check_against_oracle(rows, convs, tokenizer)
    assert [r["example_id"] for r in rows] == [f"qa:{i}" for i in range(20)]
    assert stats.rows == 20 and stats.dropped_overlong == 0
    # the labelled tokens are exactly the answer and the end of its turn
    first = rows[0]
    labelled = [
        t for t, lab in zip(first["input_ids"], first["labels"], strict=True) if lab != IGNORE_INDEX
    ]
    assert tokenizer.decode(labelled) == QA[0]["answer"] + "<|im_end|>\n"


def test_csv_prompt_from_two_columns_and_system_prompt(tmp_path, tiny_model, tokenizer):
    path = tmp_path / "code.csv"
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["prompt", "question", "response"])
        for i in range(6):
            w.writerow(
                [f"Write kernel {i}.", f"It should add {i}.", f"__global__ void k{i}() {{}}"]
            )
    spec = {
        "format": "prompt_response",
        "columns": {"prompt": ["prompt", "question"]},
        "system_prompt": "You write CUDA.",
    }
    rows, _ = run_tokenize(tmp_path, "code", spec, path, tiny_model)
    convs = [
        [
            ("system", "You write CUDA."),
            ("user", f"Write kernel {i}.\n\nIt should add {i}."),
            ("assistant", f"__global__ void k{i}() {{}}"),
        ]
        for i in range(6)
    ]
    check_against_oracle(rows, convs, tokenizer)


def test_alpaca_with_and_without_input(tmp_path, tiny_model, tokenizer):
    data = [
        {"instruction": "Add.", "input": "2 and 3", "output": "5"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
        {"instruction": "Count.", "input": None, "output": "1 2 3"},
    ]
    rows, _ = run_tokenize(tmp_path, "alp", {"format": "alpaca"}, data, tiny_model)
    convs = [
        [("user", "Add.\n\n2 and 3"), ("assistant", "5")],
        [("user", "Say hi."), ("assistant", "hi")],
        [("user", "Count."), ("assistant", "1 2 3")],
    ]
    check_against_oracle(rows, convs, tokenizer)


def test_messages_multi_turn_masks_every_non_assistant_turn(tmp_path, tiny_model, tokenizer):
    chats = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": f"a{i}"},
                {"role": "user", "content": "and then?"},
                {"role": "assistant", "content": f"b{i} done"},
            ]
        }
        for i in range(5)
    ]
    rows, _ = run_tokenize(tmp_path, "chat", {"format": "messages"}, chats, tiny_model)
    convs = [[(m["role"], m["content"]) for m in c["messages"]] for c in chats]
    check_against_oracle(rows, convs, tokenizer)
    labelled = [
        t
        for t, lab in zip(rows[0]["input_ids"], rows[0]["labels"], strict=True)
        if lab != IGNORE_INDEX
    ]
    assert tokenizer.decode(labelled) == "a0<|im_end|>\nb0 done<|im_end|>\n"


def test_template_that_transforms_content_uses_jinja_for_every_row(tmp_path, tiny_model, tokenizer):
    trimming = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    data = [
        {"prompt": "  padded  ", "response": " spaced answer \n"},
        {"prompt": "x", "response": "y"},
    ]
    rows, _ = run_tokenize(
        tmp_path, "trim", {"format": "prompt_response"}, data, tiny_model, template=trimming
    )
    convs = [[("user", d["prompt"]), ("assistant", d["response"])] for d in data]
    check_against_oracle(rows, convs, tokenizer, template=trimming)


def test_parquet_input(tmp_path, tiny_model, tokenizer):
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.Table.from_pylist(QA), path)
    spec = {"format": "prompt_response", "columns": {"prompt": "question", "response": "answer"}}
    rows, _ = run_tokenize(tmp_path, "pq", spec, path, tiny_model)
    check_against_oracle(
        rows, [[("user", r["question"]), ("assistant", r["answer"])] for r in QA], tokenizer
    )


LONG = [
    {"prompt": "p " * 5, "response": "r " * 5},
    {"prompt": "p " * 5, "response": "r " * 100},
    {"prompt": "p " * 200, "response": "r"},
]


def test_overlong_drop(tmp_path, tiny_model):
    rows, stats = run_tokenize(
        tmp_path, "long", {"format": "prompt_response"}, LONG, tiny_model, max_length=64
    )
    assert [r["example_id"] for r in rows] == ["long:0"]
    assert stats.dropped_overlong == 2 and stats.truncated == 0


def test_overlong_truncate(tmp_path, tiny_model):
    rows, stats = run_tokenize(
        tmp_path,
        "long",
        {"format": "prompt_response"},
        LONG,
        tiny_model,
        max_length=64,
        overlong="truncate",
    )
    assert [r["example_id"] for r in rows] == ["long:0", "long:1"]
    assert rows[1]["length"] == 64 and len(rows[1]["labels"]) == 64
    assert stats.truncated == 2 and stats.dropped_no_response == 1  # row 2: only prompt fits


def test_filters_and_mixture_weights(tmp_path, tiny_model):
    data = [
        {"prompt": f"p{i}", "response": f"r{i}", "language": "Cuda" if i % 2 else "C"}
        for i in range(40)
    ]
    src = write_jsonl(tmp_path / "mix.jsonl", data)
    spec = {
        "source": "local",
        "path": str(src),
        "format": "prompt_response",
        "filters": [{"column": "language", "op": "==", "value": "Cuda"}],
    }
    parquet = download_dataset("cu", spec, tmp_path / "cu")
    out = tmp_path / "o.parquet"
    stats = tokenize(
        [Source("cu", parquet, spec, 2.0), Source("cu", parquet, spec, 0.5, seed=3)],
        tiny_model,
        out,
        512,
    )
    ids = pq.read_table(out).column("example_id").to_pylist()
    odd = range(1, 40, 2)  # the rows that pass the filter
    assert ids[:40] == [x for i in odd for x in (f"cu:{i}", f"cu:{i}:1")]  # weight 2: twice
    # weight 0.5: a seeded half of the 40 raw rows (before the filter), each at most once.
    # Expected from the documented draw, written out here (not multiplicity() itself): 20
    # rows drawn without replacement by numpy's default_rng seeded with the first 8 bytes
    # (little-endian) of sha256("<seed>:<dataset>")
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(b"3:cu").digest()[:8], "little"))
    drawn = set(rng.choice(40, size=20, replace=False).tolist())
    assert ids[40:] == [f"cu:{i}" for i in odd if i in drawn]
    assert 5 <= len(ids[40:]) <= 15 and len(set(ids[40:])) == len(ids[40:])
    again = tokenize([Source("cu", parquet, spec, 0.5, seed=3)], tiny_model,
                     tmp_path / "again.parquet", 512)  # fmt: skip
    assert pq.read_table(tmp_path / "again.parquet").column("example_id").to_pylist() == ids[40:]
    assert again.rows == len(ids) - 40
    other = tokenize([Source("cu", parquet, spec, 0.5, seed=4)], tiny_model,
                     tmp_path / "other.parquet", 512)  # fmt: skip
    assert pq.read_table(tmp_path / "other.parquet").column("example_id").to_pylist() != ids[40:]
    assert other.rows_read == 40
    assert stats.rows_read == 80 and stats.rows_filtered_out == 40 and stats.rows_repeated == 20
    assert stats.rows == len(ids)


def test_output_is_identical_across_runs(tmp_path, tiny_model):
    spec = {"format": "prompt_response", "columns": {"prompt": "question", "response": "answer"}}
    for d in "ab":
        (tmp_path / d).mkdir()
        run_tokenize(tmp_path / d, "qa", spec, QA, tiny_model)
    digests = {
        hashlib.sha256((tmp_path / d / "qa.tok.parquet").read_bytes()).hexdigest() for d in "ab"
    }
    assert len(digests) == 1


@pytest.mark.parametrize(
    ("spec", "data", "message"),
    [
        (
            {"format": "prompt_response"},
            QA,
            "datasets.bad: columns 'prompt', 'response' not found (columns: question, answer)",
        ),
        (
            {"format": "prompt_response"},
            [{"prompt": "p", "response": None}],
            "datasets.bad row 0: column 'response' is null",
        ),
        (
            {"format": "messages"},
            [{"messages": [{"role": "robot", "content": "x"}]}],
            "datasets.bad row 0: each turn needs role system, user, assistant or tool",
        ),
        (
            {"format": "messages"},
            [{"messages": [{"role": "user", "content": "x"}]}],
            "datasets.bad row 0: no assistant turn to learn from",
        ),
        (
            {
                "format": "prompt_response",
                "filters": [{"column": "prompt", "op": "==", "value": "zzz"}],
            },
            [{"prompt": "p", "response": "r"}],
            "no example left after tokenizing: 1 rows read, 1 filtered out",
        ),
    ],
)
def test_bad_data_fails_with_a_clear_line(tmp_path, tiny_model, spec, data, message):
    with pytest.raises(DataError) as info:
        run_tokenize(tmp_path, "bad", spec, data, tiny_model)
    assert str(info.value).startswith(message), str(info.value)
