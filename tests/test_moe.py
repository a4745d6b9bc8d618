"""Mixtures of experts: the plan counts every expert (snaketune.core.modelshape), checked
against the same models built by transformers on the meta device (no memory, no weights)."""

from __future__ import annotations

import pytest
import torch

from snaketune.core.errors import UserError
from snaketune.core.modelshape import Shape

# The published config.json fields of each family's model (the ones the count reads).
REAL = {
    "Qwen/Qwen3-30B-A3B": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    "Qwen/Qwen1.5-MoE-A2.7B": {
        "model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_experts": 60, "num_experts_per_tok": 4, "vocab_size": 151936,
        "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    "mistralai/Mixtral-8x7B-v0.1": {
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    "deepseek-ai/DeepSeek-V2-Lite": {
        "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 102400, "tie_word_embeddings": False,
        "n_group": 1, "topk_group": 1,
    },
    "deepseek-ai/DeepSeek-V3": {
        "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": False,
        "n_group": 8, "topk_group": 4,
    },
    "openai/gpt-oss-20b": {
        "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
        "vocab_size": 201088, "tie_word_embeddings": False, "attention_bias": True,
    },
    "allenai/OLMoE-1B-7B-0924": {
        "model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024,
        "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_experts": 64, "num_experts_per_tok": 8, "vocab_size": 50304,
        "tie_word_embeddings": False,
    },
}  # fmt: skip
# Tiny ones of each family, with their quirks switched on: dense leading layers, shared
# experts, latent attention with and without a query rank, biases, unequal widths.
SMALL = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}  # fmt: skip
TINY = {
    "qwen3_moe": {"intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
                  "num_experts_per_tok": 2, "head_dim": 16, "mlp_only_layers": [0]},
    "qwen2_moe": {"intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
                  "shared_expert_intermediate_size": 48, "num_experts_per_tok": 2,
                  "decoder_sparse_step": 2},
    "mixtral": {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v2": {"intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 4,
                    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                    "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1},
    "deepseek_v3": {"intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 4,
                    "n_shared_experts": 2, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1},
    "gpt_oss": {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
                "head_dim": 16, "layer_types": ["full_attention"] * 3},
    "olmoe": {"intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
}  # fmt: skip


def on_meta(fields: dict):
    """The model transformers builds from ``fields``, on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def counted(model) -> tuple[int, int]:
    """Every parameter of ``model``, and those a token passes through: of each experts
    module (its parameters stacked per expert, 3-D), only top-k of E experts' share."""
    total = sum(p.numel() for p in model.parameters())
    k = model.config.num_experts_per_tok
    idle = 0
    for module in model.modules():
        stacked = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        if stacked:
            experts = stacked[0].shape[0]
            own = sum(p.numel() for p in module.parameters(recurse=False))
            idle += own * (experts - k) // experts
    return total, total - idle


@pytest.mark.parametrize("kind", sorted(TINY))
def test_a_tiny_model_of_each_family_is_counted_exactly(kind):
    fields = {"model_type": kind, **SMALL, **TINY[kind]}
    total, active = counted(on_meta(fields))
    shape = Shape.from_config(fields)
    assert (shape.params, shape.active_params) == (total, active)
    assert shape.moe and shape.active_params < shape.params


@pytest.mark.parametrize("name", sorted(REAL))
def test_each_familys_published_model_is_counted_within_a_percent(name):
    total, active = counted(on_meta(REAL[name]))
    shape = Shape.from_config(REAL[name])
    assert shape.params == pytest.approx(total, rel=0.01), (shape.params, total)
    assert shape.active_params == pytest.approx(active, rel=0.01), (shape.active_params, active)


def test_qwen3_30b_a3b_is_planned_at_its_real_size():
    """The issue's case: config.json alone used to give its 3.3B active parameters."""
    shape = Shape.from_config(REAL["Qwen/Qwen3-30B-A3B"])
    assert 30.4e9 < shape.params < 30.6e9 and 3.3e9 < shape.active_params < 3.4e9
    assert shape.params * 2 / 1024**3 == pytest.approx(56.9, abs=0.1)  # bf16 weights, GiB


def test_a_mixture_of_experts_the_plan_cannot_count_is_refused():
    """A mixture of experts no formula knows is counted on the model transformers builds
    (JetMoE); one transformers cannot build either is refused, not planned at its active
    size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketune.budget.modelcount import shape_of

    cfg = {
        "model_type": "jetmoe",
        **SMALL,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    built = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    assert shape_of(cfg).params == sum(p.numel() for p in built.parameters())
    unknown = {**cfg, "model_type": "snaketune_unknown_moe"}
    refused = r"model_type 'snaketune_unknown_moe': a mixture of experts the plan does not count"
    with pytest.raises(UserError, match=refused + r" .*set skip_memory_check: true"):
        shape_of(unknown)


def test_the_mfu_counts_the_experts_a_token_is_routed_to():
    """The FLOPs of a step count the active parameters (throughput.matmul_params, from the
    modules) as the plan counts them (from config.json), the input embedding left out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketune.core.throughput import matmul_params

    fields = {"model_type": "deepseek_v3", **SMALL, **TINY["deepseek_v3"]}
    shape = Shape.from_config(fields)
    config = AutoConfig.for_model("deepseek_v3", **SMALL, **TINY["deepseek_v3"])
    model = AutoModelForCausalLM.from_config(config)
    assert matmul_params(model) == shape.active_params - shape.vocab * shape.hidden


@pytest.mark.parametrize("kind", sorted(TINY))
@pytest.mark.parametrize("router", [False, True])
def test_adapters_reach_the_experts_and_the_router_only_when_asked(kind, router):
    """all-linear on each family: adapters on attention, on the dense layers' and shared
    experts' MLPs and on the fused experts (peft's parameter targeting), none on the router
    unless lora.adapt_router; their parameters are what the plan counts; a forward and
    backward pass reaches each expert's adapter."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketune.core.lora_targets import describe, exact_targets, resolve

    fields = {**SMALL, **TINY[kind]}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **fields))
    lora = {"r": 4, "alpha": 8, "target_modules": "all-linear", "adapt_router": router}
    with exact_targets():
        peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **resolve(model, lora)))
    got = describe(peft)["adapter_params"]
    shape = Shape.from_config({"model_type": kind, **fields})
    assert sum(got.values()) == shape.lora_params(4, "all-linear", (), router), got
    expected = {"attention", "experts"} | ({"router"} if router else set())
    expected |= {"mlp"} if shape.moe_layers < shape.layers else set()
    expected |= {"shared_experts"} if shape.shared_intermediate else set()
    assert set(got) == expected, got
    for name, param in peft.named_parameters():  # B starts at zero: give it a value
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    ids = torch.randint(1, SMALL["vocab_size"], (2, 12))
    peft(input_ids=ids, labels=ids).loss.backward()
    stacked = [p for n, p in peft.named_parameters() if ".experts" in n and "lora_A" in n]
    assert stacked and all(p.grad is not None and p.grad.abs().sum() > 0 for p in stacked)


# (adapted linear layers, adapted expert parameters): 3 layers' q, k, v, o; qwen3_moe's dense
# first layer's gate, up, down; each MoE layer's gate_up_proj and down_proj
@pytest.mark.parametrize(("kind", "counts"), [("qwen3_moe", (3 * 4 + 3, 2 * 2)),
                                              ("mixtral", (3 * 4, 3 * 2))])  # fmt: skip
def test_the_schemas_default_dropout_builds_on_a_mixture_of_experts(kind, counts):
    """A user's first MoE LoRA run (lora written as {r, alpha, target_modules: all-linear},
    the schema's dropout 0.05) builds its adapters through the trainer's peft config (peft
    refuses any dropout in a config that adapts fused expert parameters): the run's dropout
    on every adapted linear layer, in training mode as written, none on the experts; a
    dense model keeps peft's own dropout."""
    from conftest import defaults_spec
    from peft import get_peft_model
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper
    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketune.core.lora_targets import exact_targets, run_dropout
    from snaketune.methods.training import peft_config

    run = defaults_spec(lora={"r": 8, "alpha": 16, "target_modules": "all-linear"})
    assert run["lora"]["dropout"] == 0.05  # the schema's default, not written
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **SMALL, **TINY[kind]))
    with exact_targets():
        peft = get_peft_model(model, peft_config(run, model))
    given, left = counts
    assert run_dropout(peft, run["lora"]["dropout"]) == (
        f"lora.dropout 0.05 on the {given} adapted linear layers; none on the {left} adapted "
        "fused-expert parameters (peft's adapter on an expert parameter has no dropout; "
        "docs/moe.md)")  # fmt: skip
    layers = [m for m in peft.modules() if isinstance(m, LoraLayer)]
    experts = [m for m in layers if isinstance(m, ParamWrapper)]
    linear = [m for m in layers if not isinstance(m, ParamWrapper)]
    assert all(isinstance(m.lora_dropout["default"], torch.nn.Identity) for m in experts)
    assert all(m.lora_dropout["default"].p == 0.05 for m in linear)
    peft.train()
    ids = torch.randint(1, SMALL["vocab_size"], (2, 12))
    peft(input_ids=ids, labels=ids).loss.backward()  # trains with dropout on
    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", **SMALL, intermediate_size=32))  # fmt: skip
    assert peft_config(run, dense).lora_dropout == 0.05
    with exact_targets():
        dense_peft = get_peft_model(dense, peft_config(run, dense))
    assert run_dropout(dense_peft, 0.05) is None  # peft's own dropout: nothing to add


