"""Turn raw rows into training examples: chat template, prompt masking, length policy.

Streams the input parquet in batches (peak memory does not grow with the dataset),
renders each row as a conversation with the model's chat template, encodes a whole
batch at once with the fast tokenizer, and sets ``labels`` to -100 on every token
outside an assistant turn. Output: one parquet file with columns

    example_id  "<dataset>:<row>" (":<copy>" added for mixture repeats)
    input_ids   list<int32>
    labels      list<int32>   (-100 on prompt tokens)
    length      int32
    text_sha    sha256 (16 hex) of the conversation's roles and contents

Masking: the character spans of the assistant turns come from snaketune.data.chat (the
template's ``{% generation %}`` marks; for a prefix-stable template, from the end of the
conversation rendered up to a turn with ``add_generation_prompt=True`` to the end of the
conversation rendered through it; otherwise each message's span in the one full render, its
end-of-turn token included: docs/families.md). A token is labelled when its first character
lies inside such a span; one that straddles the boundary counts as prompt.

Overlong conversations (more than ``max_length`` tokens) are dropped (``drop``) or cut
(``truncate``; dropped anyway when no response token is left). Counts of both, and of
rows removed by filters, go into the stats JSON.
"""

from __future__ import annotations

import functools
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from snaketune.core.errors import DataError
from snaketune.core.rows import IGNORE_INDEX
from snaketune.data.chat import ChatRenderer
from snaketune.data.conversations import Items, Source, Stats, iter_conversations, text_sha
from snaketune.data.kinds import Kind, kind_of_sources
from snaketune.data.tokens import (
    end_of_turn_id,
    first_token_at,
    model_vocab_size,
    renderer_for,
    stop_ids,
)

log = logging.getLogger(__name__)

