"""Raw text, the ``text`` kind (snaketune.data.kinds): documents for continued
pre-training, a dataset of format ``text`` (``columns: {text: <col>}``, default ``text``).

Each document becomes its tokens with the model's own ends: the tokens its tokenizer puts
before a text (a BOS, where its tokenizer adds one: Llama's, Gemma's) and after it (its
end-of-text token, ``eos_token``, always: appended where the tokenizer adds none), with no
chat markup. A document longer than ``max_length`` is split into consecutive pieces of
``max_length`` tokens (the last one shorter): every token is kept, none cut or dropped
(``overlong`` is for chat rows). Each piece is an example of its own (its id the
document's with ``#k``), so the shard planner packs short documents and pieces alike,
positions restarting at each and no attention across them (snaketune.data.packing), and
the first token of each piece is context, never a target (as every packed example's).

The loss is on every token, so no second copy of the ids is stored as labels: a text row's
``labels`` is null, read back as its ``input_ids`` (snaketune.core.rows.with_labels). One
more column:

    text_bytes  int64  the UTF-8 bytes of the text its predicted tokens cover

from which evaluation gives bits per byte (comparable across tokenizers). In a mixture with
chat rows (replay) the rows are the chat rows' kind and the documents join them
(``text_bytes`` left out).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from snaketune.core.errors import DataError
from snaketune.data.conversations import Items, Source, Stats
from snaketune.data.kinds import Encoded

PIECE = "#"  # a piece's example id: the document's, then #k


@dataclass(frozen=True)
class Document:
    """A text row: its document."""

    text: str


def read_row(
    source: Source, system: tuple, cols: dict[str, Any], data: dict, i: int, row: int
) -> Document:
    """One row of a ``text`` dataset: its column must hold non-empty text."""
    col = cols["text"]
    value = data[col][i]
    where = f"datasets.{source.name} row {row}: column {col!r}"
    if not isinstance(value, str):
        what = "null" if value is None else f"of type {type(value).__name__}, not text"
        raise DataError(f"{where} is {what}; clean the data or filter the row out")
    if not value:
        raise DataError(
            f"{where} is empty (a document needs text); clean the data or filter the row out"
        )
    return Document(value)


# --------------------------------------------------- tokens (the kind's, snaketune.data.kinds)


def schema(base: pa.Schema) -> pa.Schema:
    return base.append(pa.field("text_bytes", pa.int64()))


def render(renderer, items: Items, stats: Stats):
    """The documents as they are: no template, no spans (every token is trained)."""
    return items, [doc.text for _, doc in items], [None] * len(items)


def ends(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text (``add_special_tokens``), with
    its end-of-text token after it where it puts none."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(
            f"{tokenizer.name_or_path}: the tokenizer has no end-of-text token (eos_token), "
            "which ends every document of a text dataset; set eos_token in its "
            "tokenizer_config.json"
        )
    backend = tokenizer.backend_tokenizer
    probe = "a"
    bare = backend.encode(probe, add_special_tokens=False).ids
    full = backend.encode(probe, add_special_tokens=True).ids
    at = next((k for k in range(len(full)) if full[k : k + len(bare)] == bare), 0)
    before, after = full[:at], full[at + len(bare) :]
    return before, after if after[-1:] == [eos] else [*after, eos]


def byte_ends(text: str) -> np.ndarray:
    """``B[c]``: the UTF-8 bytes of ``text[:c]``, for c = 0 .. len(text)."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    return np.concatenate([[0], np.cumsum(widths, dtype=np.int64)])


