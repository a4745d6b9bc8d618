"""A picture row's pieces at their edges (snaketune.data.pictures; quick): a picture's
bytes from each form a row gives, a message's parts, a row's turns and its pictures, the
labels carried onto the processor's tokens, the length policy, the example's hash, the
tokenize pass's counts. The processor's own tokens are test_pictures.py's."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import failing_load
from pictures import build_vlm, make_picture_data, picture

from snaketune.core.errors import DataError
from snaketune.data import pictures as pics
from snaketune.data.conversations import Source, Stats

PNG = picture("red", random.Random(0))


def test_a_pictures_bytes_come_from_each_form_a_row_gives(tmp_path, monkeypatch):
    (tmp_path / "a.png").write_bytes(PNG)
    (tmp_path / "bad.png").write_bytes(b"not a picture")
    assert pics.picture_bytes({"bytes": PNG, "path": "ignored.png"}, tmp_path, "w") == PNG
    assert pics.picture_bytes({"bytes": None, "path": "a.png"}, tmp_path, "w") == PNG
    assert pics.picture_bytes(str(tmp_path / "a.png"), tmp_path / "elsewhere", "w") == PNG
    monkeypatch.chdir(tmp_path)
    assert pics.picture_bytes("a.png", None, "w") == PNG  # no folder given: from here
    for value in ("", {"bytes": None, "path": ""}, 5, None):
        with pytest.raises(
            DataError, match=r"^w is .*, not a picture \(\{bytes, path\} or a path\)"
        ):
            pics.picture_bytes(value, tmp_path, "w")
    with pytest.raises(DataError, match=r"^w: cannot read .*gone\.png \(No such file"):
        pics.picture_bytes("gone.png", tmp_path, "w")
    with pytest.raises(DataError, match="^w does not decode as a picture"):
        pics.picture_bytes("bad.png", tmp_path, "w")


def test_a_messages_parts_are_text_and_image_marks_only():
    assert pics.parts_text("plain", "w") == ("plain", 0)
    parts = [{"type": "image"}, {"type": "text", "text": "what"}, {"type": "image"}]
    assert pics.parts_text(parts, "w") == (f"{pics.MARK}what{pics.MARK}", 2)
    for part in ({"type": "audio"}, {"type": "audio", "text": "x"}, {"type": "video", "text": "x"},
                 {"type": "text", "text": 3}, "text"):  # fmt: skip
        with pytest.raises(DataError, match="^w: a content part must be an image or text"):
            pics.parts_text([part], "w")
    with pytest.raises(DataError, match="^w: content must be text or a list of parts"):
        pics.parts_text({"type": "text"}, "w")


def rows_source(tmp_path, source="local"):
    return Source(
        "p", tmp_path / "train.jsonl", {"source": source, "path": str(tmp_path / "train.jsonl")}
    )


def test_a_rows_turns_and_pictures_are_checked_one_line_each(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}
    said = {"role": "assistant", "content": "red"}
    cols = {"messages": "messages", "images": "images"}

    def read(msgs, images=("a.png",), source="local"):
        data = {"messages": [msgs], "images": [list(images)]}
        return pics.read_row(rows_source(tmp_path, source), (), cols, data, 0, 4)

    got = read([user, said])
    assert tuple(got) == (("user", f"{pics.MARK}q"), ("assistant", "red"))
    assert tuple(got.pictures) == (PNG,)
    bad = [([], "`messages` must be a non-empty list of turns"),
           ("hi", "`messages` must be a non-empty list of turns"),
           (["hi"], "each turn needs role system, user or assistant"),
           ([{"role": "tool", "content": "5"}, said], "each turn needs role system, user"),
           ([{**said, "content": [{"type": "image"}]}], "turn 0: pictures belong in user turns, not assistant"),
           ([user], "no assistant turn to learn from")]  # fmt: skip
    for msgs, line in bad:
        with pytest.raises(DataError, match=f"^datasets.p row 4.*{line}"):
            read(msgs)
    for images, n in (((), 0), (("a.png", "a.png"), 2)):
        with pytest.raises(DataError, match=f"1 image part\\(s\\) in its messages but {n} picture"):
            read([user, said], images)
    with pytest.raises(DataError, match="cannot read a.png"):  # a Hub set names no folder
        read([user, said], source="hub")
    got = read([user, said], source="".join(["lo", "cal"]))  # the source read from a config
    assert tuple(got.pictures) == (PNG,)


def test_a_row_without_the_pictures_column_has_none():
    source = Source("p", "x", {"source": "hub"})
    for i in range(4):
        assert pics.pictures_of(source, "images", {"messages": [[]] * 4}, i, "w", 0) == []


def test_the_labels_carry_where_the_tokens_agree():
    plain, labels = [5, 6, 7, 8], np.array([-100, -100, 7, 8], np.int32)
    full = [5, 90, 90, 90, 6, 7, 8]  # a picture expanded after the first token
    assert pics.carried_labels(plain, labels, full).tolist() == [-100] * 5 + [7, 8]
    assert pics.carried_labels(plain, labels, [5, 90, 6, 9, 8]) is None  # a label changed
    many = [1] * 300 + [2]  # difflib's autojunk would drop the popular token 1, labelled too
    labelled = np.array([-100] * 290 + [1] * 10 + [2], np.int32)
    got = pics.carried_labels(many, labelled, [3, *many])
    assert got.tolist() == [-100] * 291 + [1] * 10 + [2]
    all_labelled = np.array([5, 6], np.int32)
    assert pics.carried_labels([5, 6], all_labelled, [5, 6]).tolist() == [5, 6]


def test_the_length_policy_cuts_after_the_last_picture_or_drops():
    image = {90}
    ids, labels = [1, 90, 90, 2, 3, 4], np.array([-100, -100, -100, -100, 3, 4])
    stats = Stats()
    assert pics._policy("k", ids, labels, image, 6, "drop", stats)[0] == ids  # at the limit: kept
    assert pics._policy("k", ids, labels, image, 5, "truncate", stats)[0] == ids[:5]
    assert (stats.truncated, stats.dropped_overlong) == (1, 0)
    assert pics._policy("k", ids, labels, image, 2, "truncate", stats) is None  # into a picture
    assert pics._policy("k", ids, labels, image, 5, "drop", stats) is None
    error = "".join(["er", "ror"])
    assert pics._policy("key7", ids, labels, image, 5, error, stats) is None
    assert stats.dropped_overlong == 3 and stats.longest_overlong == (6, "key7")
    assert pics._policy("k", ids, labels, image, 4, "truncate", stats) is None  # no response left
    assert stats.dropped_no_response == 1


def test_the_length_policy_at_its_edges():
    """Within the limit: kept with a label, dropped without one (all labelled or none);
    `overlong: error` keeps the first longest row (not a later one as long, not a shorter
    one), the other policies none; a picture past the limit: dropped, not cut."""
    image, stats = {90}, Stats()
    assert pics._policy("k", [1, 2], np.array([1, 2]), image, 8, "drop", stats)[0] == [1, 2]
    assert pics._policy("k", [1, 2], np.array([-100, -100]), image, 8, "drop", stats) is None
    assert stats.dropped_no_response == 1
    error = "".join(["er", "ror"])
    for key, n in (("a", 12), ("b", 12), ("c", 10)):
        pics._policy(key, [1] * n, np.ones(n), image, 8, error, stats)
    assert stats.longest_overlong == (12, "a")
    other = Stats()
    pics._policy("d", [1] * 12, np.ones(12), image, 8, "drop", other)
    assert other.longest_overlong == (0, "")
    ids, labels = [5, 3, 90, 90, 4], np.array([-100, 3, -100, -100, 4])
    assert pics._policy("k", ids, labels, image, 2, "truncate", other) is None
    assert other.dropped_overlong == 2 and other.truncated == 0
    truncate = "".join(["trun", "cate"])  # read from a config
    assert pics._policy("k", [5, 3, 4], np.array([-100, 3, 4]), image, 2, truncate, other)[0] == [
        5,
        3,
    ]


def test_a_rows_tokens_are_the_processors_without_special_tokens_added():
    from types import SimpleNamespace

    asked = []

    def tokenizer(text, **kwargs):
        asked.append(kwargs)
        return {"input_ids": [1, 2]}

    def processor(**kwargs):
        asked.append({k: v for k, v in kwargs.items() if k == "add_special_tokens"})
        return {"input_ids": [[3, 4]]}

    processor.tokenizer = tokenizer
    assert pics.expanded(processor, "t", ()) == [1, 2]
    assert pics.expanded(processor, "t", (PNG,)) == [3, 4]
    assert asked == [{"add_special_tokens": False}] * 2
    bare = SimpleNamespace(model_input_names=["pixel_values"])  # no token type ids to make
    assert pics.model_inputs(bare, [[]], None) == {}
    assert pics.inputs_of(None, [], None) == {}


def test_an_examples_hash_holds_its_pictures():
    assert pics.pictured_sha("abc", ()) == "abc"
    blob = "abc" + hashlib.sha256(PNG).hexdigest()
    assert pics.pictured_sha("abc", (PNG,)) == hashlib.sha256(blob.encode()).hexdigest()[:16]


def test_a_processor_that_cannot_load_or_takes_no_pictures_is_one_line(monkeypatch):
    from types import SimpleNamespace

    from transformers import AutoProcessor

    asked = {}
    for n, exc in enumerate((OSError("no files"), ValueError("unknown"))):
        monkeypatch.setattr(AutoProcessor, "from_pretrained", failing_load(exc, asked))
        with pytest.raises(DataError, match=f"^m{n}: no processor to read pictures with"):
            pics.processor_of(f"m{n}")
    assert asked == {"local_files_only": True}
    monkeypatch.setattr(AutoProcessor, "from_pretrained", lambda *a, **k: SimpleNamespace())
    with pytest.raises(DataError, match="^text: its processor takes no pictures"):
        pics.processor_of("text")


def test_a_picture_tokenize_pass_counts_its_rows_and_labels(tmp_path):
    from snaketune.data.tokenization import tokenize

    vlm = tmp_path / "vlm"
    build_vlm(vlm)
    make_picture_data(tmp_path / "pics", train=5, test=1)
    rows = [json.loads(x) for x in (tmp_path / "pics/train.jsonl").read_text().splitlines()]
    data = tmp_path / "pics/train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    spec = {"source": "local", "path": str(data), "format": "messages",
            "columns": {"images": "images"}}  # fmt: skip
    out = tmp_path / "tok.parquet"
    stats = tokenize([Source("p", data, spec)], vlm, out, 256, model_name="vlm")
    made = pq.read_table(out).to_pylist()
    assert stats.conversations == stats.rows == len(made) == 5
    assert stats.label_tokens == sum(sum(t != -100 for t in r["labels"]) for r in made) > 0
    assert stats.tokens == sum(len(r["input_ids"]) for r in made)
    lengths = [len(r["input_ids"]) for r in made]
    i, j = next((i, j) for i in range(5) for j in range(i + 1, 5) if lengths[j] < lengths[i])
    stats = tokenize([Source("p", data, spec)], vlm, out, lengths[j], model_name="vlm")
    kept = [r["example_id"] for r in pq.read_table(out).to_pylist()]
    assert kept == [f"p:{k}" for k in range(5) if lengths[k] <= lengths[j]]  # after a drop too
