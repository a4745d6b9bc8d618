"""Benchmark corpus cleaning (``datasets.<d>.clean``): a corpus of short documents with
planted exact duplicates, near duplicates and held-out passages cleaned the way the stage
runs (its signature jobs over the parts, two side by side on this machine's cores, then the
gather job: scripts/clean_dataset.py as the rules run it), against the same library run by
hand on the same rows in one process (datasketch's MinHash over word 5-grams and its
MinHashLSH, a set of the held-out 13-grams). Wall time, CPU time and peak memory of each job,
and what each removed.

    python bench/clean_corpus.py                   # 1,000,000 documents, 4 parts
    python bench/clean_corpus.py --docs 20000      # quicker

The documents are 10 to 60 words of a 50,000-word vocabulary (numpy's generator, seed 0);
2% are exact copies of an earlier one with their case changed, 2% near copies (one word
in 20 changed, at least one), and 0.5% hold a 20-word passage of one of 1,000 held-out
documents of 100 words.
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
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "exact": True,
    "near": {"threshold": 0.8, "ngram": 5, "num_perm": 128},
    "decontaminate": {"ngram": 13, "min_words": 8, "action": "remove", "against": []},
}
BY_HAND = r"""
import hashlib, json, sys, time
import pyarrow.parquet as pq
from datasketch import MinHash, MinHashLSH
start = time.time()
texts = pq.read_table(sys.argv[1]).column("text").to_pylist()
held = pq.read_table(sys.argv[2]).column("text").to_pylist()
grams = set()
for h in held:
    w = h.lower().split()
    grams.update(" ".join(w[i:i + 13]) for i in range(len(w) - 12))
lsh, seen, out = MinHashLSH(threshold=0.8, num_perm=128), set(), {"heldout": 0, "exact": 0, "near": 0}
def shingles(t):
    w = t.lower().split()
    return [" ".join(w[i:i + 5]).encode() for i in range(max(1, len(w) - 4))]
for i, (t, m) in enumerate(zip(texts, MinHash.generator(map(shingles, texts), num_perm=128, seed=1))):
    w = t.lower().split()
    if any(" ".join(w[j:j + 13]) in grams for j in range(len(w) - 12)):
        out["heldout"] += 1
        continue
    key = hashlib.blake2b(" ".join(w).encode(), digest_size=16).digest()
    if key in seen:
        out["exact"] += 1
        continue
    if lsh.query(m):
        out["near"] += 1
        continue
    seen.add(key)
    lsh.insert(i, m)
