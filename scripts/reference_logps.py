"""The reference model's summed log-probs of every pair of a DPO run's tokenized pairs.

    python scripts/reference_logps.py --tokenized results/tokenized/KEY/data.parquet \
        --model resources/models/tiny --nodes 2 --gpus-per-node 1 --batch-pairs 32 \
        --precision auto --attn-implementation auto \
        --out results/reference_logps/REF/logps.parquet

Data parallel over nodes x gpus_per_node workers, one per device (each holds the model),
started by the train job's launcher (snaketune.train.agents): torchrun agents on this machine,
or one srun task per node inside a SLURM job after the preflight; the stall watch reads
the workers' heartbeats (results/reference_logps/REF/heartbeat/), a worker that fails takes
the others down, and each start of the stage keeps its own log
(results/reference_logps/REF/logs/attempt-<n>.log, snaketune.train.attempts). Each worker writes
its chunks of pairs to ``parts/`` beside the output as it finishes them, so a rerun after a
kill computes only what is missing; the output is written once every chunk is there
(snaketune.evaluation.logps).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.app.cli import run
from snaketune.core import qlora
from snaketune.data.kernels import resolve_attention
from snaketune.evaluation.logps import CHUNK_PAIRS, compute_parts, merge
from snaketune.evaluation.model import resolve_precision


def worker(args: argparse.Namespace, parts: Path) -> int:
    """One device's share: worker RANK of WORLD_SIZE (torchrun's), its heartbeat written."""
    from snaketune.core.imports import load
    from snaketune.train.scoring import worker as run_worker

    load("transformers.modeling_utils")  # the model's loading: no collections meanwhile

    precision = resolve_precision(args.precision)
    quantization = None if args.quantize == "none" else {
        "quantize": args.quantize,
        "quant_type": args.quant_type,
        "double_quant": args.double_quant == "true",
        "compute_dtype": args.compute_dtype,
    }  # fmt: skip
    return run_worker(
        parts,
        lambda rank, workers, on_batch: compute_parts(
            args.tokenized,
            args.model,
            parts,
            rank,
            workers,
            args.batch_pairs,
            precision,
            resolve_attention(args.attn_implementation, args.model),
            qlora.settings(quantization, precision),
            on_batch=on_batch,
            chunk_pairs=args.chunk_pairs,
        ),
    )


def launch(args: argparse.Namespace, shared: list[str], out: Path) -> int:
    """Every worker through the shared launcher, as one attempt of the stage; then the
    output once every chunk is there."""
    from snaketune.train.scoring import Stage
    from snaketune.train.scoring import launch as run_stage

    stage = Stage(
        "reference_logps",
        str(Path(__file__).resolve()),
        shared,
        out,
        args.nodes,
        args.gpus_per_node,
        args.timeout_minutes,
    )

    def finish() -> str:
        table = merge(args.tokenized, stage.parts, out, args.chunk_pairs)
        return f"reference log-probs of {table.num_rows} pairs"

    settings = {
        "precision": args.precision,
        "attn_implementation": args.attn_implementation,
        "quantize": args.quantize,
    }
    return run_stage(stage, finish, settings, {"tokenized": args.tokenized, "model": args.model})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenized", required=True, help="the run's tokenized pairs (parquet)")
    parser.add_argument("--model", required=True, help="the reference model's directory")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the run")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="devices per node")
    parser.add_argument(
        "--batch-pairs",
        "--batch",
        type=int,
        default=8,
        dest="batch_pairs",
        help="pairs per forward pass",
    )
    parser.add_argument(
        "--sharded",
        type=int,
        default=0,
        choices=[0],
        help="every scoring stage's flag (snaketune.budget.scoring); the "
        "reference model is never sharded over the workers: 0",
    )
    parser.add_argument("--precision", default="auto", help="the run's precision")
    parser.add_argument("--attn-implementation", default="auto", help="the run's attention")
    parser.add_argument("--quantize", default="none", choices=["none", "4bit"],
                        help="the run's lora.quantize (a 4-bit base)")  # fmt: skip
    parser.add_argument("--quant-type", default="nf4", help="the run's lora.quant_type")
    parser.add_argument("--double-quant", default="true", choices=["true", "false"],
                        help="the run's lora.double_quant")  # fmt: skip
    parser.add_argument("--compute-dtype", default="auto", help="the run's lora.compute_dtype")
    parser.add_argument("--out", required=True, help="the log-probs parquet to write")
    parser.add_argument("--timeout-minutes", type=float, default=None,
                        help="a worker making no progress this long is named and the stage "
                        "ended (the run's timeout_minutes; default: the schema's)")  # fmt: skip
    parser.add_argument("--chunk-pairs", type=int, default=CHUNK_PAIRS,
                        help="pairs per part file: what a rerun after a kill may compute "
                        f"again (default {CHUNK_PAIRS})")  # fmt: skip
    parser.add_argument("--worker", action="store_true", help="(internal) one worker")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.worker:
        return worker(args, out.parent / "parts")
    shared = ["--tokenized", args.tokenized, "--model", args.model, "--nodes", str(args.nodes),
              "--gpus-per-node", str(args.gpus_per_node), "--batch-pairs", str(args.batch_pairs),
              "--precision", args.precision, "--attn-implementation", args.attn_implementation,
              "--quantize", args.quantize, "--quant-type", args.quant_type,
              "--double-quant", args.double_quant, "--compute-dtype", args.compute_dtype,
              "--out", args.out, "--chunk-pairs", str(args.chunk_pairs)]  # fmt: skip
    return launch(args, shared, out)


if __name__ == "__main__":
    sys.exit(run(main))
