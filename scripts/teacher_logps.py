"""A teacher's top-k log-probs of every label token of a distillation run's tokenized rows.

    python scripts/teacher_logps.py --tokenized results/tokenized/KEY/data.parquet \
        --model results/teacher/hf --student-model resources/models/tiny --top-k 32 \
        --nodes 2 --gpus-per-node 1 --batch-rows 8 --precision auto \
        --attn-implementation auto --out results/teacher_logps/KEY/topk.parquet

Data parallel over nodes x gpus_per_node workers, one per device, each holding the teacher
(or, ``--sharded 1``, for a teacher larger than one GPU, its weights sharded over them all),
started like the reference stage's (snaketune.train.scoring: the train job's launcher,
heartbeats, one log per attempt, chunks written to ``parts/`` as they finish, so a rerun
after a kill computes only what is missing). The teacher must tokenize as the student
does (the rows were tokenized with the student's tokenizer): another tokenizer ends the
stage in one line before any worker starts. What it writes: snaketune.evaluation.topk.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.app.cli import run
from snaketune.data.kernels import resolve_attention
from snaketune.evaluation.logps import CHUNK_PAIRS, merge
from snaketune.evaluation.model import resolve_precision
from snaketune.evaluation.topk import compute_parts


def worker(args: argparse.Namespace, parts: Path) -> int:
    """One device's share: worker RANK of WORLD_SIZE (torchrun's), its heartbeat written."""
    from snaketune.core.imports import load
    from snaketune.train.scoring import worker as run_worker

    load("transformers.modeling_utils")  # the model's loading: no collections meanwhile

    precision = resolve_precision(args.precision)
    attention = resolve_attention(args.attn_implementation, args.model)

    def compute(rank: int, workers: int, on_batch) -> int:
        return compute_parts(
            args.tokenized,
            args.model,
            parts,
            rank,
            workers,
            args.batch_rows,
            args.top_k,
            precision,
            attention,
            on_batch,
            args.chunk_rows,
        )

    return run_worker(parts, compute)


def launch(args: argparse.Namespace, shared: list[str], out: Path) -> int:
    """The tokenizers compared, every worker through the shared launcher as one attempt of
    the stage, then the output once every chunk is there."""
    from snaketune.methods.teachers import check_tokenizers
    from snaketune.train.scoring import Stage
    from snaketune.train.scoring import launch as run_stage

    if args.student_model:
        check_tokenizers(args.student_model, args.model, "distill.teacher")
    stage = Stage(
        "teacher_logps",
        str(Path(__file__).resolve()),
        shared,
        out,
        args.nodes,
        args.gpus_per_node,
        args.timeout_minutes,
    )

    def finish() -> str:
        table = merge(args.tokenized, stage.parts, out, args.chunk_rows, "teacher log-probs")
        return f"the teacher's top-{args.top_k} log-probs of {table.num_rows} examples"

    settings = {
        "top_k": args.top_k,
        "precision": args.precision,
        "attn_implementation": args.attn_implementation,
    }
    return run_stage(stage, finish, settings, {"tokenized": args.tokenized, "model": args.model})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenized", required=True, help="the run's tokenized rows (parquet)")
    parser.add_argument("--model", required=True, help="the teacher's directory")
    parser.add_argument(
        "--student-model",
        default=None,
        help="the student's directory: its tokenizer must be the teacher's",
    )
    parser.add_argument("--top-k", type=int, default=32, help="log-probs kept per token")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the run")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="devices per node")
    parser.add_argument(
        "--batch-rows",
        "--batch",
        type=int,
        default=8,
        dest="batch_rows",
        help="rows per forward pass",
    )
    parser.add_argument("--precision", default="auto", help="the run's precision")
    parser.add_argument("--attn-implementation", default="auto", help="the run's attention")
    parser.add_argument("--out", required=True, help="the top-k parquet to write")
    parser.add_argument(
        "--timeout-minutes",
        type=float,
        default=None,
        help="a worker making no progress this long is named and the stage "
        "ended (the run's timeout_minutes; default: the schema's)",
    )
    parser.add_argument(
        "--chunk-rows",
        type=int,
        default=CHUNK_PAIRS,
        help="rows per part file: what a rerun after a kill may compute "
        f"again (default {CHUNK_PAIRS})",
    )
    parser.add_argument(
        "--sharded",
        type=int,
        default=0,
        choices=[0, 1],
        help="1: the teacher's weights sharded over every worker (ZeRO-3, as "
        "the evaluation shards a model larger than one GPU; the plan decides)",
    )
    parser.add_argument("--worker", action="store_true", help="(internal) one worker")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.worker:
        return worker(args, out.parent / "parts")
    shared = [
        "--tokenized",
        args.tokenized,
        "--model",
        args.model,
        "--top-k",
        str(args.top_k),
        "--nodes",
        str(args.nodes),
        "--gpus-per-node",
        str(args.gpus_per_node),
        "--batch-rows",
        str(args.batch_rows),
        "--precision",
        args.precision,
        "--attn-implementation",
        args.attn_implementation,
        "--out",
        args.out,
        "--chunk-rows",
        str(args.chunk_rows),
    ]
    return launch(args, shared, out)


if __name__ == "__main__":
    sys.exit(run(main))