@pytest.fixture(scope="session")
def tiny_moe(demo, tmp_path_factory):
    """A tiny random Qwen3-MoE (4 experts, 2 per token, 2 layers) on the demo's tokenizer."""
    import shutil

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    src, out = demo / "resources/fixtures/tiny-llama", tmp_path_factory.mktemp("moe") / "tiny-moe"
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=447, hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0,
                            tie_word_embeddings=False, initializer_range=0.1)  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):  # fmt: skip
        shutil.copy(src / name, out / name)
    return out


def router_aux(model, rows: list[dict], experts: int, top_k: int) -> float:
    """Switch Transformer's load-balancing loss of one micro batch, written out: over every
    token of its examples (each run alone, unpacked) and every MoE layer, experts x the sum
    over the k choices and the experts of the share of tokens whose choice is that expert
    times the expert's mean router probability."""
    import torch

    logits = []
    with torch.no_grad():
        for row in rows:
            out = model(input_ids=torch.tensor([row["input_ids"]]), output_router_logits=True)
            logits.append(torch.cat(out.router_logits, 0))
    probs = torch.cat(logits, 0).softmax(-1)
    chosen = torch.nn.functional.one_hot(probs.topk(top_k, -1).indices, experts).float()
    return experts * (chosen.mean(0) * probs.mean(0)).sum().item()


