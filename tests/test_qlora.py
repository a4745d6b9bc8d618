"""A 4-bit base (lora.quantize: 4bit, QLoRA): its settings and checks, the export's
dequantized base against what bitsandbytes computes with, ZeRO-2 and ZeRO-3, and the demo's
run on a 4-bit base through the whole pipeline (config/qlora_demo.yaml).

The slow tests share one pipeline (the ``qlora_chain`` fixture): on a copy of the finished
demo, qlora_demo trains on 2 emulated nodes, converts, merges, evaluates and reports."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from conftest import (
    CI_RUNS,
    ROOT,
    chain_runs,
    ci_tier,
    kill_and_resume,
    pipeline_spec,
    read_jsonl,
    run_spec,
    snakemake,
    train,
)

from snaketune.core import qlora
from snaketune.core.errors import ConfigError, UserError
from snaketune.plan.config import load_yaml, validate_config
from snaketune.plan.runspec import RunSpec

OVERLAY = ROOT / "config" / "qlora_demo.yaml"
SETTINGS = {"bits": 4, "quant_type": "nf4", "double_quant": True, "blocksize": 64,
            "load_dtype": "fp32", "compute_dtype": "fp32"}  # fmt: skip


def demo_config(**lora) -> dict:
    config = load_yaml(ROOT / "config" / "config.yaml")
    config["runs"]["demo"]["lora"].update(lora)
    return config


def test_settings_follow_the_run():
    config = validate_config(demo_config(quantize="4bit"), ROOT)
    run = config["runs"]["demo"]
    assert qlora.settings(RunSpec.of(run).quantization, "fp32") == SETTINGS
    # a 16-bit compute dtype falls back to fp32 without a GPU, as the precision does
    run["lora"]["compute_dtype"] = "bf16"
    assert qlora.settings(RunSpec.of(run).quantization, "fp32")["compute_dtype"] == "fp32"
    run["lora"]["quantize"] = "none"
    assert RunSpec.of(run).quantization is None
    assert qlora.settings(None, "fp32") is None


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_the_exported_base_is_what_the_4bit_layers_compute_with(tiny_model, quant_type):
    """as_trained (the export's base) equals the dequantized weight of the layer
    transformers loaded in 4 bits, bit for bit, and each 4-bit layer's forward in training
    mode equals a plain linear layer with it."""
    import bitsandbytes.functional as bf
    from safetensors.torch import load_file

    from snaketune.evaluation.model import build_model

    q = {**SETTINGS, "quant_type": quant_type}
    model = build_model(tiny_model, "fp32", "sdpa", q)
    rec = qlora.record(model, q)
    assert len(rec["modules"]) == 14 and rec["unquantized_linears"] == ["lm_head"]
    tensors = load_file(str(next(tiny_model.glob("*.safetensors"))))
    for name in rec["modules"]:
        module = model.get_submodule(name)
        x = torch.randn(3, 5, module.in_features)
        loaded = bf.dequantize_4bit(module.weight.data, module.weight.quant_state)
        mine = qlora.as_trained(tensors[f"{name}.weight"], rec)
        assert torch.equal(loaded, mine), name
        module.train()
        assert torch.allclose(module(x), torch.nn.functional.linear(x, mine), atol=1e-6)
    # the CPU inference path (a repacked bf16 kernel) is kept off: eval mode computes the same
    module = model.get_submodule(rec["modules"][0])
    x = torch.randn(3, 5, module.in_features)
    module.eval()
    with torch.no_grad():
        want = torch.nn.functional.linear(
            x, qlora.as_trained(tensors[f"{rec['modules'][0]}.weight"], rec)
        )
        assert torch.allclose(module(x), want, atol=1e-6)


@pytest.mark.parametrize(
    "change,line",
    [
        ({"method": "full"}, "runs.demo.lora.quantize: a 4-bit base is frozen, so only an "
                             "adapter can train on it"),
        ({"deepspeed": "zero3_offload"}, "runs.demo.lora.quantize: 4bit with DeepSpeed offload "
                                         "(zero3_offload: offload_optimizer, offload_param) is "
                                         "not supported; a 4-bit base needs none: use "
                                         "deepspeed: zero2"),
    ],
)  # fmt: skip
def test_bad_quantize_configs_get_one_line(change, line):
    config = demo_config(quantize="4bit")
    config["runs"]["demo"].update(change)
    with pytest.raises(ConfigError) as info:
        validate_config(config, ROOT)
    assert str(info.value).startswith(line), str(info.value)
    assert "\n" not in str(info.value)


def test_without_bitsandbytes_the_line_gives_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))  # fmt: skip
    with pytest.raises(ConfigError, match=r"^runs.demo.lora.quantize: bitsandbytes is not "
                                          r"installed: pip install -e \"\.\[qlora\]\"$"):  # fmt: skip
        validate_config(demo_config(quantize="4bit"), ROOT)


def test_an_already_quantized_model_is_refused_before_queueing(tmp_path, tiny_model):
    """A model whose config.json says it is quantized (an FP8 release, say): one line from
    the plan, as the workflow's check before queueing makes it."""
    from snaketune.budget.fit import shape_and_deepspeed

    cfg = json.loads((tiny_model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    run = validate_config(demo_config(quantize="4bit"), ROOT)["runs"]["demo"]
    with pytest.raises(UserError, match=r"is already quantized \(fp8\): bitsandbytes cannot "
                                        r"quantize it again"):  # fmt: skip
        shape_and_deepspeed(tmp_path / "config.json", run, ROOT)
    run["lora"]["quantize"] = "none"  # unquantized runs of it are not this check's business
    shape_and_deepspeed(tmp_path / "config.json", run, ROOT)


@pytest.mark.extended
@pytest.mark.slow
def test_zero2_and_zero3_train_a_4bit_base_to_the_same_losses(demo, tmp_path):
    """ZeRO-3 shards the 4-bit base (stored in the compute dtype) with the other weights:
    the same losses as ZeRO-2 over 10 steps on 2 ranks."""
    spec = run_spec(max_steps=10, save_steps=100)
    spec["lora"] = {**spec["lora"], **{"quantize": "4bit", "quant_type": "nf4",
                                       "double_quant": True, "compute_dtype": "auto"}}  # fmt: skip
    losses = {}
    for preset in ("zero2", "zero3"):
        (tmp_path / preset).mkdir()
        out = train(tmp_path / preset, spec, demo / "results/demo/shards",
                    demo / "resources/models/tiny", preset)  # fmt: skip
        losses[preset] = [m["loss"] for m in read_jsonl(out / "metrics.jsonl")]
        assert qlora.read_record(out / "model")["modules"]  # 4-bit in that worker too
    assert losses["zero3"] == pytest.approx(losses["zero2"], rel=1e-5)
    assert losses["zero2"][-1] < losses["zero2"][0]


# ----------------------------------------------------------------------------- the chain


@pytest.mark.slow
@pytest.mark.extended
def test_the_demo_on_a_4bit_base_learns(qlora_chain):
    """At its documented length (6 epochs, 192 steps) the 4-bit demo learns the task."""
    w = qlora_chain
    metrics = read_jsonl(w / "results/qlora_demo/train/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 193))
    quarter = len(metrics) // 4
    first = sum(m["loss"] for m in metrics[:quarter]) / quarter
    last = sum(m["loss"] for m in metrics[-quarter:]) / quarter
    assert last < first / 3, (first, last)
    tuned = json.loads((w / "results/qlora_demo/eval/metrics.json").read_text())
    assert tuned["exact_match"] > 0.5, tuned["exact_match"]


@pytest.mark.slow
def test_the_demo_on_a_4bit_base_exports_a_plain_model(qlora_chain):
    """The 4-bit chain at the tier's length (CI: one epoch) trains every step, exports a plain
    fp32 model with the trained model's logits, and is evaluated and reported."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    w = qlora_chain
    metrics = read_jsonl(w / "results/qlora_demo/train/metrics.jsonl")
    epochs = CI_RUNS["qlora_demo"]["epochs"] if ci_tier() else 6
    assert [m["step"] for m in metrics] == list(range(1, 32 * epochs + 1))
    assert all(m["loss"] == m["loss"] for m in metrics)  # no NaN
    # 4-bit in the worker: read from its modules, not from the config
    log = (w / "logs/train/qlora_demo.log").read_text()
    assert "4-bit base: 14 linear layers in nf4 (double quantization)" in log, log[-3000:]
    assert "x 1 devices x 2 nodes" in log
    rec = qlora.read_record(w / "results/qlora_demo/lora_adapters")
    assert len(rec["modules"]) == 14 and rec["quant_type"] == "nf4"
    # the merged model: plain transformers, fp32, no quantization, the trained model's logits
    merged = w / "results/qlora_demo/merged_model"
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(merged, local_files_only=True).eval()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    probe = load_file(str(w / "results/qlora_demo/train/probe.safetensors"))
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    scale = max(1.0, probe["logits"].abs().max().item())
    assert (logits - probe["logits"]).abs().max().item() <= 1e-5 * scale
    report = json.loads((merged / "provenance.json").read_text())["report"]
    assert report["max_logit_diff"] <= 1e-5 * scale
    # evaluated and reported beside the demo
    tuned = json.loads((w / "results/qlora_demo/eval/metrics.json").read_text())
    assert 0 <= tuned["exact_match"] <= 1 and tuned["loss"] > 0, tuned
    summary = (w / "results/summary.tsv").read_text()
    assert "qlora_demo" in summary and "\ndemo\t" in summary


@pytest.mark.extended
@pytest.mark.slow
def test_killed_qlora_run_resumes_to_the_same_losses(qlora_chain, tmp_path):
    w = qlora_chain
    spec = pipeline_spec(w / "results/qlora_demo/train", tmp_path)
    start, resumed = kill_and_resume(w / "results/qlora_demo/train", tmp_path, spec,
                                     w / "results/qlora_demo/shards",
                                     w / "resources/models/tiny")  # fmt: skip
    reference = read_jsonl(w / "results/qlora_demo/train/metrics.jsonl")
    for a, b in zip(resumed[start:], reference[start:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7), a["step"]


@pytest.mark.extended
@pytest.mark.slow
def test_a_qlora_run_continues_on_one_node_from_its_two_node_checkpoint(qlora_chain, tmp_path):
    """qlora_demo's training taken back to checkpoint-150 and rerun with nodes: 1 through
    the local profile: the 4-bit run continues there (accumulation adapted, global batch
    kept) with the uninterrupted 2-node run's losses."""
    import shutil

    work = tmp_path / "w"
    subprocess.run(["cp", "-a", str(qlora_chain), str(work)], check=True)
    train_dir = work / "results/qlora_demo/train"
    for p in train_dir.iterdir():
        if p.name != "checkpoints":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    shutil.rmtree(train_dir / "checkpoints/checkpoint-192")
    proc = snakemake("results/qlora_demo/train/metrics.jsonl", "--configfile",
                     str(ROOT / "config/config.yaml"), str(OVERLAY), "--directory", str(work),
                     "--config", chain_runs(whole=("qlora_demo",),
                                            qlora_demo={"nodes": 1}))  # fmt: skip
    log = (work / "logs/train/qlora_demo.log").read_text()
    assert "continuing qlora_demo at step 150 on 1 node x 1 GPU" in log, log[-3000:]
    assert "4-bit base: 14 linear layers" in log and "resuming from checkpoint-150" in log
    got = read_jsonl(train_dir / "metrics.jsonl")
    want = read_jsonl(qlora_chain / "results/qlora_demo/train/metrics.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(got[150:], want[150:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), a["step"]
    assert proc.returncode == 0