OUTPUT_SCHEMA = pa.schema(
    [
        ("example_id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("length", pa.int32()),
        ("text_sha", pa.string()),
    ]
)
# Bump when a change here changes the tokens written for the same inputs (part of the key).
TOKENIZE_VERSION = 2


# ----------------------------------------------------------------------------- encode


def render_batch(
    renderer: ChatRenderer, items: Items
) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """Texts and assistant spans of one batch."""
    renderer.check(items[0][1])
    texts, spans = [], []
    for _, turns in items:
        text, sp = renderer.spans(turns)
        texts.append(text)
        spans.append(sp)
    return texts, spans


def labelled_tokens(
    encodings: list, spans: list[list[tuple[int, int]]], texts: list[str], row_start: np.ndarray
) -> np.ndarray:
    """Per token of the batch's rows laid end to end: inside an assistant span (trained)."""
    # +1 where an assistant span starts, -1 where it ends: a running sum > 0 is inside one.
    delta = np.zeros(int(row_start[-1]) + 1, np.int32)
    for i, (enc, sp, text) in enumerate(zip(encodings, spans, texts, strict=True)):
        n = len(enc.ids)
        for s, t in sp:
            a = first_token_at(enc, s, n, len(text))
            b = first_token_at(enc, t, n, len(text))
            if b > a:
                delta[row_start[i] + a] += 1
                delta[row_start[i] + b] -= 1
    return np.cumsum(delta[:-1]) > 0


def keep_rows(
    items: Items,
    lengths: np.ndarray,
    row_start: np.ndarray,
    labelled: np.ndarray,
    max_length: int,
    overlong: str,
    stats: Stats,
):
    """The length policy and rows with no response: (rows kept, tokens kept, each token's
    row), counted in ``stats``."""
    n = len(items)
    row_of = np.repeat(np.arange(n), lengths)
    position = np.arange(int(row_start[-1])) - row_start[:-1][row_of]
    overlong_rows = lengths > max_length
    if overlong_rows.any() and overlong == "error":  # counted as dropped; tokenize() refuses
        worst = int(np.argmax(np.where(overlong_rows, lengths, 0)))  # the first longest
        if lengths[worst] > stats.longest_overlong[0]:
            stats.longest_overlong = (int(lengths[worst]), items[worst][0])
    if overlong in ("drop", "error"):
        keep_row = ~overlong_rows
    else:
        keep_row = np.ones(n, bool)
        stats.truncated += int(overlong_rows.sum())
    keep_tok = keep_row[row_of] & (position < max_length)
    n_labels = np.bincount(row_of[labelled & keep_tok], minlength=n)
    no_response = keep_row & (n_labels == 0)
    keep_row &= ~no_response
    keep_tok &= keep_row[row_of]
    stats.conversations += n
    stats.dropped_overlong += int(overlong_rows.sum()) if overlong != "truncate" else 0
    stats.dropped_no_response += int(no_response.sum())
    return keep_row, keep_tok, row_of


def label_batch(
    items: Items,
    texts: list[str],
    spans: list[list[tuple[int, int]]],
    encodings: list,
    max_length: int,
    overlong: str,
    stats: Stats,
) -> pa.Table:
    """Labels and length policy for one encoded batch; the rows kept, as a table.

    Per row, Python only finds each assistant span's first and last token; the labels,
    the length policy and the output columns are computed on the whole batch with numpy.
    """
    n = len(items)
    ids = [enc.ids for enc in encodings]
    lengths = np.fromiter(map(len, ids), np.int64, count=n)
    row_start = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=row_start[1:])
    flat = np.fromiter(itertools.chain.from_iterable(ids), np.int32, count=int(row_start[-1]))
    labelled = labelled_tokens(encodings, spans, texts, row_start)
    keep_row, keep_tok, row_of = keep_rows(
        items, lengths, row_start, labelled, max_length, overlong, stats
    )

    n_labels = np.bincount(row_of[labelled & keep_tok], minlength=n)
    if stats.end_of_turn_id is not None:  # kept rows whose labels never close a turn
        ends = np.bincount(
            row_of[labelled & keep_tok & (flat == stats.end_of_turn_id)], minlength=n
        )
        stats.rows_without_end_of_turn += int((keep_row & (ends == 0)).sum())
    kept_lengths = np.minimum(lengths, max_length)[keep_row]
    if kept_lengths.size:
        stats.rows += int(kept_lengths.size)
        stats.tokens += int(kept_lengths.sum())
        stats.label_tokens += int(n_labels[keep_row].sum())
        stats.max_tokens = max(stats.max_tokens, int(kept_lengths.max()))
    out_ids = flat[keep_tok]
    if out_ids.size:
        stats.max_token_id = max(stats.max_token_id, int(out_ids.max()))
    out_labels = np.where(labelled, flat, IGNORE_INDEX).astype(np.int32)[keep_tok]
    offsets = pa.array(np.concatenate([[0], np.cumsum(kept_lengths)]).astype(np.int32))
    kept = np.flatnonzero(keep_row).tolist()
    return pa.Table.from_arrays(
        [
            pa.array([items[i][0] for i in kept], pa.string()),
            pa.ListArray.from_arrays(offsets, pa.array(out_ids)),
            pa.ListArray.from_arrays(offsets, pa.array(out_labels)),
            pa.array(kept_lengths.astype(np.int32)),
            pa.array([text_sha(items[i][1]) for i in kept], pa.string()),
        ],
        schema=OUTPUT_SCHEMA,
    )


# ------------------------------------------------ supervised rows, as a kind (snaketune.data.kinds)


def schema(base: pa.Schema) -> pa.Schema:
    return base


def render(renderer: ChatRenderer, items: Items, stats: Stats):
    return (items, *render_batch(renderer, items))


def label(
    items: Items,
    texts: list[str],
    spans: list,
    encodings: list,
    max_length: int,
    overlong: str,
    stats: Stats,
    *,
    schema: pa.Schema,
) -> pa.Table:
    return label_batch(items, texts, spans, encodings, max_length, overlong, stats)


def dropped(stats: Stats) -> str:
    return ""


batch = None  # its methods collate rows themselves (packing, padding-free)


def check_end_of_turn(stats: Stats, model_dir: str | Path, model_name: str) -> None:
    """One warning line each: examples whose assistant turn does not end with the
    template's end-of-turn token (a model trained on them learns not to stop), and a model
    whose generation_config does not stop on that token (the exports add it)."""
    if stats.end_of_turn is None:
        return
    if stats.rows_without_end_of_turn:
        log.warning(
            "%d of %d examples' assistant turns do not end with %s (cut by max_length with "
            "overlong: truncate): the model learns less of when to stop; raise max_length or "
            "set overlong: drop",
            stats.rows_without_end_of_turn,
            stats.rows,
            stats.end_of_turn,
        )
    if not stats.model_stops_at_end_of_turn:
        log.warning(
            "models.%s: the chat template ends an assistant turn with %s (id %d), but the "
            "model's generation_config stops only on %s: a tuned model would run on to "
            "max_new_tokens; the exported models get %d added to eos_token_id",
            model_name,
            stats.end_of_turn,
            stats.end_of_turn_id,
            stop_ids(model_dir),
            stats.end_of_turn_id,
        )


