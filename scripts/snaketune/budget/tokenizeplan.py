"""A dataset's tokenization before it runs: its tokens, its time and its disk.

Time is tokens over a measured rate: tokens a second one process writes on one core, by what
it renders (documents need no chat template and go twice as fast as chat rows), as
bench/corpus.py measured them (docs/benchmarks.md), or as this machine's last tokenize job of
the same kind ran them (its tokens over the CPU seconds of its Snakemake benchmark file). A
job runs as many worker processes as its threads where its rows allow (at least
MIN_ROWS_PER_WORKER each: snaketune.data.tokenization), and the parts of a set run side by
side, so the figure is one part's wall time.

Tokens are estimated from the rows' text: the UTF-8 bytes of the columns the format reads in
the first rows of each source, at BYTES_PER_TOKEN, a chat row at most ``max_length`` (longer
ones are dropped or cut), a document whole (its pieces are all kept). The disk is what the
set writes: int32 ids, and labels beside them for chat rows (a document's labels are its ids,
not stored).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from snaketune.budget.rates import stage
from snaketune.plan.pipeline import CLEAN, TOKENIZE

# Tokens a second of one process on one core, imports and I/O included (bench/corpus.py,
# 2 cores, 2026-12-01: docs/benchmarks.md's table of a text corpus).
TOKENS_S_PER_CORE = {"documents": 240_000.0, "chat": 98_000.0}
BYTES_PER_TOKEN = 4.0  # English text under a BPE of 32k-150k tokens; code and others differ
THREADS = 8  # rules tokenize_dataset and tokenize_part: the job's threads
MIN_CPU_S = 60.0  # a measured job shorter than this is mostly its imports: not a rate
SAMPLE_ROWS = 1000
ID_BYTES = 4  # int32 ids and labels
# corpus cleaning's seconds a row (a part's signature job; the gather over every part), its
# jobs' start (datasketch and scipy imported), and a signature's bytes besides its MinHash
# (4 bytes a permutation): bench/clean_corpus.py, docs/benchmarks.md
CLEAN_S_PER_ROW = {"sign": 110e-6, "gather": 95e-6}
CLEAN_JOB_START_S = 1.0
# the gather's memory: a row's MinHash and its 16 LSH buckets, or its exact hash alone; the
# libraries (bench/clean_corpus.py: 6,618 MiB at 1,000,000 rows, a signature job 0.3 GiB)
GATHER_BYTES_PER_ROW = 6_700
EXACT_BYTES_PER_ROW = 250
CLEAN_LIBRARIES_GIB = 0.3
SIGNATURE_BYTES = 40


def kind_word(config: dict[str, Any], dataset: str) -> str:
    """``documents`` where every source of ``dataset`` is raw text, else ``chat``."""
    from snaketune.data.formats import components
    from snaketune.data.kinds import kind_of_source

    specs = [config["datasets"][c["name"]] for c in components(config, dataset)]
    return "chat" if any(kind_of_source(s).chat for s in specs) else "documents"


def measured_rate(workdir: Path, kind: str) -> tuple[float, str] | None:
    """Tokens per CPU second of this machine's newest finished tokenize job (a whole set's or
    a part's) of ``kind`` that ran at least MIN_CPU_S, and where it comes from; None: none."""
    import csv

    found = []
    for bench in (workdir / "benchmarks").glob("tokenize_*/**/*.tsv"):
        rel = bench.relative_to(workdir / "benchmarks")
        if rel.parts[0] == TOKENIZE.name:
            stats = workdir / "results/tokenized" / bench.stem / "stats.json"
        else:  # tokenize_part/<key>/<part>.tsv
            stats = workdir / "results/tokenized" / rel.parts[1] / f"part-{bench.stem}.stats.json"
        try:
            counts = json.loads(stats.read_text())
            with open(bench, newline="") as fh:
                cpu = float(list(csv.DictReader(fh, delimiter="\t"))[-1]["cpu_time"])
        except (OSError, ValueError, KeyError, IndexError):
            continue
        ran = "chat" if counts.get("conversations") else "documents"
        if ran == kind and cpu >= MIN_CPU_S and counts.get("tokens"):
            found.append((bench.stat().st_mtime, counts["tokens"] / cpu, bench))
    if not found:
        return None
    _, rate, bench = max(found)
    return rate, f"this machine's last {kind} tokenize job ({bench.relative_to(workdir)})"


