"""Benchmark tokenizing a text corpus (format text): tokens/s per core against the fast
tokenizer alone and against the peers' way, 1 part against 2 on this machine's cores,
peak memory at 1x and 4x the documents.

    python bench/corpus.py                       # 10,000 documents (and 40,000 for memory)
    python bench/corpus.py --docs 10000          # quicker
    python bench/corpus.py --tokens 1e9          # a corpus of about that many tokens, end
                                                 # to end (one tokenize job, all cores)

The corpus is made here: documents of pseudo-English words (Zipf-distributed, 40 to 4,000
words each), a byte-level BPE of 8,192 tokens trained on it (tokenizers' trainer), saved as
the model's tokenizer. Each figure runs in a fresh process (imports before the clock):

  ours, 1 process     snaketune.data.tokenization.tokenize, one process, one encoder thread
                      (read parquet, the tokenizer's ends, split at max_length, write parquet)
  ours, chat rows     the same documents as prompt_response rows (first fifth the prompt),
                      ChatML template, one process
  (a) encoder alone   the Rust backend's encode_batch on the documents in memory, one thread
                      (no reading, no splitting, no writing): the limit
  (b) run_clm         transformers' examples/run_clm.py recipe: datasets.map(tokenize,
                      batched) then map(group_texts) into max_length blocks, num_proc = cores
  1 job, 1 process / 1 job, N workers / N parts side by side: the tokenize_dataset script
  as the rules run it (RAYON_NUM_THREADS = the job's threads), wall time
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
ROOT = Path(__file__).resolve().parents[1]
MAX_LENGTH = 2048
SPEC = {"source": "local", "format": "text"}


def make_corpus(path: Path, docs: int, seed: int = 0) -> int:
    """``docs`` documents of pseudo-English into ``path`` (parquet); returns their bytes."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    vocabulary = np.random.default_rng(0)  # the same words whatever the documents' seed
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(vocabulary.choice(letters, vocabulary.integers(1, 10))) for _ in range(5000)]
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    writer, size = None, 0
    for start in range(0, docs, 5000):
        batch = []
        for _ in range(min(5000, docs - start)):
            n = int(np.exp(rng.uniform(np.log(40), np.log(4000))))
            picked = rng.choice(len(words), n, p=weights)
            text = " ".join(words[i] for i in picked)
            batch.append(". ".join(text[i : i + 80] for i in range(0, len(text), 80)))
        size += sum(len(t.encode()) for t in batch)
        table = pa.table({"text": batch})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    return size


