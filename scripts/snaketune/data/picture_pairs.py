"""Preference pairs with pictures: the ``picture_pairs`` kind of data (snaketune.data.kinds),
TRL's vision preference layout as the Hub ships it (``HuggingFaceH4/rlaif-v_formatted``): a
``preference`` dataset with ``columns.images``, whose prompt's user turns hold
``{"type": "image"}`` parts, filled in order by the row's pictures.

A pair is read as a text pair (snaketune.data.conversations) with each image part as a mark
(snaketune.data.pictures), rendered and labelled as text pairs are (snaketune.data.pairs),
then each side is expanded by the model's processor and its labels carried over, as a
picture row's are. Both sides hold the prompt's pictures; the tokenized file keeps them
once (column ``images``), and a batch repeats them for the rejected sides (chosen sides
first, as TRL's DPO reads a batch). The length policy cuts a pair only after its last image
token. DPO trains on them (its reference stage and held-out pairs pass the pictures too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from snaketune.core.errors import DataError
from snaketune.data import pairs, pictures
from snaketune.data.chat import ChatRenderer
from snaketune.data.conversations import Items, Pair, Source, Stats, text_sha
from snaketune.data.kinds import Encoded
from snaketune.data.pictures import COLUMN, MARK

FIELDS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class PicturedPair(Pair):
    """A preference pair and the pictures of its prompt's image parts, in order (bytes)."""

    pictures: tuple[bytes, ...] = ()


def _marked_messages(value: Any, where: str) -> Any:
    """A preference field with each message's parts as text (image parts as ``MARK``)."""
    if not isinstance(value, list):
        return value  # text, or what read_pair names as wrong
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or isinstance(m.get("content"), str):
            out.append(m)
            continue
        text, images = pictures.parts_text(m.get("content"), f"{where} message {j}")
        if images and m.get("role") != "user":
            raise DataError(
                f"{where} message {j}: pictures belong in user turns, not {m.get('role')}"
            )
        out.append({**m, "content": text})
    return out


def read_row(source: Source, system: tuple, cols: dict[str, Any], data: dict, i: int, row: int):
    """One preference row with pictures as a PicturedPair."""
    where = f"datasets.{source.name} row {row}"
    local = {
        cols[f]: [_marked_messages(data[cols[f]][i], f"{where}: column {cols[f]!r}")]
        for f in FIELDS
        if cols.get(f) in data
    }
    pair = pairs.read_pair(source, system, cols, local, 0, row)
    if any(MARK in t[1] for t in (*pair.chosen, *pair.rejected)):
        raise DataError(f"{where}: pictures belong in the prompt, not in a response")
    parts = sum(t[1].count(MARK) for t in pair.prompt)
    found = pictures.pictures_of(source, cols[COLUMN], data, i, where, parts)
    return PicturedPair(pair.prompt, pair.chosen, pair.rejected, tuple(found))


def schema(base: pa.Schema) -> pa.Schema:
    return pairs.schema(base).append(pa.field(COLUMN, pa.list_(pa.binary())))


def render(renderer: ChatRenderer, items: Items, stats: Stats):
    """The pairs with each mark as the template's image text, rendered as text pairs are."""
    named = [
        (key, PicturedPair(pictures.marked(renderer, p.prompt), p.chosen, p.rejected, p.pictures))
        for key, p in items
    ]
    return pairs.render(renderer, named, stats)


def label(b: Encoded) -> pa.Table:
    """The pairs with their pictures' image tokens on both sides, labels carried over, the
    length policy on the expanded lengths (a side is cut only after its last image token)."""
    processor = pictures.processor_of(b.tokenizer.name_or_path)
    image_ids = set(pictures.image_ids_of(processor))
    n, stats = len(b.items), b.stats
    rows: dict[str, list] = {f.name: [] for f in b.schema}
    cut_ok = _cut_after_pictures(image_ids, b.max_length)
    for k, (key, pair) in enumerate(b.items):
        sides = []
        for (ids, labels), j in zip(
            pairs.encoded_sides(k, n, b.texts, b.spans, b.encodings), (k, k + n), strict=True
        ):
            full, carried = pictures.expanded_side(
                processor, key, ids.tolist(), labels, b.texts[j], pair.pictures
            )
            sides.append((np.asarray(full, np.int32), carried))
        sides = pairs.kept_sides(key, sides, b.max_length, b.overlong, stats, cut_ok)
        if sides is None:
            continue
        stats.pictures += len(pair.pictures)
        stats.image_tokens += sum(int(t) in image_ids for t in sides[0][0])
        sha = pictures.pictured_sha(text_sha(pair), pair.pictures)
        values = {**pairs.pair_values(key, sides, sha), COLUMN: list(pair.pictures)}
        for name, value in values.items():
            rows[name].append(value)
    return pa.Table.from_pydict(rows, schema=b.schema)


def _cut_after_pictures(image_ids: set[int], max_length: int):
    """Whether a side may be cut at ``max_length``: its image tokens all come before."""

    def ok(ids) -> bool:
        return not any(int(t) in image_ids for t in ids[max_length:])

    return ok


def dropped(stats: Stats) -> str:
    return f"{pairs.dropped(stats)}; {pictures.dropped(stats)}"


batch = pairs.batch  # the pictures' model inputs are added by model_inputs (both sides)


def extra_inputs(tokenizer):
    """What a pair collator adds to each batch of picture pairs: the pictures' model inputs
    for the chosen sides, then the same for the rejected sides."""
    processor = pictures.processor_of(tokenizer.name_or_path)

    def add(examples: list[dict[str, Any]], ids) -> dict[str, Any]:
        rows = [e[COLUMN] for e in examples]
        return pictures.model_inputs(processor, rows * 2, ids)

    return add


def trainer_table(table):
    """The table a TRL trainer is handed (its columns decide TRL's code path): without the
    pictures, which the collator turns into model inputs (TRL's own vision path would
    process prompts itself and refuses a precomputed reference)."""
    return table.remove_columns([COLUMN]) if COLUMN in table.column_names else table
