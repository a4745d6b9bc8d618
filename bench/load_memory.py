"""The CPU memory of loading a model as the train stage loads it, against the plan's figure
per process (snaketune.plan.memplan.cpu_per_node: without offload or a 4-bit base, each
process loads the whole model at w bytes a weight before DeepSpeed moves it to its GPU).

    python bench/load_memory.py               # a random Llama of ~110M weights
    python bench/load_memory.py --short       # ~7M weights (the suite's short form)

A random Llama is saved as safetensors in bf16, then loaded by
snaketune.evaluation.model.build_model in bf16 (the checkpoint's own dtype) and in fp32
(a conversion), each in a fresh process, sampling every millisecond:

- anonymous resident memory (what a process holds of its own), less the process's
  baseline after the same load of a tiny model (libraries and kernels in place);
- file-backed resident memory: the checkpoint's memory map, pages the kernel shares
  between the processes of a node that read the same file.

The plan counts P x w per process. Not measured here: the 4-bit path (it loads onto the
GPU with device_map, a layer at a time; on a CPU the "device" is this memory) and the GPU
side of either (no GPU on this machine).
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/tokenize.py is named like the stdlib's tokenize module: take the folder off the path
if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
PAGE = os.sysconf("SC_PAGE_SIZE")
SIZES = {
    "full": {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
             "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4},
    "short": {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2},
}  # fmt: skip


def resident() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of this process."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    rss, shared = int(fields[1]) * PAGE, int(fields[2]) * PAGE
    return rss - shared, shared


def measure(model_dir: str, tiny_dir: str, precision: str) -> dict:
    """In this process: the tiny model's load (the baseline), then the model's, sampled."""
    from snaketune.evaluation.model import build_model

    build_model(Path(tiny_dir), precision, "sdpa")
    base_anon, base_file = resident()
    peak = [base_anon, base_file]
    running = True

    def sample() -> None:
        while running:
            anon, file = resident()
            peak[0], peak[1] = max(peak[0], anon), max(peak[1], file)
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    model = build_model(Path(model_dir), precision, "sdpa")
    running = False
    thread.join()
    params = sum(p.numel() for p in model.parameters())
    return {"precision": precision, "params": params, "anon_bytes": peak[0] - base_anon,
            "file_bytes": peak[1] - base_file}  # fmt: skip


def save(sizes: dict, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**sizes, tie_word_embeddings=False))
    model.to(torch.bfloat16).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="a ~7M-weight model")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--measure", nargs=3, metavar=("MODEL", "TINY", "PRECISION"),
                        help=argparse.SUPPRESS)  # the child process  # fmt: skip
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model, tiny = Path(tmp, "model"), Path(tmp, "tiny")
        save(SIZES["short" if args.short else "full"], model)
        save({**SIZES["short"], "num_hidden_layers": 1, "hidden_size": 64,
              "intermediate_size": 128, "vocab_size": 256}, tiny)  # fmt: skip
        rows = []
        for precision in ("bf16", "fp32"):
            out = subprocess.run([sys.executable, __file__, "--measure", str(model), str(tiny),
                                  precision], capture_output=True, text=True, check=True,
                                 env={**os.environ, "PYTHONWARNINGS": "ignore"})  # fmt: skip
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["plan_bytes"] = row["params"] * (2 if precision == "bf16" else 4)
            rows.append(row)
    if args.json:
        print(json.dumps(rows))  # one line, the last
        return 0
    print(f"{'precision':<10}{'weights':>12}{'P x w MiB':>11}{'anon MiB':>10}{'file MiB':>10}")
    for r in rows:
        print(f"{r['precision']:<10}{r['params']:>12,}{r['plan_bytes'] / 2**20:>11.1f}"
              f"{r['anon_bytes'] / 2**20:>10.1f}{r['file_bytes'] / 2**20:>10.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