def make_model(corpus: Path, out: Path) -> Path:
    """A byte-level BPE of 8,192 tokens trained on ``corpus``, saved as a model's tokenizer
    (end-of-text and ChatML tokens, a ChatML template) with a config.json of its size."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=special)
    texts = pq.read_table(corpus).column("text").to_pylist()[:5000]
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|im_start|>",
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    (out / "config.json").write_text(json.dumps({"vocab_size": len(fast)}))
    return out


# ----------------------------------------------------------------------------- in a child


def child_ours(data: str, model: str, out: str, fmt: str, part: str, workers: str) -> dict:
    from snaketune.data.conversations import Source
    from snaketune.data.tokenization import tokenize
    from snaketune.data.tokens import load_tokenizer

    load_tokenizer(model)
    spec = dict(SPEC, format=fmt)
    if fmt == "prompt_response":
        spec["columns"] = {"prompt": "prompt", "response": "response"}
    p = tuple(map(int, part.split("/"))) if part != "-" else None
    start = time.perf_counter()
    stats = tokenize(
        [Source("c", Path(data), spec)],
        model,
        out,
        MAX_LENGTH,
        part=p,
        workers=int(workers),
        min_rows=1,
    )
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "tokens": stats.tokens,
        "rows": stats.rows,
        "seconds": seconds,
        "peak_rss_mib": max(rss, children),
    }


def child_encoder(data: str, model: str) -> dict:
    import pyarrow.parquet as pq

    from snaketune.data.tokens import load_tokenizer

    backend = load_tokenizer(model).backend_tokenizer
    texts = pq.read_table(data).column("text").to_pylist()
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), 1024):
        tokens += sum(len(e.ids) for e in backend.encode_batch(texts[i : i + 1024]))
    return {"tokens": tokens, "seconds": time.perf_counter() - start}


def child_run_clm(data: str, model: str, cache: str, procs: str) -> dict:
    """transformers' run_clm.py: tokenize with datasets.map, then group_texts."""
    from itertools import chain

    import datasets

    from snaketune.data.tokens import load_tokenizer

    datasets.disable_progress_bars()
    tok = load_tokenizer(model)
    ds = datasets.Dataset.from_parquet(data, cache_dir=cache)

    def tokenize_function(examples):
        return tok(examples["text"])

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total = (len(concatenated["input_ids"]) // MAX_LENGTH) * MAX_LENGTH
        result = {
            k: [t[i : i + MAX_LENGTH] for i in range(0, total, MAX_LENGTH)]
            for k, t in concatenated.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    start = time.perf_counter()
    tokenized = ds.map(
        tokenize_function,
        batched=True,
        num_proc=int(procs),
        remove_columns=["text"],
        load_from_cache_file=False,
    )
    grouped = tokenized.map(
        group_texts, batched=True, num_proc=int(procs), load_from_cache_file=False
    )
    seconds = time.perf_counter() - start
    tokens = sum(len(x) for x in tokenized["input_ids"])
    kept = len(grouped) * MAX_LENGTH
    return {"tokens": tokens, "seconds": seconds, "kept_tokens": kept}


def child(args: list[str], env: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, "--_child", *args]
    full = {**os.environ, **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def script(data: Path, model: Path, out: Path, threads: int, part: str | None = None):
    """tokenize_dataset.py as rule tokenize_dataset / tokenize_part runs it (a Popen)."""
    spec = {
        "dataset": "c",
        "model": "m",
        "max_length": MAX_LENGTH,
        "overlong": "drop",
        "chat_template": None,
        "sources": [{"name": "c", "spec": SPEC, "weight": 1.0, "seed": 0}],
    }
    cmd = [
        sys.executable,
        str(ROOT / "scripts/tokenize_dataset.py"),
        "--spec",
        json.dumps(spec),
        "--data",
        str(data),
        "--model",
        str(model),
        "--out",
        str(out),
        "--stats",
        str(out.with_suffix(".stats.json")),
    ]
    if part:
        cmd += ["--part", part]
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads)}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wall(procs: list) -> float:
    start = time.perf_counter()
    for p in procs:
        if p.wait():
            raise SystemExit(p.stderr.read().decode()[-3000:])
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=10_000, help="documents of the 1x corpus")
    parser.add_argument("--tokens", type=float, help="only: a corpus of this many tokens")
    parser.add_argument("--_child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        what, *rest = args._child
        fn = {"ours": child_ours, "encoder": child_encoder, "run_clm": child_run_clm}[what]
        print(json.dumps(fn(*rest)))
        return 0
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.tokens:
            return billion(tmp, args.tokens, cores)
        data = tmp / "corpus.parquet"
        size = make_corpus(data, args.docs)
        model = make_model(data, tmp / "model")
        import pyarrow as pa
        import pyarrow.parquet as pq

        texts = pq.read_table(data).column("text").to_pylist()
        cut = [len(t) // 5 for t in texts]
        chat = tmp / "chat.parquet"
        pq.write_table(
            pa.table(
                {
                    "prompt": [t[:c] for t, c in zip(texts, cut, strict=True)],
                    "response": [t[c:] for t, c in zip(texts, cut, strict=True)],
                }
            ),
            chat,
        )
        one = {"RAYON_NUM_THREADS": "1"}
        ours = child(["ours", str(data), str(model), str(tmp / "o.parquet"), "text", "-", "1"], one)
        talk = child(
            ["ours", str(chat), str(model), str(tmp / "c.parquet"), "prompt_response", "-", "1"],
            one,
        )
        encoder = child(["encoder", str(data), str(model)], one)
        clm = child(["run_clm", str(data), str(model), str(tmp / "hf"), str(cores)])
        single = wall([script(data, model, tmp / "s1.parquet", 1)])
        workers = wall([script(data, model, tmp / "s2.parquet", cores)])
        parts = wall(
            [
                script(data, model, tmp / f"p{p}.parquet", 1, f"{p:05d}-of-{cores:05d}")
                for p in range(cores)
            ]
        )
        big = tmp / "corpus4.parquet"
        make_corpus(big, 4 * args.docs, seed=1)
        ours4 = child(
            ["ours", str(big), str(model), str(tmp / "o4.parquet"), "text", "-", "1"], one
        )

    def tps(r):
        return r["tokens"] / r["seconds"]

    print(
        f"machine: {cores} cores; corpus: {args.docs:,} documents, {size / 1e6:.1f} MB, "
        f"{ours['tokens']:,} tokens; byte-level BPE of 8,192; max_length {MAX_LENGTH}"
    )
    print(f"{'what':<52}{'tokens/s':>12}{'seconds':>10}{'ours / it':>11}")
    for name, r in (
        ("ours, text, 1 process (per core)", ours),
        ("ours, chat rows, 1 process (per core)", talk),
        ("(a) encoder alone, 1 thread: the limit", encoder),
        (f"(b) run_clm recipe, num_proc {cores}", clm),
    ):
        print(f"{name:<52}{tps(r):>12,.0f}{r['seconds']:>10.2f}{tps(ours) / tps(r):>11.2f}")
    print(
        f"run_clm kept {clm['kept_tokens']:,} of {clm['tokens']:,} tokens (group_texts drops "
        f"each batch's tail); ours kept {ours['tokens']:,} (every token and one end each)"
    )
    print(
        f"the tokenize_dataset job: 1 process {single:.1f} s; {cores} worker processes "
        f"{workers:.1f} s ({workers / single:.2f}x); {cores} parts side by side {parts:.1f} s "
        f"({parts / single:.2f}x)"
    )
    print(
        f"peak RSS, 1 process: {ours['peak_rss_mib']:.0f} MiB at {ours['rows']:,} rows, "
        f"{ours4['peak_rss_mib']:.0f} MiB at {ours4['rows']:,} rows (4x the documents: "
        f"{ours4['peak_rss_mib'] / ours['peak_rss_mib']:.2f}x)"
    )
    return 0


def billion(tmp: Path, tokens: float, cores: int) -> int:
    """A corpus of about ``tokens`` tokens, tokenized end to end by one tokenize job with
    all the cores (its worker processes)."""
    probe = tmp / "probe.parquet"
    make_corpus(probe, 2000)
    model = make_model(probe, tmp / "model")
    per_doc = (
        child(
            ["ours", str(probe), str(model), str(tmp / "p.parquet"), "text", "-", "1"],
            {"RAYON_NUM_THREADS": "1"},
        )["tokens"]
        / 2000
    )
    docs = int(tokens / per_doc)
    data = tmp / "corpus.parquet"
    start = time.perf_counter()
    size = make_corpus(data, docs, seed=2)
    made = time.perf_counter() - start
    proc = script(data, model, tmp / "out.parquet", cores)
    seconds = wall([proc])
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(tmp / "out.parquet").metadata
    stats = json.loads((tmp / "out.stats.json").read_text())
    print(
        f"machine: {cores} cores; {docs:,} documents, {size / 1e9:.2f} GB of text (made in "
        f"{made:.0f} s); tokenized by one job ({cores} worker processes) in {seconds:.0f} s: "
        f"{stats['tokens']:,} tokens, {meta.num_rows:,} rows, {stats['tokens'] / seconds:,.0f} "
        f"tokens/s; peak RSS of a process {rss:.0f} MiB; "
        f"{(tmp / 'out.parquet').stat().st_size / 1e9:.2f} GB written"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
