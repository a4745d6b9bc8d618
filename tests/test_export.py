"""convert_checkpoint and merge_lora on real DeepSpeed checkpoints (CPU, 2 emulated nodes):
full + ZeRO-3, LoRA + ZeRO-2 (the demo) and LoRA + ZeRO-3, tied embeddings, and inputs that
must fail cleanly, leaving no output behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_spec, train
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from snaketune.app.fixtures import FixtureSizes, make_fixtures
from snaketune.core.errors import DataError
from snaketune.export.adapters import (
    adapter_key,
    adapter_target,
    check_adapter,
    convert_lora,
    lora_delta,
    merge_lora,
)
from snaketune.export.convert import convert_full

pytestmark = pytest.mark.slow


def base_of(full_zero3: Path) -> Path:
    """The base model the full_zero3 fixture trained from."""
    return Path((full_zero3 / "base").read_text())


def _logits(model, probe: Path) -> torch.Tensor:
    data = load_file(str(probe))
    model.eval()
    with torch.no_grad():
        return model(input_ids=data["input_ids"]).logits


def test_full_zero3_converts_to_a_model_transformers_loads(full_zero3, tmp_path):
    train_dir = full_zero3 / "results/x/train"
    out = tmp_path / "hf"
    report = convert_full(train_dir / "final_checkpoint", train_dir / "model", base_of(full_zero3),
                          out, "100KB", torch.float32, train_dir / "probe.safetensors")  # fmt: skip
    assert report["zero_stage"] == 3 and report["ranks"] == 4
    # the trainer switched the KV cache off (TrainingArguments.use_cache); the export has the
    # base's setting back, as plain transformers reads it
    trained = json.loads((train_dir / "model/config.json").read_text())
    assert trained["use_cache"] is False and report["restored"] == {"use_cache": True}
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    for shard in shards:  # a shard holds several tensors only while under the limit
        names = [n for n, f in index["weight_map"].items() if f == shard]
        assert len(names) == 1 or (out / shard).stat().st_size <= 100_000 + 8_192, shard
    model = AutoModelForCausalLM.from_pretrained(out)  # config, weights, nothing else
    probe = load_file(str(train_dir / "probe.safetensors"))
    assert (_logits(model, train_dir / "probe.safetensors") - probe["logits"]).abs().max() <= 1e-5
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()


def test_demo_lora_zero2_adapter_and_merged_model(demo):
    adapter, merged = demo / "results/demo/lora_adapters", demo / "results/demo/merged_model"
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    # 2 layers x 7 linears x (A, B), and the two modules trained in full (modules_to_save)
    lora = [k for k in tensors if ".lora_" in k]
    assert len(lora) == 28 and all(t.numel() > 0 for t in tensors.values())
    whole = sorted(set(tensors) - set(lora))
    assert whole == [
        "base_model.model.lm_head.weight",
        "base_model.model.model.embed_tokens.weight",
    ]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["modules_to_save"]) == ["embed_tokens", "lm_head"]
    base = AutoModelForCausalLM.from_pretrained(demo / "resources/models/tiny")
    model = AutoModelForCausalLM.from_pretrained(merged)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(model.state_dict()[q], base.state_dict()[q])  # the merge changed it
    for key in whole:  # the trained copies replace the base's, exactly
        name = key.removeprefix("base_model.model.")
        assert torch.equal(model.state_dict()[name], tensors[key])
        assert not torch.equal(base.state_dict()[name], tensors[key])
    assert "probe logits match the reference" in (demo / "logs/merge_lora/demo.log").read_text()


@pytest.fixture(scope="module")
def lora_zero3(demo, tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("lora_zero3")
    return train(workdir, run_spec(max_steps=4, deepspeed="zero3"), demo / "results/demo/shards",
                 demo / "resources/models/tiny", "zero3")  # fmt: skip


@pytest.mark.extended
def test_lora_zero3_adapter_is_whole_and_merges(lora_zero3, demo, tmp_path):
    base = demo / "resources/models/tiny"
    probe = lora_zero3 / "probe.safetensors"
    convert_lora(lora_zero3 / "final_checkpoint", lora_zero3 / "model", base, tmp_path / "a",
                 torch.float32, probe)  # fmt: skip
    tensors = load_file(str(tmp_path / "a/adapter_model.safetensors"))
    shapes = {tuple(t.shape) for t in tensors.values()}
    vocab = AutoModelForCausalLM.from_pretrained(base).config.vocab_size
    # full shapes, not ZeRO-3 partitions (the modules trained in full included)
    assert {(8, 64), (64, 8), (8, 256), (256, 8), (vocab, 64)} <= shapes
    report = merge_lora(base, tmp_path / "a", tmp_path / "m", torch.float32, "5GB", probe)
    assert report["merged_tensors"] == 16 and report["max_weight_change"] > 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    trained = load_file(str(probe))["logits"]
    assert (_logits(merged, probe) - trained).abs().max() <= 1e-4


def test_tied_embeddings_convert_right(demo, tmp_path):
    fixtures = make_fixtures(tmp_path / "fx", FixtureSizes(tie_word_embeddings=True))
    run = train(tmp_path, run_spec(method="full", max_steps=3, learning_rate=1e-2),
                demo / "results/demo/shards", fixtures["model"], "zero2")  # fmt: skip
    out = tmp_path / "hf"
    convert_full(
        run / "final_checkpoint",
        run / "model",
        fixtures["model"],
        out,
        "5GB",
        torch.float32,
        run / "probe.safetensors",
    )
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    base = AutoModelForCausalLM.from_pretrained(fixtures["model"])
    assert not torch.equal(model.lm_head.weight, base.lm_head.weight)  # trained, and still tied


def test_checkpoint_missing_a_rank_fails_and_leaves_nothing(full_zero3, tmp_path):
    train_dir = full_zero3 / "results/x/train"
    broken = tmp_path / "ckpt"
    shutil.copytree(train_dir / "final_checkpoint", broken)
    (broken / "final/zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(
        DataError,
        match=r"checkpoint of 4 ranks is missing zero_pp_rank_2_mp_rank_00_optim_states.pt",
    ):
        convert_full(
            broken,
            train_dir / "model",
            base_of(full_zero3),
            tmp_path / "hf",
            "5GB",
            torch.float32,
            train_dir / "probe.safetensors",
        )
    assert not (tmp_path / "hf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf")]


def test_wrong_weights_fail_the_logit_gate(full_zero3, tmp_path):
    train_dir = full_zero3 / "results/x/train"
    probe = load_file(str(train_dir / "probe.safetensors"))
    probe["logits"] = probe["logits"] + 1e-3
    save_file(probe, str(tmp_path / "probe.safetensors"))
    with pytest.raises(
        DataError, match=r"logits on the probe inputs differ from the reference by 0.001"
    ):
        convert_full(train_dir / "final_checkpoint", train_dir / "model", base_of(full_zero3),
                     tmp_path / "hf", "5GB", torch.float32, tmp_path / "probe.safetensors")  # fmt: skip
    assert not (tmp_path / "hf").exists()


def test_empty_or_inert_adapters_fail_the_merge(demo, tmp_path):
    base = demo / "resources/models/tiny"
    probe = demo / "results/demo/train/probe.safetensors"
    good = demo / "results/demo/lora_adapters"
    tensors = load_file(str(good / "adapter_model.safetensors"))
    key = next(k for k in tensors if ".lora_A." in k)
    base_weights = load_file(str(base / "model.safetensors"))
    for name, edit, message in (
        ("empty", {key: torch.empty(0)}, r"adapter tensor .*lora_A.weight is empty \(shape \(0,\)\)"),
        ("inert", {**{k: torch.zeros_like(v) for k, v in tensors.items() if ".lora_B." in k},
                   **{k: base_weights[k.removeprefix("base_model.model.")]
                      for k in tensors if ".lora_" not in k}},
         "the adapter changes nothing"),
    ):  # fmt: skip
        bad = tmp_path / name
        shutil.copytree(good, bad)
        save_file({**tensors, **edit}, str(bad / "adapter_model.safetensors"))
        with pytest.raises(DataError, match=message):
            merge_lora(base, bad, tmp_path / f"{name}-merged", torch.float32, "5GB", probe)
        assert not (tmp_path / f"{name}-merged").exists()


@pytest.mark.parametrize(
    ("name", "key", "target"),
    [
        ("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight",
         "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight",
         "model.layers.0.mlp.up_proj.weight"),
        ("base_model.model.model.embed_tokens.lora_embedding_B.default",
         "base_model.model.model.embed_tokens.lora_embedding_B", "model.embed_tokens.weight"),
        ("base_model.model.lm_head.modules_to_save.default.weight",
         "base_model.model.lm_head.weight", "lm_head.weight"),
        ("base_model.model.lm_head.original_module.weight", None, None),
        ("base_model.model.model.norm.weight", None, None),
    ],
)  # fmt: skip
def test_adapter_names_map_to_peft_keys_and_base_weights(name, key, target):
    assert adapter_key(name) == key
    if key is not None:
        assert adapter_target(key) == target


def test_embedding_adapter_and_whole_modules_shape_check_and_merge(tmp_path):
    """An embedding's LoRA (stored transposed) and a module trained in full merge right,
    and a whole module of the wrong shape is refused."""
    base = {"model.embed_tokens.weight": (10, 4), "lm_head.weight": (10, 4)}
    a, b = torch.randn(2, 10), torch.randn(4, 2)
    lm_head = torch.randn(10, 4)
    good = {"base_model.model.model.embed_tokens.lora_embedding_A": a,
            "base_model.model.model.embed_tokens.lora_embedding_B": b,
            "base_model.model.lm_head.weight": lm_head}  # fmt: skip
    check_adapter(good, base, 2)
    delta = lora_delta("x.lora_embedding_A", a, b, 2.0)
    assert delta.shape == (10, 4) and torch.allclose(delta, 2.0 * (b @ a).T)
    with pytest.raises(DataError, match=r"lm_head.weight has shape \(9, 4\), the base weight"):
        check_adapter({**good, "base_model.model.lm_head.weight": torch.randn(9, 4)}, base, 2)
    with pytest.raises(DataError, match=r"lora_embedding_A has shape \(10, 2\).*needs \(2, 10\)"):
        check_adapter({**good, "base_model.model.model.embed_tokens.lora_embedding_A":
                       torch.randn(10, 2)}, base, 2)  # fmt: skip
