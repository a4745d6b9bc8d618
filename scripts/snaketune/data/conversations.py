"""Rows to conversations: a dataset's rows (downloaded parquet, read in batches) in its
format (prompt_response, alpaca, messages) as chat turns, after its filters and its
mixture weight, with the counts of what happened to them (``Stats``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from snaketune.core.errors import DataError
from snaketune.data import toolcalls
from snaketune.data.chat import Turn
from snaketune.data.formats import FORMAT_FIELDS, OPTIONAL_FIELDS, filter_mask, multiplicity
from snaketune.data.kinds import fields_read, kind_of_source

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


@dataclass
class Stats:
    """What happened to the rows; written as the stats JSON."""

    rows_read: int = 0
    rows_filtered_out: int = 0
    rows_sampled_out: int = 0
    rows_repeated: int = 0
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
    pictures: int = 0  # a picture dataset's pictures kept, and their image tokens
    image_tokens: int = 0


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
        if fmt == "preference":
            out.append(read_pair(source, system, cols, data, i, row))
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


def read_pair(
    source: Source, system: tuple[Turn, ...], cols: dict[str, Any], data: dict, i: int, row: int
) -> Pair:
    """One preference row as a Pair, in any of TRL's forms: text prompt and responses; a
    prompt message list with assistant turns; or whole conversations sharing their prompt."""
    name = source.name
    raw = {
        f: data[cols[f]][i] if cols[f] in data else None for f in ("prompt", "chosen", "rejected")
    }
    if raw["prompt"] is None:  # whole conversations: text in the HH form, or messages
        chosen = _whole(raw["chosen"], name, row, cols["chosen"])
        rejected = _whole(raw["rejected"], name, row, cols["rejected"])
    else:
        chosen = _turns(raw["chosen"], name, row, cols["chosen"], "assistant")
        rejected = _turns(raw["rejected"], name, row, cols["rejected"], "assistant")
    if raw["prompt"] is None:  # implicit prompt: the turns both conversations share
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    else:
        prompt = _turns(raw["prompt"], name, row, cols["prompt"], "user")
        if isinstance(raw["prompt"], str):
            prompt = (*system, *prompt)
        # whole conversations repeat the prompt's turns: keep what follows them
        if chosen[: len(prompt)] == prompt and len(chosen) > len(prompt):
            chosen = chosen[len(prompt) :]
        if rejected[: len(prompt)] == prompt and len(rejected) > len(prompt):
            rejected = rejected[len(prompt) :]
    if not prompt or any(turn[0] != "assistant" for turn in (*chosen, *rejected)):
        raise DataError(
            f"datasets.{name} row {row}: a preference row needs prompt turns and responses of "
            "assistant turns only (chosen/rejected); clean the data or filter the row out"
        )
    return Pair(prompt, chosen, rejected)


# A turn of a conversation written as text in Anthropic's HH-RLHF form:
# "\n\nHuman: ...\n\nAssistant: ..." (a speaker's name at the start of the text or after a
# blank line).
HH_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant): ?")
# How a preference dataset without a prompt column may hold its pairs (its message names it).
WHOLE_FORMS = "lists of {role, content} messages, or text in the 'Human: ... Assistant: ...' form"


def hh_turns(text: str) -> tuple[Turn, ...] | None:
    """Text in the HH form as turns (Human: user, Assistant: assistant); None where the
    text is not in that form (it does not start with a speaker, or names only one)."""
    parts = HH_TURN.split(text)
    if len(parts) < 5 or parts[0].strip():
        return None
    pairs = zip(parts[1::2], parts[2::2], strict=True)
    return tuple(("user" if who == "Human" else "assistant", said.strip()) for who, said in pairs)


def _whole(value: Any, name: str, row: int, col: str) -> tuple[Turn, ...]:
    """A whole conversation of a preference dataset without a prompt column: messages, or
    text in the HH form. Plain text is refused for the dataset: no prompt can be told from
    it (the fix is a prompt column, or whole conversations)."""
    if not isinstance(value, str):
        return _turns(value, name, row, col, None)
    turns = hh_turns(value)
    if turns is None:
        raise DataError(
            f"datasets.{name}: a preference dataset without a prompt column needs `chosen` and "
            f"`rejected` as whole conversations that share their prompt ({WHOLE_FORMS}); column "
            f"{col!r} holds plain text (row {row}: {value!r:.60}); name the prompt column "
            "(columns.prompt) or give whole conversations"
        )
    return turns


def text_sha(turns: tuple[Turn, ...] | Pair) -> str:
    """Template-independent hash of a conversation (roles and contents), or of a pair."""
    if isinstance(turns, Pair):
        turns = (*turns.prompt, *turns.chosen, ("\x1d", ""), *turns.rejected)
    tools = getattr(turns, "tools", None)  # a row's tools are part of it
    tail = [json.dumps(tools, sort_keys=True)] if tools else []
    blob = "\x1e".join(["\x1f".join(v or "" for v in turn) for turn in turns] + tail)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _open_source(source: Source) -> pq.ParquetFile:
    pf = pq.ParquetFile(source.path)
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


def iter_conversations(
    sources: list[Source], stats: Stats
) -> Iterator[list[tuple[str, tuple[Turn, ...]]]]:
    """Batches of (example_id, conversation) over every source, after filters and weights."""
    for source in sources:
        pf = _open_source(source)
        cols = [c for c in needed_columns(source.spec) if c in pf.schema_arrow.names]
        counts = None
        if source.weight != 1.0:
            counts = multiplicity(pf.metadata.num_rows, source.weight, source.seed, source.name)
        per = stats.per_source.setdefault(
            source.name, {"read": 0, "kept_by_filters": 0, "emitted": 0}
        )
        first = 0
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=cols):
            n = batch.num_rows
            stats.rows_read += n
            per["read"] += n
            index = np.arange(first, first + n)
            mask = filter_mask(batch, source.spec.get("filters", []), source.name)
            if mask is not None:
                keep = np.asarray(mask.to_numpy(zero_copy_only=False), dtype=bool)
                batch, index = batch.filter(mask), index[keep]
                stats.rows_filtered_out += n - len(index)
            per["kept_by_filters"] += len(index)
            rows = index.tolist()
            items: list[tuple[str, tuple[Turn, ...]]] = []
            for row, conv in zip(rows, conversations(source, batch, rows), strict=True):
                reps = 1 if counts is None else int(counts[row])
                if reps == 0:
                    stats.rows_sampled_out += 1
                stats.rows_repeated += max(reps - 1, 0)
                for copy in range(reps):
                    suffix = f":{copy}" if copy else ""
                    items.append((f"{source.name}:{row}{suffix}", conv))
            per["emitted"] += len(items)
            first += n
            if items:
                yield items
