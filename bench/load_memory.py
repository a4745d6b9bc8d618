"""The CPU memory of loading a model as the train stage loads it, against the plan's figure
per process (snaketune.budget.memplan.cpu_per_node).

    python bench/load_memory.py               # a random Llama of ~125M weights
    python bench/load_memory.py --short       # ~5M weights (the suite's short form)
    python bench/load_memory.py --gpu         # onto a CUDA GPU: the CPU side of each path

A random Llama is saved as safetensors in bf16, then loaded by
snaketune.evaluation.model.build_model, each way in a fresh process: in bf16 (the
checkpoint's own dtype), in fp32 (a conversion), and as a 4-bit base (lora.quantize: 4bit,
nf4) as a QLoRA run loads it, quantized onto the process's device with device_map. Sampled
every millisecond, less the process's baseline after the same load of a tiny model
(libraries and kernels in place):

- anon: the peak anonymous resident memory (what the process holds of its own);
- held: what it keeps after the load, freed heap returned first; for the 4-bit load on this
  CPU that is the device side (the 4-bit layers, the other weights in fp32 after peft's
  k-bit preparation), and anon less held the loading path's own share, which on a GPU node
  stays in CPU memory;
- tensors: the loaded model's parameters and buffers, counted;
- file: the checkpoint's memory map, pages the kernel shares between the processes of a
  node that read the same file.

The plan counts P x w per process for a conversion and the largest layer at w bytes for the
other two paths. Not measured here: the GPU side (no GPU on this machine).
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


def measure(model_dir: str, tiny_dir: str, precision: str, device: str = "cpu") -> dict:
    """In this process: the tiny model's load (the baseline), then the model's, sampled.
    ``device`` cuda: the 4-bit base is quantized onto the GPU (device_map), the others loaded
    on the CPU and moved to the GPU (as the evaluate stage and DeepSpeed move them); what the
    GPU then holds is counted (gpu_bytes)."""
    import torch

    from snaketune.core.qlora import settings
    from snaketune.evaluation.model import build_model

    quantize = None
    if precision == "4bit":  # a QLoRA run's base, loaded as its train job loads it
        precision = "bf16"
        quantize = settings({"quant_type": "nf4", "double_quant": True,
                             "compute_dtype": "auto"}, precision)  # fmt: skip

    def load(path: str):
        model = build_model(Path(path), precision, "sdpa", quantize=quantize,
                            device="cuda:0" if device == "cuda" else "cpu")  # fmt: skip
        return model.to(device) if device == "cuda" and quantize is None else model

    import ctypes
    import gc

    def trimmed() -> tuple[int, int]:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages back to the system
        return resident()

    load(tiny_dir)
    base_anon, base_file = trimmed()
    base_gpu = torch.cuda.memory_allocated() if device == "cuda" else 0
    peak = [base_anon, base_file]
    running = True

    def sample() -> None:
        while running:
            anon, file = resident()
            peak[0], peak[1] = max(peak[0], anon), max(peak[1], file)
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    model = load(model_dir)
    running = False
    thread.join()
    held = trimmed()[0] - base_anon
    on_gpu = torch.cuda.memory_allocated() - base_gpu if device == "cuda" else None
    tensors = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    del model
    return {"precision": "4bit" if quantize else precision, "anon_bytes": max(peak[0] - base_anon, held),
            "held_bytes": held, "tensor_bytes": tensors, "gpu_bytes": on_gpu,
            "file_bytes": peak[1] - base_file}  # fmt: skip


def save(sizes: dict, out: Path) -> tuple[int, int]:
    """A random Llama in bf16 at ``out``; its weights and its largest module's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**sizes, tie_word_embeddings=False))
    model.to(torch.bfloat16).save_pretrained(out)
    layer = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return sum(p.numel() for p in model.parameters()), layer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="a ~7M-weight model")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--gpu", action="store_true",
                        help="load onto a CUDA GPU (the CPU side measured, the GPU's counted)")  # fmt: skip
    parser.add_argument("--measure", nargs=4, metavar=("MODEL", "TINY", "PRECISION", "DEVICE"),
                        help=argparse.SUPPRESS)  # the child process  # fmt: skip
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model, tiny = Path(tmp, "model"), Path(tmp, "tiny")
        params, largest = save(SIZES["short" if args.short else "full"], model)
        save({**SIZES["short"], "num_hidden_layers": 1, "hidden_size": 64,
              "intermediate_size": 128, "vocab_size": 256}, tiny)  # fmt: skip
        rows = []
        for precision in ("bf16", "fp32", "4bit"):
            out = subprocess.run([sys.executable, __file__, "--measure", str(model), str(tiny),
                                  precision, "cuda" if args.gpu else "cpu"],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "PYTHONWARNINGS": "ignore"})  # fmt: skip
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["params"] = params
            w = 4 if precision == "fp32" else 2  # a 4-bit base loads in the run's bf16
            streamed = precision != "fp32"  # the plan: a layer at a time, else P x w
            row["plan_bytes"] = (largest if streamed else params) * w
            rows.append(row)
    print(f"{'loaded as':<10}{'weights':>12}{'plan MiB':>10}{'anon MiB':>10}{'held MiB':>10}"
          f"{'tensors MiB':>12}{'file MiB':>10}" + (f"{'GPU MiB':>10}" if args.gpu else ""))  # fmt: skip
    for r in rows:
        print(f"{r['precision']:<10}{r['params']:>12,}{r['plan_bytes'] / 2**20:>10.1f}"
              f"{r['anon_bytes'] / 2**20:>10.1f}{r['held_bytes'] / 2**20:>10.1f}"
              f"{r['tensor_bytes'] / 2**20:>12.1f}{r['file_bytes'] / 2**20:>10.1f}"
              + (f"{r['gpu_bytes'] / 2**20:>10.1f}" if r["gpu_bytes"] is not None else ""))  # fmt: skip
    print(
        "plan: the plan's CPU figure per process (a layer at a time, or P x w); anon: the "
        "peak the load held of its own; held: what it kept after the load (on a GPU node: "
        "on the GPU for a 4-bit base, none for the others)"
    )
    if args.json:  # the figures for a program, after the table: one line, the last
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
