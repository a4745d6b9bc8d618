"""Model FLOPs utilisation (MFU): the FLOPs a training step needs over what the GPUs could do.

Per optimizer step, summed over every example of the global batch:

    flops = c * N * T  +  6 * L * d * sum_i n_i^2

- T: real (non-pad) tokens; n_i: the length of example i (packed or not, attention runs
  within an example, so its cost follows n_i^2, not the row or padded length);
- N: parameters that do a matmul per token: all but the input embedding (a tied output
  head counts once);
- c = 6 for full fine-tuning (forward 2N, backward 2N for activation gradients and 2N for
  weight gradients), c = 4 for LoRA (frozen weights get no weight gradients; the adapter's
  own FLOPs are under 1% at usual ranks and are left out);
- attention: QK^T and AV are 4 * n^2 * d FLOPs per layer forward, halved by the causal mask,
  and the backward costs twice the forward: 6 * L * d * n^2 for both methods (attention
  has no weights, its backward runs in full).

MFU = flops / step seconds / (GPUs x peak dense bf16 FLOP/s). Recomputed activations
(gradient checkpointing) are not counted, by the usual convention (that would be HFU).
Peaks below are the vendors' dense (no sparsity) bf16 figures; ``gpu_peak_tflops`` in a run
overrides them (another GPU, or fp16/fp32 peaks).
"""

from __future__ import annotations

from dataclasses import dataclass

from snaketune.core.configfields import stacked_params


class Counted:
    """What the step callback (snaketune.train.progress) reads from a collator, counted
    over its batches: real (example) tokens, tokens in the model's input (padding
    included), samples, and the sum of squared sequence lengths (attention work)."""

    def __init__(self) -> None:
        self.tokens = self.padded = self.samples = self.squares = 0

    def add(self, lengths: list[int], padded: int, samples: int) -> None:
        """One batch: its sequences' real lengths, its input's size, its samples."""
        self.tokens += sum(lengths)
        self.squares += sum(n * n for n in lengths)
        self.padded += padded
        self.samples += samples


@dataclass(frozen=True)
class FlopsModel:
    """What the MFU of a step needs; None on CPU."""

    n_params: int
    layers: int
    hidden: int
    lora: bool
    gpus: int
    peak_tflops: float | None


PEAK_BF16_TFLOPS = {  # per GPU, dense
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
}


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """Peak dense bf16 TFLOP/s of one GPU named ``device_name`` (None when unknown)."""
    if override:
        return float(override)
    name = device_name.upper().replace("-", " ")  # torch's "NVIDIA H100 PCIe", a config's
    for key, value in PEAK_BF16_TFLOPS.items():  # most specific first
        if all(part.upper() in name for part in key.split()):
            return value
    return None


def matmul_params(model) -> int:
    """N: parameters used in a matmul per token (the input embedding is a lookup; of a
    mixture of experts' experts, stacked per expert in 3-D parameters, the share of the
    num_experts_per_tok a token is routed to)."""
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    total = sum(p.numel() for p in model.parameters())
    routed = getattr(model.config, "num_experts_per_tok", None)
    for module in model.modules() if routed else ():
        own = list(module.parameters(recurse=False))
        stacked = stacked_params(module)
        if stacked:  # the experts module: each of its parameters has one slice per expert
            experts = stacked[0][1].shape[0]
            total -= sum(p.numel() for p in own) * (experts - routed) // experts
    return total if tied else total - embedding.numel()


def step_flops(
    n_params: int, tokens: float, squares: float, layers: int, hidden: int, lora: bool
) -> float:
    """FLOPs of one optimizer step (see the module docstring)."""
    return (4 if lora else 6) * n_params * tokens + 6 * layers * hidden * squares


def mfu(flops: float, seconds: float, gpus: int, peak: float | None) -> float | None:
    if not peak or seconds <= 0:
        return None
    return flops / seconds / (gpus * peak * 1e12)
