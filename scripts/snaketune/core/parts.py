"""A tokenized set in parts, read where its parts are: the set a stage is given is one
parquet file (``data.parquet``: tokenized by one job) or the index of its parts
(``parts.json``: N jobs, ``tokenize_part``, each tokenizing its own rows of the sources).
Every reader of a tokenized set (the shard stage, the scoring stages, evaluation, the
plans) reads it through this module, so the parts are never copied into one file; their
rows, in part order, are the rows one job would have written.

A part is the rows ``[p*T//N, (p+1)*T//N)`` of the sources' rows laid end to end (``T``
of them, before filters and weights): each part reads only the row groups its rows are in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from snaketune.core.errors import ConfigError
from snaketune.core.imports import deferred

pa = deferred("pyarrow")
pq = deferred("pyarrow.parquet")

INDEX = "parts.json"  # a set in parts: its index, beside the part files
PART = re.compile(r"(\d{5})-of-(\d{5})")  # a part's name: 00003-of-00008
PART_PATTERN = r"\d{5}-of-\d{5}"
PART_BYTES = 2**30  # parts: auto: one part for each GiB of the sources' files
MAX_AUTO_PARTS = 64


def part_name(part: int, parts: int) -> str:
    return f"{part:05d}-of-{parts:05d}"


def parse_part(name: str) -> tuple[int, int]:
    """``00003-of-00008`` -> (3, 8)."""
    found = PART.fullmatch(name)
    if found is None or int(found[1]) >= int(found[2]):
        raise ConfigError(f"part {name!r}: not a part (PART-of-PARTS, e.g. 00000-of-00004)")
    return int(found[1]), int(found[2])


def part_files(parts: int) -> list[str]:
    """The part files of a set in ``parts`` parts, beside its index."""
    return [f"part-{part_name(p, parts)}.parquet" for p in range(parts)]


def row_range(part: int, parts: int, total: int) -> tuple[int, int]:
    """The rows of the sources laid end to end that part ``part`` of ``parts`` reads."""
    return part * total // parts, (part + 1) * total // parts


def files(path: str | Path) -> list[Path]:
    """The parquet files of a tokenized set: itself, or the parts its index lists."""
    path = Path(path)
    if path.name != INDEX:
        return [path]
    index = json.loads(path.read_text(encoding="utf-8"))
    return [path.parent / p["file"] for p in index["parts"]]


def exists(path: str | Path) -> bool:
    """Whether a tokenized set is there (an index: with each of its parts)."""
    path = Path(path)
    return path.is_file() and all(f.is_file() for f in files(path))


def num_rows(path: str | Path) -> int:
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files(path))


def names(path: str | Path) -> list[str]:
    """The set's columns."""
    return pq.ParquetFile(files(path)[0]).schema_arrow.names


def read_table(path: str | Path, columns: list[str] | None = None, **kwargs: Any) -> pa.Table:
    """The set's rows (``columns`` of them; ``filters`` as pyarrow's), parts in order (or a
    shard's), every row with its labels: the one reader of tokenized rows, so no stage has
    to remember that a text row stores none (snaketune.core.rows.with_labels)."""
    from snaketune.core.rows import with_labels

    tables = [pq.read_table(f, columns=columns, **kwargs) for f in files(path)]
    return with_labels(tables[0] if len(tables) == 1 else pa.concat_tables(tables))


def iter_batches(
    path: str | Path, batch_size: int, columns: list[str] | None = None
) -> Iterator[pa.RecordBatch]:
    """The set's rows in batches, parts in order."""
    for f in files(path):
        yield from pq.ParquetFile(f).iter_batches(batch_size=batch_size, columns=columns)


def summed(parts: list[dict[str, Any]], stats_type: type) -> dict[str, Any]:
    """The stats of a set from its parts' (``stats_type``: the dataclass they are): counts
    added, maxima the largest, the rest (the template's token and its id, how masks were
    found) the first part's."""
    out: dict[str, Any] = {}
    for f in fields(stats_type):
        values = [p[f.name] for p in parts if f.name in p]
        if not values:
            continue
        if f.name.startswith(("max_", "longest_")):
            out[f.name] = max(values)
        elif f.name == "per_source":
            merged: dict[str, dict[str, int]] = {}
            for v in values:
                for source, counts in v.items():
                    mine = merged.setdefault(source, {})
                    for k, n in counts.items():
                        mine[k] = mine.get(k, 0) + n
            out[f.name] = merged
        elif f.name.endswith("_id"):  # a token's id (the template's end of turn): the same
            out[f.name] = values[0]
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            out[f.name] = sum(values)
        else:
            out[f.name] = values[0]
    return out


