"""Vision-language fine-tuning: picture questions (TRL's layout, tests/pictures.py) through
every stage with a tiny Gemma 3 (its own processor and Hub template): tokenize with the
processor, shards carrying the pictures, LoRA on 2 emulated nodes, conversion, merge,
evaluation and the report; each figure checked against plain transformers on the raw rows.
Bad pictures are named by row and column before anything trains (quick tier)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import BIN, ENV, ROOT, read_jsonl, snakemake
from miniature import miniature
from pictures import build_vlm, make_picture_data, make_picture_pairs

RUN = {
    "model": "vlm",
    "dataset": "pics",
    "eval_dataset": "pics_test",
    "method": "lora",
    "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
    "deepspeed": "zero2",
    "nodes": 2,
    "gpus_per_node": 1,
    "max_length": 128,
    "micro_batch_size": 8,
    "max_steps": 12,
    "learning_rate": 5.0e-3,
    "save_steps": 6,
    "eval": {"max_new_tokens": 4, "batch_size": 16},
}


def picture_config(runs: dict | None = None) -> dict:
    """The fixtures as a config: the tiny VLM, the picture sets, the run (packing left to
    the schema: a picture set turns it off)."""
    local = {"source": "local", "format": "messages", "columns": {"images": "images"}}
    return {
        "models": {"vlm": {"source": "local", "path": "resources/vlm"}},
        "datasets": {
            "pics": {**local, "path": "resources/pics/train.jsonl"},
            "pics_test": {**local, "path": "resources/pics/test.jsonl"},
        },
        "runs": runs if runs is not None else {"see": RUN},
    }


def make_workdir(workdir: Path) -> Path:
    build_vlm(workdir / "resources/vlm")
    make_picture_data(workdir / "resources/pics")
    (workdir / "config.yaml").write_text(yaml.safe_dump(picture_config()))
    return workdir


# The Gemma 3 example in miniature (tests/miniature.py): the tiny Gemma 3 and the colour
# questions under the example's names, 2 emulated nodes, 4 steps, 8 eval examples.
EXAMPLE = ROOT / "config/examples/gemma3-4b-vlm-lora-2x4.yaml"
NAME, BASE, TRAIN, TEST = "gemma3_vqa", "gemma3_4b", "llava_mix", "llava_mix_test"
EVALUATED = 8  # the miniature's eval.limit


@pytest.fixture(scope="module")
def picture_pipeline(tmp_path_factory) -> Path:
    """The example in miniature through snakemake on the local profile, to the report."""
    workdir = tmp_path_factory.mktemp("pictures") / "w"
    path = miniature(EXAMPLE, None, workdir)
    proc = snakemake("--configfile", str(path), "--directory", str(workdir))
    (workdir / "snakemake.out").write_text(proc.stdout + proc.stderr)
    return workdir


def raw_rows(workdir: Path, limit: int | None = EVALUATED) -> list[dict]:
    return read_jsonl(workdir / f"data/{TEST}/test.jsonl")[:limit]


def pictures_of(workdir: Path, r: dict, blank: bool = False, data: str = TEST) -> list:
    from PIL import Image

    out = []
    for name in r["images"]:
        img = Image.open(workdir / "data" / data / name).convert("RGB")
        out.append(Image.new("RGB", img.size, (128, 128, 128)) if blank else img)
    return out


def plain_heldout_loss(
    model_dir: Path, workdir: Path, blank: bool = False, limit: int | None = EVALUATED
) -> tuple[float, int]:
    """The held-out loss written out with plain transformers on the raw test rows: the
    model's own processor renders each conversation (its template with the image part) and
    expands its picture; the answer's tokens (what the conversation's render adds after the
    generation prompt's: the answer, <end_of_turn> and the turn's newline) are scored, one
    row at a time."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for r in raw_rows(workdir, limit):
        images = [pictures_of(workdir, r, blank)]
        kw = {"images": images, "return_tensors": "pt", "add_special_tokens": False}
        full = processor(text=[processor.apply_chat_template(r["messages"])], **kw)
        prompt = processor(
            text=[processor.apply_chat_template(r["messages"][:1], add_generation_prompt=True)],
            **kw,
        )["input_ids"][0]
        ids = full["input_ids"][0]
        assert torch.equal(ids[: len(prompt)], prompt)
        with torch.no_grad():
            logits = model(**full).logits[0].double()
        logp = torch.log_softmax(logits[:-1], -1)
        for t in range(len(prompt), len(ids)):
            total -= logp[t - 1, ids[t]].item()
            count += 1
    return total / count, count