def pieces(
    ids: list[int], offsets: list, text: str, before: list[int], after: list[int], size: int
) -> list[tuple[list[int], int]]:
    """A document's tokens (``before`` + ``ids`` + ``after``) in consecutive pieces of at
    most ``size``, each with the UTF-8 bytes its predicted tokens (all but its first)
    cover."""
    doc = [*before, *ids, *after]
    # each token's end, in characters: the ends before it 0, its text's own, the ends after
    ends_at = np.concatenate(
        [
            np.zeros(len(before), np.int64),
            np.asarray([o[1] for o in offsets], np.int64).reshape(-1),
            np.full(len(after), len(text), np.int64),
        ]
    )
    ends_at = np.maximum.accumulate(ends_at)
    to_bytes = byte_ends(text)
    out = []
    for a in range(0, len(doc), size):
        b = min(a + size, len(doc))
        out.append((doc[a:b], int(to_bytes[ends_at[b - 1]] - to_bytes[ends_at[a]])))
    return out


def piece_sha(text: str, k: int) -> str:
    """A piece's text hash: its document's and its place in it."""
    return hashlib.sha256(f"\x1c{k}\x1c{text}".encode()).hexdigest()[:16]


def label(b: Encoded) -> pa.Table:
    """Every document's pieces as rows (labels null: every token is trained)."""
    before, after = ends(b.tokenizer)
    stats = b.stats
    names, ids, lengths, shas, sizes = [], [], [], [], []
    for (key, doc), enc in zip(b.items, b.encodings, strict=True):
        parts = pieces(enc.ids, enc.offsets, doc.text, before, after, b.max_length)
        stats.documents += 1
        stats.documents_split += len(parts) > 1
        for k, (piece, size) in enumerate(parts):
            names.append(f"{key}{PIECE}{k}" if len(parts) > 1 else key)
            ids.append(piece)
            lengths.append(len(piece))
            shas.append(piece_sha(doc.text, k))
            sizes.append(size)
    n, tokens = len(names), int(sum(lengths))
    stats.rows += n
    stats.document_rows += n
    stats.tokens += tokens
    stats.label_tokens += tokens - n  # the first token of each row is context
    stats.text_bytes += int(sum(sizes))
    if n:
        stats.max_tokens = max(stats.max_tokens, max(lengths))
        stats.max_token_id = max(stats.max_token_id, max(max(p) for p in ids))
    columns = {
        "example_id": pa.array(names, pa.string()),
        "input_ids": pa.array(ids, pa.list_(pa.int32())),
        "labels": pa.nulls(n, pa.list_(pa.int32())),
        "length": pa.array(lengths, pa.int32()),
        "text_sha": pa.array(shas, pa.string()),
        "text_bytes": pa.array(sizes, pa.int64()),
    }
    return pa.Table.from_arrays([_column(columns, f, n) for f in b.schema], schema=b.schema)


def _column(columns: dict[str, pa.Array], field: pa.Field, n: int) -> pa.Array:
    """A column of the batch's table in the writer's ``schema``: its own, or, in a mixture
    whose rows have more (pictures), that column empty (a document has no pictures)."""
    if field.name in columns:
        return columns[field.name]
    if pa.types.is_list(field.type):
        return pa.array([[]] * n, field.type)
    return pa.nulls(n, field.type)


def dropped(stats: Stats) -> str:
    if not stats.documents:
        return ""
    return (
        f"{stats.documents} documents -> {stats.document_rows} rows: "
        f"{stats.documents_split} longer than max_length split into pieces, every token "
        f"kept (none cut or dropped); {stats.text_bytes} bytes of text trained on"
    )


batch = None  # rows of the methods of rows (SFT): collated as theirs


def held_out_figures(loss: dict[str, Any], rows: list[dict]) -> dict[str, Any]:
    """A held-out set of documents' figures beside its ``loss`` (the evaluation's mean loss
    per predicted token and their count): the bits per byte of its text (the summed loss
    in bits over the UTF-8 bytes the predicted tokens cover: comparable across
    tokenizers), in the ``documents`` format (snaketune.evaluation.figures)."""
    text_bytes = sum(int(r["text_bytes"]) for r in rows)
    nats = loss["loss"] * loss["response_tokens"]
    return {
        "format": "documents",
        "bits_per_byte": nats / math.log(2) / max(text_bytes, 1),
        "text_bytes": text_bytes,
    }
