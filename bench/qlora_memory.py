"""The memory plan of a LoRA run, on a 4-bit base and not, against what training really
holds, on CPU.

    python bench/qlora_memory.py                 # a table: plan and measured, per part
    python bench/qlora_memory.py --json          # the same as JSON

Two models, each loaded as the train stage loads it (snaketune.evaluation.model.build_model: 4-bit
NF4 linear layers with double quantization, peft's k-bit preparation), wrapped with a LoRA
adapter on every linear layer and trained a few AdamW steps on random tokens at full
length (fp32, sdpa, one process):

- ``demo``: the demo's model (snaketune.app.fixtures, 180k weights) with the demo's settings
  (config/qlora_demo.yaml: LoRA r8, modules_to_save lm_head and embed_tokens, micro batch
  32 x 256 tokens);
- ``29m``: a random Llama of 29.4M weights (hidden 512, 8 layers, vocabulary 4096), LoRA
  r16, micro batch 4 x 256 tokens.

Two measurements of the same training:

- **tensors**: the largest sum of live tensor storage, tracked by PyTorch's own
  ``torch.distributed._tools.mem_tracker.MemTracker`` (a dispatch mode that sees every
  tensor's storage: parameters, gradients, optimizer states, activations, temporaries).
  It is the CPU counterpart of ``torch.cuda.max_memory_allocated``, which is what the plan
  models on a GPU, its margin set aside (CUDA's context, NCCL buffers and the caching
  allocator's fragmentation, which a CPU run has not).
- **RSS**: the process's anonymous resident memory, sampled every millisecond, less the
  baseline before loading (the same code run once on a tiny model first, so libraries and
  kernels are in place). It adds what glibc's allocator keeps after tensors are freed.

Plan: snaketune.budget.memplan's weights, gradients, optimizer states and activations for the same
settings (no margin). tests/test_memplan.py checks the demo's rows: the plan within 15% of
the tensors' peak.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/tokenize.py is named like the stdlib's tokenize module, which Python would import
# from this folder (first on sys.path when a script here runs): take the folder off the path.
if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import ctypes
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
PAGE = os.sysconf("SC_PAGE_SIZE")
Q4 = {"bits": 4, "quant_type": "nf4", "double_quant": True, "blocksize": 64,
      "load_dtype": "fp32", "compute_dtype": "fp32"}  # fmt: skip


@dataclass(frozen=True)
class Case:
    """A model and the run settings it trains with."""

    name: str
    micro: int
    length: int
    r: int
    saved: tuple[str, ...] = ()
    sizes: tuple[tuple[str, int], ...] = ()  # a random Llama's config; () the demo's model


CASES = {
    "demo": Case("demo", 32, 256, 8, ("lm_head", "embed_tokens")),
    "29m": Case(
        "29m",
        4,
        256,
        16,
        (),
        (
            ("vocab_size", 4096),
            ("hidden_size", 512),
            ("intermediate_size", 1536),
            ("num_hidden_layers", 8),
            ("num_attention_heads", 8),
            ("num_key_value_heads", 4),
        ),
    ),  # fmt: skip
}


def resident() -> int:
    """Anonymous resident memory (file-backed pages left out: a checkpoint's memory map)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * PAGE


def trim() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)


class Sampler(threading.Thread):
    """The largest resident memory seen while running."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = resident(), True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, resident())
            time.sleep(0.001)


def tracker():
    """PyTorch's MemTracker, taught that a frozen weight (a 4-bit base's, a LoRA base's) has
    no gradient to hook: it registers a gradient hook on every parameter, which a tensor
    that does not require one refuses."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            out = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            for param in module.parameters() if install_grad_hooks else ():
                if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:

                    def seen(grad):
                        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(lambda g: seen(g)),
                        param.register_post_accumulate_grad_hook(lambda p: seen(p.grad)),
                    )
            return out

    return Tracker()


