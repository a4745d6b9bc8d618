"""Training throughput, packed against padded, through the real train stage.

    python bench/train_throughput.py                  # CPU: ~13M-parameter Llama, micro batch 8
    python bench/train_throughput.py --steps 40 --warmup 8
    python bench/train_throughput.py --gpu            # one GPU: Llama-3.2-1B shape, the table
    python bench/train_throughput.py --qlora          # CPU: LoRA against QLoRA (4-bit base)

Examples are random token ids whose lengths follow GSM8K's spread with the demo's chat
template (a clipped log-normal, median 180 tokens, 5-95% 104-310; random micro batches of
4/8/16/32 keep 0.75/0.66/0.60/0.55 of their tokens as real ones), a prompt share masked.
Nothing is downloaded. Both sides train the same examples in the same global steps
(shard_dataset's plan depends on the data, seed and global batch only), through
scripts/train.py: torchrun agent, DeepSpeed ZeRO-2, SFTTrainer, the metrics callback.
tokens/s counts real (non-pad) tokens of the steps after --warmup, from metrics.jsonl.

CPU mode (1 node x 1 process, full fine-tuning, fp32, attn_implementation: sdpa):
  padded   packing: false (one row per example, padded to the longest)
  packed   packing: true  (what sdpa trains packed batches with on CPU: one row, sdpa one
           example at a time, snaketune.data.kernels.segment_attention)
and, on the same model, forward+backward of the same micro batches in each layout under
sdpa and eager: padded, rows of at most max_length (block-diagonal mask), one row holding
all (block-diagonal mask), and one row under sdpa_segments (what decides which packed
layout the CPU path uses). Target: packed / padded >= 1.4, same loss per token.

QLoRA mode (CPU, same model and examples, packed): LoRA r16 on every linear layer with the
base in fp32 against the same adapter on a 4-bit NF4 base (lora.quantize: 4bit): real
tokens/s, peak memory (RSS) and loss per token.

GPU mode (1 node x 1 GPU, bf16, random weights, max_length 2048): every combination of
method (LoRA r16, QLoRA r16, full), packing (on, off), attention (sdpa, flash_attention_2 when
installed) and Liger (on, off when installed): tokens/s per GPU, MFU and peak memory.
"""

from __future__ import annotations

import sys

# bench/tokenize.py is named like the stdlib's tokenize module, which Python would import
# from this folder (first on sys.path when a script here runs): take the folder off the path.
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import argparse
import itertools
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
ROOT = Path(__file__).resolve().parents[1]

# GSM8K-shaped lengths (question + worked answer + chat markup, in tokens)
MEDIAN, SIGMA, SHORTEST, LONGEST = 180, 0.33, 60, 420


def gsm8k_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(MEDIAN), SIGMA, n), SHORTEST, LONGEST).astype(np.int64)


