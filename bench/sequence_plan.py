"""The memory plan of a long-context LoRA run with sequence parallelism: per GPU, for
sequence_parallel N = 1, 2, 4, 8, of config/examples/llama3.1-8b-32k-lora-sp-1x8.yaml
(Llama 3.1 8B, 32,768-token packed rows, ZeRO-3 on one node of 8 H100 80 GB).

    python bench/sequence_plan.py            # a table
    python bench/sequence_plan.py --json     # the same as JSON

The split divides what each GPU holds of a sequence (activations, logits); the weights,
gradients and optimizer states are ZeRO-3's share of the 8 GPUs whatever N is. The
model's shape is Llama 3.1 8B's config.json (written here: nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

# bench/tokenize.py would stand in for the standard library's tokenize (jsonschema reads
# it): run again without this folder on the path (python -P)
if not sys.flags.safe_path:
    os.execv(sys.executable, [sys.executable, "-P", __file__, *sys.argv[1:]])

from snaketune.budget.advice import plan_run
from snaketune.budget.fit import setup_of
from snaketune.budget.memplan import GPUS, Shape
from snaketune.plan.config import load_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "config/examples/llama3.1-8b-32k-lora-sp-1x8.yaml"
LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False}  # fmt: skip


def plans() -> list[dict]:
    run = load_config(EXAMPLE, ROOT)["runs"]["llama8b_32k"]
    deepspeed = json.loads((ROOT / "config/deepspeed/zero3.json").read_text())
    shape, base = Shape.from_config(LLAMA_8B), setup_of(run, deepspeed)
    rows = []
    for n in (1, 2, 4, 8):
        plan = plan_run(shape, replace(base, sequence_parallel=n), GPUS[run["gpu"]])
        rows.append({"sequence_parallel": n, **{k: round(v, 1) for k, v in
                     plan["per_gpu_gib"].items()}, "fits": plan["fits"]})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    rows = plans()
    if parser.parse_args().json:
        print(json.dumps(rows, indent=1))
        return
    keys = [k for k in rows[0] if k not in ("sequence_parallel", "fits")]
    print("N  " + "  ".join(f"{k:>11}" for k in keys) + "  fits 80 GB")
    for r in rows:
        print(
            f"{r['sequence_parallel']:<2} "
            + "  ".join(f"{r[k]:>11}" for k in keys)
            + f"  {'yes' if r['fits'] else 'NO'}"
        )


if __name__ == "__main__":
    main()
