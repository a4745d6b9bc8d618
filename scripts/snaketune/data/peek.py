"""What `snaketune validate` and the dry run read of a dataset before any job runs: the
columns and first rows of a local file (a parquet file's first rows; the first lines of
JSON lines or CSV; a JSON array file when it is small), or of a Hub dataset once
downloaded (its parquet), checked against the dataset's config entry as tokenize will read
it (snaketune.data.conversations on those rows): no rows, every missing column (named with
the columns found), a first row not in the dataset's format (tokenize's line for that row;
a preference dataset without a prompt column whose rows are plain text: named at the
dataset). A bad row further on is still found by the tokenize job.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import Any

from snaketune.core.errors import DataError
from snaketune.core.imports import deferred
from snaketune.data.conversations import Source, conversations, missing_columns
from snaketune.data.formats import filter_mask
from snaketune.data.sources import file_format, jsonl_row_problem

pa = deferred("pyarrow")
pacsv = deferred("pyarrow.csv")
pq = deferred("pyarrow.parquet")

PEEK_ROWS = 64  # the rows read of each dataset
MAX_JSON_ARRAY = 64 * 2**20  # a JSON array file is read whole: only up to this size


def _first_file(path: Path) -> Path:
    if not path.is_dir():
        return path
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise DataError(f"{path}: directory holds no data files")
    return files[0]


def _lines(path: Path, rows: int) -> list[str]:
    """The first ``rows`` lines that are not blank, as text."""
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at line {number}); "
                    "re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8"
                ) from None
            if line.strip():
                out.append(line)
            if len(out) == rows:
                break
    return out


def head(path: Path, fmt: str, rows: int = PEEK_ROWS) -> pa.Table | None:
    """The first ``rows`` rows of a local dataset (a file, or a directory's first file) in
    format ``fmt``; None where they cannot be read cheaply (a JSON array over 64 MiB)."""
    first = _first_file(path)
    if fmt == "parquet":
        pf = pq.ParquetFile(first)
        batch = next(pf.iter_batches(batch_size=rows), None)
        return (
            pa.Table.from_batches([batch]) if batch is not None else pf.schema_arrow.empty_table()
        )
    if fmt == "csv":
        lines = _lines(first, rows + 1)  # the header, then the rows
        return pacsv.read_csv(io.BytesIO("".join(lines).encode()))
    with open(first, "rb") as fh:
        array = fh.read(4096).lstrip().startswith(b"[")
    if array:
        if first.stat().st_size > MAX_JSON_ARRAY:
            return None
        records = json.loads(first.read_text(encoding="utf-8"))[:rows]
    else:
        records = [json.loads(line) for line in _lines(first, rows)]
    if not all(isinstance(r, dict) for r in records):
        raise DataError("its rows must be JSON objects")
    return pa.Table.from_pylist(records)


def check_rows(name: str, spec: dict[str, Any], table: pa.Table) -> str | None:
    """The problem tokenize would meet in ``table`` (a dataset's first rows) as dataset
    ``name`` of entry ``spec``: missing columns (all of them, with the columns found), or
    rows that do not read as its format; None when they read."""
    if table.num_rows == 0:
        return f"datasets.{name}: the dataset has no rows; check the path, split or file"
    problem = missing_columns(name, spec, table.schema.names)
    if problem:
        return problem
    batch = table.combine_chunks().to_batches()[0]
    try:
        mask = filter_mask(batch, spec.get("filters", []), name)
        if mask is not None:
            batch = batch.filter(mask)
        conversations(Source(name, Path(), spec), batch, list(range(batch.num_rows)))
    except DataError as exc:  # the row's own line (a row of the first ones)
        return str(exc)
    return None


def check_dataset(name: str, spec: dict[str, Any], path: Path, local: bool) -> str | None:
    """``check_rows`` on the first rows of dataset ``name`` at ``path`` (its local source
    file, or, ``local`` false, the parquet its download wrote)."""
    where = f"datasets.{name}.path" if local else f"datasets.{name}"
    fmt = "parquet"
    try:
        if local:
            fmt = file_format(path, spec.get("file_format"))
        table = head(path, fmt)
    except DataError as exc:  # the download job's own line
        return f"{where}: {exc}"
    except (OSError, ValueError, pa.ArrowException) as exc:
        reason = str(exc).splitlines()[0].split("?: ")[-1] if str(exc) else type(exc).__name__
        row = jsonl_row_problem(path) if fmt == "jsonl" and path.exists() else None
        if row is not None:
            return f"{where}: {path}: {row} (pyarrow: {reason})"
        return (
            f"{where}: {path}: cannot read as {fmt} ({reason}); fix the file, or set "
            "file_format if the extension misleads"
        )
    return None if table is None else check_rows(name, spec, table)


def show_row(renderer, name: str, spec: dict[str, Any], path: Path, local: bool, row: int) -> str:
    """Row ``row`` of dataset ``name`` as tokenize makes it: the rendered text with the
    tokens trained on between « and » (a preference row: its chosen side)."""
    import numpy as np

    from snaketune.data.conversations import Pair
    from snaketune.data.tokenization import labelled_tokens

    fmt = file_format(path, spec.get("file_format")) if local else "parquet"
    table = head(path, fmt, rows=row + 1)
    if table is None or table.num_rows <= row:
        raise DataError(
            f"datasets.{name}: no row {row} (the first rows read: "
            f"{0 if table is None else table.num_rows})"
        )
    batch = table.slice(row, 1).combine_chunks().to_batches()[0]
    (item,) = conversations(Source(name, Path(), spec), batch, [row])
    turns = (*item.prompt, *item.chosen) if isinstance(item, Pair) else item
    turns = (*item.prompt, *item.completion) if hasattr(item, "completion") else turns
    # a conversation's own tuple (its tools, snaketune.data.toolcalls, ride on it)
    text, spans = renderer.spans(turns if isinstance(turns, tuple) else tuple(turns))
    encoding = renderer.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    trained = labelled_tokens([encoding], [spans], [text], np.array([0, len(encoding.ids)]))
    out, inside = [], False
    for token, on in zip(encoding.ids, trained, strict=True):
        if on != inside:
            out.append("«" if on else "»")
            inside = bool(on)
        out.append(renderer.tokenizer.decode([token]))
    return "".join(out) + ("»" if inside else "")
