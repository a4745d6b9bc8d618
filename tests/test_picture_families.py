"""Pictures with the families users fine-tune now: Qwen3.5 and Gemma 4 at tiny size (tests/
families.py: transformers' own config classes, their Hub chat templates, their processors'
classes and their tokenizers' picture tokens), not only the Gemma 3 of tests/pictures.py.

Their processors take a video processor whose class needs torchvision, which has no CPU
build on these machines: here each processor is made without it (``no_video_check``: the
picture path never reads it) and handed to the tokenize job and the collator in place of
the one ``AutoProcessor`` would load; on a GPU machine (torchvision there: ``-m gpu``,
which bench/gpu_check.py runs) the whole processor is saved beside the model and loaded as a
user's job loads it. Either way: every tokenized row is the processor's own tokens of the
conversation with its picture, the labelled tokens are the ones the same conversation
trains without its picture, the collator's picture inputs are the processor's own, and the
model takes them.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from families import build, no_video_check, processor
from pictures import COLOURS, QUESTION, picture

FAMILIES = ("qwen3.5", "gemma4")
CORPUS = [f"{QUESTION} The shape is {c}." for c in COLOURS] * 8


def picture_rows(out):
    """Three picture questions (answers of unequal lengths), their PNGs beside the file."""
    import random

    rng = random.Random(3)
    rows = []
    for i, colour in enumerate(("red", "green", "yellow")):
        (out / f"p{i}.png").write_bytes(picture(colour, rng))
        user = [{"type": "image"}, {"type": "text", "text": QUESTION}]
        rows.append({"messages": [{"role": "user", "content": user},
                                  {"role": "assistant",
                                   "content": [{"type": "text", "text": colour}]}],
                     "images": [f"p{i}.png"]})  # fmt: skip
    return rows


def tokenized(rows, model_dir, out, images: bool):
    """The rows through the tokenize job's code (with their pictures, or as text rows
    without them); its rows."""
    from snaketune.data.conversations import Source
    from snaketune.data.tokenization import tokenize

    if not images:
        rows = [{"messages": [{"role": m["role"], "content": m["content"][-1]["text"]}
                              for m in r["messages"]]} for r in rows]  # fmt: skip
    data = out / f"{'pics' if images else 'text'}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    columns = {"images": "images"} if images else {}
    spec = {"source": "local", "path": str(data), "format": "messages", "columns": columns}
    result = out / f"tokenized-{images}.parquet"
    tokenize([Source("pics", data, spec)], model_dir, result, 4096, model_name="m")
    return pq.read_table(result).to_pylist()


def check_family(name, model_dir, proc, tmp_path, device="cpu"):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from snaketune.data.pictures import PictureCollator

    rows = picture_rows(tmp_path)
    ours = tokenized(rows, model_dir, tmp_path, images=True)
    text = tokenized(rows, model_dir, tmp_path, images=False)
    assert len(ours) == len(rows) == len(text)
    for r, row, plain in zip(rows, ours, text, strict=True):
        img = Image.open(tmp_path / r["images"][0]).convert("RGB")
        want = proc(text=[proc.apply_chat_template(r["messages"])], images=[[img]],
                    add_special_tokens=False)["input_ids"][0]  # fmt: skip
        assert row["input_ids"] == list(want), name
        trained = [t for t, label in zip(row["input_ids"], row["labels"], strict=True)
                   if label != -100]  # fmt: skip
        assert trained and trained == [t for t in plain["labels"] if t != -100], name
    tok = AutoTokenizer.from_pretrained(model_dir)
    collator = PictureCollator(tok.pad_token_id, 4096, None, tok)
    batch = collator(ours[:1])
    img = Image.open(tmp_path / rows[0]["images"][0]).convert("RGB")
    own = proc(text=[proc.apply_chat_template(rows[0]["messages"])], images=[[img]],
               add_special_tokens=False, return_tensors="pt")  # fmt: skip
    for key, value in own.items():
        if key not in ("input_ids", "attention_mask"):
            assert key in batch and torch.equal(batch[key], value), (name, key)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).to(device)
    inputs = {k: v.to(device) for k, v in batch.items() if k not in ("position_ids",)}
    loss = model(**inputs).loss
    assert torch.isfinite(loss), name
    loss.backward()  # the pictures reach the trained weights
    grads = [
        p.grad for n, p in model.named_parameters() if "language_model" in n and p.grad is not None
    ]
    assert grads and any(g.abs().sum() > 0 for g in grads), name


@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_s_picture_rows_are_its_processors_tokens_and_inputs(name, tmp_path, monkeypatch):
    """Qwen3.5 and Gemma 4 on this CPU: their processors made without the video part."""
    from snaketune.data import pictures

    model_dir = build(name, CORPUS, tmp_path / name)
    no_video_check(monkeypatch)
    proc = processor(name, model_dir, video=False)
    monkeypatch.setattr(pictures, "processor_of", lambda _dir: proc)
    check_family(name, model_dir, proc, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_s_whole_processor_loads_and_trains_on_a_gpu(name, tmp_path):
    """On a GPU machine (torchvision there): the whole processor, video part included, saved
    beside the model and loaded by the product as a user's job loads it (AutoProcessor)."""
    model_dir = build(name, CORPUS, tmp_path / name)
    processor(name, model_dir, video=True).save_pretrained(model_dir)
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(model_dir)
    assert json.loads((model_dir / "config.json").read_text())["model_type"] in (
        "qwen3_5",
        "gemma4",
    )
    check_family(name, model_dir, proc, tmp_path, device="cuda")
