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

Masking: an assistant turn's text runs from the end of the conversation rendered up to
that turn with ``add_generation_prompt=True`` to the end of the conversation rendered
through that turn (so the end-of-turn token is learned). A token is labelled when its
first character lies inside such a span; one that straddles the boundary counts as prompt.

Overlong conversations (more than ``max_length`` tokens) are dropped (``drop``) or cut
(``truncate``; dropped anyway when no response token is left). Counts of both, and of
rows removed by filters, go into the stats JSON.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from snaketune.config import FORMAT_FIELDS, OPTIONAL_FIELDS
from snaketune.errors import DataError

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
BATCH_ROWS = 1024
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
TOKENIZE_VERSION = 1


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


# ----------------------------------------------------------------------------- templates


Turn = tuple[str, str]  # (role, content)

# Contents used to check that a template inserts message contents verbatim: padding,
# blank lines, markup and template syntax must all come out unchanged.
_PROBES = ("", " lead and trail \n", "a\n\nb\t", "<think>x</think>y", "{{ x }} {% y %}", "&<>'\"")


def _sentinel(i: int) -> str:
    return f"\ue000{i}\ue001"


class ChatRenderer:
    """Render conversations with a tokenizer's chat template and find the assistant spans.

    Rendering every row through jinja costs more than encoding it. Most templates insert
    message contents verbatim between fixed pieces of markup, so for each conversation
    shape (its sequence of roles) the renderer derives those pieces once, from a render
    with placeholder contents, checks them against real renders of probe contents, and
    then builds each row by concatenation. Templates that transform contents (trim,
    escape, drop reasoning) fail the check and every row is rendered by jinja.
    """

    def __init__(self, tokenizer, template: str | None = None):
        from transformers.utils.chat_template_utils import _compile_jinja_template

        template = template or tokenizer.chat_template
        if not template:
            raise DataError(
                "the tokenizer has no chat template; "
                "set `chat_template:` (a Jinja file) on the model"
            )
        if isinstance(template, dict):  # named templates: use the default one
            template = template.get("default") or next(iter(template.values()))
        self.template = template
        self._compiled = _compile_jinja_template(template)
        # Template.render() copies the environment's globals into a new context on every
        # call; merge them once and hand jinja a ready context (what render() does next).
        self._base = {**self._compiled.globals, **tokenizer.special_tokens_map}
        self._layouts: dict[tuple[str, ...], tuple | None] = {}

    def render(
        self, turns: list[Turn] | tuple[Turn, ...], add_generation_prompt: bool = False
    ) -> str:
        """The template's text for ``turns`` (what apply_chat_template(tokenize=False) gives)."""
        messages = [{"role": r, "content": c} for r, c in turns]
        ctx = self._compiled.new_context(
            {**self._base, "messages": messages, "add_generation_prompt": add_generation_prompt},
            shared=True,
        )
        return self._compiled.environment.concat(self._compiled.root_render_func(ctx))

    def spans_slow(self, turns: tuple[Turn, ...]) -> tuple[str, list[tuple[int, int]]]:
        """Text and assistant spans, by rendering every prefix through jinja."""
        text = self.render(turns)
        spans = []
        for i, (role, _) in enumerate(turns):
            if role != "assistant":
                continue
            gen = self.render(turns[:i], add_generation_prompt=True)
            through = self.render(turns[: i + 1]) if i + 1 < len(turns) else text
            if not (text.startswith(gen) and text.startswith(through) and len(gen) <= len(through)):
                raise DataError(
                    "the chat template renders a conversation differently from its prefixes, "
                    "so prompt tokens cannot be masked; use another template (`chat_template:`)"
                )
            spans.append((len(gen), len(through)))
        return text, spans

    def _pieces(self, roles: tuple[str, ...], gen: bool) -> list[str] | None:
        turns = [(r, _sentinel(i)) for i, r in enumerate(roles)]
        text = self.render(turns, add_generation_prompt=gen)
        pieces = []
        for i in range(len(roles)):
            head, sep, text = text.partition(_sentinel(i))
            if not sep or _sentinel(i) in text:
                return None
            pieces.append(head)
        return [*pieces, text]

    def _layout(self, roles: tuple[str, ...]) -> tuple | None:
        """Markup pieces of ``roles`` and of each assistant turn's prefixes, or None."""
        if roles in self._layouts:
            return self._layouts[roles]
        full = self._pieces(roles, gen=False)
        marks = []  # per assistant turn: (markup before its content, markup through its end)
        for i, role in enumerate(roles):
            if role == "assistant" and full is not None:
                gen = self._pieces(roles[:i], gen=True)
                through = self._pieces(roles[: i + 1], gen=False)
                if gen is None or through is None:
                    full = None
                    break
                marks.append((len("".join(gen)), len("".join(through)), i))
        layout = None if full is None else (full, marks)
        if layout is not None:
            for k, probe in enumerate(_PROBES):
                turns = tuple((r, f"{probe}{k}{j}") for j, r in enumerate(roles))
                if self._spans_fast(turns, layout) != self.spans_slow(turns):
                    layout = None
                    break
        self._layouts[roles] = layout
        return layout

    @staticmethod
    def _spans_fast(turns: tuple[Turn, ...], layout: tuple) -> tuple[str, list[tuple[int, int]]]:
        full, marks = layout
        parts = [full[0]]
        lengths = [0]
        for (_, content), piece in zip(turns, full[1:], strict=True):
            parts.append(content)
            parts.append(piece)
            lengths.append(lengths[-1] + len(content))
        spans = [(gen + lengths[i], through + lengths[i + 1]) for gen, through, i in marks]
        return "".join(parts), spans

    def spans(self, turns: tuple[Turn, ...]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans [start, end) of its assistant turns."""
        layout = self._layout(tuple(r for r, _ in turns))
        return self.spans_slow(turns) if layout is None else self._spans_fast(turns, layout)

    def check(self, turns: tuple[Turn, ...]) -> None:
        """Compare the fast path with jinja on one real conversation (a spot check per batch)."""
        layout = self._layout(tuple(r for r, _ in turns))
        if layout is not None and self._spans_fast(turns, layout) != self.spans_slow(turns):
            self._layouts[tuple(r for r, _ in turns)] = None
            log.warning(
                "chat template is not verbatim for this data; rendering every row with jinja"
            )


def end_of_turn_id(tokenizer, renderer: ChatRenderer) -> int | None:
    """The special token the chat template closes an assistant turn with (Qwen's and the
    demo's ``<|im_end|>``, Llama 3's ``<|eot_id|>``): the first special token of the markup
    after an assistant message, within its turn. None when that markup has none."""
    turns = (("user", _sentinel(0)), ("assistant", _sentinel(1)))
    try:
        text, spans = renderer.spans_slow(turns)
    except Exception:  # noqa: BLE001 -- a template this probe cannot render: no check
        return None
    start, end = spans[0]
    after = text.find(_sentinel(1), start) + len(_sentinel(1))
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    for token in tokenizer.backend_tokenizer.encode(text[after:end], add_special_tokens=False).ids:
        if token in special:
            return token
    return None


def stop_ids(model_dir: str | Path) -> list[int]:
    """The ids plain ``generate`` stops on: generation_config.json's eos_token_id (else
    config.json's)."""
    model_dir = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            if value is not None:
                return [value] if isinstance(value, int) else list(value)
    return []


def add_end_of_turn(model_dir: Path) -> str | None:
    """Make plain ``generate`` of an exported model stop where its chat template ends an
    assistant turn: add that token to generation_config.json's eos_token_id when missing.
    Returns what was done, in words (None: nothing to do)."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if not tokenizer.chat_template:
        return None
    end = end_of_turn_id(tokenizer, ChatRenderer(tokenizer))
    ids = stop_ids(model_dir)
    if end is None or end in ids:
        return None
    path = model_dir / "generation_config.json"
    config = (GenerationConfig.from_pretrained(model_dir, local_files_only=True)
              if path.is_file() else GenerationConfig())  # fmt: skip
    config.eos_token_id = [*ids, end]
    config.save_pretrained(model_dir)
    name = tokenizer.convert_ids_to_tokens(end)
    return (f"generation_config eos_token_id {ids} -> {[*ids, end]}: {name}, which the chat "
            "template ends an assistant turn with, now stops generation")  # fmt: skip


# ----------------------------------------------------------------------------- rows


def _column(spec: dict[str, Any], fieldname: str) -> str | list[str]:
    return spec.get("columns", {}).get(fieldname, FORMAT_FIELDS[spec["format"]][fieldname])


def needed_columns(spec: dict[str, Any]) -> list[str]:
    """Raw columns a dataset's format and filters read."""
    cols: list[str] = []
    for fieldname in FORMAT_FIELDS[spec["format"]]:
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
    cols = {f: _column(spec, f) for f in FORMAT_FIELDS[fmt]}
    data = {
        c: batch.column(c).to_pylist()
        for col in cols.values()
        for c in (col if isinstance(col, list) else [col])
        if c in batch.schema.names
    }
    out = []
    for i, row in enumerate(rows):
        if fmt == "messages":
            msgs = data[cols["messages"]][i]
            if not isinstance(msgs, list) or not msgs:
                raise DataError(
                    f"datasets.{name} row {row}: `messages` must be a non-empty list of turns; "
                    "clean the data or filter the row out"
                )
            turns = []
            for m in msgs:
                if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                    raise DataError(
                        f"datasets.{name} row {row}: each turn needs role system, user or "
                        "assistant "
                        f"and text content (got {m!r:.80}); clean the data or filter the row out"
                    )
                turns.append((m["role"], _text(m.get("content"), name, row, "content")))
            if not any(role == "assistant" for role, _ in turns):
                raise DataError(
                    f"datasets.{name} row {row}: no assistant turn to learn from; "
                    "clean the data or filter the row out"
                )
            out.append(tuple(turns))
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


def text_sha(turns: tuple[Turn, ...]) -> str:
    """Template-independent hash of a conversation (roles and contents)."""
    blob = "\x1e".join([f"{role}\x1f{content}" for role, content in turns])
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


# ----------------------------------------------------------------------------- filters, mixture


def filter_mask(batch: pa.RecordBatch, filters: list[dict[str, Any]], name: str) -> pa.Array | None:
    """Boolean mask of the rows that pass every filter (None when there are none)."""
    mask = None
    for flt in filters:
        col, op, value = flt["column"], flt["op"], flt["value"]
        arr = batch.column(col)
        if op in ("in", "not_in"):
            hit = pc.is_in(arr, value_set=pa.array(value))
            cond = hit if op == "in" else pc.invert(hit)
        else:
            fn = {
                "==": pc.equal,
                "!=": pc.not_equal,
                "<": pc.less,
                "<=": pc.less_equal,
                ">": pc.greater,
                ">=": pc.greater_equal,
            }[op]
            try:
                cond = fn(arr, pa.scalar(value))
            except (pa.ArrowNotImplementedError, pa.ArrowInvalid) as exc:
                raise DataError(
                    f"datasets.{name}.filters: cannot compare column {col!r} ({arr.type}) "
                    f"with {value!r}; use a value of the column's type"
                ) from exc
        cond = pc.fill_null(cond, False)
        mask = cond if mask is None else pc.and_(mask, cond)
    return mask


def multiplicity(rows: int, weight: float, seed: int, name: str) -> np.ndarray:
    """How many times each raw row enters a mixture: floor(weight), plus one for a seeded
    subset of round(frac * rows) rows."""
    whole = int(np.floor(weight))
    frac = weight - whole
    counts = np.full(rows, whole, dtype=np.int64)
    extra = int(round(frac * rows))
    if extra:
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        counts[rng.choice(rows, size=extra, replace=False)] += 1
    return counts


def _open_source(source: Source) -> pq.ParquetFile:
    pf = pq.ParquetFile(source.path)
    names = pf.schema_arrow.names
    missing = [
        c for c in needed_columns(source.spec) if c not in names and c not in _optional(source.spec)
    ]
    if missing:
        raise DataError(
            f"datasets.{source.name}: column {missing[0]!r} not found "
            f"(columns: {', '.join(names)}); "
            "set `columns:` to map the format's fields to this dataset's columns"
        )
    return pf


def _optional(spec: dict[str, Any]) -> set[str]:
    return {_column(spec, f) for f in OPTIONAL_FIELDS if f in FORMAT_FIELDS[spec["format"]]}


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


# ----------------------------------------------------------------------------- encode


def _first_token_at(enc, char: int, n_tokens: int, text_len: int) -> int:
    """Index of the first token that starts at or after character ``char``."""
    if char >= text_len:
        return n_tokens
    tok = enc.char_to_token(char)
    if tok is None:  # a character no token covers: look at every offset
        return bisect.bisect_left([o[0] for o in enc.offsets], char)
    return tok + 1 if enc.token_to_chars(tok)[0] < char else tok


Items = list[tuple[str, tuple[Turn, ...]]]


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
    total = int(row_start[-1])
    flat = np.fromiter(itertools.chain.from_iterable(ids), np.int32, count=total)

    # +1 where an assistant span starts, -1 where it ends: a running sum > 0 is inside one.
    delta = np.zeros(total + 1, np.int32)
    for i, (enc, sp, text) in enumerate(zip(encodings, spans, texts, strict=True)):
        for s, t in sp:
            a = _first_token_at(enc, s, len(ids[i]), len(text))
            b = _first_token_at(enc, t, len(ids[i]), len(text))
            if b > a:
                delta[row_start[i] + a] += 1
                delta[row_start[i] + b] -= 1
    labelled = np.cumsum(delta[:-1]) > 0

    row_of = np.repeat(np.arange(n), lengths)
    position = np.arange(total) - row_start[:-1][row_of]
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

    if stats.end_of_turn_id is not None:  # kept rows whose labels never close a turn
        ends = np.bincount(row_of[labelled & keep_tok & (flat == stats.end_of_turn_id)],
                           minlength=n)  # fmt: skip
        stats.rows_without_end_of_turn += int((keep_row & (ends == 0)).sum())
    stats.conversations += n
    stats.dropped_overlong += int(overlong_rows.sum()) if overlong != "truncate" else 0
    stats.dropped_no_response += int(no_response.sum())
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
            "set overlong: drop", stats.rows_without_end_of_turn, stats.rows, stats.end_of_turn,
        )  # fmt: skip
    if not stats.model_stops_at_end_of_turn:
        log.warning(
            "models.%s: the chat template ends an assistant turn with %s (id %d), but the "
            "model's generation_config stops only on %s: a tuned model would run on to "
            "max_new_tokens; the exported models get %d added to eos_token_id",
            model_name, stats.end_of_turn, stats.end_of_turn_id, stop_ids(model_dir),
            stats.end_of_turn_id,
        )  # fmt: skip


