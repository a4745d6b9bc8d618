"""The floor of a decode step of transformers' ``generate()``: the time a step takes whatever
the model's bytes and FLOPs, paid per layer (a layer's kernels launched one by one from
Python) and per step (the logits processors, the stopping criteria, the cache's update).

Tiny Llamas (hidden 64: their bytes and FLOPs are nothing) of 2, 4, 8 and 16 layers each
generate ``--tokens`` greedy tokens for batches of 1 and 8 prompts, on this machine's CPU,
one thread; a step's seconds are a line in the layers, fitted by least squares: its slope is
the per-layer floor, its intercept the per-step one. Prints each model's milliseconds a
step and the fit; snaketune.budget.rates.DECODE_FLOOR_S holds the figures (docs/benchmarks.md,
"Decoding's floor").

    python bench/decode_floor.py
    python bench/decode_floor.py --tokens 64 --layers 2 4 8 16 --batches 1 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

# bench/tokenize.py would shadow the standard library's tokenize (which transformers imports)
# from this folder (first on sys.path when a script here runs): take the folder off the path.
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)


def tiny_model(layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def step_seconds(layers: int, batch: int, tokens: int, repeats: int) -> float:
    """The median seconds of one decode step of ``generate()`` (its prefill apart: a run of
    one new token is subtracted)."""
    import torch

    model = tiny_model(layers)
    prompt = torch.randint(3, 256, (batch, 16))
    common = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(new: int) -> float:
        began = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=new, min_new_tokens=new, **common)
        return time.perf_counter() - began

    run(4)  # warm up
    full = statistics.median(run(tokens) for _ in range(repeats))
    first = statistics.median(run(1) for _ in range(repeats))
    return (full - first) / (tokens - 1)


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of seconds on layers: (per layer, per step)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return slope, my - slope * mx


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated a run")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU, 1 thread, {args.tokens} tokens a run")
    for batch in args.batches:
        points = []
        for layers in args.layers:
            s = step_seconds(layers, batch, args.tokens, args.repeats)
            points.append((layers, s))
            print(f"batch {batch}: {layers:>2} layers: {s * 1e3:.2f} ms a decode step")
        per_layer, per_step = fit(points)
        print(
            f"batch {batch}: floor {per_layer * 1e3:.3f} ms a layer + {per_step * 1e3:.2f} ms "
            "a step"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
