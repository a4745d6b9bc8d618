"""When a training step holds its gradients: the peak of live tensors of one ZeRO-2 step
with one micro batch and with two, through DeepSpeed on this machine's CPU, against the
memory plan (snaketune.budget.memplan, less its CUDA margin).

    python bench/memory_timing.py            # a table
    python bench/memory_timing.py --json     # the same as JSON

Each case runs in a process of its own (gloo, one rank): a random Llama (hidden 512, 8
layers, vocabulary 4096: 27.4M weights), full fine-tuning in fp32, DeepSpeed ZeRO-2 as the
product's preset sets it (config/deepspeed/zero2.json: overlap_comm, contiguous gradients)
with its buckets scaled to the tiny model (5e5 elements: the preset's 2e8 would be seven
times the model), torch's AdamW as the client optimizer (the product's CPU configs carry no
DeepSpeed optimizer block), one warm-up step, then two steps tracked by PyTorch's
``MemTracker`` (every tensor's storage: the CPU counterpart of
``torch.cuda.max_memory_allocated``, which the plan less its margin models on a GPU).

What it shows: with one micro batch a step the gradients are made while backward frees the
activations, so the peak holds no gradients; with two, the first micro batch's gradients
stay beside the second one's activations, and the peak is higher by the gradients' bytes.
The plan takes the larger of the two for the first and their sum for the second.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/tokenize.py is named like the stdlib's tokenize module, which Python would import
# from this folder (first on sys.path when a script here runs): take the folder off the path.
if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import json
import os
import subprocess

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
SIZES = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4096}  # fmt: skip
BUCKET = 5e5
MIB = 2**20


def one(accumulation: int, micro: int, length: int) -> dict:
    """In this process: the tracked peak of two steps (MiB, by kind) and the weights."""
    import torch

    from snaketune.train.commands import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
    import deepspeed
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import LlamaConfig, LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SIZES, attn_implementation="sdpa"))
    preset = json.loads((ROOT / "config/deepspeed/zero2.json").read_text())["zero_optimization"]
    zero = {**preset, "allgather_bucket_size": BUCKET, "reduce_bucket_size": BUCKET}
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    ids = torch.randint(0, SIZES["vocab_size"], (micro, length))
    tracked: list = []

    def step() -> float:
        for _ in range(accumulation):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            for mt in tracked:  # the tracker's per-module figures are one pass's
                mt.reset_mod_stats()
        return float(loss)

    step()  # warm: the optimizer's states and DeepSpeed's buffers made
    mt = MemTracker()
    tracked.append(mt)
    # what exists before tracking starts: the weights, the fp32 partition, Adam's states
    mt.track_external(
        engine.module, optimizer.optimizer, *optimizer.single_partition_of_fp32_groups
    )
    with mt:
        losses = [step(), step()]
    (peak,) = mt.get_tracker_snapshot("peak").values()
    kinds = {getattr(k, "value", k): round(v / MIB, 2) for k, v in peak.items()}
    return {"peak_mib": kinds, "params": sum(p.numel() for p in model.parameters()),
            "losses": losses}  # fmt: skip


def plan(params_config: dict, accumulation: int, micro: int, length: int) -> dict[str, float]:
    """The memory plan (MiB) of the same run, less its margin."""
    from snaketune.budget.memplan import Setup, Shape, estimate

    shape = Shape.from_config(
        {"model_type": "llama", "tie_word_embeddings": False, **params_config}
    )
    s = Setup(adapter="full", stage=2, offload_optimizer=False, offload_params=False, nodes=1,
              gpus_per_node=1, micro_batch_size=micro, max_length=length,
              gradient_checkpointing=False, attention="sdpa", liger=False, bytes_per_weight=4,
              accumulation=accumulation)  # fmt: skip
    got = estimate(shape, s)
    return {k: round(v * 1024, 1) for k, v in got.items() if k not in ("margin", "total")}


def measure(micro: int = 8, length: int = 512) -> dict:
    """Each accumulation (1, 2) measured in a process of its own, beside its plan."""
    out = {"micro_batch_size": micro, "max_length": length, "sizes": SIZES, "cases": {}}
    for accumulation in (1, 2):
        proc = subprocess.run(
            [sys.executable, __file__, "--one", str(accumulation), str(micro), str(length)],
            capture_output=True, text=True, timeout=900,
            env={**os.environ, "PYTHONWARNINGS": "ignore::FutureWarning"},
        )  # fmt: skip
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            raise RuntimeError(f"accumulation {accumulation}: {proc.stderr[-3000:]}")
        got = json.loads(lines[-1])
        got["plan_mib"] = plan(SIZES, accumulation, micro, length)
        got["plan_total_mib"] = round(sum(got["plan_mib"].values()), 1)
        out["cases"][accumulation] = got
    one_, two = out["cases"][1], out["cases"][2]
    out["measured_step_up_mib"] = round(two["peak_mib"]["Total"] - one_["peak_mib"]["Total"], 2)
    out["planned_step_up_mib"] = round(two["plan_total_mib"] - one_["plan_total_mib"], 1)
    out["gradients_mib"] = two["plan_mib"]["gradients"]
    return out


def table(got: dict) -> str:
    rows = ["| gradient accumulation | peak of live tensors (MiB) | plan less margin (MiB) | "
            "plan error |", "|---:|---:|---:|---:|"]  # fmt: skip
    for acc, case in got["cases"].items():
        peak, planned = case["peak_mib"]["Total"], case["plan_total_mib"]
        rows.append(
            f"| {acc} | {peak:,.1f} | {planned:,.1f} | {100 * (planned / peak - 1):+.1f}% |"
        )
    rows.append("")
    rows.append(f"peak with 2 micro batches less with 1: measured {got['measured_step_up_mib']:.1f} "
                f"MiB, planned {got['planned_step_up_mib']:.1f} (the gradients: "
                f"{got['gradients_mib']:.1f})")  # fmt: skip
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)), flush=True)
        return 0
    got = measure()
    print(json.dumps(got, indent=1) if args.json else table(got))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