@pytest.mark.slow
def test_a_tiny_vlm_trains_on_pictures_and_its_heldout_loss_is_plain_transformers(
    picture_pipeline,
):
    """LoRA on picture questions on 2 emulated nodes reaches evaluation; its held-out loss
    equals the loss written out with plain transformers on the raw rows with the exported
    model and its processor (1e-5), and the pictures reach the model: the evaluation's own
    loss moves when the pictures are blanked."""
    from transformers import AutoModelForImageTextToText

    from snaketune.evaluation.evaluate import heldout_loss, load_examples

    w = picture_pipeline
    out = (w / "snakemake.out").read_text()
    log = (w / f"logs/train/{NAME}.log").read_text()
    assert "x 1 devices x 2 nodes" in log and "padded batches" in log, log[-2000:]
    steps = [m for m in read_jsonl(w / f"results/{NAME}/train/metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 5)) and all(
        math.isfinite(m["loss"]) for m in steps
    )
    metrics = json.loads((w / f"results/{NAME}/eval/metrics.json").read_text())
    merged = w / f"results/{NAME}/merged_model"
    want, tokens = plain_heldout_loss(merged, w)
    assert metrics["loss"] == pytest.approx(want, abs=1e-5), (metrics["loss"], want)
    assert metrics["response_tokens"] == tokens
    assert metrics["base"]["loss"] == pytest.approx(plain_heldout_loss(w / f"models/{BASE}", w)[0],
                                                    abs=1e-5)  # fmt: skip
    # the pictures reach the model: the same rows with blank pictures score otherwise
    tokenized = next((w / "results/tokenized").glob(f"{TEST}__*/data.parquet"))
    rows = load_examples(tokenized, EVALUATED)
    blank = pictures_of(w, raw_rows(w)[0], blank=True)[0]
    import io

    buf = io.BytesIO()
    blank.save(buf, format="PNG")
    blanked = [{**r, "images": [buf.getvalue()]} for r in rows]
    model = AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32).eval()
    pad = 0
    ours = heldout_loss(model, rows, 16, pad)["loss"]
    assert ours == pytest.approx(want, abs=1e-5)
    assert abs(heldout_loss(model, blanked, 16, pad)["loss"] - ours) > 1e-3
    assert plain_heldout_loss(merged, w, blank=True)[0] != pytest.approx(want, abs=1e-3)
    assert f"{NAME}: eval loss" in out
    # the held-out pass while training (eval_steps: before the first step too) scores the
    # pictures as the evaluation does: every test row, the base's loss at step 0
    (start,) = [m for m in read_jsonl(w / f"results/{NAME}/train/metrics.jsonl") if m["step"] == 0]
    base = plain_heldout_loss(w / f"models/{BASE}", w, limit=None)
    assert start["heldout_loss"] == pytest.approx(base[0], abs=1e-5)
    assert start["heldout_response_tokens"] == base[1]


@pytest.mark.slow
def test_the_tokens_are_the_processors_and_only_the_answer_is_trained(picture_pipeline):
    """Each tokenized row is what the model's processor makes of the conversation and its
    picture (the image part expanded into the picture's tokens), its labels exactly what
    the model writes after the generation prompt (the answer, <end_of_turn> and the turn's
    newline: a prefix-stable template's turn); the shards carry each row's picture bytes."""
    from transformers import AutoProcessor

    w = picture_pipeline
    processor = AutoProcessor.from_pretrained(w / f"models/{BASE}")
    tokenized = next((w / "results/tokenized").glob(f"{TRAIN}__*/data.parquet"))
    table = pq.read_table(tokenized).to_pylist()
    raw = read_jsonl(w / f"data/{TRAIN}/train.jsonl")
    assert len(table) == len(raw)
    for got in table[:8]:
        r = raw[int(got["example_id"].split(":")[1])]
        images = [pictures_of(w, r, data=TRAIN)]
        text = processor.apply_chat_template(r["messages"])
        ids = processor(text=[text], images=images, add_special_tokens=False)["input_ids"][0]
        assert got["input_ids"] == list(ids)
        answer = r["messages"][1]["content"][0]["text"]
        trained = [t for t in got["labels"] if t != -100]
        assert (
            "".join(processor.tokenizer.convert_ids_to_tokens(trained))
            == f"{answer}<end_of_turn>\n"
        )
        assert got["labels"][: -len(trained)] == [-100] * (len(got["labels"]) - len(trained))
        assert got["images"] == [(w / f"data/{TRAIN}" / r["images"][0]).read_bytes()]
    shards = [
        pq.read_table(p) for p in sorted((w / f"results/{NAME}/shards").glob("node-*.parquet"))
    ]
    assert len(shards) == 2 and all("images" in s.column_names for s in shards)
    log = (w / f"logs/shard_dataset/{NAME}.log").read_text()
    assert "packing off for picture rows, which are padded, never packed" in log, log
    stats = json.loads(next((w / "results/tokenized").glob(f"{TRAIN}__*/stats.json")).read_text())
    assert stats["pictures"] == len(raw) and stats["image_tokens"] == 6 * len(raw)


