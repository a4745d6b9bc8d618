"""The memory plan of an evaluate stage against what evaluation really holds, on CPU.

    python bench/eval_memory.py              # a random Llama of 29M weights
    python bench/eval_memory.py --short      # 7M weights (the suite's short form)
    python bench/eval_memory.py --json

A random Llama (vocabulary 4096) is evaluated as the evaluate stage does it, in fp32 on one
process: the held-out loss pass over a batch (snaketune.evaluation.evaluate.heldout_loss)
and greedy generation of the batch with the KV cache (forced to its full max_new_tokens),
under PyTorch's own ``torch.distributed._tools.mem_tracker.MemTracker`` (the CPU
counterpart of ``torch.cuda.max_memory_allocated``: the largest sum of live tensors). The
plan: snaketune.budget.evalplan.eval_bytes for the same settings at 4 bytes a weight, its
margin (fragmentation, CUDA context) set aside, a logit at the 12 bytes the loss pass
costs on a CPU (on a GPU the plan counts w + 4). Each phase is measured alone, so the table
says which of the two the plan's "larger of loss pass and generation" picks.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/tokenize.py is named like the stdlib's tokenize module: take the folder off the path
if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import json
import tempfile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
SIZES = {
    "full": {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536,
             "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4},
    "short": {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2},
}  # fmt: skip
BATCH, PROMPT, NEW = 8, 256, 64


def peak(fn) -> int:
    """The largest sum of live tensor storage while ``fn`` runs (MemTracker; its per-module
    figures cleared at each module's next call: generation calls every module once per
    token, which MemTracker's module accounting refuses; the overall peak is kept)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:  # the module's second call
                self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

    tracker = Tracker()
    with tracker:
        fn()
    (values,) = tracker.get_tracker_snapshot("peak").values()
    return int({getattr(k, "value", k): v for k, v in values.items()}["Total"])


def measure(sizes: dict) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from snaketune.budget.evalplan import eval_bytes
    from snaketune.budget.memplan import Shape
    from snaketune.evaluation.evaluate import heldout_loss

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:  # saved and loaded, as the stage loads it
        LlamaForCausalLM(LlamaConfig(**sizes, tie_word_embeddings=False)).save_pretrained(tmp)
        model = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        shape = Shape.from_config(json.loads(Path(tmp, "config.json").read_text()))
    ids = torch.randint(1, sizes["vocab_size"], (BATCH, PROMPT))
    rows = [{"input_ids": r.tolist(), "labels": [-100] * (PROMPT // 2) + r[PROMPT // 2 :].tolist()}
            for r in ids]  # fmt: skip
    weights = sum(p.numel() * p.element_size() for p in model.parameters())

    def loss() -> None:
        heldout_loss(model, rows, BATCH, 0)

    def generate() -> None:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0)  # fmt: skip

    loss(), generate()  # warm: lazily built kernels and caches out of the figures
    got = {"weights": weights, "loss_pass": peak(loss) - weights,
           "generation": peak(generate) - weights}  # fmt: skip
    # on this CPU a logit costs 12 bytes in the loss pass: the fp32 logits, the copy that
    # flattening their shifted view makes, and log-softmax's output (on a GPU: w + 4)
    plan = eval_bytes(shape, 1, BATCH, PROMPT, NEW, w=4, logit_bytes=12)
    plan["generation"] = plan["kv_cache"] + plan["prefill"]
    plan["planned"] = plan["weights"] + max(plan["loss_pass"], plan["generation"])
    got["plan"] = plan
    got["measured"] = weights + max(got["loss_pass"], got["generation"])
    got["params"] = shape.params
    return got


# --gpu: a Llama-3.2-1B-shaped model (random weights) in bf16 on one CUDA GPU; --gpu --moe:
# a mixture of experts shaped as Qwen3-30B-A3B's layers (128 experts, 8 per token), 8 of them
GPU_MODELS = {
    "llama": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
              "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True},
    "moe": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
            "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 8,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "num_experts": 128, "num_experts_per_tok": 8, "tie_word_embeddings": False},
}  # fmt: skip
GPU_BATCH, GPU_PROMPT, GPU_NEW = 8, 1024, 128


def measure_gpu(kind: str = "llama") -> dict:
    """The same two phases on a CUDA GPU in bf16, as the evaluate stage runs there, each
    phase's peak from torch.cuda.max_memory_allocated less the weights; the plan's GPU
    figures (2 bytes a weight, 6 a logit)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketune.budget.evalplan import eval_bytes
    from snaketune.budget.memplan import Shape
    from snaketune.evaluation.evaluate import heldout_loss

    torch.manual_seed(0)
    fields = dict(GPU_MODELS[kind])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    shape = Shape.from_config(GPU_MODELS[kind])
    vocab, batch, prompt, new = GPU_MODELS[kind]["vocab_size"], GPU_BATCH, GPU_PROMPT, GPU_NEW
    ids = torch.randint(1, vocab, (batch, prompt), device="cuda")
    rows = [{"input_ids": r.tolist(), "labels": [-100] * (prompt // 2) + r[prompt // 2 :].tolist()}
            for r in ids.cpu()]  # fmt: skip
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated()

    def phase(fn) -> int:
        fn()  # warm
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - weights

    def generate() -> None:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=new, min_new_tokens=new, pad_token_id=0)  # fmt: skip

    got = {"weights": weights, "loss_pass": phase(lambda: heldout_loss(model, rows, batch, 0)),
           "generation": phase(generate), "device": torch.cuda.get_device_name()}  # fmt: skip
    plan = eval_bytes(shape, 1, batch, prompt, new, w=2)
    plan["generation"] = plan["kv_cache"] + plan["prefill"]
    plan["planned"] = plan["weights"] + max(plan["loss_pass"], plan["generation"])
    got.update(plan=plan, measured=weights + max(got["loss_pass"], got["generation"]),
               params=shape.params, active=shape.active_params, kind=kind)  # fmt: skip
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="a 7M-weight model")
    parser.add_argument("--gpu", action="store_true",
                        help="on a CUDA GPU in bf16: a Llama-3.2-1B shape")  # fmt: skip
    parser.add_argument("--moe", action="store_true",
                        help="with --gpu: a mixture of experts (Qwen3-30B-A3B's layers, 8 of them)")  # fmt: skip
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.gpu:
        got = measure_gpu("moe" if args.moe else "llama")
        print(json.dumps(got) if args.json else gpu_table(got))
        return 0
    got = measure(SIZES["short" if args.short else "full"])
    mib, p = 2**20, got["plan"]
    print(
        f"CPU, fp32, one process; {got['params'] / 1e6:.1f}M weights; batch {BATCH} x "
        f"{PROMPT} tokens, {NEW} new tokens; MiB"
    )
    print("| part | planned | measured (MemTracker) |")
    print("|---|---:|---:|")
    print(f"| weights | {p['weights'] / mib:.1f} | {got['weights'] / mib:.1f} |")
    print(f"| loss pass (the logits, 12 bytes each on CPU) | {p['loss_pass'] / mib:.1f} | "
          f"{got['loss_pass'] / mib:.1f} |")  # fmt: skip
    print(f"| generation (KV cache {p['kv_cache'] / mib:.1f} + prefill MLP "
          f"{p['prefill'] / mib:.1f}) | {p['generation'] / mib:.1f} | "
          f"{got['generation'] / mib:.1f} |")  # fmt: skip
    print(f"| total (weights + the larger) | {p['planned'] / mib:.1f} | "
          f"{got['measured'] / mib:.1f} |")  # fmt: skip
    print(f"plan / measured: {p['planned'] / got['measured']:.2f}")
    if args.json:  # the figures for a program, after the table: one line, the last
        print(json.dumps(got))
    return 0


def gpu_table(got: dict) -> str:
    mib, p = 2**20, got["plan"]
    active = f" ({got['active'] / 1e6:.1f}M active)" if got["active"] < got["params"] else ""
    rows = [f"{got['device']}, bf16, one process; {got['params'] / 1e6:.1f}M weights{active}; batch "
            f"{GPU_BATCH} x {GPU_PROMPT} tokens, {GPU_NEW} new tokens; MiB (measured: "
            "torch.cuda.max_memory_allocated)", "| part | planned | measured |", "|---|---:|---:|",
            f"| weights | {p['weights'] / mib:.1f} | {got['weights'] / mib:.1f} |",
            f"| loss pass (6 bytes a logit) | {p['loss_pass'] / mib:.1f} | "
            f"{got['loss_pass'] / mib:.1f} |",
            f"| generation (KV cache {p['kv_cache'] / mib:.1f} + prefill MLP "
            f"{p['prefill'] / mib:.1f}) | {p['generation'] / mib:.1f} | "
            f"{got['generation'] / mib:.1f} |",
            f"| total (weights + the larger) | {p['planned'] / mib:.1f} | "
            f"{got['measured'] / mib:.1f} |",
            f"plan / measured: {p['planned'] / got['measured']:.2f}"]  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