def row_bytes(path: Path, columns: list[str]) -> float | None:
    """Mean UTF-8 bytes of ``columns`` over the first SAMPLE_ROWS rows of a parquet or JSON
    lines file (None: neither, or none of the columns)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        file = pq.ParquetFile(path)
        have = [c for c in columns if c in file.schema_arrow.names]
        if not have:
            return None
        rows = next(file.iter_batches(batch_size=SAMPLE_ROWS, columns=have)).to_pylist()
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as fh:
            rows = [json.loads(line) for _, line in zip(range(SAMPLE_ROWS), fh, strict=False)]
    else:
        return None
    sizes = [sum(_bytes(row.get(c)) for c in columns) for row in rows]
    return sum(sizes) / len(sizes) if sizes else None


def _bytes(value: Any) -> int:
    """UTF-8 bytes of a cell's text (a turn list's contents, as JSON)."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value.encode())
    return len(json.dumps(value, ensure_ascii=False).encode())


def tokens_of(
    config: dict[str, Any], dataset: str, max_length: int, workdir: Path
) -> tuple[float, int, str] | None:
    """Tokens ``dataset`` tokenizes to and its rows (a mixture's components by their
    weights, as snaketune.plan.corpus.source_rows counts them) and how the tokens were
    counted; None where a source cannot be read yet."""
    from snaketune.data.conversations import needed_columns
    from snaketune.data.formats import components
    from snaketune.data.kinds import kind_of_source
    from snaketune.plan.corpus import source_rows, stated

    total, weighted, said, read = 0.0, 0.0, [], False
    for comp in components(config, dataset):
        spec = config["datasets"][comp["name"]]
        path = workdir / "resources/datasets" / comp["name"] / "data.parquet"
        if not path.is_file() and spec.get("source") == "local":
            path = workdir / spec["path"]  # an absolute path stays itself
        size = None if path.is_file() else stated(config, comp["name"])[0]
        if size is not None and size.get("tokens"):  # not downloaded: its card's tokens
            total += size["tokens"] * comp["weight"]
            weighted += size["rows"] * comp["weight"]
            said.append(f"the tokens {size['from']} states")
            continue
        rows = source_rows(config, comp["name"], workdir)
        mean = row_bytes(path, needed_columns(spec)) if path.is_file() else None
        if rows is None or mean is None:
            return None
        per_row, read = mean / BYTES_PER_TOKEN, True
        if kind_of_source(spec).chat:
            per_row = min(per_row, max_length)
        total += rows * comp["weight"] * per_row
        weighted += rows * comp["weight"]
    text = [f"its rows' text at {BYTES_PER_TOKEN:g} bytes a token"] if read else []
    return total, int(weighted), "; ".join(text + said)