@pytest.mark.slow
def test_the_export_is_the_bases_class_with_its_processor_and_generates_from_a_picture(
    picture_pipeline,
):
    """The merged model is Gemma 3's vision-language class with the processor beside it:
    plain transformers loads both and answers a question about a picture."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    w = picture_pipeline
    merged = w / f"results/{NAME}/merged_model"
    config = json.loads((merged / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]
    processor = AutoProcessor.from_pretrained(merged)
    model = AutoModelForImageTextToText.from_pretrained(merged)
    r = raw_rows(w)[0]
    prompt = processor.apply_chat_template(r["messages"][:1], add_generation_prompt=True)
    batch = processor(text=[prompt], images=[pictures_of(w, r)], return_tensors="pt",
                      add_special_tokens=False)  # fmt: skip
    out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > batch["input_ids"].shape[1]
    # LoRA by default left the vision tower and the projector as published; the language
    # model's weights changed
    base = AutoModelForImageTextToText.from_pretrained(w / f"models/{BASE}").state_dict()
    merged_sd = model.state_dict()
    for name, value in base.items():
        same = torch.equal(merged_sd[name], value)
        assert same or "language_model" in name, name
    assert not all(torch.equal(merged_sd[n], v) for n, v in base.items() if "language_model" in n)


@pytest.mark.slow
def test_the_report_shows_each_samples_picture_beside_its_question(picture_pipeline):
    """Each evaluated sample carries its picture, small (a JPEG data URI of at most 96 px a
    side, the same picture: its mean colour within a few levels of the source's), and its
    prompt says a picture's image tokens once with their count; the report shows them."""
    import base64
    import io

    from PIL import Image, ImageStat

    w = picture_pipeline
    samples = read_jsonl(w / f"results/{NAME}/eval/samples.jsonl")
    assert len(samples) == EVALUATED
    for s, r in zip(samples, raw_rows(w), strict=True):
        (uri,) = s["pictures"]
        assert uri.startswith("data:image/jpeg;base64,")
        small = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
        assert max(small.size) <= 96
        source = pictures_of(w, r)[0]
        for got, want in zip(ImageStat.Stat(small).mean, ImageStat.Stat(source).mean, strict=True):
            assert abs(got - want) < 8, (got, want)
        assert "<image_soft_token>×4" in s["prompt"] and "What colour is the shape?" in s["prompt"]
    html = (w / "results/summary.html").read_text()
    assert html.count("<img src='data:image/jpeg;base64,") >= 8


# ----------------------------------------------------------------------------- bad pictures


@pytest.fixture(scope="module")
def bad_workdir(tmp_path_factory) -> Path:
    """The fixtures with a broken picture (the training set's row 2) and a row whose image
    part has no picture (the test set's row 5)."""
    w = make_workdir(tmp_path_factory.mktemp("bad_pictures"))
    (w / "resources/pics/pictures/broken.png").write_bytes(b"\x89PNG\r\n not a picture")
    for split, i, change in (("train", 2, {"images": ["pictures/broken.png"]}),
                             ("test", 5, {"images": []})):  # fmt: skip
        rows = read_jsonl(w / f"resources/pics/{split}.jsonl")
        rows[i].update(change)
        (w / f"resources/pics/{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows)
        )
    return w


def test_a_broken_picture_and_a_missing_one_are_named_by_row_and_column_before_training(
    bad_workdir,
):
    """`snaketune validate` names the broken picture (dataset, row, column, picture) and the
    row whose image parts have no picture, one line each; nothing is written."""
    w = bad_workdir
    proc = subprocess.run([str(BIN / "snaketune"), "validate", str(w / "config.yaml")], cwd=w,
                          env=ENV, capture_output=True, text=True)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert ("datasets.pics row 2: column 'images' picture 0 does not decode as a picture "
            "(cannot identify image file)") in out  # fmt: skip
    assert ("datasets.pics_test row 5: 1 image part(s) in its messages but 0 picture(s) in column "
            "'images'") in out  # fmt: skip
    assert "Traceback" not in out
    assert not (w / "results").exists()


def test_pictures_for_a_method_that_does_not_train_on_them_are_refused(tmp_path):
    """A picture set for DPO or GRPO: the config's check names the dataset and the methods
    that train on pictures."""
    from conftest import ROOT

    from snaketune.core.errors import ConfigError
    from snaketune.plan.config import validate_config

    run = {**RUN, "method": "grpo"}
    with pytest.raises(ConfigError) as info:
        validate_config(picture_config({"see": run}), ROOT)
    assert ("runs.see.dataset: 'pics' holds pictures (columns.images), which method grpo does "
            "not train on; set method: lora or full") in str(info.value)  # fmt: skip
    config = validate_config(picture_config(), ROOT)
    assert config["runs"]["see"]["packing"] is False  # pictures are padded, not packed


@pytest.mark.extended
@pytest.mark.slow
def test_a_full_fine_tune_on_pictures_exports_the_bases_class_and_evaluates(tmp_path):
    """The example as a full fine-tune (every weight, the vision tower's too): it trains on
    2 emulated nodes, converts to the base's class with its processor, and its held-out loss
    is plain transformers' on the raw rows with that export."""
    w = tmp_path / "w"
    path = miniature(EXAMPLE, None, w)
    config = yaml.safe_load(path.read_text())
    run = config["runs"][NAME]
    del run["lora"]
    run.update(method="full", learning_rate=1e-3)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    snakemake("--configfile", str(path), "--directory", str(w))
    export = w / f"results/{NAME}/hf"
    assert json.loads((export / "config.json").read_text())["architectures"] == [
        "Gemma3ForConditionalGeneration"
    ]
    metrics = json.loads((w / f"results/{NAME}/eval/metrics.json").read_text())
    assert metrics["loss"] == pytest.approx(plain_heldout_loss(export, w)[0], abs=1e-5)
    assert metrics["loss"] != pytest.approx(metrics["base"]["loss"], abs=1e-4)  # it trained


@pytest.mark.extended
@pytest.mark.slow
def test_lora_on_the_vision_tower_too_trains_merges_and_evaluates(tmp_path):
    """The example with lora.adapt_vision: the vision tower's linears carry adapters too;
    the merged model's tower differs from the base's, and its held-out loss is plain
    transformers' on the raw rows with that merged model."""
    from transformers import AutoModelForImageTextToText

    w = tmp_path / "w"
    path = miniature(EXAMPLE, None, w)
    config = yaml.safe_load(path.read_text())
    config["runs"][NAME]["lora"]["adapt_vision"] = True
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    snakemake("--configfile", str(path), "--directory", str(w))
    merged = w / f"results/{NAME}/merged_model"
    metrics = json.loads((w / f"results/{NAME}/eval/metrics.json").read_text())
    assert metrics["loss"] == pytest.approx(plain_heldout_loss(merged, w)[0], abs=1e-5)
    base = AutoModelForImageTextToText.from_pretrained(w / f"models/{BASE}").state_dict()
    tuned = AutoModelForImageTextToText.from_pretrained(merged).state_dict()
    tower = [n for n in base if "vision_tower" in n and n.endswith("q_proj.weight")]
    assert tower and not any(torch.equal(base[n], tuned[n]) for n in tower)


def test_a_model_without_a_processor_for_pictures_is_named_before_training(
    tmp_path, fixtures_dir, monkeypatch
):
    """Picture rows tokenized for a text model (the demo's tiny Llama, ChatML): one line
    naming the model and why (its template prints nothing for a picture; the tokenize job
    writes its outputs only once complete)."""
    from snaketune.core.errors import DataError
    from snaketune.data.conversations import Source
    from snaketune.data.tokenization import tokenize

    w = make_workdir(tmp_path)
    monkeypatch.chdir(w)  # where the tokenize job runs: the pictures' paths are from there
    data = w / "resources/pics/train.parquet"
    import pyarrow.json as pj

    pq.write_table(pj.read_json(w / "resources/pics/train.jsonl"), data)
    spec = picture_config()["datasets"]["pics"]
    with pytest.raises(DataError) as info:
        tokenize([Source("pics", data, spec)], fixtures_dir / "tiny-llama", tmp_path / "t.parquet",
                 128, model_name="tiny")  # fmt: skip
    assert str(info.value).startswith(f"{fixtures_dir / 'tiny-llama'}: the chat template "
                                      "prints nothing for an image part")  # fmt: skip


# ----------------------------------------------------------------------------- DPO on pictures

PAIR_RUN = {
    **RUN,
    "dataset": "pp",
    "eval_dataset": "pp_test",
    "method": "dpo",
    "micro_batch_size": 4,
    "max_steps": 4,
    "save_steps": 4,
    "eval": {"max_new_tokens": 4, "batch_size": 8},
}


@pytest.fixture(scope="module")
def picture_dpo(tmp_path_factory) -> Path:
    """DPO (LoRA, the reference precomputed by its stage) on picture pairs in TRL's vision
    preference layout, 2 emulated nodes, through snakemake to the report."""
    w = tmp_path_factory.mktemp("picture-dpo") / "w"
    build_vlm(w / "resources/vlm")
    make_picture_pairs(w / "resources/pairs")
    local = {"source": "local", "format": "preference", "columns": {"images": "images"}}
    config = {
        "models": {"vlm": {"source": "local", "path": "resources/vlm"}},
        "datasets": {
            "pp": {**local, "path": "resources/pairs/train.jsonl"},
            "pp_test": {**local, "path": "resources/pairs/test.jsonl"},
        },
        "runs": {"see": PAIR_RUN},
    }
    (w / "config.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake("--configfile", str(w / "config.yaml"), "--directory", str(w))
    (w / "snakemake.out").write_text(proc.stdout + proc.stderr)
    return w


def plain_pair_logps(model_dir: Path, w: Path, split: str, blank: bool = False) -> list:
    """Each raw pair's summed log-probs of its chosen and its rejected response, written out
    with plain transformers: the processor renders prompt + response with the model's
    template and expands the picture; the response's tokens are what follows the render of
    the prompt with its generation prompt."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for r in read_jsonl(w / f"resources/pairs/{split}.jsonl"):
        img = Image.open(w / "resources/pairs" / r["images"][0]).convert("RGB")
        if blank:
            img = Image.new("RGB", img.size, (128, 128, 128))
        kw = {"images": [[img]], "return_tensors": "pt", "add_special_tokens": False}
        text = processor.apply_chat_template(r["prompt"], add_generation_prompt=True)
        prompt = processor(text=[text], **kw)["input_ids"][0]
        sides = []
        for side in ("chosen", "rejected"):
            full = processor(text=[processor.apply_chat_template(r["prompt"] + r[side])], **kw)
            ids = full["input_ids"][0]
            assert torch.equal(ids[: len(prompt)], prompt)
            with torch.no_grad():
                logp = torch.log_softmax(model(**full).logits[0].double()[:-1], -1)
            sides.append(sum(logp[t - 1, ids[t]].item() for t in range(len(prompt), len(ids))))
        out.append(tuple(sides))
    return out


def assert_pair_tokens(processor, row: dict, r: dict, folder: Path) -> None:
    """A tokenized picture pair ``row`` is the processor's own tokens of raw pair ``r`` (its
    picture under ``folder``) on each side, labelled on the response only: what follows the
    render of the prompt with its generation prompt."""
    from PIL import Image

    img = Image.open(folder / r["images"][0]).convert("RGB")
    kw = {"images": [[img]], "add_special_tokens": False}
    text = processor.apply_chat_template(r["prompt"], add_generation_prompt=True)
    prompt = processor(text=[text], **kw)["input_ids"][0]
    for side, ids, labels in (("chosen", "input_ids", "labels"),
                              ("rejected", "rejected_input_ids", "rejected_labels")):  # fmt: skip
        want = processor(text=[processor.apply_chat_template(r["prompt"] + r[side])], **kw)
        want = list(want["input_ids"][0])
        assert row[ids] == want
        assert row[labels] == [-100] * len(prompt) + want[len(prompt) :]


@pytest.mark.extended
@pytest.mark.slow
def test_dpo_on_picture_pairs_scores_them_as_plain_transformers_does(picture_dpo):
    """DPO on picture pairs on 2 emulated nodes reaches evaluation; every tokenized side is
    the processor's own tokens with only the response labelled; the reference stage's
    log-probs of every training pair and the evaluation's of every held-out pair are plain
    transformers' with the picture (the base's; the merged model's), and blanking the
    pictures moves them (the pictures reach the model); the first step's policy, still the
    reference, gives implicit rewards of 0 (training passes the pictures as the stage did)."""
    from transformers import AutoProcessor

    w = picture_dpo
    tokenized = next((w / "results/tokenized").glob("pp__*/data.parquet"))
    rows = pq.read_table(tokenized).to_pylist()
    raw = {f"pp:{i}": r for i, r in enumerate(read_jsonl(w / "resources/pairs/train.jsonl"))}
    processor = AutoProcessor.from_pretrained(w / "resources/vlm")
    for row in rows[:6]:
        assert_pair_tokens(processor, row, raw[row["example_id"]], w / "resources/pairs")
    assert len(rows) == 48 and all(len(r["images"]) == 1 for r in rows)

    ref = pq.read_table(next((w / "results/reference_logps").glob("*/logps.parquet"))).to_pylist()
    base = plain_pair_logps(w / "resources/vlm", w, "train")
    for r in ref:
        c, j = base[int(r["example_id"].split(":")[1])]
        assert (r["ref_chosen_logps"], r["ref_rejected_logps"]) == (
            pytest.approx(c, abs=1e-4), pytest.approx(j, abs=1e-4)), r  # fmt: skip
    blanked = plain_pair_logps(w / "resources/vlm", w, "test", blank=True)
    seen = plain_pair_logps(w / "resources/vlm", w, "test")
    flat = [(a, b) for x, y in zip(blanked, seen, strict=True) for a, b in zip(x, y, strict=True)]
    assert max(abs(a - b) for a, b in flat) > 1e-3

    steps = [m for m in read_jsonl(w / "results/see/train/metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert steps[0]["reward_chosen"] == pytest.approx(0, abs=1e-5)
    assert steps[0]["reward_rejected"] == pytest.approx(0, abs=1e-5)
    assert steps[-1]["reward_margin"] != pytest.approx(0, abs=1e-5)  # it trained

    merged = w / "results/see/merged_model"
    tuned = plain_pair_logps(merged, w, "test")
    samples = read_jsonl(w / "results/see/eval/samples.jsonl")
    assert len(samples) == 8
    for s in samples:
        c, j = tuned[int(s["example_id"].split(":")[1])]
        assert (s["chosen_logp"], s["rejected_logp"]) == (
            pytest.approx(c, abs=1e-4), pytest.approx(j, abs=1e-4)), s  # fmt: skip
        assert s["pictures"][0].startswith("data:image/jpeg;base64,")
    assert json.loads((merged / "config.json").read_text())["architectures"] == [
        "Gemma3ForConditionalGeneration"
    ]
    assert "see: preference_accuracy" in (w / "snakemake.out").read_text()


def test_a_picture_pair_batch_and_its_reference_log_probs_are_plain_transformers(tmp_path):
    """Picture pairs through the tokenize job's code (each side the processor's own tokens,
    only the response labelled), the reference stage's worker (its log-probs of each side)
    and the DPO stage's collator (its data, the reference read back) scored by the model:
    each side's summed log-prob is plain transformers' with the prompt's picture, the
    rejected side's too; blanked pictures move them (the pictures reach the model). Quick:
    the pipeline's test is extended."""
    import datasets
    from transformers import AutoProcessor, AutoTokenizer

    from snaketune.data.conversations import Source
    from snaketune.data.tokenization import tokenize
    from snaketune.evaluation.logps import compute_parts, load_scorer, merge, sequence_logps
    from snaketune.methods import dpo
    from snaketune.methods.common import RankRows

    w, vlm = tmp_path, tmp_path / "resources/vlm"
    build_vlm(vlm)
    make_picture_pairs(w / "resources/pairs", train=5, test=2)
    raw = read_jsonl(w / "resources/pairs/train.jsonl")
    data = w / "resources/pairs/train.parquet"  # the download's form, beside its pictures
    pq.write_table(pa.Table.from_pylist(raw), data)
    spec = {"source": "local", "path": str(data), "format": "preference",
            "columns": {"images": "images"}}  # fmt: skip
    tokenized = w / "tokenized.parquet"
    tokenize([Source("pp", data, spec)], vlm, tokenized, 128, model_name="vlm")
    rows = pq.read_table(tokenized).to_pylist()
    assert [r["example_id"] for r in rows] == [f"pp:{i}" for i in range(5)]

    processor = AutoProcessor.from_pretrained(vlm)
    for row, r in zip(rows, raw, strict=True):
        assert_pair_tokens(processor, row, r, w / "resources/pairs")

    plain = plain_pair_logps(vlm, w, "train")
    blank = plain_pair_logps(vlm, w, "train", blank=True)
    assert max(abs(a - b) for x, y in zip(plain, blank, strict=True)
               for a, b in zip(x, y, strict=True)) > 1e-3  # fmt: skip

    parts = w / "parts"
    assert compute_parts(tokenized, vlm, parts, 0, 1, 3, "fp32", "sdpa", chunk_pairs=4) == 2
    ref = merge(tokenized, parts, w / "logps.parquet", chunk_pairs=4).to_pylist()
    for r, (c, j) in zip(ref, plain, strict=True):
        assert (r["ref_chosen_logps"], r["ref_rejected_logps"]) == (
            pytest.approx(c, abs=1e-4), pytest.approx(j, abs=1e-4)), r  # fmt: skip

    run = {"dpo": {"reference": "precomputed"}}
    table = datasets.Dataset.from_list(rows)  # a rank's rows, as the train stage reads them
    made = dpo.data(RankRows(run, table, None, AutoTokenizer.from_pretrained(vlm), "padded", None,
                             {"reference_logps": str(w / "logps.parquet")}))  # fmt: skip
    batch = made.collator(rows[1:4])
    sides = [len(r[k]) for r in rows[1:4] for k in ("input_ids", "rejected_input_ids")]
    assert len(batch["input_ids"]) == 6 and len(set(sides)) > 1  # sides padded to one length
    assert batch["ref_rejected_logps"].tolist() == [r["ref_rejected_logps"] for r in ref[1:4]]
    model = load_scorer(vlm, "fp32", "sdpa", "cpu")
    chosen, rejected = sequence_logps(model, batch)
    for c, j, (pc, pj) in zip(chosen.tolist(), rejected.tolist(), plain[1:4], strict=True):
        assert (c, j) == (pytest.approx(pc, abs=1e-4), pytest.approx(pj, abs=1e-4))


