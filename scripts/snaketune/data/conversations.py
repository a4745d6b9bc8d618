"""Rows to conversations: a dataset's rows (downloaded parquet, read in batches) in its
format (prompt_response, alpaca, messages) as chat turns, after its filters and its
mixture weight, with the counts of what happened to them (``Stats``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snaketune.core.errors import DataError
from snaketune.core.imports import deferred
from snaketune.data import toolcalls
from snaketune.data.chat import Turn
from snaketune.data.formats import FORMAT_FIELDS, OPTIONAL_FIELDS, filter_mask, multiplicity
from snaketune.data.kinds import fields_read, kind_of_source

np = deferred("numpy")
pa = deferred("pyarrow")
pq = deferred("pyarrow.parquet")

log = logging.getLogger(__name__)

BATCH_ROWS = 1024  # rows read and rendered at a time
# One batch of conversations: (example id, turns), (example id, Pair) for preference data,
# (example id, Labelled) for labelled responses.
Items = list[tuple[str, Any]]


@dataclass(frozen=True)
class Pair:
    """A preference row: the prompt's turns, and the turns of each response after them."""

    prompt: tuple[Turn, ...]
    chosen: tuple[Turn, ...]
    rejected: tuple[Turn, ...]


@dataclass
class Source:
    """One dataset as tokenize reads it: its downloaded parquet and its config entry."""

    name: str
    path: Path
    spec: dict[str, Any]
    weight: float = 1.0
    seed: int = 0
    # the rows its cleaning removed and the documents it cut (snaketune.data.cleaning.Removed)
    removed: Any = None


@dataclass
class Stats:
    """What happened to the rows; written as the stats JSON."""

    rows_read: int = 0
    rows_filtered_out: int = 0
    rows_sampled_out: int = 0
    rows_repeated: int = 0
    rows_cleaned_out: int = 0  # removed by the dataset's cleaning (datasets.<d>.clean)
    conversations: int = 0
    dropped_overlong: int = 0
    truncated: int = 0
    dropped_no_response: int = 0
    # preference pairs: a side empty, both sides the same, prompt tokens that differ
    dropped_empty_pair: int = 0
    dropped_identical_pair: int = 0
    dropped_prompt_mismatch: int = 0
    rows: int = 0
    tokens: int = 0
    label_tokens: int = 0
    max_tokens: int = 0
    max_token_id: int = -1
    longest_overlong: tuple[int, str] = (0, "")  # (tokens, example id), overlong: error
    per_source: dict[str, dict[str, int]] = field(default_factory=dict)
    # the token the chat template closes an assistant turn with (None: the template closes
    # it with no special token), the examples whose labels lack it (cut by max_length), and
    # whether the model's generation_config stops on it
    end_of_turn: str | None = None
    end_of_turn_id: int | None = None
    rows_without_end_of_turn: int = 0
    model_stops_at_end_of_turn: bool | None = None
    masks: str = ""  # how the assistant tokens were found (ChatRenderer.describe)
    template_date: str | None = None  # the day a template that prints the date rendered
    pictures: int = 0  # a picture dataset's pictures kept, and their image tokens
    image_tokens: int = 0
    # text documents (snaketune.data.text): read, split into pieces (longer than
    # max_length), the rows they became, and the UTF-8 bytes their trained tokens cover
    documents: int = 0
    documents_split: int = 0
    document_rows: int = 0
    text_bytes: int = 0
    # what the dataset's cleaning removed, and why (its report.json; every part's the same)
    cleaned: dict[str, Any] = field(default_factory=dict)


def _column(spec: dict[str, Any], fieldname: str) -> str | list[str]:
    return spec.get("columns", {}).get(fieldname, FORMAT_FIELDS[spec["format"]].get(fieldname))


def fields_of(spec: dict[str, Any]) -> list[str]:
    """The fields a dataset's rows are read by: its format's, and ``images`` where
    ``columns.images`` names its pictures (snaketune.data.pictures)."""
    return [*FORMAT_FIELDS[spec["format"]], *fields_read(spec)]


def needed_columns(spec: dict[str, Any]) -> list[str]:
    """Raw columns a dataset's format and filters read."""
    cols: list[str] = []
    for fieldname in fields_of(spec):
        col = _column(spec, fieldname)
        cols.extend(col if isinstance(col, list) else [col])
    cols.extend(f["column"] for f in spec.get("filters", []))
    return list(dict.fromkeys(cols))


def _text(value: Any, name: str, row: int, col: str, optional: bool = False) -> str:
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        what = "null" if value is None else f"of type {type(value).__name__}, not text"
        raise DataError(
            f"datasets.{name} row {row}: column {col!r} is {what}; "
            "clean the data or filter the row out"
        )
    return value


