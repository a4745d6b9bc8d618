"""Benchmark tokenize_dataset on the families' real chat templates: rows/s and tokens/s of
snaketune's tokenize (render, find the assistant spans, encode, mask, write) for each way a
template's spans are found, against transformers' own apply_chat_template on the same rows
(render and encode, no masks, no I/O) as the baseline.

    python bench/chat_masks.py                 # 4,000 two-exchange rows per family
    python bench/chat_masks.py --rows 1000

The families are tests/families.py's (tiny tokenizers with each family's template, built
offline); rows are two exchanges (system, user, assistant, user, assistant), reasoning on
every other row.
"""

from __future__ import annotations

import sys

# bench/tokenize.py is named like the stdlib's tokenize module: take this folder off the path
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import argparse  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts")]

FAMILIES = ("llama3", "smollm3", "qwen3.5", "gpt-oss", "glm-4.5")


def main(argv: list[str] | None = None) -> int:
    import pandas as pd
    import pyarrow.parquet as pq
    from families import build, chat_rows
    from transformers import AutoTokenizer

    from snaketune.app.fixtures import make_arith
    from snaketune.data.conversations import Source
    from snaketune.data.tokenization import tokenize
    from snaketune.data.tokens import renderer_for

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000, help="chat rows per family")
    args = parser.parse_args(argv)
    arith = make_arith(2 * args.rows, 8)
    corpus = [f"{r['question']} {r['answer']}" for r in arith["train"][:512]]
    rows = chat_rows(arith["train"], reasoning=True)
    print(f"{len(rows)} rows per family, two exchanges each\n")
    print(
        f"{'family':10} {'masks found by':12} {'ours rows/s':>12} {'tokens/s':>10} "
        f"{'apply_chat_template rows/s':>27} {'ratio':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pd.DataFrame(rows).to_parquet(tmp / "rows.parquet")
        source = Source("chat", tmp / "rows.parquet", {"format": "messages"})
        for name in FAMILIES:
            model = build(name, corpus, tmp / name)
            start = time.perf_counter()
            stats = tokenize([source], model, tmp / f"{name}.parquet", 4096, model_name=name)
            ours = time.perf_counter() - start
            assert pq.read_metadata(tmp / f"{name}.parquet").num_rows == len(rows)
            tokenizer = AutoTokenizer.from_pretrained(model)
            start = time.perf_counter()
            for row in rows:
                tokenizer.apply_chat_template(row["messages"], tokenize=True)
            theirs = time.perf_counter() - start
            spans_by = renderer_for(model, None).spans_by
            print(
                f"{name:10} {spans_by:12} {len(rows) / ours:12,.0f} {stats.tokens / ours:10,.0f} "
                f"{len(rows) / theirs:27,.0f} {theirs / ours:6.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