def test_picture_pairs_for_a_pair_method_other_than_dpo_are_refused():
    """KTO reads preference sets too, but not their pictures: refused, naming DPO."""
    from snaketune.core.errors import ConfigError
    from snaketune.plan.config import validate_config

    local = {"source": "local", "format": "preference", "columns": {"images": "images"}}
    config = {
        "models": {"vlm": {"source": "local", "path": "resources/vlm"}},
        "datasets": {"pp": {**local, "path": "resources/pairs/train.jsonl"}},
        "runs": {"see": {**PAIR_RUN, "method": "kto", "eval_dataset": None}},
    }
    del config["runs"]["see"]["eval_dataset"]
    with pytest.raises(ConfigError) as info:
        validate_config(config, ROOT)
    assert ("runs.see.dataset: 'pp' holds pictures (columns.images), which method kto does "
            "not train on; set method: dpo") in str(info.value)  # fmt: skip


def test_lora_adapts_the_language_model_alone_unless_adapt_vision_says_so(tmp_path):
    """The adapters of `all-linear` go on the language model's linears; with
    lora.adapt_vision the vision tower's linears too (never the output layer); the plan's
    trainable parameters equal peft's count either way."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from snaketune.budget.modelcount import shape_of
    from snaketune.core.lora_targets import exact_targets, resolve

    base = AutoModelForImageTextToText.from_pretrained(build_vlm(tmp_path / "vlm"))
    cfg = json.loads((tmp_path / "vlm/config.json").read_text())
    for vision in (False, True):
        lora = {"r": 4, "alpha": 8, "target_modules": "all-linear", "adapt_vision": vision}
        targets = resolve(base, lora)["target_modules"]
        assert any("vision_tower" in t for t in targets) is vision, targets
        assert all("language_model" in t or "vision_tower" in t for t in targets), targets
        with exact_targets():
            model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8,
                                                                   target_modules=targets))  # fmt: skip
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        tower = sum(p.numel() for n, p in model.named_parameters()
                    if p.requires_grad and "vision_tower" in n)  # fmt: skip
        assert (tower > 0) is vision
        planned = shape_of(cfg).lora_params(4, "all-linear", (), False, vision)
        assert planned == trainable, (vision, planned, trainable)


def test_the_disk_plan_counts_the_pictures_the_tokenized_files_and_shards_will_hold(
    tmp_path, monkeypatch
):
    """A local picture set, downloaded: its pictures (the files its rows name, summed here
    from the folder) count once for the training set's tokenized file, once for its shards
    and once for the held-out set's tokenized file, each until it is written (this run's
    own set: a set of the same dataset for another model, whose name starts like it, or at
    another max_length, is not it; nor is a set in parts not all written); a text run
    counts none."""
    import pyarrow as pa

    from snaketune.budget.diskplan import format_disk
    from snaketune.budget.pictureplan import picture_bytes
    from snaketune.plan.config import validate_config
    from snaketune.plan.stages import tokenized

    w = tmp_path
    make_picture_data(w / "resources/pics")
    monkeypatch.chdir(w)
    config = validate_config(picture_config(), ROOT)
    raw = {}
    for name, split in (("pics", "train"), ("pics_test", "test")):
        rows = [
            json.loads(x) for x in (w / f"resources/pics/{split}.jsonl").read_text().splitlines()
        ]
        out = w / f"resources/datasets/{name}/data.parquet"
        out.parent.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows), out)
        files = sum(
            p.stat().st_size for p in (w / "resources/pics/pictures").glob(f"{split}-*.png")
        )
        raw[name] = out.stat().st_size + files
    assert picture_bytes(config, "see", w) == pytest.approx(2 * raw["pics"] + raw["pics_test"])
    (w / "results/see/shards").mkdir(parents=True)
    assert picture_bytes(config, "see", w) == pytest.approx(raw["pics"] + raw["pics_test"])
    for neighbour in ("pics__vlm__big__0123", "pics__vlm__4567"):  # model vlm__big; max_length
        (w / "results/tokenized" / neighbour).mkdir(parents=True)
        pq.write_table(
            pa.table({"length": [1]}), w / "results/tokenized" / neighbour / "data.parquet"
        )
    assert picture_bytes(config, "see", w) == pytest.approx(raw["pics"] + raw["pics_test"])
    own = w / tokenized(config, "see")
    own.parent.mkdir(parents=True)
    pq.write_table(pa.table({"length": [1]}), own)
    assert picture_bytes(config, "see", w) == pytest.approx(raw["pics_test"])
    text = {**config, "datasets": {k: {**v, "columns": {}} for k, v in config["datasets"].items()}}
    assert picture_bytes(text, "see", tmp_path / "nothing") == 0
    plan = {"need_bytes": {"total": 3 * 2**30, "checkpoint": 1, "checkpoints": 1, "final": 1,
                           "exports": 1, "pictures": 2**30},
            "path": "/x", "free_bytes": 2**40, "held_bytes": 0, "save_total_limit": 2,
            "optimizer": "last", "fits": True}  # fmt: skip
    assert "; pictures in tokenized data and shards 1.00 GiB)" in format_disk("see", plan)


@pytest.mark.slow
def test_the_disk_plans_pictures_are_what_tokenize_and_shard_wrote(picture_pipeline):
    """What the disk plan counts for the training set's pictures, once per file (its
    downloaded parquet and the pictures its rows name), against the tokenized file and the
    shards the pipeline wrote: each within 25% (the files hold the tokens too)."""
    from snaketune.budget.pictureplan import downloaded_bytes

    w = picture_pipeline
    config = yaml.safe_load((w / "config.yaml").read_text())
    planned = downloaded_bytes(config, TRAIN, w)
    tokenized = next((w / "results/tokenized").glob(f"{TRAIN}__*/data.parquet")).stat().st_size
    shards = sum(p.stat().st_size for p in (w / f"results/{NAME}/shards").glob("*.parquet"))
    assert tokenized == pytest.approx(planned, rel=0.25), (planned, tokenized)
    assert shards == pytest.approx(planned, rel=0.25), (planned, shards)


def test_adapt_vision_left_at_its_default_changes_no_run_s_settings():
    """lora.adapt_vision came after runs were trained: at its default it is not in the
    train job's settings (no LoRA run retrains for it); set, it is."""
    import copy

    from snaketune.plan.config import validate_config
    from snaketune.plan.trainjob import train_spec

    run = validate_config(picture_config(), ROOT)["runs"]["see"]
    assert run["lora"]["adapt_vision"] is False
    assert "adapt_vision" not in train_spec(run)
    on = copy.deepcopy(run)
    on["lora"]["adapt_vision"] = True
    assert json.loads(train_spec(on))["lora"]["adapt_vision"] is True


