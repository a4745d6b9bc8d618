"""MFU: the FLOPs formula, the peak table and the parameters that count."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from snaketune.core.throughput import matmul_params, mfu, peak_tflops, step_flops


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_by_device_name(name, peak):
    assert peak_tflops(name) == peak
    assert peak_tflops(name, override=100.0) == 100.0


def test_flops_of_a_step():
    # full: 6 N per token; LoRA: 4 N; attention 6 x layers x hidden x n^2 per example
    assert step_flops(1000, 10, 0, 2, 8, lora=False) == 60_000
    assert step_flops(1000, 10, 0, 2, 8, lora=True) == 40_000
    assert step_flops(0, 10, 100, 2, 8, lora=False) == 6 * 2 * 8 * 100
    assert mfu(989e12, 1.0, 1, 989.0) == pytest.approx(1.0)
    assert mfu(1e12, 1.0, 2, None) is None


@pytest.mark.parametrize("tied", [False, True])
def test_matmul_params_leave_out_the_input_embedding(tied):
    config = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)  # fmt: skip
    model = LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    assert matmul_params(model) == (total if tied else total - 100 * 16)
