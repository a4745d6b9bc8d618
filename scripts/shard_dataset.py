"""Plan every optimizer step of an epoch and write one parquet shard per node.

    python scripts/shard_dataset.py --tokenized results/tokenized/KEY/data.parquet \
        --nodes 2 --gpus-per-node 1 --micro-batch-size 4 --gradient-accumulation-steps 1 \
        --seed 42 --packing --model resources/models/tiny --attn-implementation auto \
        --eval results/tokenized/EVALKEY/data.parquet --run demo --out results/demo/shards

Writes node-{k}.parquet for each node (one row per example, with the step, rank and micro
batch it is trained in) and manifest.json (rows, tokens, sha256 per shard, steps per epoch,
the worst step's token balance across ranks, and the example ids left out to give every
node the same step count). With --packing and --model, a model that cannot train on packed
sequences is refused here, before any training job.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.app.cli import run
from snaketune.core.errors import DataError
from snaketune.core.io import atomic_path, write_json
from snaketune.core.provenance import NAME, output_hashes, record, write_provenance
from snaketune.data.kernels import check_packing, expected_attention
from snaketune.data.shard import Layout, check_overlap, shard


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenized", required=True, help="tokenized parquet")
    parser.add_argument("--nodes", type=int, required=True, help="nodes of the run")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="devices per node")
    parser.add_argument(
        "--micro-batch-size", type=int, required=True, help="examples per device per pass"
    )
    parser.add_argument("--sequence-parallel", type=int, default=1,
                        help="GPUs sharing each sequence (they read the same rows)")  # fmt: skip
    parser.add_argument(
        "--gradient-accumulation-steps", type=int, default=1, help="passes per optimizer step"
    )
    parser.add_argument("--seed", type=int, default=42, help="seed of the shard assignment")
    parser.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="balance each step's tokens across ranks for packed training (default on)",
    )
    parser.add_argument(
        "--pads-unpackable",
        action="store_true",
        help="packing: auto: a model that cannot be packed is trained padded, not refused",
    )
    parser.add_argument("--model", help="the run's model directory (checked for packing)")
    parser.add_argument(
        "--attn-implementation", default="auto", help="the run's attention (packing check)"
    )
    parser.add_argument(
        "--eval", help="the run's tokenized eval set: fail here if it shares training examples"
    )
    parser.add_argument("--run", default="run", help="run name (for messages)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--manifest",
        help="also write the manifest here (the train stage's input: Snakemake compares its "
        "checksum, so shards cut again byte for byte retrain nothing)",
    )
    args = parser.parse_args(argv)
    layout = Layout(args.nodes, args.gpus_per_node, args.micro_batch_size,
                    args.gradient_accumulation_steps, args.sequence_parallel)  # fmt: skip
    if args.packing and args.model and not args.pads_unpackable:
        check_packing(
            args.model, expected_attention(args.attn_implementation, args.model), f"runs.{args.run}"
        )
    try:  # the data errors of this step name the run
        if args.eval:
            check_overlap(Path(args.tokenized), Path(args.eval))
        with atomic_path(args.out) as tmp:
            manifest = shard(args.tokenized, tmp, layout, args.seed, args.packing)
            write_json(tmp / "manifest.json", manifest)
            inputs = {"tokenized": args.tokenized, **({"eval": args.eval} if args.eval else {})}
            skip = ("tokenized", "eval", "out", "model")
            config = {k: v for k, v in vars(args).items() if k not in skip}
            prov = record("shard_dataset", args.out, config, inputs, output_hashes(tmp))
            write_provenance(tmp / NAME, prov)
        if args.manifest:
            write_json(args.manifest, manifest)
    except DataError as exc:
        raise DataError(f"runs.{args.run}: {exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