print(json.dumps({"removed": out, "s": time.time() - start}))
"""


def make_corpus(folder: Path, docs: int) -> tuple[Path, Path, dict[str, int]]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    vocab = np.array([f"w{i}" for i in range(50_000)])
    held = [" ".join(vocab[rng.integers(0, len(vocab), 100)]) for _ in range(1000)]
    lengths = rng.integers(10, 61, docs)
    words = vocab[rng.integers(0, len(vocab), int(lengths.sum()))]
    cuts = np.concatenate([[0], np.cumsum(lengths)])
    texts = [" ".join(words[cuts[i] : cuts[i + 1]]) for i in range(docs)]
    kinds = rng.random(docs)
    planted = {"exact": 0, "near": 0, "heldout": 0}
    for i in range(docs // 10, docs):
        source = texts[int(rng.integers(0, i // 2))]
        if kinds[i] < 0.02:
            texts[i], planted["exact"] = source.upper(), planted["exact"] + 1
        elif kinds[i] < 0.04:
            ws = source.split()
            for j in rng.choice(len(ws), max(1, len(ws) // 20), replace=False):
                ws[j] = "changed"
            texts[i], planted["near"] = " ".join(ws), planted["near"] + 1
        elif kinds[i] < 0.045:
            passage = " ".join(held[int(rng.integers(0, len(held)))].split()[40:60])
            texts[i], planted["heldout"] = f"{texts[i]} {passage}", planted["heldout"] + 1
    corpus, heldout = folder / "corpus.parquet", folder / "heldout.parquet"
    pq.write_table(pa.table({"text": texts}), corpus, row_group_size=50_000)
    pq.write_table(pa.table({"text": held}), heldout)
    return corpus, heldout, planted


def measured(cmd: list[str]) -> tuple[float, float, float, str]:
    """Wall s, CPU s and peak RSS (MiB) of a command in a process of its own, its stdout."""
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=ENV)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, (cmd, out)
    return time.time() - start, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, out


ENV = {**os.environ, "PYTHONPATH": str(ROOT / "scripts"), "PYTHONWARNINGS": "ignore"}


def ours(corpus: Path, heldout: Path, parts: int, side: int, folder: Path) -> dict:
    spec = {
        "dataset": "corpus",
        "sources": [{"name": "corpus", "spec": {"source": "local", "format": "text"}}],
        "heldout": [{"name": "heldout", "spec": {"source": "local", "format": "text"}}],
        "settings": SETTINGS,
        "version": 1,
    }
    script = [sys.executable, str(ROOT / "scripts/clean_dataset.py"), "--spec", json.dumps(spec)]
    common = [*script, "--heldout", str(heldout)]
    sigs = [folder / f"signatures-{p:05d}-of-{parts:05d}.parquet" for p in range(parts)]
    jobs, start = [], time.time()
    for group in range(0, parts, side):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(side) as pool:
            cmds = [[*common, "--part", f"{p:05d}-of-{parts:05d}", "--data", str(corpus),
                     "--out", str(sigs[p])] for p in range(group, min(group + side, parts))]  # fmt: skip
            jobs += list(pool.map(measured, cmds))
    signed = time.time() - start
    gather = measured([*common, "--signatures", *map(str, sigs), "--out",
                       str(folder / "removed.parquet"), "--report", str(folder / "report.json")])  # fmt: skip
    report = json.loads((folder / "report.json").read_text())
    return {"signatures": jobs, "signed_s": signed, "gather": gather, "report": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--side-by-side", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--make-in", help=argparse.SUPPRESS)  # the corpus made in a child
    args = parser.parse_args()
    if args.make_in:
        print(json.dumps(make_corpus(Path(args.make_in), args.docs)[2]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        t = time.time()
        # made in a process of its own: a job forked from a process holding the corpus would
        # count its pages in its own peak memory (ru_maxrss)
        made = measured([sys.executable, __file__, "--docs", str(args.docs), "--make-in", tmp])
        corpus, heldout, planted = (
            folder / "corpus.parquet",
            folder / "heldout.parquet",
            json.loads(made[3]),
        )
        print(f"corpus: {args.docs:,} documents ({corpus.stat().st_size / 2**20:.0f} MiB), "
              f"planted {planted} in {time.time() - t:.0f} s")  # fmt: skip
        mine = ours(corpus, heldout, args.parts, args.side_by_side, folder)
        hand = measured([sys.executable, "-c", BY_HAND, str(corpus), str(heldout)])
    sig = mine["signatures"]
    print(f"\nours: {args.parts} signature jobs, {args.side_by_side} side by side, then the gather")
    for k, (wall, cpu, rss, _) in enumerate(sig):
        print(f"  signatures part {k}: {wall:6.1f} s wall, {cpu:6.1f} CPU-s, peak {rss:6.0f} MiB")
    wall, cpu, rss, _ = mine["gather"]
    print(f"  gather:            {wall:6.1f} s wall, {cpu:6.1f} CPU-s, peak {rss:6.0f} MiB")
    total_cpu = sum(s[1] for s in sig) + cpu
    print(f"  in all: {mine['signed_s'] + wall:.1f} s wall, {total_cpu:.1f} CPU-s; "
          f"removed {mine['report']['removed']}")  # fmt: skip
    wall, cpu, rss, out = hand
    print(f"by hand (one process): {wall:.1f} s wall, {cpu:.1f} CPU-s, peak {rss:.0f} MiB; "
          f"removed {json.loads(out)['removed']}")  # fmt: skip
    print(f"planted: {planted}")


if __name__ == "__main__":
    main()
