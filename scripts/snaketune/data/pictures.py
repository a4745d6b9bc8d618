"""Pictures in chat rows: the ``pictures`` kind of data (snaketune.data.kinds), TRL's vision
layout as the Hub's VLM datasets ship it. A ``messages`` dataset with ``columns.images``:
user turns hold ``{"type": "image"}`` parts, filled in order by the row's pictures (the
Hub's Image feature ``{bytes, path}``, or a path relative to the data file).

- Reading (:func:`read_row`): each image part becomes ``MARK`` in the turn's text; the
  pictures must decode and match the parts in number (else one line naming the dataset, the
  row and the column).
- Tokenize (:func:`render`, :func:`label`): ``MARK`` becomes what the model's own chat
  template prints for an image part (Gemma 3: ``<start_of_image>``), the conversation is
  rendered and its assistant tokens found as for text rows, then the model's processor
  expands each picture into its image tokens (``AutoProcessor``: the tokens a picture takes
  in that family) and the labels are carried over onto the expanded tokens. The length
  policy applies to the expanded length; a row is never cut inside its pictures. The
  tokenized file keeps the pictures' bytes beside the tokens (column ``images``), so the
  shards carry them.
- Training and evaluation (:func:`model_inputs`): a batch's pictures through the processor's
  image processor (``pixel_values`` and what else the family takes) and the image tokens'
  type ids, beside the padded tokens. Picture rows are padded, never packed.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import io
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from snaketune.core.errors import DataError
from snaketune.core.rows import IGNORE_INDEX
from snaketune.data.chat import ChatRenderer
from snaketune.data.conversations import Items, Source, Stats, text_sha
from snaketune.data.kinds import Encoded
from snaketune.data.packing import Collator
from snaketune.data.tokenization import labelled_tokens, render_batch

log = logging.getLogger(__name__)

MARK = "\ue0f1"  # an image part's place in a turn, until the template names it
COLUMN = "images"  # the tokenized column of a row's pictures (PNG/JPEG bytes, in order)


class Pictured(tuple):
    """A conversation's turns (a tuple, as every row's) and the pictures of its image parts,
    in order (encoded bytes)."""

    pictures: tuple[bytes, ...]

    def __new__(cls, turns, pictures=()):
        made = super().__new__(cls, turns)
        made.pictures = tuple(pictures)
        return made


# ----------------------------------------------------------------------------- reading


def decoded(data: bytes):
    """A picture as PIL reads it (RGB)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def picture_bytes(value: Any, base: Path | None, where: str) -> bytes:
    """A row's picture (``{bytes, path}`` or a path) as bytes that decode; else one line."""
    if isinstance(value, dict) and value.get("bytes"):
        data = value["bytes"]
    else:
        path = value.get("path") if isinstance(value, dict) else value
        if not isinstance(path, str) or not path:
            raise DataError(f"{where} is {value!r:.60}, not a picture ({{bytes, path}} or a path)")
        file = Path(path) if Path(path).is_absolute() or base is None else base / path
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise DataError(f"{where}: cannot read {file} ({exc.strerror})") from None
    try:
        decoded(data)
    except Exception as exc:  # noqa: BLE001 -- PIL raises many kinds for a bad file
        why = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(exc))
        raise DataError(f"{where} does not decode as a picture ({why})") from None
    return data


def parts_text(content: Any, where: str) -> tuple[str, int]:
    """A message's content as text with ``MARK`` for each image part, and the parts' count."""
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        raise DataError(f"{where}: content must be text or a list of parts (got {content!r:.60})")
    text, images = [], 0
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            text.append(MARK)
            images += 1
        elif kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        else:
            raise DataError(f"{where}: a content part must be an image or text (got {part!r:.60})")
    return "".join(text), images


def read_row(source: Source, system: tuple, cols: dict[str, Any], data: dict, i: int, row: int):
    """One picture row as a Pictured conversation."""
    name, col = source.name, cols[COLUMN]
    where = f"datasets.{name} row {row}"
    msgs = data[cols["messages"]][i]
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: `messages` must be a non-empty list of turns")
    turns, parts = [], 0
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise DataError(
                f"{where}: each turn needs role system, user or assistant (got {m!r:.60})"
            )
        text, n = parts_text(m.get("content"), f"{where} turn {j}")
        if n and m["role"] != "user":
            raise DataError(f"{where} turn {j}: pictures belong in user turns, not {m['role']}")
        turns.append((m["role"], text))
        parts += n
    if not any(t[0] == "assistant" for t in turns):
        raise DataError(
            f"{where}: no assistant turn to learn from; clean the data or filter it out"
        )
    return Pictured((*system, *turns), pictures_of(source, col, data, i, where, parts))


