"""The vision-language fixtures, built offline: a tiny random Gemma 3 (a 2-layer text model of
width 32, a 1-layer SigLIP tower on 32x32 pictures, 4 tokens a picture) with Gemma 3's own
processor class and its Hub chat template (tests/templates/gemma3.jinja), and picture
questions a tiny model can answer from the pixels: a shape of one colour on a grey ground,
"What colour is the shape?" -> the colour. The pictures are PNG files beside the data,
named by a path relative to the data file (TRL's layout: a ``messages`` column whose user
turn holds a ``{"type": "image"}`` part, an ``images`` column with the pictures).

Gemma 3's processor needs no torchvision (which has no CPU build on these machines): its
image processor's PIL backend serves.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATE = Path(__file__).parent / "templates/gemma3.jinja"
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220),
           "yellow": (230, 210, 20)}  # fmt: skip
QUESTION = "What colour is the shape?"
SIDE = 32  # the vision tower's picture size
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
           "<start_of_image>", "<end_of_image>", "<image_soft_token>"]  # fmt: skip


def tokenizer():
    """A character-level tokenizer with Gemma 3's markup and image tokens (the processor
    reads ``boi_token``, ``eoi_token`` and ``image_token`` off it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for ch in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,?!:'\n":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()  # characters joined back as they were
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=["<start_of_turn>", "<end_of_turn>"],
        model_specific_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        chat_template=TEMPLATE.read_text(),
    )


def build_vlm(out: Path, seed: int = 0) -> Path:
    """The tiny Gemma 3 VLM and its processor, saved under ``out``."""
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        GenerationConfig,
    )

    tok = tokenizer()
    ids = tok.convert_tokens_to_ids
    images = Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}, do_pan_and_scan=False)
    processor = Gemma3Processor(image_processor=images, tokenizer=tok,
                                chat_template=TEMPLATE.read_text(), image_seq_length=4)  # fmt: skip
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=512, sliding_window=64,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=[tok.eos_token_id, ids("<end_of_turn>")]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=SIDE, patch_size=8),
        mm_tokens_per_image=4,
        image_token_index=ids("<image_soft_token>"),
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    # transformers starts the projector from the vision tower at zero (a published Gemma 3
    # has it trained): drawn here, or no picture would reach the language model
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
    model.generation_config = GenerationConfig(
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id, ids("<end_of_turn>")],
        do_sample=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def picture(colour: str, rng: random.Random) -> bytes:
    """A PNG: a square or a disc of ``colour`` on a grey ground, at a random place and size."""
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", (48, 40), (128, 128, 128))
    draw = ImageDraw.Draw(img)
    size = rng.randint(12, 24)
    x, y = rng.randint(0, 48 - size), rng.randint(0, 40 - size)
    shape = draw.rectangle if rng.random() < 0.5 else draw.ellipse
    shape([x, y, x + size, y + size], fill=COLOURS[colour])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def row(colour: str, path: str, columns: tuple[str, str] = ("messages", "images")) -> dict:
    """One picture question in TRL's layout (``columns``: the messages' and the pictures')."""
    return {
        columns[0]: [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": [{"type": "text", "text": colour}]},
        ],
        columns[1]: [path],
    }


def make_picture_data(
    out: Path,
    train: int = 96,
    test: int = 16,
    seed: int = 7,
    columns: tuple[str, str] = ("messages", "images"),
) -> Path:
    """train.jsonl and test.jsonl under ``out``, their pictures under out/pictures/."""

    def draw(rng: random.Random, name: str) -> dict:
        colour = rng.choice(sorted(COLOURS))
        (out / name).write_bytes(picture(colour, rng))
        return row(colour, name, columns)

    return write_sets(out, (("train", train), ("test", test)), seed, draw)


def write_sets(out: Path, sizes, seed: int, draw) -> Path:
    """Each split of ``sizes`` ((split, rows)) as out/<split>.jsonl, its rows made by
    ``draw(rng, picture name)`` (which writes the picture under out/pictures/)."""
    rng = random.Random(seed)
    (out / "pictures").mkdir(parents=True, exist_ok=True)
    for split, n in sizes:
        rows = [draw(rng, f"pictures/{split}-{i:04d}.png") for i in range(n)]
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def pair(colour: str, wrong: str, path: str) -> dict:
    """A picture preference row in TRL's vision layout (``HuggingFaceH4/rlaif-v_formatted``):
    the prompt's user turn holds the picture's part, the responses are assistant turns."""
    return {
        "prompt": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
        ],
        "chosen": [{"role": "assistant", "content": [{"type": "text", "text": colour}]}],
        "rejected": [{"role": "assistant", "content": [{"type": "text", "text": wrong}]}],
        "images": [path],
    }


def make_picture_pairs(out: Path, train: int = 48, test: int = 8, seed: int = 11) -> Path:
    """train.jsonl and test.jsonl of picture pairs under ``out`` (the right colour chosen, a
    wrong one rejected; responses of unequal lengths), their pictures under out/pictures/."""

    def draw(rng: random.Random, name: str) -> dict:
        colour = rng.choice(sorted(COLOURS))
        wrong = rng.choice(sorted(set(COLOURS) - {colour}))
        (out / name).write_bytes(picture(colour, rng))
        return pair(colour, wrong, name)

    return write_sets(out, (("train", train), ("test", test)), seed, draw)
