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
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

from snaketune.core.imports import deferred
from snaketune.core.parts import row_range
from snaketune.core.rows import IGNORE_INDEX
from snaketune.data.chat import TEMPLATE_DATE, ChatRenderer
from snaketune.data.conversations import Items, Source, Stats, iter_conversations, text_sha
from snaketune.data.kinds import Encoded, Kind, kind_of_source, kind_of_sources
from snaketune.data.tokens import (
    check_end_of_turn,
    check_result,
    first_token_at,
    tokenizer_for,
)

np = deferred("numpy")
pa = deferred("pyarrow")
pq = deferred("pyarrow.parquet")

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


def label_batch(b: Encoded) -> pa.Table:
    """Labels and length policy for one encoded batch; the rows kept, as a table.

    Per row, Python only finds each assistant span's first and last token; the labels,
    the length policy and the output columns are computed on the whole batch with numpy.
    """
    items, encodings, max_length, stats = b.items, b.encodings, b.max_length, b.stats
    n = len(items)
    ids = [enc.ids for enc in encodings]
    lengths = np.fromiter(map(len, ids), np.int64, count=n)
    row_start = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=row_start[1:])
    flat = np.fromiter(itertools.chain.from_iterable(ids), np.int32, count=int(row_start[-1]))
    labelled = labelled_tokens(encodings, b.spans, b.texts, row_start)
    keep_row, keep_tok, row_of = keep_rows(
        items, lengths, row_start, labelled, max_length, b.overlong, stats
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


label = label_batch


def dropped(stats: Stats) -> str:
    return ""


batch = None  # its methods collate rows themselves (packing, padding-free)


def _log_result(stats: Stats, kind: Kind, modules: Iterable[ModuleType]) -> None:
    log.info(
        "tokenized %d %s -> %d examples, %d tokens (%d dropped overlong, %d truncated)",
        stats.conversations + stats.documents,
        kind.noun,
        stats.rows,
        stats.tokens,
        stats.dropped_overlong,
        stats.truncated,
    )
    for module in dict.fromkeys(modules):  # each kind's own line (documents beside chat)
        if line := module.dropped(stats):
            log.info("%s", line)


def num_rows(path: str | Path) -> int:
    return pq.ParquetFile(path).metadata.num_rows


def module_of(kind: Kind, source: Source) -> ModuleType:
    """What renders and labels a source's rows: the sources' ``kind``, or the source's own
    where it joins that kind's rows (documents beside chat rows)."""
    own = kind_of_source(source.spec)
    return own.impl() if own.joins else kind.impl()


def part_rows(sources: list[Source], part: tuple[int, int] | None) -> tuple[int, int] | None:
    """The rows of the sources laid end to end that ``part`` (p, N) reads (None: all)."""
    if part is None:
        return None
    return row_range(*part, sum(num_rows(s.path) for s in sources))


MIN_ROWS_PER_WORKER = 20_000  # fewer rows a worker: one process (a worker starts in ~2 s)
PROGRESS_S = 10.0  # a progress line every this many seconds


def tokenize(
    sources: list[Source],
    model_dir: str | Path,
    out: str | Path,
    max_length: int,
    overlong: str = "drop",
    chat_template: str | None = None,
    model_name: str = "model",
    part: tuple[int, int] | None = None,
    workers: int = 1,
    min_rows: int = MIN_ROWS_PER_WORKER,
    template_date: str = TEMPLATE_DATE,
) -> Stats:
    """Tokenize ``sources`` into the parquet file ``out``; return the stats. The kind of
    the sources' data (snaketune.data.kinds: one for all) renders and labels each batch:
    preference data (snaketune.data.pairs) becomes one row per pair.

    Errors about the tokenizer start with ``models.<model_name>``. ``part``: (p, N), only
    part p of N of the sources' rows (snaketune.core.parts). ``workers``: processes that
    render and encode (the job's threads), each its own consecutive rows (at least
    ``min_rows`` each), their files written into ``out`` in order: the same rows as one.
    ``template_date``: the day a chat template that prints today's date renders.
    """
    span = part_rows(sources, part) or (0, sum(num_rows(s.path) for s in sources))
    n = max(1, min(workers, (span[1] - span[0]) // max(min_rows, 1)))
    args = (sources, model_dir, max_length, overlong, chat_template, model_name, template_date)
    if part is not None:
        log.info("part %05d-of-%05d: rows %d-%d of the sources", part[0], part[1], *span)
    if n == 1:
        stats = tokenize_rows(*args, out, span, whole=part is None)
    else:
        stats = in_workers(args, Path(out), span, n, whole=part is None)
    if part is not None:  # a part's own summary (a whole set's is logged where it is checked)
        kind = kind_of_sources(s.spec for s in sources)
        _log_result(stats, kind, [kind.impl(), *(module_of(kind, s) for s in sources)])
    return stats


def tokenize_rows(
    sources: list[Source],
    model_dir: str | Path,
    max_length: int,
    overlong: str,
    chat_template: str | None,
    model_name: str,
    template_date: str,
    out: str | Path,
    rows: tuple[int, int],
    whole: bool = True,
) -> Stats:
    """The rows ``rows`` of the sources laid end to end tokenized into ``out`` in this
    process (``whole``: all of a set's, checked as a set)."""
    kind = kind_of_sources(s.spec for s in sources)
    stats = Stats()
    renderer, tokenizer = tokenizer_for(
        sources, model_dir, chat_template, model_name, stats, template_date
    )
    encode = functools.partial(tokenizer.backend_tokenizer.encode_batch, add_special_tokens=False)
    table_schema = kind.impl().schema(OUTPUT_SCHEMA)

    def finish(batch: tuple) -> None:
        module, items, texts, spans, future = batch
        encodings = future.result()
        encoded = Encoded(items, texts, spans, encodings, max_length, overlong, stats)
        table = module.label(encoded.of(table_schema, tokenizer))
        if table.num_rows:
            writer.write_table(table)

    # The Rust encoder releases the GIL: while it encodes batch k on a worker thread, this
    # thread labels batch k-1 and reads and renders batch k+1. Output order is unchanged.
    progress = Progress(rows[1] - rows[0])
    with pq.ParquetWriter(str(out), table_schema) as writer, ThreadPoolExecutor(1) as pool:
        pending = None
        for source, items in iter_conversations(sources, stats, rows):
            progress.tell(stats.rows_read)
            module = module_of(kind, source)
            items, texts, spans = module.render(renderer, items, stats)
            if not items:
                continue
            submitted = (module, items, texts, spans, pool.submit(encode, texts))
            if pending is not None:
                finish(pending)
            pending = submitted
        if pending is not None:
            finish(pending)
    check_result(stats, max_length, overlong, model_dir, model_name, whole=whole)
    if renderer is not None and stats.conversations and whole:
        check_end_of_turn(stats, model_dir, model_name)
    stats.masks = renderer.describe() if renderer is not None else "documents: no chat template"
    if whole:
        _log_result(stats, kind, [kind.impl(), *(module_of(kind, s) for s in sources)])
        log.info("models.%s: %s", model_name, stats.masks)
    return stats


class Progress:
    """A line every PROGRESS_S seconds: the rows read of ``total``, their rate and the time
    left."""

    def __init__(self, total: int):
        self.total, self.began = total, time.monotonic()
        self.next = self.began + PROGRESS_S

    def tell(self, done: int) -> None:
        now = time.monotonic()
        if now < self.next or not done:
            return
        self.next = now + PROGRESS_S
        rate = done / (now - self.began)
        left = (self.total - done) / rate
        line = "tokenize: %d of %d rows, %.0f rows/s, about %.0f s left"
        log.info(line, done, self.total, rate, left)


def in_workers(args: tuple, out: Path, span: tuple[int, int], n: int, whole: bool) -> Stats:
    """The rows ``span`` tokenized by ``n`` worker processes, each its consecutive 1/n of
    them into a file of its own; the files are written into ``out`` in order (row groups
    copied, nothing encoded again) and their stats summed, checked as one pass's."""
    import dataclasses

    from snaketune.core.parts import in_processes, summed

    lo, hi = span
    ranges = [(lo + a, lo + b) for a, b in (row_range(k, n, hi - lo) for k in range(n))]
    parts = [
        dataclasses.asdict(stats)
        for stats in in_processes(tokenize_rows, args, out, ranges, extra=(False,))
    ]
    total = summed(parts, Stats)
    stats = Stats(**{**total, "longest_overlong": tuple(total["longest_overlong"])})
    sources, model_dir, max_length, overlong, _, model_name, _ = args
    check_result(stats, max_length, overlong, model_dir, model_name, whole=whole)
    kind = kind_of_sources(s.spec for s in sources)
    if whole:
        _log_result(stats, kind, [kind.impl(), *(module_of(kind, s) for s in sources)])
    log.info("tokenized in %d worker processes (rows %d-%d)", n, lo, hi)
    return stats