def test_picture_pairs_at_the_length_limit_and_their_bad_rows(tmp_path):
    """The tokenize job's picture pairs at the edges (quick): the image tokens counted are
    the chosen sides' own; at a limit some pairs pass, a pair over it is dropped and the
    pairs after it are kept; truncation cuts a side only after its last image token (below
    it, the pair is dropped); a picture in a response, or in an assistant turn, is refused;
    the trainer's table is handed without the pictures."""
    from transformers import AutoProcessor

    from snaketune.core.errors import DataError
    from snaketune.data import picture_pairs, pictures
    from snaketune.data.conversations import Source
    from snaketune.data.tokenization import tokenize

    vlm = tmp_path / "vlm"
    build_vlm(vlm)
    make_picture_pairs(tmp_path / "pairs", train=6, test=1)
    raw = read_jsonl(tmp_path / "pairs/train.jsonl")
    image = set(pictures.image_ids_of(AutoProcessor.from_pretrained(vlm)))

    def run(rows, limit, overlong="drop"):
        data = tmp_path / "pairs/train.parquet"
        pq.write_table(pa.Table.from_pylist(rows), data)
        spec = {"source": "local", "path": str(data), "format": "preference",
                "columns": {"images": "images"}}  # fmt: skip
        out = tmp_path / "tok.parquet"
        stats = tokenize([Source("pp", data, spec)], vlm, out, limit, overlong, model_name="vlm")
        return stats, pq.read_table(out).to_pylist()

    stats, rows = run(raw, 256)
    assert stats.image_tokens == sum(sum(t in image for t in r["input_ids"]) for r in rows) > 0
    longest = [max(len(r["input_ids"]), len(r["rejected_input_ids"])) for r in rows]
    i, j = next((i, j) for i in range(6) for j in range(i + 1, 6) if longest[j] < longest[i])
    stats, kept = run(raw, longest[j])  # pair i over the limit, pair j after it within
    assert [r["example_id"] for r in kept] == [
        f"pp:{k}" for k in range(6) if longest[k] <= longest[j]]  # fmt: skip
    assert stats.dropped_overlong == sum(n > longest[j] for n in longest) >= 1
    last_image = max(k for k, t in enumerate(rows[i]["input_ids"]) if t in image)
    start = min(k for k, t in enumerate(rows[i]["labels"]) if t != -100)  # its response
    stats, cut = run(raw, start + 1, "truncate")  # cuts responses, after the pictures
    assert stats.truncated >= 1 and stats.dropped_overlong == 0 and len(cut) == 6
    assert all(len(r["input_ids"]) <= start + 1 for r in cut)
    with pytest.raises(DataError, match="6 longer than max_length"):  # into the pictures
        run(raw, last_image, "truncate")
    in_response = [
        {"role": "assistant", "content": [{"type": "text", "text": f"red {pictures.MARK}"}]}
    ]
    for field, line in (("chosen", "pictures belong in the prompt"),
                        ("rejected", "pictures belong in user turns")):  # fmt: skip
        bad = json.loads(json.dumps(raw))
        bad[1][field] = (
            in_response
            if field == "chosen"
            else [
                {"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}
            ]
        )
        with pytest.raises(DataError, match=line):
            run(bad, 256)
    mixed = [
        {"role": "system", "content": "s"},
        "not a message",
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]},
    ]
    marked = picture_pairs._marked_messages(mixed, "w")
    assert marked[:2] == mixed[:2] and marked[2]["content"] == pictures.MARK + "q"
    import datasets

    table = datasets.Dataset.from_dict({"input_ids": [[1]], "images": [[b"png"]]})
    assert picture_pairs.trainer_table(table).column_names == ["input_ids"]
    plain = table.remove_columns(["images"])
    assert picture_pairs.trainer_table(plain).column_names == ["input_ids"]