def pictures_of(source: Source, col: str, data: dict, i: int, where: str, parts: int) -> list:
    """Row ``i``'s pictures of column ``col`` as bytes that decode, as many as its ``parts``
    image parts; else one line naming the row (``where``) and the column."""
    values = data.get(col, [None] * (i + 1))[i] or []
    if not isinstance(values, list):
        values = [values]
    if len(values) != parts:
        raise DataError(
            f"{where}: {parts} image part(s) in its messages but {len(values)} picture(s) in "
            f'column {col!r}; each {{"type": "image"}} part takes the next picture'
        )
    base = None  # a local file's pictures are named from its folder (or from the folder given)
    if source.spec.get("source") == "local":
        given = Path(source.spec["path"])
        base = given if given.is_dir() else given.parent
    return [
        picture_bytes(v, base, f"{where}: column {col!r} picture {k}") for k, v in enumerate(values)
    ]


# ----------------------------------------------------------------------------- tokenize


@functools.lru_cache(maxsize=4)
def processor_of(model_dir: str):
    """The model's processor (``AutoProcessor``): one line where it has none for pictures."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise DataError(f"{model_dir}: no processor to read pictures with ({exc})") from None
    if getattr(processor, "image_processor", None) is None:
        raise DataError(
            f"{model_dir}: its processor takes no pictures (no image processor): a picture "
            "dataset needs a vision-language model"
        )
    return processor


@functools.lru_cache(maxsize=4)  # one probe per renderer, not per batch
def image_text(renderer: ChatRenderer) -> str:
    """What the chat template prints for one image part (before its processor expands it):
    the render of a user turn with an image part less the render without it."""
    probe = "\ue0f2"
    with_part = [{"type": "image"}, {"type": "text", "text": probe}]
    try:  # a text-only template may not take a list of parts at all
        text_only = [{"type": "text", "text": probe}]
        a = renderer.render_messages([{"role": "user", "content": text_only}])
        b = renderer.render_messages([{"role": "user", "content": with_part}])
        pre = a[: a.index(probe)]
        found = b[len(pre) : b.index(probe)] if b.startswith(pre) else ""
    except Exception:  # noqa: BLE001 -- jinja raises what the template's code raises
        found = ""
    if not found:
        raise DataError(
            f"{renderer.tokenizer.name_or_path}: the chat template prints nothing for an image "
            "part: it is not a vision-language "
            "model's template (a picture dataset needs a vision-language model and its own "
            "template: `chat_template:` unset)"
        )
    return found


def render(renderer: ChatRenderer, items: Items, stats: Stats):
    """Each row's ``MARK``s as the template's image text, rendered as text rows are."""
    named = [
        (key, Pictured(marked(renderer, conv), getattr(conv, "pictures", ())))
        for key, conv in items
    ]
    return (named, *render_batch(renderer, named))


def carried_labels(plain: list[int], labels: np.ndarray, full: list[int]) -> np.ndarray | None:
    """``labels`` (of the tokens ``plain``) on the processor's tokens ``full``: where the two
    agree token for token the label is carried; the expanded pictures and what the expansion
    re-tokenized around them are prompt. None where a labelled token did not carry over."""
    out = np.full(len(full), IGNORE_INDEX, np.int32)
    matcher = difflib.SequenceMatcher(None, plain, full, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            out[j1:j2] = labels[i1:i2]
    return out if (out != IGNORE_INDEX).sum() == (labels != IGNORE_INDEX).sum() else None


def expanded(processor, text: str, pictures: tuple[bytes, ...]) -> list[int]:
    """The processor's tokens of ``text`` with its pictures' image tokens."""
    if not pictures:
        return processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    enc = processor(text=[text], images=[[decoded(p) for p in pictures]], add_special_tokens=False)
    return list(enc["input_ids"][0])


def schema(base: pa.Schema) -> pa.Schema:
    return base.append(pa.field(COLUMN, pa.list_(pa.binary())))


def label(b: Encoded) -> pa.Table:
    """The rows with their pictures' image tokens, labels carried over, the length policy on
    the expanded length (a row is cut only after its last image token)."""
    processor = processor_of(b.tokenizer.name_or_path)
    encodings, stats = b.encodings, b.stats
    lengths = np.array([len(e.ids) for e in encodings], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    mask = labelled_tokens(encodings, b.spans, b.texts, starts)
    image_ids = set(image_ids_of(processor))
    columns: dict[str, list] = {
        k: [] for k in ("example_id", "input_ids", "labels", "length", "text_sha", COLUMN)
    }
    for i, (key, conv) in enumerate(b.items):
        plain = encodings[i].ids
        labels = np.where(mask[starts[i] : starts[i + 1]], plain, IGNORE_INDEX).astype(np.int32)
        full, carried = expanded_side(processor, key, plain, labels, b.texts[i], conv.pictures)
        stats.conversations += 1
        kept = _policy(key, full, carried, image_ids, b.max_length, b.overlong, stats)
        if kept is None:
            continue
        ids, labs = kept
        stats.rows += 1
        stats.tokens += len(ids)
        stats.label_tokens += int((labs != IGNORE_INDEX).sum())
        stats.max_tokens = max(stats.max_tokens, len(ids))
        stats.max_token_id = max(stats.max_token_id, int(max(ids)))
        stats.pictures += len(conv.pictures)
        stats.image_tokens += sum(t in image_ids for t in ids)
        sha = pictured_sha(text_sha(conv), conv.pictures)
        for name, value in zip(
            columns, (key, ids, labs.tolist(), len(ids), sha, list(conv.pictures)), strict=True
        ):
            columns[name].append(value)
    return pa.Table.from_pydict(columns, schema=b.schema)


def expanded_side(processor, key: str, plain: list[int], labels: np.ndarray, text: str, pictures):
    """A rendered sequence's tokens with its pictures' image tokens (``expanded``), and its
    labels carried over; a labelled token the expansion changed is one line naming ``key``."""
    full = expanded(processor, text, pictures)
    carried = carried_labels(plain, labels, full)
    if carried is None:
        raise DataError(
            f"{key}: the processor's picture tokens changed the response's tokens; the "
            "chat template and the processor disagree (use the model's own template)"
        )
    return full, carried


def pictured_sha(sha: str, pictures) -> str:
    """An example's text hash with its pictures' (the pictures are part of the example)."""
    if not pictures:
        return sha
    blob = sha + "".join(hashlib.sha256(p).hexdigest() for p in pictures)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def marked(renderer: ChatRenderer, turns: tuple) -> tuple:
    """Turns with each ``MARK`` as the template's image text."""
    image = image_text(renderer)
    return tuple((t[0], t[1].replace(MARK, image), *t[2:]) for t in turns)


