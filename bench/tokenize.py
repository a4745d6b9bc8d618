"""Benchmark tokenize_dataset: throughput against the raw fast tokenizer and datasets.map,
and peak memory at two dataset sizes 10x apart.

    python bench/tokenize.py                      # 200k and 20k examples
    python bench/tokenize.py --rows 50000         # quicker

Prints tokens/s of
  ours         snaketune.data.tokenization.tokenize (read parquet, chat template, encode, mask,
               length policy, write parquet)
  (a) raw      tokenizer(texts) in batches of 1024 on the already-templated texts, and the
               Rust backend's encode_batch on the same texts (no template, no masks, no I/O)
  (b) map      datasets.Dataset.map(batched=True) applying the chat template and the tokenizer
and the peak RSS of `ours` run alone in a fresh process at --rows and --rows/10.
Targets (issue 2): ours >= 0.8 x (a) and faster than (b); peak RSS within 1.3x.
"""

from __future__ import annotations

import sys

# bench/tokenize.py is named like the stdlib's tokenize module, which Python would import
# from this folder (first on sys.path when a script here runs): take the folder off the path.
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import argparse
import json
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

SPEC = {"format": "prompt_response", "columns": {"prompt": "question", "response": "answer"}}


def make_data(out: Path, rows: int) -> Path:
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from snaketune.app.fixtures import _problem

    rng = random.Random(rows)
    path = out / f"data-{rows}.parquet"
    writer = None
    for start in range(0, rows, 10_000):
        batch = [_problem(rng) for _ in range(min(10_000, rows - start))]
        table = pa.Table.from_pylist(batch)
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    return path


def run_ours(data: Path, model: Path, out: Path) -> dict:
    """tokenize() in this process; returns tokens, seconds, peak RSS (MiB)."""
    from snaketune.data.conversations import Source
    from snaketune.data.tokenization import tokenize
    from snaketune.data.tokens import load_tokenizer

    load_tokenizer(model)  # imports done before the clock starts, as for the baselines
    start = time.perf_counter()
    stats = tokenize([Source("bench", data, SPEC)], model, out, max_length=512)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"tokens": stats.tokens, "rows": stats.rows, "seconds": seconds, "peak_rss_mib": rss}


def in_subprocess(data: Path, model: Path, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--_child", str(data), str(model), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_raw(data: Path, model: Path) -> dict:
    import pyarrow.parquet as pq

    from snaketune.data.chat import ChatRenderer
    from snaketune.data.tokens import load_tokenizer

    tok = load_tokenizer(model)
    renderer = ChatRenderer(tok)
    rows = pq.read_table(data).to_pylist()
    texts = [renderer.render([("user", r["question"]), ("assistant", r["answer"])]) for r in rows]
    out = {}
    for name, fn in (
        ("hf_call", lambda b: tok(b, add_special_tokens=False)["input_ids"]),
        ("backend", lambda b: tok.backend_tokenizer.encode_batch(b, add_special_tokens=False)),
    ):
        fn(texts[:1024])  # warm up
        start = time.perf_counter()
        tokens = 0
        for i in range(0, len(texts), 1024):
            enc = fn(texts[i : i + 1024])
            tokens += sum(len(e) for e in enc)
        out[name] = {"tokens": tokens, "seconds": time.perf_counter() - start}
    return out


def run_map(data: Path, model: Path, cache: Path) -> dict:
    import datasets

    from snaketune.data.tokens import load_tokenizer

    datasets.disable_progress_bars()
    tok = load_tokenizer(model)
    ds = datasets.Dataset.from_parquet(str(data), cache_dir=str(cache))

    def encode(batch):
        convs = [
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            for q, a in zip(batch["question"], batch["answer"], strict=True)
        ]
        texts = tok.apply_chat_template(convs, tokenize=False)
        return tok(texts, add_special_tokens=False)

    start = time.perf_counter()
    out = ds.map(
        encode,
        batched=True,
        batch_size=1024,
        remove_columns=ds.column_names,
        load_from_cache_file=False,
    )
    seconds = time.perf_counter() - start
    return {"tokens": sum(len(x) for x in out["input_ids"]), "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=200_000, help="examples in the large dataset")
    parser.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        data, model, out = map(Path, args._child)
        print(json.dumps(run_ours(data, model, out)))
        return 0

    from snaketune.app.fixtures import make_fixtures

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_fixtures(tmp / "fixtures")["model"]
        big = make_data(tmp, args.rows)
        small = make_data(tmp, args.rows // 10)
        ours = in_subprocess(big, model, tmp / "out-big.parquet")
        ours_small = in_subprocess(small, model, tmp / "out-small.parquet")
        raw = run_raw(big, model)
        mapped = run_map(big, model, tmp / "hf-cache")

    def tps(r):
        return r["tokens"] / r["seconds"]

    print(
        f"machine: {os.cpu_count()} cores; tokenizer: fixture byte-level BPE; "
        f"{ours['rows']} examples, {ours['tokens']} tokens"
    )
    print(f"{'what':<44}{'tokens/s':>12}{'seconds':>10}{'ours / it':>11}")
    for name, r in (
        ("ours: tokenize_dataset", ours),
        ("(a) tokenizer(texts), batches of 1024", raw["hf_call"]),
        ("(a') backend encode_batch, same texts", raw["backend"]),
        ("(b) datasets.map(batched=True)", mapped),
    ):
        print(f"{name:<44}{tps(r):>12,.0f}{r['seconds']:>10.2f}{tps(ours) / tps(r):>11.2f}")
    ratio = ours["peak_rss_mib"] / ours_small["peak_rss_mib"]
    print(
        f"peak RSS of ours: {ours_small['peak_rss_mib']:.0f} MiB at {ours_small['rows']} examples, "
        f"{ours['peak_rss_mib']:.0f} MiB at {ours['rows']} examples (ratio {ratio:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