def tokenize_plan(
    config: dict[str, Any], dataset: str, max_length: int, workdir: Path, parts: int = 1
) -> dict[str, Any]:
    """One part's seconds (the parts side by side), the tokens, the bytes written and the
    basis of a dataset's tokenization; seconds None where the rows cannot be read yet."""
    from snaketune.data.tokenization import MIN_ROWS_PER_WORKER

    kind = kind_word(config, dataset)
    counted = tokens_of(config, dataset, max_length, workdir)  # each source read once
    if counted is None:
        why = "not estimated: the dataset is not readable yet"
        return {"s": None, "tokens": None, "bytes": None, "basis": why}
    tokens, rows, how = counted
    rate, where = measured_rate(workdir, kind) or (
        TOKENS_S_PER_CORE[kind],
        f"bench/corpus.py's {kind} figure per core",
    )
    workers = max(1, min(THREADS, rows // parts // MIN_ROWS_PER_WORKER))
    seconds = tokens / parts / (rate * workers)
    per_token = ID_BYTES * (2 if kind == "chat" else 1)  # documents store no labels
    basis = (
        f"about {tokens / 1e6:,.1f}M tokens ({how}) at {rate:,.0f} tokens/s a core ({where}), "
        f"{workers} worker process(es) a job"
        + (f", {parts} parts side by side (a part's time)" if parts > 1 else "")
    )
    return {"s": seconds, "tokens": tokens, "bytes": tokens * per_token, "basis": basis}


def clean_rows(config: dict[str, Any], dataset: str, workdir: Path) -> int | None:
    """The rows a dataset's cleaning reads (its sources', a mixture's every component's)."""
    from snaketune.data.formats import components
    from snaketune.plan.corpus import source_rows

    counted = [source_rows(config, c["name"], workdir) for c in components(config, dataset)]
    return None if None in counted else sum(counted)


def clean_memory(config: dict[str, Any], name: str, workdir: Path = Path(".")) -> dict:
    """The gather job's memory of run ``name``'s cleaning ({} where it has none, or its rows
    are not known yet): every kept row's MinHash and LSH's buckets, or its exact hash alone."""
    dataset = config["runs"][name]["dataset"]
    block = (config.get("datasets") or {}).get(dataset)
    rows = clean_rows(config, dataset, workdir) if block and "clean" in block else None
    if rows is None:
        return {}
    per_row = GATHER_BYTES_PER_ROW if block["clean"]["near"] else EXACT_BYTES_PER_ROW
    gib = CLEAN_LIBRARIES_GIB + rows * per_row / 2**30
    why = f"{rows:,} rows at {per_row:,} bytes a row (bench/clean_corpus.py)"
    return {CLEAN.name: {"cpu_gib": round(gib, 2), "why": why}}


def clean_plan(config: dict[str, Any], dataset: str, workdir: Path, parts: int) -> dict[str, Any]:
    """A dataset's cleaning (datasets.<d>.clean): the wall time of one signature job (the
    parts side by side) and then the gather's, and the bytes its signatures take; seconds
    None where its rows are not known yet (snaketune.plan.corpus.source_rows)."""
    rows = clean_rows(config, dataset, workdir)
    if rows is None:
        return {"s": None, "bytes": None, "basis": "not estimated: its rows are not known yet"}
    near = config["datasets"][dataset]["clean"]["near"]
    sign, gather = (CLEAN_S_PER_ROW[k] * (1 if near else 0.3) for k in ("sign", "gather"))
    seconds = 2 * CLEAN_JOB_START_S + rows / parts * sign + rows * gather
    width = 4 * near["num_perm"] if near else 0
    basis = (
        f"{rows:,} rows at {sign * 1e6:.0f} us a row in each of {parts} signature job(s) side "
        f"by side, then {gather * 1e6:.0f} us a row gathered (bench/clean_corpus.py)"
    )
    return {"s": seconds, "bytes": rows * (SIGNATURE_BYTES + width), "basis": basis}


def token_bytes(config: dict[str, Any], name: str, root: Path) -> float:
    """Bytes run ``name``'s tokens will take in the files not written yet: its tokenized
    sets (training and held-out) as tokenize_plan counts them, or as made, and its shards (a
    copy of the training set's rows, ids and labels as stored)."""
    from snaketune.core import parts as tokenized_set
    from snaketune.plan.clean import removed_path
    from snaketune.plan.stages import run_tokenize_spec, tokenized

    run = config["runs"][name]
    sets = [(run["dataset"], tokenized(config, name), True)]
    if run.get("eval_dataset") in config["datasets"]:
        sets.append((run["eval_dataset"], tokenized(config, name, eval_set=True), False))
    total = 0.0
    for dataset, path, sharded in sets:
        made = tokenized_set.exists(root / path)
        if made:
            size = float(sum(f.stat().st_size for f in tokenized_set.files(root / path)))
        else:
            size = tokenize_plan(config, dataset, run["max_length"], root)["bytes"] or 0.0
            total += size
        if sharded and not (root / "results" / name / "shards").is_dir():
            total += size
    spec = run_tokenize_spec(config, name)
    if "clean" in spec and not (root / removed_path(spec["clean"])).is_file():
        total += clean_plan(config, run["dataset"], root, spec.get("parts", 1))["bytes"] or 0.0
    return total


def tokenize_cost(
    config: dict[str, Any], dataset: str, max_length: int, workdir: Path, parts: int = 1
) -> dict[str, Any]:
    """A dataset's tokenization: one part's wall time (snaketune.budget.tokenizeplan)."""
    plan = tokenize_plan(config, dataset, max_length, workdir, parts)
    return stage(plan["s"], 0, plan["basis"])


def clean_cost(config: dict[str, Any], dataset: str, run: str, workdir: Path) -> dict[str, Any]:
    """A dataset's cleaning before its tokenization, where asked and not done yet."""
    from snaketune.plan.clean import clean_key, removed_path
    from snaketune.plan.stages import run_tokenize_spec

    spec = run_tokenize_spec(config, run)
    if dataset != spec["dataset"] or "clean" not in spec:
        return {}
    if (workdir / removed_path(spec["clean"])).is_file():
        return {}
    plan = clean_plan(config, dataset, workdir, spec.get("parts", 1))
    return {f"{CLEAN.name} {clean_key(spec['clean'])}": stage(plan["s"], 0, plan["basis"])}