def load_tokenizer(model_dir: str | Path):
    """The model's fast tokenizer (local files only)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"{model_dir}: cannot load its tokenizer ({reason[:200]}); the model directory "
            "needs the tokenizer files (tokenizer.json, tokenizer_config.json)"
        ) from exc
    if not getattr(tok, "is_fast", False):
        raise DataError(
            f"{model_dir}: the tokenizer has no fast (Rust) version; snaketune needs one"
        )
    return tok


def model_vocab_size(model_dir: str | Path) -> int | None:
    """``vocab_size`` from a model's config.json (its text model's, for multimodal ones)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text(encoding="utf-8"))
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def tokenize(
    sources: list[Source],
    model_dir: str | Path,
    out: str | Path,
    max_length: int,
    overlong: str = "drop",
    chat_template: str | None = None,
    model_name: str = "model",
) -> Stats:
    """Tokenize ``sources`` into the parquet file ``out``; return the stats.

    Errors about the tokenizer start with ``models.<model_name>``.
    """
    try:
        tokenizer = load_tokenizer(model_dir)
        renderer = ChatRenderer(tokenizer, chat_template)
    except DataError as exc:
        raise DataError(f"models.{model_name}: {exc}") from None
    encode = functools.partial(tokenizer.backend_tokenizer.encode_batch, add_special_tokens=False)
    stats = Stats()
    stats.end_of_turn_id = end_of_turn_id(tokenizer, renderer)
    if stats.end_of_turn_id is not None:
        stats.end_of_turn = tokenizer.convert_ids_to_tokens(stats.end_of_turn_id)
        stats.model_stops_at_end_of_turn = stats.end_of_turn_id in stop_ids(model_dir)

    def finish(batch: tuple) -> None:
        items, texts, spans, future = batch
        table = label_batch(items, texts, spans, future.result(), max_length, overlong, stats)
        if table.num_rows:
            writer.write_table(table)

    # The Rust encoder releases the GIL: while it encodes batch k on a worker thread, this
    # thread labels batch k-1 and reads and renders batch k+1. Output order is unchanged.
    with pq.ParquetWriter(str(out), OUTPUT_SCHEMA) as writer, ThreadPoolExecutor(1) as pool:
        pending = None
        for items in iter_conversations(sources, stats):
            texts, spans = render_batch(renderer, items)
            submitted = (items, texts, spans, pool.submit(encode, texts))
            if pending is not None:
                finish(pending)
            pending = submitted
        if pending is not None:
            finish(pending)
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
    check_end_of_turn(stats, model_dir, model_name)
    log.info(
        "tokenized %d conversations -> %d examples, %d tokens (%d dropped overlong, %d truncated)",
        stats.conversations,
        stats.rows,
        stats.tokens,
        stats.dropped_overlong,
        stats.truncated,
    )
    return stats