def model_dir(case: Case, tmp: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not case.sizes:  # the demo's model, as scripts/make_fixtures.py builds it
        from snaketune.app.fixtures import make_fixtures

        make_fixtures(tmp)
        return tmp / "tiny-llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**dict(case.sizes))).save_pretrained(tmp / "model")
    return tmp / "model"


def train(path: Path, case: Case, quantized: bool, steps: int, measure: bool) -> dict:
    """Load, wrap and train; the tensors' peak (by kind) and the RSS peak over training."""
    import torch
    from peft import LoraConfig, get_peft_model

    from snaketune.evaluation.model import build_model, trainable_in

    trim()
    baseline = resident()
    model = build_model(path, "fp32", "sdpa", Q4 if quantized else None)
    for param in model.parameters():  # as on a GPU: in memory, not a file's map
        if type(param).__name__ != "Params4bit":
            param.data = param.data.clone()
    lora = LoraConfig(r=case.r, lora_alpha=2 * case.r, lora_dropout=0.0,
                      target_modules="all-linear", modules_to_save=list(case.saved) or None,
                      task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(model, lora)
    trainable_in(model, torch.float32)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (case.micro, case.length), generator=generator)
    trim()
    sampler, mt = Sampler(), tracker()
    mt.track_external(model, optimizer, ids)
    if measure:
        sampler.start()
    losses = []
    with mt:
        for _ in range(steps):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            mt.reset_mod_stats()  # the tracker's per-module figures are one iteration's
    sampler.running = False
    if measure:
        sampler.join()
    (peak,) = mt.get_tracker_snapshot("peak").values()
    kinds = {getattr(k, "value", k): v for k, v in peak.items()}
    return {"tensors": kinds, "rss_bytes": sampler.peak - baseline, "losses": losses}


def plan(path: Path, case: Case, quantized: bool) -> dict[str, float]:
    from snaketune.budget.memplan import Setup, Shape, activations, model_states

    shape = Shape.from_config(json.loads((path / "config.json").read_text()))
    setup = Setup(adapter="lora", stage=0, offload_optimizer=False, offload_params=False,
                  nodes=1, gpus_per_node=1, micro_batch_size=case.micro,
                  max_length=case.length, gradient_checkpointing=False, attention="sdpa",
                  liger=False, bytes_per_weight=4, lora_r=case.r, lora_saved=case.saved,
                  quantized=quantized)  # fmt: skip
    # bytes, unrounded (estimate() rounds to 0.01 GiB, coarse at the demo's size)
    got = {**model_states(shape, setup), "activations": activations(shape, setup)}
    got["planned"] = sum(got.values())
    got["params"] = shape.params
    return got


def measure(case: Case, quantized: bool, steps: int = 2) -> dict:
    """Plan and measurements of one case, LoRA (``quantized`` False) or QLoRA."""
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(case, Path(tmp))
        # the same code once first: libraries, kernels and allocator arenas in place
        train(path, Case("warm", 1, 16, 2), quantized, 1, False)
        got = train(path, case, quantized, steps, True)
        got["plan"] = plan(path, case, quantized)
    return got


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES),
                        help="which models (default: all)")  # fmt: skip
    args = parser.parse_args()
    cases = [CASES[name] for name in args.cases]
    rows = {
        (case.name, name): measure(case, quantized, args.steps)
        for case in cases
        for name, quantized in (("LoRA", False), ("QLoRA", True))
    }
    if args.json:
        print(json.dumps({f"{c} {n}": r for (c, n), r in rows.items()}))
        return 0
    mib = 2**20
    print(f"CPU, fp32, sdpa, {args.steps} AdamW steps; MiB. Cases: "
          + "; ".join(f"{c.name}: micro batch {c.micro} x {c.length}, LoRA r{c.r}"
                      + (f", modules_to_save {', '.join(c.saved)}" if c.saved else "")
                      for c in cases))  # fmt: skip
    print("| model | run | planned (no margin) | tensors' peak | plan / tensors | RSS peak "
          "| plan / RSS | weights planned / held |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for (case, name), r in rows.items():
        p, t = r["plan"], r["tensors"]
        print(f"| {case} ({p['params'] / 1e6:.2f}M) | {name} | {p['planned'] / mib:.1f} | "
              f"{t['Total'] / mib:.1f} | {p['planned'] / t['Total']:.2f} | "
              f"{r['rss_bytes'] / mib:.1f} | {p['planned'] / r['rss_bytes']:.2f} | "
              f"{p['weights'] / mib:.2f} / {t['Parameter'] / mib:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
