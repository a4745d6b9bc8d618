"""Convert a run's final DeepSpeed checkpoint to a Hugging Face model or LoRA adapter.

    python scripts/convert_checkpoint.py --method full \
        --checkpoint results/demo/train/final_checkpoint --trained results/demo/train/model \
        --base resources/models/tiny --probe results/demo/train/probe.safetensors \
        --out results/demo/hf --max-shard-size 5GB --dtype auto

Consolidates ZeRO-1/2/3 shards of any world size one parameter at a time (memory bounded
by --max-shard-size), writes safetensors shards with an index, and checks the result's
logits on the training job's probe inputs before renaming it into place.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.app.cli import run


def main(argv: Sequence[str] | None = None) -> int:
    from snaketune.core.imports import load, loading

    with loading():  # torch: no collections meanwhile
        from snaketune.core.provenance import NAME, output_hashes, record, write_provenance
        from snaketune.core.qlora import hide_bitsandbytes, needs_bitsandbytes
        from snaketune.export.adapters import convert_lora
        from snaketune.export.convert import convert_full, export_dtype

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--method",
        dest="adapter",
        choices=["full", "lora"],
        required=True,
        help="what the checkpoint holds: a LoRA adapter or every weight (the run's adapter kind)",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="DeepSpeed checkpoint directory (has `latest`)",
    )
    parser.add_argument(
        "--trained", type=Path, required=True, help="train/model: config, tokenizer, adapter config"
    )
    parser.add_argument(
        "--base",
        type=Path,
        required=True,
        help="base model directory (LoRA shape checks; the inference settings an export keeps)",
    )
    parser.add_argument(
        "--probe", type=Path, required=True, help="probe.safetensors written by the train stage"
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 2GB"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="output dtype (auto: the training precision)",
    )
    args = parser.parse_args(argv)
    # a run that quantized nothing converts without bitsandbytes (peft would import it)
    hide_bitsandbytes(needs_bitsandbytes(args.base, args.trained))
    load("transformers.modeling_utils", *(["peft"] if args.adapter == "lora" else []))
    dtype = export_dtype(args.dtype, args.probe)
    config = {"method": args.adapter, "max_shard_size": args.max_shard_size, "dtype": args.dtype}
    inputs = {"checkpoint": args.checkpoint, "trained": args.trained, "probe": args.probe,
              "base": args.base}  # fmt: skip

    def finish(tmp: Path, report: dict) -> None:
        prov = record("convert_checkpoint", args.out, config, inputs, output_hashes(tmp),
                      report=report)  # fmt: skip
        write_provenance(tmp / NAME, prov)

    if args.adapter == "full":
        report = convert_full(args.checkpoint, args.trained, args.base, args.out,
                              args.max_shard_size, dtype, args.probe, finish)  # fmt: skip
    else:
        report = convert_lora(
            args.checkpoint, args.trained, args.base, args.out, dtype, args.probe, finish
        )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