def conversations(source: Source, batch: pa.RecordBatch, rows: list[int]) -> list[tuple[Turn, ...]]:
    """The rows of ``batch`` (raw row numbers ``rows``) as conversations of (role, content)."""
    spec, name = source.spec, source.name
    fmt = spec["format"]
    system = (("system", spec["system_prompt"]),) if "system_prompt" in spec else ()
    cols = {f: _column(spec, f) for f in fields_of(spec)}
    data = {
        c: batch.column(c).to_pylist()
        for col in cols.values()
        for c in (col if isinstance(col, list) else [col])
        if c in batch.schema.names
    }
    out, own = [], getattr(kind_of_source(spec).impl(), "read_row", None)
    for i, row in enumerate(rows):
        if own is not None:  # a format its data kind reads (a labelled response, pictures)
            out.append(own(source, system, cols, data, i, row))
            continue
        if fmt == "messages":
            tools = data[cols["tools"]][i] if cols.get("tools") in data else None
            out.append(message_turns(data[cols["messages"]][i], tools, name, row))
            continue
        if fmt == "prompt_response":
            pcols = cols["prompt"] if isinstance(cols["prompt"], list) else [cols["prompt"]]
            prompt = "\n\n".join(_text(data[c][i], name, row, c) for c in pcols)
            response = _text(data[cols["response"]][i], name, row, cols["response"])
        else:  # alpaca
            prompt = _text(data[cols["instruction"]][i], name, row, cols["instruction"])
            extra = (
                _text(data[cols["input"]][i], name, row, cols["input"], optional=True)
                if cols["input"] in data
                else ""
            )
            if extra.strip():
                prompt = f"{prompt}\n\n{extra}"
            response = _text(data[cols["output"]][i], name, row, cols["output"])
        out.append((*system, ("user", prompt), ("assistant", response)))
    return out


def message_turns(msgs: Any, tools: Any, name: str, row: int) -> tuple[Turn, ...]:
    """A messages row as turns (tool calls and results read and checked:
    snaketune.data.toolcalls), a Tooled conversation where the row declares tools."""
    where = f"datasets.{name} row {row}"
    if not isinstance(msgs, list) or not msgs:
        raise DataError(
            f"{where}: `messages` must be a non-empty list of turns; clean the data or filter "
            "the row out"
        )
    turns = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in toolcalls.ROLES:
            raise DataError(
                f"{where}: each turn needs role system, user, assistant or tool and text content "
                f"(got {m!r:.80}); clean the data or filter the row out"
            )
        calls = toolcalls.calls_of(m, f"{where} turn {j}") if m["role"] == "assistant" else None
        if calls is None:
            turns.append(_turn(m, name, row))
            continue
        turn = _turn({**m, "content": m.get("content") or ""}, name, row)
        turns.append((*turn, None, calls) if len(turn) == 2 else (*turn, calls))
    if not any(turn[0] == "assistant" for turn in turns):
        raise DataError(
            f"{where}: no assistant turn to learn from; clean the data or filter the row out"
        )
    declared = toolcalls.tools_of(tools, where)
    toolcalls.check_calls(tuple(turns), declared, where)
    return toolcalls.Tooled(turns, declared) if declared else tuple(turns)


