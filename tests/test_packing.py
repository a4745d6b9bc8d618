"""Packing: no attention crosses an example, and packed batches train exactly as padded ones.

(a) an example's per-token losses are the same alone and packed between two others;
(b) one optimizer step on the same examples, packed and padded, gives the same loss and
gradient norm (the loss normalised over the global batch's label tokens, as the Trainer
does with ``num_items_in_batch``). CPU, fp32, tiny Llama and Qwen2, sdpa and eager (rows
with the block-diagonal mask) and sdpa_segments (one row, sdpa one example at a time: what
sdpa trains packed batches with on CPU), each on the layout it trains with.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from snaketune.core.errors import ConfigError, UserError
from snaketune.data.kernels import (
    SEGMENTS,
    check_kernels_installed,
    check_packing,
    layout_for,
    packing_problem,
    register_segment_attention,
    resolve_attention,
    resolve_liger,
    segments_problem,
    training_kernel,
)
from snaketune.data.packing import Collator, fill_rows, packed_rows

VOCAB = 96
ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
KERNELS = ["sdpa", "eager", SEGMENTS]  # what packed batches train with (layout_for)


def tiny(arch: str, attention: str, seed: int = 0):
    if attention == SEGMENTS:
        register_segment_attention()
    config_class, model_class = ARCHS[arch]
    config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          attn_implementation=attention)  # fmt: skip
    torch.manual_seed(seed)
    return model_class(config).float()


def example(n: int, seed: int, prompt: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
    return {"input_ids": ids, "labels": [-100] * prompt + ids[prompt:], "example_id": f"e{seed}"}


def token_losses(model, batch: dict) -> torch.Tensor:
    """Loss of every position's next-token prediction (-1 where there is no target)."""
    logits = model(**batch).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none", ignore_index=-100
    )
    return torch.where(labels.reshape(-1) == -100, -1.0, loss).reshape(labels.shape)


@pytest.mark.parametrize("attention", KERNELS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_an_example_packed_between_two_others_has_its_own_losses(arch, attention):
    model = tiny(arch, attention)
    first, middle, last = example(13, 1), example(9, 2), example(6, 3)
    alone = token_losses(model, packed_rows([middle], 64, 0))[0]
    packed = Collator(layout_for(True, attention), 0, 64)([first, middle, last])
    # one row, in the micro batch's order: first (13), middle (9), last (6)
    assert packed["position_ids"][0].tolist() == [*range(13), *range(9), *range(6)]
    losses = token_losses(model, packed)[0]
    got = losses[13 : 13 + 8]  # middle's targets: positions 13..20 predict 14..21
    assert (alone >= 0).sum() == (got >= 0).sum() == 9 - 3
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-6)
    # the boundary: first's last token predicts nothing, middle's first label is masked
    assert losses[12] == -1 and losses[13 + 8] == -1
    # the padded layout of the same example agrees (a batch of one row per example; padded
    # batches never train with sdpa_segments: sdpa, same weights)
    padded = Collator("padded", 0, 64)([first, middle, last])
    reference = tiny(arch, "sdpa") if attention == SEGMENTS else model
    torch.testing.assert_close(token_losses(reference, padded)[1][:8], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_kv_cache_would_let_packed_examples_see_each_other(arch):
    """Why packed batches carry use_cache=False: with the model's default (a cache) the
    packed-sequence mask is skipped. If this ever stops failing, the guard is moot."""
    model = tiny(arch, "sdpa")
    model.config.use_cache = True
    batch = packed_rows([example(13, 1), example(9, 2)], 64, 0)
    with_guard = token_losses(model, batch)[0]
    batch["use_cache"] = True
    without = token_losses(model, batch)[0]
    assert not torch.allclose(with_guard[13:21], without[13:21])


def _one_step(model, micro_batches: list[dict]) -> tuple[float, float]:
    """Loss and gradient norm of one optimizer step over ``micro_batches`` the way the
    Trainer computes them: each micro batch's summed token loss over the step's count."""
    model.zero_grad()
    count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)
    total = 0.0
    for batch in micro_batches:
        loss = model(**batch, num_items_in_batch=torch.tensor(count)).loss
        loss.backward()
        total += loss.item()
    norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None))
    return total, norm.item()