def image_ids_of(processor) -> list[int]:
    """The token ids a picture expands into (its image tokens and their markers)."""
    tok = processor.tokenizer
    names = [getattr(tok, k, None) for k in ("image_token", "boi_token", "eoi_token")]
    names += [getattr(processor, "image_token", None)]
    return sorted({tok.convert_tokens_to_ids(n) for n in names if isinstance(n, str)})


def _policy(key, ids, labels, image_ids, max_length, overlong, stats):
    """The length policy on a picture row: kept whole, cut after its last image token
    (``truncate``) or dropped (counted); None when dropped."""
    if len(ids) <= max_length:
        return (ids, labels) if (labels != IGNORE_INDEX).any() else _no_response(stats)
    last_image = max((k for k, t in enumerate(ids) if t in image_ids), default=-1)
    if overlong == "error" and len(ids) > stats.longest_overlong[0]:
        stats.longest_overlong = (len(ids), key)
    if overlong != "truncate" or last_image >= max_length:
        stats.dropped_overlong += 1
        return None
    stats.truncated += 1
    ids, labels = ids[:max_length], labels[:max_length]
    return (ids, labels) if (labels != IGNORE_INDEX).any() else _no_response(stats)


def _no_response(stats: Stats) -> None:
    stats.dropped_no_response += 1
    return None


def dropped(stats: Stats) -> str:
    return f"{stats.pictures} pictures, {stats.image_tokens} image tokens in the examples kept"


batch = None  # its methods collate rows themselves (model_inputs adds the pictures)


# ----------------------------------------------------------------------------- batches


class PictureCollator(Collator):
    """A planned micro batch of picture rows: padded (``padded``: pictures are never packed),
    with the pictures' model inputs (:func:`model_inputs`) beside the tokens."""

    def __init__(self, pad_token_id: int, row_tokens: int, ids_log: Path | None, tokenizer):
        super().__init__("padded", pad_token_id, row_tokens, ids_log)
        self.processor = processor_of(tokenizer.name_or_path)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super().__call__(examples)
        pictures = [e[COLUMN] for e in examples]
        batch.update(model_inputs(self.processor, pictures, batch["input_ids"]))
        return batch


def model_inputs(processor, pictures: list[list[bytes]], ids) -> dict[str, Any]:
    """A batch's pictures as the model takes them: the image processor's outputs the
    processor names as model inputs (``pixel_values``, Qwen's ``image_grid_thw``, ...), and
    the image tokens' type ids (``ids``: the batch's padded tokens) where the family reads
    them (Gemma 3's ``token_type_ids``)."""
    flat = [decoded(p) for row in pictures for p in row]
    out: dict[str, Any] = {}
    names = set(processor.model_input_names)
    if flat:
        made = processor.image_processor(flat, return_tensors="pt")
        out.update({k: v for k, v in made.items() if k in names})
    if getattr(processor, "return_mm_token_type_ids", False):
        import torch

        types = torch.tensor(processor.create_mm_token_type_ids(ids.tolist()), dtype=torch.long)
        out["token_type_ids" if "token_type_ids" in names else "mm_token_type_ids"] = types
    return out


def inputs_of(model, rows: list[dict], ids) -> dict[str, Any]:
    """The pictures' model inputs of evaluation ``rows`` (a picture set's; {} for text rows)
    beside their padded tokens ``ids`` (a row's sequences: one, or a pair's two sides), with
    the processor saved beside ``model``'s weights (an export's, or an adapter's base)."""
    if not rows or COLUMN not in rows[0]:
        return {}
    processor = processor_of(model.config._name_or_path)
    device = next(model.parameters()).device
    sides = len(ids) // len(rows)  # a pair's rows are its chosen sides, then its rejected
    made = model_inputs(processor, [r[COLUMN] for r in rows] * sides, ids)
    return {k: v.to(device) for k, v in made.items()}