# Where a row's message keeps its reasoning (TRL's and transformers' names).
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _turn(message: dict, name: str, row: int, col: str = "content") -> Turn:
    """A message as a turn: (role, content), and its reasoning third where it has one."""
    content = _text(message.get("content"), name, row, col)
    reasoning = next((message[k] for k in REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return (message["role"], content)
    return (message["role"], content, _text(reasoning, name, row, "reasoning_content"))


def _turns(value: Any, name: str, row: int, col: str, role: str | None) -> tuple[Turn, ...]:
    """A preference field as turns: text (one turn of ``role``) or a list of messages."""
    if isinstance(value, str):
        return ((role, value),) if role else ()
    if not isinstance(value, list) or not value:
        raise DataError(
            f"datasets.{name} row {row}: column {col!r} must be text or a non-empty list of "
            f"{{role, content}} messages (got {value!r:.60}); clean the data or filter the row out"
        )
    turns = []
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise DataError(
                f"datasets.{name} row {row}: column {col!r}: each message needs role system, "
                f"user or assistant and text content (got {m!r:.80}); clean the data or filter "
                "the row out"
            )
        turns.append(_turn(m, name, row, col))
    return tuple(turns)


def text_sha(turns: tuple[Turn, ...] | Pair) -> str:
    """Template-independent hash of a conversation (roles and contents), or of a pair."""
    if isinstance(turns, Pair):
        turns = (*turns.prompt, *turns.chosen, ("\x1d", ""), *turns.rejected)
    tools = getattr(turns, "tools", None)  # a row's tools are part of it
    tail = [json.dumps(tools, sort_keys=True)] if tools else []
    blob = "\x1e".join(["\x1f".join(v or "" for v in turn) for turn in turns] + tail)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _open_source(source: Source) -> pq.ParquetFile:
    # pre-buffered reads keep every row group read until the file is closed: a corpus of
    # a million documents grew a tokenize worker to 2 GB (docs/benchmarks.md)
    pf = pq.ParquetFile(source.path, pre_buffer=False)
    problem = missing_columns(source.name, source.spec, pf.schema_arrow.names)
    if problem:
        raise DataError(problem)
    return pf


def missing_columns(name: str, spec: dict[str, Any], names: list[str]) -> str | None:
    """The line naming every column dataset ``name`` reads that ``names`` lacks (with the
    columns found and the fix); None when none is missing."""
    optional = optional_columns(spec)
    missing = [c for c in needed_columns(spec) if c not in names and c not in optional]
    if not missing:
        return None
    fields = ", ".join(FORMAT_FIELDS[spec["format"]])
    return (
        f"datasets.{name}: column{'s' * (len(missing) > 1)} "
        f"{', '.join(repr(c) for c in missing)} not found (columns: {', '.join(names)}); "
        f"set `columns:` to map the fields of format {spec['format']} ({fields}) to this "
        "dataset's columns, or fix `format`"
    )


def optional_columns(spec: dict[str, Any]) -> set[str]:
    """The columns a dataset's format may lack (alpaca's input, preference's prompt)."""
    return {_column(spec, f) for f in OPTIONAL_FIELDS.get(spec["format"], ())}


def row_groups(pf: pq.ParquetFile, lo: int, hi: int) -> tuple[list[int], int]:
    """The row groups of ``pf`` that hold its rows ``lo`` .. ``hi`` - 1, and the first row
    of the first of them."""
    groups, first, start = [], None, 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if start < hi and start + n > lo:
            groups.append(g)
            first = start if first is None else first
        start += n
    return groups, first or 0


def row_batches(
    sources: list[Source], rows: tuple[int, int] | None, columns, batch_rows: int = BATCH_ROWS
) -> Iterator[tuple[int, Source, pq.ParquetFile, Any, Any, int]]:
    """(source number, source, its file, a batch of its rows after its filters, their row
    numbers, the rows read before them) over every source; ``rows``: only the rows ``lo`` ..
    ``hi`` - 1 of the sources' rows laid end to end (a part of the set: snaketune.core.parts),
    read from the row groups that hold them; ``columns(spec)``: the columns to read. The one
    reader of a dataset's raw rows, for tokenization and cleaning alike."""
    offset = 0
    for k, source in enumerate(sources):
        pf = _open_source(source)
        total = pf.metadata.num_rows
        lo, hi = (0, total) if rows is None else (rows[0] - offset, rows[1] - offset)
        lo, hi, offset = max(lo, 0), min(hi, total), offset + total
        if lo >= hi:
            continue
        cols = [c for c in columns(source.spec) if c in pf.schema_arrow.names]
        groups, first = row_groups(pf, lo, hi)
        for batch in pf.iter_batches(batch_size=batch_rows, columns=cols, row_groups=groups):
            at, first = first, first + batch.num_rows  # the batch's first row, the next's
            a, b = max(lo - at, 0), min(hi - at, batch.num_rows)
            if a >= b:
                continue
            batch, index = batch.slice(a, b - a), np.arange(at + a, at + b)
            mask = filter_mask(batch, source.spec.get("filters", []), source.name)
            if mask is not None:
                keep = np.asarray(mask.to_numpy(zero_copy_only=False), dtype=bool)
                yield k, source, pf, batch.filter(mask), index[keep], b - a
            else:
                yield k, source, pf, batch, index, b - a


def iter_conversations(
    sources: list[Source], stats: Stats, rows: tuple[int, int] | None = None
) -> Iterator[tuple[Source, list[tuple[str, Any]]]]:
    """Batches of (example_id, conversation) over every source's rows ``rows`` (all: None),
    after filters, cleaning and weights, each with the source it came from (its kind renders
    and labels it)."""
    counts: dict[int, Any] = {}  # by source number: one dataset may be two sources
    for k, source, pf, batch, index, n in row_batches(sources, rows, needed_columns):
        if source.weight != 1.0 and k not in counts:  # drawn over all its rows
            counts[k] = multiplicity(pf.metadata.num_rows, source.weight, source.seed, source.name)
        per = stats.per_source.setdefault(
            source.name, {"read": 0, "kept_by_filters": 0, "emitted": 0}
        )
        stats.rows_read += n
        per["read"] += n
        stats.rows_filtered_out += n - len(index)
        per["kept_by_filters"] += len(index)
        if source.removed is not None:  # its cleaning's (snaketune.data.cleaning)
            keep = source.removed.keep(source.name, index)
            batch, index = batch.filter(pa.array(keep)), index[keep]
            stats.rows_cleaned_out += int((~keep).sum())
            batch = source.removed.edited(source.name, source.spec, batch, index)
        if items := _items(source, batch, index.tolist(), counts.get(k), stats):
            per["emitted"] += len(items)
            yield source, items


def _items(source: Source, batch: Any, rows: list[int], counts: Any, stats: Stats) -> list:
    """A batch's (example_id, conversation) items, each row as many times as its weight
    draws it (``counts``; None: once)."""
    items: list[tuple[str, tuple[Turn, ...]]] = []
    for row, conv in zip(rows, conversations(source, batch, rows), strict=True):
        reps = 1 if counts is None else int(counts[row])
        if reps == 0:
            stats.rows_sampled_out += 1
        stats.rows_repeated += max(reps - 1, 0)
        for copy in range(reps):
            suffix = f":{copy}" if copy else ""
            items.append((f"{source.name}:{row}{suffix}", conv))
    return items
