"""Where LoRA adapters go (snaketune.core.lora_targets), piece by piece: the expert
parameters a list of names asks for, a dense model's targets as written, the names read off
a module's path, the run's dropout only where it is missing, the description of what
carries adapters. Quick: tiny models built in milliseconds; the families' adapters against
their plan are test_moe.py's."""

from __future__ import annotations

import json

import pytest
import torch
from test_moe import SMALL, TINY

from snaketune.core import lora_targets as lt


def mixtral():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fields = {**SMALL, **TINY["mixtral"]}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("mixtral", **fields))


def dense(**fields):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **{**SMALL, "intermediate_size": 32, **fields})
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(("names", "experts"), [
    (["q_proj", "v_proj"], set()),  # attention only: no expert parameter
    (["down_proj"], {"down_proj"}),
    (["gate_proj", "up_proj"], {"gate_up_proj"}),
    (["gate_proj"], set()),  # gate and up are stacked: half of them is not a target
    (["q_proj", "gate_proj", "up_proj", "down_proj"], {"gate_up_proj", "down_proj"}),
])  # fmt: skip
def test_named_targets_adapt_the_expert_parameters_they_name(names, experts):
    model = mixtral()
    got = lt.resolve(model, {"r": 8, "alpha": 16, "target_modules": names})
    params = got["target_parameters"]
    assert params == sorted(f"mlp.experts.{e}" for e in experts)  # per layer: a pattern
    # the linears named (Mixtral's MLP is all experts: no linear gate, up or down)
    linears = {m.rsplit(".", 1)[-1] for m in got["target_modules"]}
    assert linears == set(names) & {"q_proj", "v_proj"}, got["target_modules"]
    assert got["rank_pattern"] == {r".*\.gate_up_proj": 16}  # 2r: gate and up, one adapter
    assert got["alpha_pattern"] == {r".*\.gate_up_proj": 32}  # 2 alpha


def test_a_dense_model_keeps_its_targets_as_written():
    """Untied output layer or not, a model with no experts and no vision tower gets the
    run's targets unchanged (the output layer is not a tower); a model with no output layer
    has no parameter outside its language model."""
    from transformers import AutoModel

    for tied in (False, True):
        model = dense(tie_word_embeddings=tied)
        for targets in ("all-linear", ["q_proj", "o_proj"]):
            assert lt.resolve(model, {"r": 4, "alpha": 8, "target_modules": targets}) == {
                "target_modules": targets}  # fmt: skip
    base = AutoModel.from_config(dense().config)
    assert base.get_output_embeddings() is None
    assert list(lt.language_outside(base, base)) == []


def test_names_are_read_from_a_modules_path():
    assert lt.targeted("model.layers.0.self_attn.q_proj", False, {"q_proj"})
    assert lt.targeted("q_proj", False, {"q_proj"})  # a name without a path
    assert not lt.targeted("model.layers.0.self_attn.q_proj", False, {"self_attn", "k_proj"})
    assert lt.targeted("model.layers.0.self_attn.q_proj", True, set())
    assert lt.suffix("model.layers.3.mlp.experts") == "mlp.experts"
    assert lt.suffix("model.layers.12.self_attn.q_proj") == "self_attn.q_proj"
    # the index at an odd place in the path (i + 1 is not i | 1 nor i ^ 1 there)
    assert lt.suffix("model.language_model.layers.7.self_attn.q_proj") == "self_attn.q_proj"
    assert lt.suffix("lm_head") == "lm_head"  # no layer index: the name itself
    kinds = {
        "model.layers.0.mlp.gate": "router", "gate": "router", "router": "router",
        "model.layers.1.mlp.shared_expert_gate": "router",
        "model.layers.1.mlp.shared_expert.up_proj": "shared_experts",
        "model.layers.1.mlp.experts": "experts",
        "model.layers.0.mlp.down_proj": "mlp", "down_proj": "mlp",
        "model.layers.0.self_attn.q_proj": "attention", "model.layers.0.attention.wq": "attention",
    }  # fmt: skip
    assert {name: lt.kind_of(name) for name in kinds} == kinds


def peft_mixtral(dropout: float):
    from peft import LoraConfig, get_peft_model

    model = mixtral()
    lora = {"r": 4, "alpha": 8, "target_modules": "all-linear"}
    with lt.exact_targets():
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                **lt.resolve(model, lora)))  # fmt: skip


def test_the_runs_dropout_goes_only_where_it_is_missing():
    """No dropout asked: nothing changes, the adapters keep peft's Identity; a config whose
    dropout is the run's already: nothing to do; a config with another: the run's is
    given (the message counts the layers given it)."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    peft = peft_mixtral(0.0)
    experts = SMALL["num_hidden_layers"] * 2
    assert lt.dropout_where_supported(peft, 0.0) == (0, experts)
    layers = [
        m for m in peft.modules() if isinstance(m, LoraLayer) and not isinstance(m, ParamWrapper)
    ]
    assert layers and all(isinstance(m.lora_dropout["default"], torch.nn.Identity) for m in layers)
    assert lt.run_dropout(peft, 0.0) is None
    next(iter(peft.peft_config.values())).lora_dropout = 0.1
    assert lt.run_dropout(peft, 0.05) == (
        f"lora.dropout 0.05 on the {len(layers)} adapted linear layers; none on the {experts} "
        "adapted fused-expert parameters (peft's adapter on an expert parameter has no "
        "dropout; docs/moe.md)")  # fmt: skip
    assert all(m.lora_dropout["default"].p == 0.05 for m in layers)
    assert lt.run_dropout(peft, float("0.1")) is None  # the same value, another object


def test_the_description_counts_trainable_adapters_only(tmp_path):
    peft = peft_mixtral(0.0)
    before = lt.describe(peft)
    frozen = next(p for n, p in peft.named_parameters() if "q_proj.lora_A" in n)
    frozen.requires_grad_(False)  # an adapter that does not train: not counted
    base = next(p for n, p in peft.named_parameters() if "embed_tokens" in n)
    base.requires_grad_(True)  # a base weight that trains: not an adapter
    after = lt.describe(peft)
    assert after["adapter_params"]["attention"] == (
        before["adapter_params"]["attention"] - frozen.numel())  # fmt: skip
    assert set(after["adapter_params"]) == set(before["adapter_params"])
    assert after["trainable_params"] == before["trainable_params"] - frozen.numel() + base.numel()
    (tmp_path / lt.ADAPTERS).write_text(json.dumps(after))
    assert lt.read_description(tmp_path) == after
    assert lt.read_description(tmp_path / "none") is None