@pytest.mark.slow
# Each preset and each method once, ZeRO-3 (which partitions the fused experts) with the
# adapters on them; ZeRO-2 LoRA trains in the resume test below, ZeRO-3 full in the
# continuation test (each against itself there, not against the oracle).
@pytest.mark.parametrize(
    ("preset", "method"),
    [("zero3", "lora"), pytest.param("zero2", "full", marks=pytest.mark.extended)],
)
def test_a_mixture_of_experts_trains_on_two_nodes_with_its_router_in_balance(
    demo, tiny_moe, tmp_path, preset, method
):
    """The tiny Qwen3-MoE on the demo's shards, 2 nodes, 6 steps, router_aux_loss_coef 0.01:
    it learns under ZeRO-2 and ZeRO-3, LoRA and full; the first step's logged loss (the
    weights as loaded: the warmup's first learning rate is 0) is the token mean of both
    ranks' NLL plus 0.01 x the mean of the two micro batches' auxiliary losses, each
    computed example by example with plain transformers, and its aux_loss that mean; every
    step logs the expert load; a LoRA run's provenance says its adapters sit on attention
    and the experts, not the router, with the plan's count of them."""
    import json

    from conftest import read_jsonl, run_spec, train
    from oracles import mean_nll, planned_steps
    from transformers import AutoModelForCausalLM

    shards = demo / "results/demo/shards"
    spec = run_spec(method=method, max_steps=6, save_steps=6, router_aux_loss_coef=0.01,
                    **({"learning_rate": 1e-3} if method == "full" else {}))  # fmt: skip
    if method == "lora":
        spec["lora"]["modules_to_save"] = []
    out = train(tmp_path, spec, shards, tiny_moe, preset)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, [r["loss"] for r in rows]  # it learns
    assert all(r["expert_load"] >= 1.0 for r in rows)
    base = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()
    (first,) = planned_steps(shards, 1)
    aux = sum(router_aux(base, rank, 4, 2) for rank in first) / len(first)
    nll, _ = mean_nll(base, first[0] + first[1])
    assert rows[0]["aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert rows[0]["loss"] == pytest.approx(nll + 0.01 * aux, rel=1e-5)
    from snaketune.app.summary import summary_row  # summary.tsv and the report: last quarter

    summary = summary_row("x", spec, out, None, None)
    assert float(summary["aux_loss_last_quarter"]) == pytest.approx(rows[-1]["aux_loss"], abs=1e-4)
    assert float(summary["expert_load_last_quarter"]) >= 1.0
    if method == "lora":
        adapters = json.loads((out / "provenance.json").read_text())["adapters"]
        assert set(adapters["adapter_params"]) == {"attention", "experts"}, adapters
        shape = Shape.from_config(json.loads((tiny_moe / "config.json").read_text()))
        assert sum(adapters["adapter_params"].values()) == shape.lora_params(8, "all-linear")


@pytest.mark.extended
@pytest.mark.slow
def test_a_moe_lora_run_resumes_exactly_and_its_merged_model_is_the_adapter_model(
    demo, tiny_moe, tmp_path
):
    """The tiny Qwen3-MoE's LoRA run (ZeRO-2, 2 nodes, checkpoints at steps 3 and 6): its
    launcher killed past the resumed checkpoint, the rerun logs each step once with the same
    losses; its adapter converted and merged into the per-expert tensors of the base
    checkpoint (as transformers 5 saves a mixture of experts), the merged model, loaded by
    plain transformers with the base's parameter count, gives the logits of the base with
    the adapter loaded by plain peft (1e-5)."""
    import subprocess
    import sys

    from conftest import ENV, ROOT, kill_and_resume, read_jsonl, run_spec, train
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    shards = demo / "results/demo/shards"
    # checkpoint-3 kept whole (optimizer: all), as the resume from it needs
    spec = run_spec(max_steps=6, save_steps=3, save_total_limit=2, checkpoints={"optimizer": "all"})
    spec["lora"]["modules_to_save"] = []
    (tmp_path / "first").mkdir()
    (tmp_path / "again").mkdir()
    out = train(tmp_path / "first", spec, shards, tiny_moe, "zero2")
    start, resumed = kill_and_resume(out, tmp_path / "again", spec, shards, tiny_moe)
    assert start == 3
    first = {m["step"]: m["loss"] for m in read_jsonl(out / "metrics.jsonl")}
    assert {m["step"]: m["loss"] for m in resumed} == first
    for script, args in (
        ("convert_checkpoint.py", ["--method", "lora", "--checkpoint", out / "final_checkpoint",
                                   "--trained", out / "model", "--base", tiny_moe,
                                   "--out", tmp_path / "adapter"]),
        ("merge_lora.py", ["--base", tiny_moe, "--adapter", tmp_path / "adapter",
                           "--out", tmp_path / "merged"]),
    ):  # fmt: skip
        cmd = [sys.executable, str(ROOT / "scripts" / script), *map(str, args), "--probe",
               str(out / "probe.safetensors"), "--max-shard-size", "5GB", "--dtype", "auto"]  # fmt: skip
        proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    assert sum(p.numel() for p in merged.parameters()) == sum(p.numel() for p in base.parameters())
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ids = torch.randint(3, 447, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, merged.eval()(input_ids=ids).logits
        unchanged = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)(
            input_ids=ids).logits  # fmt: skip
    assert (want - unchanged).abs().max() > 1e-3  # the adapter changes the model
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_the_qwen3_30b_a3b_example_is_planned_at_its_real_size(tmp_path):
    """config/examples/qwen3-30b-a3b-lora-1x8.yaml through `snaketune plan` with the model's
    config.json where the download puts it: every expert counted (30.5B weights, 3.35B
    active), ZeRO-3 training on the node's 8 H100s at 17.6 GiB per GPU with the adapters on
    the 128 experts (1.0B trainable), each evaluation on one GPU, conversion and merge on
    CPU. Its disk plan (about 100 GiB) is judged against this machine's free space: a
    refusal there is the only one allowed."""
    import json
    import subprocess

    from conftest import BIN, ENV, ROOT, SHAPES

    model = tmp_path / "resources/models/qwen3_30b_a3b"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(SHAPES["Qwen/Qwen3-30B-A3B"]))
    example = ROOT / "config/examples/qwen3-30b-a3b-lora-1x8.yaml"
    proc = subprocess.run([str(BIN / "snaketune"), "plan", str(example), "--json"], cwd=tmp_path,
                          env=ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
    (plan,) = json.loads(proc.stdout)
    assert proc.returncode == 0 or plan["disk"]["fits"] is False, proc.stderr[-2000:]
    assert plan["params"] == 30_532_122_624 and plan["active_params"] == 3_353_032_704
    assert plan["fits"] and plan["per_gpu_gib"]["total"] == pytest.approx(17.6, abs=0.05)
    stages = plan["stages"]
    for stage in ("evaluate", "evaluate_base"):
        assert (stages[stage]["nodes"], stages[stage]["gpus_per_node"]) == (1, 1), stages[stage]
        assert stages[stage]["fits"] and stages[stage]["per_gpu_gib"] > 56.9
    assert {"convert_checkpoint", "merge_lora"} <= set(stages)
    shape = Shape.from_config(SHAPES["Qwen/Qwen3-30B-A3B"])
    assert shape.lora_params(16, "all-linear") == pytest.approx(0.995e9, rel=1e-3)


def experts_adapter_check(device: str, dtype) -> None:
    """A Qwen3-MoE with LoRA on its experts (16 experts, 4 per token) on ``device``: in bf16
    a step with the load-balancing loss reaches every expert's adapter with finite
    gradients; in fp32 each expert's change written into the fused experts
    (snaketune.export.experts) gives the adapter model's logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketune.core.lora_targets import exact_targets, resolve
    from snaketune.export.experts import ExpertPair

    config = AutoConfig.for_model("qwen3_moe", vocab_size=512, hidden_size=256,
                                  intermediate_size=512, moe_intermediate_size=128,
                                  num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=2, head_dim=32, num_experts=16,
                                  num_experts_per_tok=4, output_router_logits=True)  # fmt: skip
    # the experts alone (every layer routes): what the merge below writes is the whole adapter
    lora = {"r": 4, "alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"]}
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with exact_targets():
        peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **resolve(model, lora)))
    for name, param in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    ids = torch.randint(1, 512, (4, 64), device=device)
    if dtype == torch.bfloat16:
        out = peft(input_ids=ids, labels=ids)
        (out.loss + 0.01 * out.aux_loss).backward()
        grads = [p.grad for n, p in peft.named_parameters() if ".experts" in n and "lora_" in n]
        assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
                             for g in grads)  # fmt: skip
        return
    with torch.no_grad():
        want = peft(input_ids=ids).logits
        for module in [m for n, m in peft.named_modules() if n.endswith("mlp.experts")]:
            for wrapper in (module, module.base_layer):
                param = wrapper.get_param()
                kind = "gate_up" if param.shape[1] == 2 * 128 else "down"
                pair = ExpertPair("", kind, wrapper.lora_A["default"].weight,
                                  wrapper.lora_B["default"].weight,
                                  wrapper.scaling["default"])  # fmt: skip
                param += pair.delta(16)
        with peft.disable_adapter():
            got = peft.get_base_model()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_each_experts_change_merged_gives_the_adapter_models_logits():
    experts_adapter_check("cpu", torch.float32)


@pytest.mark.gpu
def test_adapters_on_the_experts_train_and_merge_on_a_gpu():
    """On CUDA (transformers picks its experts kernel there): the step in bf16, the merge in
    fp32 (experts_adapter_check)."""
    experts_adapter_check("cuda", torch.bfloat16)
    experts_adapter_check("cuda", torch.float32)


@pytest.mark.extended
@pytest.mark.slow
def test_a_moe_run_continues_on_one_node_from_its_two_node_checkpoint(demo, tiny_moe, tmp_path):
    """Full fine-tuning of the tiny Qwen3-MoE under ZeRO-3 with its load-balancing loss:
    2 nodes to step 3, then continued on 1 node (accumulation 2, the global batch kept)
    through DeepSpeed's universal checkpoint (the fused experts re-partitioned): the same
    losses and learning rates as the uninterrupted 2-node run."""
    from conftest import read_jsonl, run_spec, train
    from test_topology import TOLERANCE, _continue, _shard, assert_same_losses

    spec = run_spec(method="full", max_steps=6, save_steps=3, learning_rate=1e-3,
                    router_aux_loss_coef=0.01, checkpoints={"optimizer": "all"})  # fmt: skip
    (tmp_path / "ref").mkdir()
    reference = train(tmp_path / "ref", spec, _shard(demo, tmp_path / "s2", 2, 1, 32, 1),
                      tiny_moe, "zero3")  # fmt: skip
    spec = {**spec, "nodes": 1, "gradient_accumulation_steps": 2}
    out = _continue(reference, 3, tmp_path / "w", spec,
                    _shard(demo, tmp_path / "s1", 1, 1, 32, 2), tiny_moe, "zero3")  # fmt: skip
    assert_same_losses(read_jsonl(out / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl"),
                       after=3, rel=TOLERANCE)  # fmt: skip


def test_a_router_coefficient_on_a_dense_model_is_refused_before_queueing(tmp_path):
    """router_aux_loss_coef set on a run whose model names no experts: one line before
    anything is queued (TRL's DPO trainer would raise only once the job runs)."""
    import json

    from conftest import ROOT, SHAPES

    from snaketune.budget.fit import check_runs
    from snaketune.plan.config import validate_config

    model = tmp_path / "resources/models/m"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(SHAPES["meta-llama/Llama-3.1-8B-Instruct"]))
    data = {"source": "hub", "id": "y", "format": "prompt_response"}
    config = validate_config({"models": {"m": {"source": "hub", "id": "x"}}, "datasets": {"d": data},
                              "runs": {"r": {"model": "m", "dataset": "d", "method": "lora",
                                             "max_steps": 10, "router_aux_loss_coef": 0.01,
                                             "nodes": 1, "gpus_per_node": 1, "max_length": 512,
                                             "micro_batch_size": 1, "learning_rate": 1e-4}}},
                             ROOT)  # fmt: skip
    found = check_runs(config, ["r"], tmp_path, ROOT, local=True)
    assert found[:1] == ["runs.r.router_aux_loss_coef: model m is not a mixture of experts (its "
                     "config.json names no experts); drop the key"], found  # fmt: skip


def test_the_router_term_is_the_coefficient_times_the_mean_of_a_step_s_micro_batches():
    """Router.prepare takes the model's coefficient (auto) and switches the model's own
    addition off; the term each micro batch adds sums over a step's accumulation to the
    coefficient times the mean of its micro batches' auxiliary losses."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketune.methods.training import Router

    config = AutoConfig.for_model("qwen3_moe", vocab_size=64, hidden_size=32,
                                  intermediate_size=64, moe_intermediate_size=16,
                                  num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, num_experts=4,
                                  num_experts_per_tok=2, router_aux_loss_coef=0.02)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    router = Router.prepare(model, {"router_aux_loss_coef": "auto",
                                    "gradient_accumulation_steps": 4})  # fmt: skip
    assert (router.coef, router.experts, router.top_k) == (0.02, 4, 2)
    assert model.config.output_router_logits is True
    assert all(m.router_aux_loss_coef == 0.0 for m in model.modules()
               if hasattr(m, "router_aux_loss_coef"))  # fmt: skip
    aux = (1.0, 2.0, 3.0, 6.0)  # a step's 4 micro batches
    step = sum(router.term(SimpleNamespace(aux_loss=torch.tensor(a))) for a in aux)
    assert step.item() == pytest.approx(0.02 * sum(aux) / len(aux))


def test_each_expert_s_gate_up_and_down_are_the_stacked_change_s_parts_at_peft_s_scale():
    """Expert e's change is B[:, :, e] @ A[e] times the scale, written out here per expert
    from the stacked tensors (A: experts x rank rows; B: out x rank x experts columns); a
    transformers 5 checkpoint's per-expert gate_proj takes its first half, up_proj its
    second; the scale is alpha / r, or alpha / sqrt(r) with rsLoRA, from the rank and alpha
    patterns where they name the stacked gate and up."""
    from snaketune.export.experts import ExpertPair, expert_delta, pair_scale

    experts, r, width, h = 3, 2, 4, 5
    torch.manual_seed(0)
    a, b = torch.randn(r * experts, h), torch.randn(2 * width, r * experts)
    pair, cache = ExpertPair("m.experts", "gate_up", a, b, 0.5), {}
    for e in range(experts):
        a_e = torch.stack([a[e * r + k] for k in range(r)])  # (r, h)
        b_e = torch.stack([b[:, k * experts + e] for k in range(r)], dim=1)  # (out, r)
        want = b_e @ a_e * 0.5
        got_gate = expert_delta(f"m.experts.{e}.gate_proj.weight", pair, experts, cache)
        got_up = expert_delta(f"m.experts.{e}.up_proj.weight", pair, experts, cache)
        torch.testing.assert_close(got_gate, want[:width])
        torch.testing.assert_close(got_up, want[width:])
    assert pair_scale({"r": 16, "lora_alpha": 32}, "down") == 2.0
    assert pair_scale({"r": 16, "lora_alpha": 32, "use_rslora": True}, "down") == 8.0
    patterned = {"r": 16, "lora_alpha": 32, "use_rslora": True,
                 "rank_pattern": {"mlp.experts.gate_up_proj": 4},
                 "alpha_pattern": {"mlp.experts.gate_up_proj": 8}}  # fmt: skip
    assert pair_scale(patterned, "gate_up") == 4.0  # 8 / sqrt(4)
    assert pair_scale(patterned, "down") == 8.0  # 32 / sqrt(16)


def test_an_export_has_the_bases_inference_settings_back(tmp_path):
    """What training switches on in a mixture of experts' config (router logits, for the
    load-balancing term; the trainer's KV cache off) is set back to the base's config.json
    values in an export (absent there: transformers' defaults, no router logits, a cache),
    and a base's own choice is kept."""
    import json

    from transformers import Qwen3MoeConfig

    from snaketune.export.convert import inference_settings

    trained = Qwen3MoeConfig(**SMALL, **TINY["qwen3_moe"])
    trained.output_router_logits, trained.use_cache = True, False
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert inference_settings(trained, tmp_path) == {"use_cache": True,
                                                     "output_router_logits": False}  # fmt: skip
    assert trained.output_router_logits is False and trained.use_cache is True
    trained.use_cache = False
    (tmp_path / "config.json").write_text(json.dumps({"use_cache": False}))
    assert inference_settings(trained, tmp_path) == {}  # the base's own setting, kept


def test_a_family_without_an_auxiliary_loss_adds_none_unless_a_coefficient_is_set():
    """DeepSeek-V3 balances its experts with a router bias (its config has no
    router_aux_loss_coef, its model returns no aux_loss): ``auto`` adds no term; a run's own
    coefficient adds that times the Switch balance loss of the router's logits, written out
    here (router_aux)."""
    import json as _json

    from families import FAMILIES
    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketune.methods.training import Router

    family = FAMILIES["deepseek-v3"]
    fields = {**_json.loads(_json.dumps(family.fields)), "vocab_size": 100}
    config = AutoConfig.for_model(family.model_type, **fields)
    assert getattr(config, "router_aux_loss_coef", None) is None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    row = {"input_ids": list(range(3, 40))}
    auto = Router.prepare(model, {"router_aux_loss_coef": "auto", "gradient_accumulation_steps": 1})
    with torch.no_grad():
        outputs = model(input_ids=torch.tensor([row["input_ids"]]))
    assert outputs.aux_loss is None and auto.coef == 0.0 and auto.term(outputs) == 0.0
    set_ = Router.prepare(model, {"router_aux_loss_coef": 0.01, "gradient_accumulation_steps": 2})
    want = 0.01 * router_aux(model, [row], 4, 2) / 2
    assert float(set_.term(outputs)) == pytest.approx(want, rel=1e-5)
