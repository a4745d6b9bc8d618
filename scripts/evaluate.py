"""Evaluate a model on a held-out tokenized eval set: loss, perplexity, GSM8K exact match.

    python scripts/evaluate.py --model results/demo/merged_model \
        --eval results/tokenized/EVALKEY/data.parquet --train results/tokenized/KEY/data.parquet \
        --base-metrics results/base_eval/EVALKEY/metrics.json --out results/demo/eval \
        --max-new-tokens 256 --batch-size 8

With --lm-eval, also runs those lm-evaluation-harness tasks (metrics.json's lm_eval).
Writes metrics.json, samples.jsonl (prompt, reference, generation, parsed answer,
correct) and provenance.json. With --train, fails first if any eval example is a training
example. With --base-metrics, adds the base model's figures and the gain over them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.app.cli import run


def main(argv: Sequence[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    from snaketune.core.provenance import NAME, output_hashes, record, write_provenance
    from snaketune.evaluation.evaluate import base_pair_logps, evaluate

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True, help="model directory to evaluate")
    parser.add_argument("--eval", type=Path, required=True, help="tokenized eval parquet")
    parser.add_argument("--train", type=Path, help="tokenized training parquet (overlap check)")
    parser.add_argument("--base-metrics", type=Path, help="the base model's metrics.json (gain)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--limit", type=int, default=None, help="first N eval examples (all by default)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=256, help="longest generation")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per batch")
    parser.add_argument(
        "--lm-eval", type=json.loads, default=None,
        help="lm-evaluation-harness settings as JSON (a run's eval.lm_eval block)",
    )  # fmt: skip
    parser.add_argument(
        "--dpo-beta", type=float, default=None,
        help="a DPO run's beta: the implicit rewards of held-out pairs against the base's",
    )  # fmt: skip
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()
    base = json.loads(args.base_metrics.read_text()) if args.base_metrics else None
    inputs = {"model": args.model, "eval": args.eval}
    inputs.update({"train": args.train} if args.train else {})
    inputs.update({"base_metrics": args.base_metrics} if args.base_metrics else {})
    config = {"limit": args.limit, "max_new_tokens": args.max_new_tokens,
              "batch_size": args.batch_size, "lm_eval": args.lm_eval}  # fmt: skip

    def finish(tmp: Path, _: dict) -> None:
        stage = "evaluate" if args.train else "evaluate_base"
        write_provenance(tmp / NAME, record(stage, args.out, config, inputs, output_hashes(tmp)))

    metrics = evaluate(
        args.model,
        args.eval,
        args.train,
        args.out,
        args.limit,
        args.max_new_tokens,
        args.batch_size,
        base,
        finish,
        args.lm_eval,
        base_pair_logps(args.base_metrics.with_name("samples.jsonl"))
        if args.base_metrics
        else None,
        args.dpo_beta,
    )
    print(json.dumps({k: metrics[k] for k in ("loss", "perplexity", "exact_match", "math_verify")}))
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
