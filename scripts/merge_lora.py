"""Merge a LoRA adapter into its base model: one Hugging Face model directory.

    python scripts/merge_lora.py --base resources/models/tiny \
        --adapter results/demo/lora_adapters --probe results/demo/train/probe.safetensors \
        --out results/demo/merged_model --max-shard-size 5GB --dtype auto

Reads the base one tensor at a time and writes shards of at most --max-shard-size. Fails
(leaving no output) when an adapter tensor is empty, when the adapter changes nothing, or
when the merged model's logits differ from base-with-adapter on the probe inputs.
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
        from snaketune.export.adapters import merge_lora
        from snaketune.export.convert import export_dtype

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", type=Path, required=True, help="base model directory")
    parser.add_argument(
        "--adapter", type=Path, required=True, help="adapter directory (convert_checkpoint output)"
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
    hide_bitsandbytes(needs_bitsandbytes(args.base, args.adapter))
    load("transformers.modeling_utils", "peft")  # what loading the base and its adapter imports
    config = {"max_shard_size": args.max_shard_size, "dtype": args.dtype}
    inputs = {"base": args.base, "adapter": args.adapter, "probe": args.probe}

    def finish(tmp: Path, report: dict) -> None:
        prov = record("merge_lora", args.out, config, inputs, output_hashes(tmp), report=report)
        write_provenance(tmp / NAME, prov)

    report = merge_lora(
        args.base,
        args.adapter,
        args.out,
        export_dtype(args.dtype, args.probe),
        args.max_shard_size,
        args.probe,
        finish,
    )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