def real_fraction(lengths: np.ndarray, micro: int) -> float:
    """Mean share of real tokens in random padded micro batches of ``micro`` examples."""
    x = lengths[: len(lengths) // micro * micro].reshape(-1, micro)
    return float((x.sum(1) / (x.max(1) * micro)).mean())


def write_tokenized(path: Path, lengths: np.ndarray, vocab: int, seed: int = 0) -> Path:
    """A tokenized parquet (the schema tokenize_dataset writes) of random token ids."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from snaketune.data.tokenization import OUTPUT_SCHEMA

    rng = np.random.default_rng(seed)
    ids, labels = [], []
    for n in lengths.tolist():
        seq = rng.integers(4, vocab, n).tolist()
        prompt = max(1, int(n * 0.4))  # the question and the chat markup are masked
        ids.append(seq)
        labels.append([-100] * prompt + seq[prompt:])
    table = pa.table(
        {
            "example_id": [f"bench:{i}" for i in range(len(lengths))],
            "input_ids": ids,
            "labels": labels,
            "length": lengths.tolist(),
            "text_sha": [f"{i:016x}" for i in range(len(lengths))],
        },
        schema=OUTPUT_SCHEMA,
    )
    pq.write_table(table, path)
    return path


def make_model(out: Path, gpu: bool, layers: int) -> tuple[Path, int]:
    """A random-weight Llama with the fixture tokenizer (only its pad id is used)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from snaketune.app.fixtures import build_tokenizer, make_gsm8k_like

    tokenizer = build_tokenizer(
        ["bench corpus"] + [r["answer"] for r in make_gsm8k_like(64, 0)["train"]], 1024
    )
    if gpu:  # Llama-3.2-1B
        config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                             num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                             max_position_embeddings=4096, rope_theta=500000.0,
                             tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    else:
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=384, intermediate_size=1024,
                             num_hidden_layers=layers, num_attention_heads=6,
                             num_key_value_heads=2, max_position_embeddings=2048,
                             pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if gpu:
        model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def steady(records: list[dict], warmup: int) -> dict[str, float]:
    """Real tokens/s, mean loss, MFU and peak memory over the steps after ``warmup``."""
    after = records[warmup:]
    seconds = records[-1]["elapsed_s"] - records[warmup - 1]["elapsed_s"]
    tokens = sum(
        r["tokens_per_s"] * (r["elapsed_s"] - p["elapsed_s"])
        for p, r in zip(records[warmup - 1 :], after, strict=False)
    )
    mfus = [r["mfu"] for r in after if "mfu" in r]
    return {
        "tokens_per_s": tokens / seconds,
        "loss": float(np.mean([r["loss"] for r in after])),
        "padding": float(np.mean([r["padding"] for r in after])),
        "mfu": float(np.median(mfus)) if mfus else float("nan"),
        "peak_gib": max(r["peak_memory_mib"] for r in records) / 1024,
    }


def run_spec_of(micro: int, steps: int, packing: bool, **run) -> dict:
    """The validated run a side trains (1 node x 1 process, no warmup, no checkpoint)."""
    from snaketune.app.fixtures import demo_run_spec

    return demo_run_spec(ROOT, nodes=1, gpus_per_node=1, micro_batch_size=micro,
                         gradient_accumulation_steps=1, max_steps=steps, warmup_ratio=0.0,
                         lr_scheduler="linear", save_steps=10**6, max_grad_norm=1.0, seed=0,
                         packing=packing, **run)  # fmt: skip


def train_side(tmp: Path, name: str, tokenized: Path, model: Path, micro: int, steps: int,
               packing: bool, **run) -> list[dict]:  # fmt: skip
    """Shard (packed or not) and run the train stage; return metrics records."""
    from snaketune.app.fixtures import run_train_stage
    from snaketune.data.shard import Layout, shard

    shards = tmp / f"shards-{name}"
    manifest = shard(tokenized, shards, Layout(1, 1, micro, 1), seed=0, packing=packing)
    (shards / "manifest.json").write_text(json.dumps(manifest))
    spec = run_spec_of(micro, steps, packing, **run)
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count())}
    return run_train_stage(ROOT, spec, shards, model, tmp / f"train-{name}", env=env)


def layout_timings(model_dir: Path, tokenized: Path, micro: int, rows: int, batches: int) -> dict:
    """Seconds per forward+backward of the same micro batches in each layout."""
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    from snaketune.data.kernels import SEGMENTS, register_segment_attention
    from snaketune.data.packing import Collator

    register_segment_attention()
    table = pq.read_table(tokenized, columns=["example_id", "input_ids", "labels"]).to_pylist()
    groups = [table[i * micro : (i + 1) * micro] for i in range(batches)]
    layouts = {"sdpa": (("padded", Collator("padded", 0, rows)),
                        ("rows<=max_length", Collator("rows", 0, rows)),
                        ("one row", Collator("rows", 0, 10**9))),
               SEGMENTS: (("one row", Collator("varlen", 0, rows)),)}  # fmt: skip
    layouts["eager"] = layouts["sdpa"]
    out = {}
    for attention in ("sdpa", "eager", SEGMENTS):
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attention)
        model.config.use_cache = False
        for name, collate in layouts[attention]:
            inputs = [collate(g) for g in groups]
            model(**inputs[0]).loss.backward()  # warm up
            start = time.perf_counter()
            for batch in inputs:
                model(**batch).loss.backward()
            out[(attention, name)] = (time.perf_counter() - start) / batches
    return out