def test_the_picture_plan_measures_what_each_set_holds(tmp_path):
    """snaketune.budget.pictureplan at its edges (quick): the first SAMPLED rows' named
    files scaled to all rows (not one row more or less), a file not there and embedded
    bytes not counted, one row its own size; a Hub set its parquet alone, a set not
    downloaded nothing; a text training set beside a picture held-out set: the held-out
    set's pictures alone."""
    from snaketune.budget import pictureplan as pp

    pics = tmp_path / "resources/pics"
    pics.mkdir(parents=True)
    (pics / "small.png").write_bytes(b"x" * 10)
    (pics / "big.png").write_bytes(b"x" * 1000)
    spec = {"source": "local", "format": "messages", "path": "resources/pics/train.jsonl",
            "columns": {"images": "images"}}  # fmt: skip
    data = tmp_path / "data.parquet"
    sampled = 1000  # the rows measured, as the module's docstring says
    rows = [{"images": ["small.png"]}] * (sampled + 1001)
    rows[sampled - 1] = {"images": ["big.png"]}  # the last row sampled
    pq.write_table(pa.Table.from_pylist(rows), data)
    measured = (sampled - 1) * 10 + 1000
    assert pp.named_files_bytes(data, spec, pics) == measured * len(rows) / sampled
    assert pp.named_files_bytes(data, {**spec, "columns": {}}, pics) == 0.0  # a text set
    for table in (
        pa.table({"other": ["small.png"]}),
        pa.table({"images": pa.array([], pa.list_(pa.string()))}),
    ):
        pq.write_table(table, data)  # no pictures column; no rows
        assert pp.named_files_bytes(data, spec, pics) == 0.0
    parts = [
        {"images": [{"bytes": b"png", "path": "big.png"}, {"bytes": None, "path": "small.png"}]}
    ]
    pq.write_table(pa.Table.from_pylist(parts), data)  # a Hub layout: bytes, or a path
    assert pp.named_files_bytes(data, spec, pics) == 10
    one = [{"images": ["small.png", "gone.png"]}]
    pq.write_table(pa.Table.from_pylist(one), data)
    assert pp.named_files_bytes(data, spec, pics) == 10
    config = {"datasets": {"hubset": {"source": "hub", "format": "messages", "repo": "o/r",
                                      "columns": {"images": "images"}},
                           "mine": {**spec, "source": "".join(["lo", "cal"])}}}  # fmt: skip
    for name in ("hubset", "mine"):
        assert pp.downloaded_bytes(config, name, tmp_path) == 0.0  # not downloaded
        (tmp_path / f"resources/datasets/{name}").mkdir(parents=True)
        pq.write_table(
            pa.Table.from_pylist(one), tmp_path / f"resources/datasets/{name}/data.parquet"
        )
    size = (tmp_path / "resources/datasets/hubset/data.parquet").stat().st_size
    assert pp.downloaded_bytes(config, "hubset", tmp_path) == size
    assert pp.downloaded_bytes(config, "mine", tmp_path) == size + 10  # a read string too

    text = {"source": "local", "format": "messages", "path": "t.jsonl", "columns": {}}
    (tmp_path / "resources/datasets/txt").mkdir(parents=True)
    pq.write_table(pa.table({"x": [1]}), tmp_path / "resources/datasets/txt/data.parquet")
    config["datasets"]["txt"] = text
    config["models"] = {"m": {"source": "local", "path": "m"}}  # what the sets' keys read
    config["runs"] = {"r": {"model": "m", "dataset": "txt", "eval_dataset": "mine",
                            "max_length": 64, "overlong": "drop"}}  # fmt: skip
    assert pp.picture_bytes(config, "r", tmp_path) == size + 10  # the held-out set's, once
    config["runs"]["r"]["eval_dataset"] = None
    assert pp.picture_bytes(config, "r", tmp_path) == 0