@pytest.mark.parametrize("attention", KERNELS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_one_step_packed_and_padded_gives_the_same_loss_and_gradient(arch, attention):
    model = tiny(arch, attention)
    padded_model = tiny(arch, "sdpa")  # the same weights, as packing: false trains them
    examples = [example(n, seed) for seed, n in enumerate([31, 7, 18, 25, 12, 9, 40, 16])]
    # padded: 4 micro batches of 2 in plan order; packed: 2 micro batches of 4 (rows of 48,
    # or one row of 4 for sdpa_segments)
    padded = [Collator("padded", 0, 48)(examples[i : i + 2]) for i in range(0, 8, 2)]
    layout = layout_for(True, attention)
    packed = [Collator(layout, 0, 48)(examples[i : i + 4]) for i in range(0, 8, 4)]
    assert packed[0]["input_ids"].shape[0] < 4  # really packed: fewer rows than examples
    loss_a, norm_a = _one_step(padded_model, padded)
    loss_b, norm_b = _one_step(model, packed)
    assert loss_b == pytest.approx(loss_a, rel=1e-4)
    assert norm_b == pytest.approx(norm_a, rel=1e-4)


def test_fill_rows_makes_few_nearly_equal_rows_and_never_cuts_an_example():
    # 26 tokens in rows of 12: 3 rows, longest first to the least-filled: 9 | 7+2 | 5+3
    assert fill_rows([5, 9, 3, 7, 2], 12) == [[1], [3, 4], [0, 2]]
    assert fill_rows([6, 6, 6, 6, 1], 13) == [[0, 2, 4], [1, 3]]  # 25 tokens: 2 rows of <= 13
    assert fill_rows([20, 3], 12) == [[0], [1]]  # longer than a row: a row of its own
    assert fill_rows([4, 4, 4], 100) == [[0, 1, 2]]


def test_collator_counts_real_and_padded_tokens_and_logs_ids(tmp_path):
    ids = tmp_path / "ids.txt"
    collate = Collator("rows", 0, 16, ids)
    batch = collate([example(10, 1), example(6, 2), example(5, 3)])
    assert batch["input_ids"].shape == (2, 11) and batch["use_cache"] is False  # [10], [6+5]
    assert (collate.tokens, collate.padded, collate.samples) == (21, 22, 3)
    assert collate.squares == 100 + 36 + 25
    assert ids.read_text().split() == ["e1", "e2", "e3"]
    padded = Collator("padded", 0, 16)
    padded([example(10, 1), example(6, 2)])
    assert (padded.tokens, padded.padded) == (16, 20)


def test_layouts_by_attention():
    assert layout_for(False, "flash_attention_2") == layout_for(False, SEGMENTS) == "padded"
    assert layout_for(True, "flash_attention_2") == layout_for(True, SEGMENTS) == "varlen"
    assert layout_for(True, "sdpa") == layout_for(True, "eager") == "rows"


def test_packed_sdpa_runs_one_example_at_a_time_on_cpu_where_the_model_allows():
    """On CPU, packed sdpa batches train one example at a time (sdpa_segments); on a GPU,
    sdpa takes them whole (rows with the block-diagonal mask)."""
    packed_sdpa = "sdpa" if torch.cuda.is_available() else SEGMENTS
    llama = {"model_type": "llama"}
    assert training_kernel("sdpa", True, llama) == packed_sdpa
    assert training_kernel("sdpa", False, llama) == "sdpa"
    assert training_kernel("eager", True, llama) == "eager"
    qwen2 = {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": None}
    assert training_kernel("sdpa", True, qwen2) == packed_sdpa
    mistral = {"model_type": "mistral", "sliding_window": 4096}
    assert segments_problem(mistral) == "sliding-window attention"
    assert training_kernel("sdpa", True, mistral) == "sdpa"  # rows, the block-diagonal mask
    gemma2 = {"model_type": "gemma2", "attn_logit_softcapping": 50.0, "sliding_window": None}
    assert training_kernel("sdpa", True, gemma2) == "sdpa"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_an_example_packed_between_two_others_has_its_own_losses_on_a_gpu(arch):
    """(a) on CUDA with the kernel packed sdpa batches train with there (rows with the
    block-diagonal mask), fp32. Tolerance: the packed row and the lone example run through
    different kernel shapes; fp32 sums in another order differ by ~1e-6 relative (the CPU
    test holds 1e-5), TF32 stays off for matmuls by default."""
    attention = training_kernel("sdpa", True, {"model_type": arch})
    assert attention == "sdpa"
    model = tiny(arch, attention).cuda()
    first, middle, last = example(13, 1), example(9, 2), example(6, 3)

    def on_gpu(batch: dict) -> dict:
        return {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}

    alone = token_losses(model, on_gpu(packed_rows([middle], 64, 0)))[0]
    packed = on_gpu(Collator(layout_for(True, attention), 0, 64)([first, middle, last]))
    got = token_losses(model, packed)[0][13 : 13 + 8]
    assert (alone >= 0).sum() == (got >= 0).sum() == 9 - 3
    torch.testing.assert_close(got, alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_segment_attention_refuses_padding_it_cannot_honour(arch):
    model = tiny(arch, SEGMENTS)
    batch = Collator("padded", 0, 64)([example(9, 1), example(5, 2)])
    with pytest.raises(RuntimeError, match="sdpa_segments attention takes packed or unpadded"):
        model(**batch)
    # rows of equal length (no padding) are plain causal rows: the same logits as sdpa
    same = {
        "input_ids": batch["input_ids"][:, :5],
        "attention_mask": batch["attention_mask"][:, :5],
    }
    torch.testing.assert_close(model(**same).logits, tiny(arch, "sdpa")(**same).logits)


def test_varlen_layout_is_one_row_with_flash_boundaries():
    batch = Collator("varlen", 0, 16)([example(5, 1), example(3, 2)])
    assert batch["input_ids"].shape == (1, 8)
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 8] and batch["max_length_q"] == 5
    assert batch["labels"][0, 5] == -100 and batch["use_cache"] is False


def test_kernels_on_this_machine():
    """auto picks flash-attention 2 where it is installed and the GPU takes it, else sdpa;
    Liger where it is installed and there is a GPU; naming what this machine lacks fails.
    The expectation follows the machine (CPU here, a GPU node elsewhere)."""
    from snaketune.data.kernels import flash_attention_usable, installed

    gpu = torch.cuda.is_available()
    flash = flash_attention_usable()
    assert flash is False or gpu  # flash-attention needs a GPU
    assert resolve_attention("auto") == ("flash_attention_2" if flash else "sdpa")
    assert resolve_attention("eager") == "eager"
    if flash:
        assert resolve_attention("flash_attention_2") == "flash_attention_2"
    else:
        with pytest.raises(UserError, match="flash_attention_2 needs flash-attn"):
            resolve_attention("flash_attention_2")
    assert resolve_liger("auto") is (gpu and installed("liger_kernel"))
    if gpu:
        assert resolve_liger(True) is True
    else:
        with pytest.raises(UserError, match="liger_kernel: true needs a CUDA GPU"):
            resolve_liger(True)
    if installed("flash_attn") or installed("liger_kernel"):
        return  # the config-time refusals below are for machines without them
    with pytest.raises(ConfigError) as info:
        check_kernels_installed("runs.r", {"attn_implementation": "flash_attention_2"})
    assert str(info.value) == (
        "runs.r.attn_implementation: flash_attention_2 asked for but flash-attn is not "
        'installed; pip install -e ".[gpu]" (CUDA GPU nodes), or set attn_implementation: auto'
    )
    with pytest.raises(
        ConfigError, match=r'liger-kernel is not installed; pip install -e "\.\[gpu\]"'
    ):
        check_kernels_installed("runs.r", {"liger_kernel": True})


@pytest.mark.parametrize(
    ("config", "attention", "problem"),
    [
        ({"model_type": "llama"}, "sdpa", None),
        ({"model_type": "qwen2"}, "eager", None),
        ({"model_type": "llama"}, "flash_attention_2", None),
        ({"model_type": "bloom"}, "sdpa", "BloomForCausalLM takes no position_ids"),
        ({"model_type": "mpt"}, "sdpa", "MptForCausalLM takes no position_ids"),
        ({"model_type": "mamba"}, "sdpa", "MambaForCausalLM takes no position_ids"),
        ({"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]},
         "flash_attention_2", "Qwen3NextForCausalLM has linear_attention layers"),
        ({"model_type": "no-such-model"}, "sdpa", "model type 'no-such-model' has no causal-LM"),
    ],
)  # fmt: skip
def test_which_models_can_take_packed_sequences(config, attention, problem):
    found = packing_problem(config, attention)
    assert found == problem if problem is None else found.startswith(problem), found


def test_a_model_that_cannot_pack_is_refused_with_the_fix(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bloom"}))
    with pytest.raises(UserError) as info:
        check_packing(tmp_path, "sdpa", "runs.demo")
    assert str(info.value) == (
        f"runs.demo.packing: {tmp_path.name} cannot train on packed sequences with sdpa "
        "attention (BloomForCausalLM takes no position_ids, so positions cannot restart per "
        "example); set packing: auto (trains it padded) or false"
    )


def test_a_familys_class_facts_are_kept_and_read_back_without_transformers(tmp_path, monkeypatch):
    """The facts the checks read off a family's class equal the class's own (read here with
    transformers directly); they are kept by model type, so the next process reads them
    without importing the class; a torn file is read again from the class."""
    import inspect

    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketune.data import kernels

    monkeypatch.setenv("SNAKETUNE_CACHE", str(tmp_path))
    facts = kernels.class_facts({"model_type": "gpt_oss"})
    cls = AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model("gpt_oss"))]
    assert facts == {
        "name": cls.__name__,
        "position_ids": "position_ids" in inspect.signature(cls.forward).parameters,
        "sdpa": cls._supports_sdpa,
        "flash_attention_2": cls._supports_flash_attn,
        "masking_utils": "masking_utils" in inspect.getsource(inspect.getmodule(cls)),
    }
    assert facts["sdpa"] is False  # gpt-oss: attention sinks, no sdpa path
    (kept,) = (tmp_path / "model-classes").glob("*.json")
    calls = []
    monkeypatch.setattr(kernels, "_class_facts", lambda t: calls.append(t) or {"torn": True})
    assert kernels.class_facts({"model_type": "gpt_oss"}) == facts and not calls
    kept.write_text('{"val')  # torn
    assert kernels.class_facts({"model_type": "gpt_oss"}) == {"torn": True}
    assert calls == ["gpt_oss"]


@pytest.mark.parametrize(
    ("model_type", "want"),
    [("llama", "sdpa"), ("gpt_oss", "eager"), ("bloom", "eager"), (None, "sdpa")],
)
def test_auto_attention_takes_what_the_models_class_supports(tmp_path, model_type, want):
    """``attn_implementation: auto`` on a CPU: sdpa where the class has it, else eager
    (gpt-oss's attention sinks, bloom's ALiBi); sdpa for a model not known here."""
    from snaketune.data.kernels import expected_attention, resolve_attention

    if model_type is not None:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert resolve_attention("auto", tmp_path) == want
    assert expected_attention("auto", tmp_path) == want
    assert resolve_attention("eager", tmp_path) == "eager"  # a user's choice is kept