LORA = {
    "r": 16,
    "alpha": 32,
    "dropout": 0.0,
    "target_modules": "all-linear",
    "modules_to_save": [],
    "quant_type": "nf4",
    "double_quant": True,
    "compute_dtype": "auto",
}


def cpu_inputs(tmp: Path, args: argparse.Namespace) -> tuple[Path, int, Path, np.ndarray]:
    """The CPU modes' model (its directory and size), tokenized examples and their lengths,
    under ``tmp``."""
    from transformers import AutoConfig

    model, params = make_model(tmp / "model", gpu=False, layers=args.layers)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    lengths = gsm8k_lengths(args.micro_batch_size * args.steps)
    return model, params, write_tokenized(tmp / "tokenized.parquet", lengths, vocab), lengths


def qlora(args: argparse.Namespace) -> None:
    """LoRA against QLoRA on CPU: the same model, examples and adapter."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, params, tokenized, lengths = cpu_inputs(tmp, args)
        sides = {}
        for name, quantize in (("LoRA", "none"), ("QLoRA (4-bit NF4 base)", "4bit")):
            run = {"method": "lora", "attn_implementation": "sdpa", "max_length": 512,
                   "learning_rate": 1e-4, "lora": {**LORA, "quantize": quantize}}  # fmt: skip
            records = train_side(tmp, name.split()[0], tokenized, model, args.micro_batch_size,
                                 args.steps, True, **run)  # fmt: skip
            sides[name] = steady(records, args.warmup)
    print(f"machine: {os.cpu_count()} cores, CPU, 1 node x 1 process; Llama {params / 1e6:.1f}M "
          f"parameters ({args.layers} layers, hidden 384), LoRA r16 on every linear layer, fp32, "
          f"packed, ZeRO-2; micro batch {args.micro_batch_size}, {args.steps} steps (first "
          f"{args.warmup} left out)")  # fmt: skip
    print("| run | real tokens/s | peak RSS GiB | loss/token |")
    print("|---|---:|---:|---:|")
    for name, s in sides.items():
        print(f"| {name} | {s['tokens_per_s']:,.0f} | {s['peak_gib']:.2f} | {s['loss']:.4f} |")


def cpu(args: argparse.Namespace) -> None:
    from snaketune.data.kernels import SEGMENTS

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, params, tokenized, lengths = cpu_inputs(tmp, args)
        common = {"method": "full", "attn_implementation": "sdpa", "max_length": 512,
                  "learning_rate": 1e-4}  # fmt: skip
        sides = {}
        for name, packing in (("padded", False), ("packed", True)):
            records = train_side(tmp, name, tokenized, model, args.micro_batch_size, args.steps,
                                 packing, **common)  # fmt: skip
            sides[name] = steady(records, args.warmup)
        timings = layout_timings(model, tokenized, args.micro_batch_size, 512, args.layout_batches)
    print(
        f"machine: {os.cpu_count()} cores, CPU, 1 node x 1 process; Llama {params / 1e6:.1f}M parameters "
        f"({args.layers} layers, hidden 384), full fine-tuning, fp32, attention sdpa (packed: "
        f"{SEGMENTS}), ZeRO-2; micro batch {args.micro_batch_size}, "
        f"{args.steps} steps (first {args.warmup} left out); GSM8K-shaped lengths, random micro "
        f"batches keep {real_fraction(lengths, args.micro_batch_size):.2f} of their tokens"
    )
    print(f"{'what':<40}{'real tokens/s':>14}{'padding':>9}{'loss/token':>12}")
    for name, s in sides.items():
        print(
            f"{'train stage, ' + name:<40}{s['tokens_per_s']:>14,.0f}{s['padding']:>9.2f}{s['loss']:>12.4f}"
        )
    ratio = sides["packed"]["tokens_per_s"] / sides["padded"]["tokens_per_s"]
    print(f"ratio packed / padded: {ratio:.2f}  (target >= 1.4)")
    print(f"\nforward+backward per micro batch of {args.micro_batch_size} (same examples):")
    for (attention, name), seconds in timings.items():
        base = timings[("sdpa" if attention == SEGMENTS else attention, "padded")]
        print(
            f"  {attention:<15}{name:<18}{seconds * 1000:>9.1f} ms  ({base / seconds:.2f}x padded)"
        )


def gpu(args: argparse.Namespace) -> None:
    import torch

    from snaketune.data.kernels import installed

    assert torch.cuda.is_available(), "--gpu needs a CUDA GPU"
    n = args.micro_batch_size * args.steps
    lengths = gsm8k_lengths(n)
    attentions = ["sdpa"] + (["flash_attention_2"] if installed("flash_attn") else [])
    ligers = [False] + ([True] if installed("liger_kernel") else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, _ = make_model(tmp / "model", gpu=True, layers=16)
        tokenized = write_tokenized(tmp / "tokenized.parquet", lengths, 128256)
        for method, packing, attention, liger in itertools.product(
            ("lora", "qlora", "full"), (True, False), attentions, ligers
        ):
            run = {"method": method, "attn_implementation": attention, "liger_kernel": liger,
                   "max_length": 2048, "precision": "bf16", "learning_rate": 1e-5,
                   "gradient_checkpointing": args.gradient_checkpointing}  # fmt: skip
            if method in ("lora", "qlora"):
                run["lora"] = {**LORA, "quantize": "4bit" if method == "qlora" else "none"}
                run["method"] = "lora"
            name = f"{method}-{packing}-{attention}-{liger}"
            try:
                records = train_side(tmp, name, tokenized, model, args.micro_batch_size,
                                     args.steps, packing, **run)  # fmt: skip
                rows.append((method, packing, attention, liger, steady(records, args.warmup)))
            except RuntimeError as exc:
                rows.append((method, packing, attention, liger, {"error": str(exc)[-300:]}))
    print(f"GPU: {torch.cuda.get_device_name()}; Llama-3.2-1B shape, random weights, bf16, "
          f"micro batch {args.micro_batch_size}, {args.steps} steps (first {args.warmup} left out)")  # fmt: skip
    print("| method | packing | attention | Liger | tokens/s per GPU | MFU | peak GiB | padding |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for method, packing, attention, liger, s in rows:
        if "error" in s:
            print(f"| {method} | {packing} | {attention} | {liger} | failed: {s['error']!r} ||||")
            continue
        print(f"| {method} | {packing} | {attention} | {liger} | {s['tokens_per_s']:,.0f} | "
              f"{100 * s['mfu']:.1f}% | {s['peak_gib']:.1f} | {s['padding']:.2f} |")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpu", action="store_true", help="the GPU table (needs CUDA)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per side")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="examples per step")
    parser.add_argument("--layers", type=int, default=8, help="CPU model layers (13M at 8)")
    parser.add_argument(
        "--layout-batches", type=int, default=6, help="micro batches timed per layout"
    )
    parser.add_argument("--gradient-checkpointing", action="store_true", help="GPU mode")
    parser.add_argument("--qlora", action="store_true", help="CPU: LoRA against QLoRA")
    args = parser.parse_args()
    args.micro_batch_size = args.micro_batch_size or (32 if args.gpu else 8)
    (gpu if args.gpu else qlora if args.qlora else cpu)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