def auto_parts(size: int | None) -> int:
    """``parts: auto``: one part per GiB of the sources' files (at most MAX_AUTO_PARTS);
    one where the size is not known yet (a Hub dataset not downloaded)."""
    if not size:
        return 1
    return max(1, min(MAX_AUTO_PARTS, -(-size // PART_BYTES)))


def finished_parts(directory: Path) -> int | None:
    """How many parts a finished tokenized set in ``directory`` has (None: none there)."""
    if (directory / INDEX).is_file():
        return len(json.loads((directory / INDEX).read_text(encoding="utf-8"))["parts"])
    return 1 if (directory / "data.parquet").is_file() else None


def write_index(
    part_paths: list[Path],
    out: Path,
    spec: dict[str, Any],
    stats_type: type,
    check: Callable[[Any], None],
) -> dict[str, Any]:
    """The index of a set in parts (``out``, its parts.json): each part's file, rows and
    sha256, and the set's stats (``stats_type``: snaketune.data.conversations.Stats) summed
    over the parts' (``<part>.stats.json``), checked as one job's would be (``check``, of
    those stats: snaketune.data.tokenization.check_result)."""
    from snaketune.core.io import sha256_file, write_json

    stats = [json.loads(p.with_suffix(".stats.json").read_text()) for p in part_paths]
    total = summed(stats, stats_type)
    check(stats_type(**{k: v for k, v in total.items() if k != "longest_overlong"}))
    index = {
        "parts": [
            {"file": p.name, "rows": pq.ParquetFile(p).metadata.num_rows, "sha256": sha256_file(p)}
            for p in part_paths
        ],
        "stats": {**total, "max_length": spec["max_length"], "overlong": spec["overlong"]},
    }
    write_json(out, index)
    return index


def _one_encoder_thread() -> None:
    """A worker process: one thread for the fast tokenizer's encoder (its siblings use the
    job's other cores), its lines on the job's log."""
    import logging
    import os

    os.environ["RAYON_NUM_THREADS"] = "1"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(process)d: %(message)s")


def in_processes(
    fn: Callable[..., Any], args: tuple, out: Path, ranges: list[tuple[int, int]], extra=()
) -> list[Any]:
    """``fn(*args, piece_k, ranges[k], *extra)`` in a process each (spawned: a fresh
    encoder in each), each writing the parquet file ``piece_k``; the pieces are then
    written into ``out`` in order (their row groups copied, nothing computed again) and
    removed. Returns each call's result, in order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pieces = [out.with_name(f"{out.name}.worker-{k}") for k in range(len(ranges))]
    context = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(
            len(ranges), mp_context=context, initializer=_one_encoder_thread
        ) as pool:
            futures = [
                pool.submit(fn, *args, piece, rows, *extra)
                for piece, rows in zip(pieces, ranges, strict=True)
            ]
            results = [f.result() for f in futures]
        with pq.ParquetWriter(str(out), pq.ParquetFile(pieces[0]).schema_arrow) as writer:
            for piece in pieces:
                file = pq.ParquetFile(piece)
                for group in range(file.num_row_groups):
                    writer.write_table(file.read_row_group(group))
    finally:
        for piece in pieces:
            piece.unlink(missing_ok=True)
    return results


def job_cores(threads: int) -> int:
    """The worker processes a tokenize job runs: its SLURM allocation's CPUs where it runs in
    one (``SLURM_CPUS_PER_TASK``: a profile's cpus_per_task, which may be above the rule's
    threads), else its ``threads``; at most the cores it may run on."""
    import os

    given = os.environ.get("SLURM_CPUS_PER_TASK")
    wanted = int(given) if given and given.isdigit() else threads
    return max(1, min(wanted, len(os.sched_getaffinity(0))))