def check_result(
    stats: Stats, max_length: int, overlong: str, model_dir: str | Path, model_name: str
) -> None:
    """After the pass, one line (DataError) for a result training cannot use: overlong
    examples under ``overlong: error``, nothing left, token ids past the model's
    vocabulary."""
    if overlong == "error" and stats.dropped_overlong:
        tokens, example = stats.longest_overlong
        raise DataError(
            f"{stats.dropped_overlong} examples are longer than max_length {max_length} "
            f"(overlong: error; the longest, {example}, has {tokens} tokens); raise max_length "
            f"to {tokens} or set overlong: drop (leave them out) or truncate (cut them)"
        )
    if stats.rows == 0:
        raise DataError(
            f"no example left after tokenizing: {stats.rows_read} rows read, "
            f"{stats.rows_filtered_out} filtered out, {stats.dropped_overlong} longer than "
            f"max_length {max_length}, {stats.dropped_no_response} without response tokens; "
            "check filters, raise max_length or set overlong: truncate"
        )
    vocab = model_vocab_size(model_dir)
    if vocab is not None and stats.max_token_id >= vocab:
        raise DataError(
            f"models.{model_name}: the tokenizer makes token id {stats.max_token_id} but the "
            f"model's vocab_size is {vocab} (config.json), so training would index past the "
            "embeddings; use the tokenizer that belongs to the model, or resize its embeddings"
        )


def _log_result(stats: Stats, kind: Kind) -> None:
    log.info(
        "tokenized %d %s -> %d examples, %d tokens (%d dropped overlong, %d truncated)",
        stats.conversations,
        kind.noun,
        stats.rows,
        stats.tokens,
        stats.dropped_overlong,
        stats.truncated,
    )
    if line := kind.impl().dropped(stats):
        log.info("%s", line)


def tokenize(
    sources: list[Source],
    model_dir: str | Path,
    out: str | Path,
    max_length: int,
    overlong: str = "drop",
    chat_template: str | None = None,
    model_name: str = "model",
) -> Stats:
    """Tokenize ``sources`` into the parquet file ``out``; return the stats. The kind of
    the sources' data (snaketune.data.kinds: one for all) renders and labels each batch:
    preference data (snaketune.data.pairs) becomes one row per pair.

    Errors about the tokenizer start with ``models.<model_name>``.
    """
    try:
        renderer = renderer_for(model_dir, chat_template)
        tokenizer = renderer.tokenizer
    except DataError as exc:
        raise DataError(f"models.{model_name}: {exc}") from None
    encode = functools.partial(tokenizer.backend_tokenizer.encode_batch, add_special_tokens=False)
    stats = Stats()
    stats.end_of_turn_id = end_of_turn_id(tokenizer, renderer)
    renderer.full_rows = renderer.stopped_rows = 0  # the probe's row is not the data's
    if stats.end_of_turn_id is not None:
        stats.end_of_turn = tokenizer.convert_ids_to_tokens(stats.end_of_turn_id)
        stats.model_stops_at_end_of_turn = stats.end_of_turn_id in stop_ids(model_dir)
    kind = kind_of_sources(s.spec for s in sources)
    table_schema = kind.impl().schema(OUTPUT_SCHEMA)
    label_of = functools.partial(kind.impl().label, schema=table_schema)

    def finish(batch: tuple) -> None:
        items, texts, spans, future = batch
        table = label_of(items, texts, spans, future.result(), max_length, overlong, stats)
        if table.num_rows:
            writer.write_table(table)

    # The Rust encoder releases the GIL: while it encodes batch k on a worker thread, this
    # thread labels batch k-1 and reads and renders batch k+1. Output order is unchanged.
    with pq.ParquetWriter(str(out), table_schema) as writer, ThreadPoolExecutor(1) as pool:
        pending = None
        for items in iter_conversations(sources, stats):
            items, texts, spans = kind.impl().render(renderer, items, stats)
            if not items:
                continue
            submitted = (items, texts, spans, pool.submit(encode, texts))
            if pending is not None:
                finish(pending)
            pending = submitted
        if pending is not None:
            finish(pending)
    check_result(stats, max_length, overlong, model_dir, model_name)
    check_end_of_turn(stats, model_dir, model_name)
    _log_result(stats, kind)
    stats.masks = renderer.describe()
    log.info("models.%s: %s", model_name, stats.masks)
    return stats
