"""Which kernels a run gets (snaketune.data.kernels) on the machine a test makes: flash-attn
and liger-kernel installed or not, a GPU of a compute capability or none, so that a GPU
node's choices are checked on this CPU machine too (test_packing.py checks the choices on
the machine it runs on, and each kernel's numbers)."""

from __future__ import annotations

import json
import logging

import pytest

from snaketune.core.errors import ConfigError, UserError


@pytest.fixture
def node(monkeypatch):
    """Make this machine one with ``packages`` installed and a GPU of ``capability``
    (None: no GPU)."""
    import torch

    from snaketune.data import kernels

    def make(packages=(), capability=None):
        monkeypatch.setattr(kernels, "installed", lambda package: package in packages)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100")

    return make


def test_flash_attention_needs_the_package_and_an_ampere_gpu(node):
    from snaketune.data.kernels import flash_attention_usable

    for packages, capability, usable in [
        (("flash_attn",), (8, 0), True),
        (("flash_attn",), (9, 0), True),
        (("flash_attn",), (7, 5), False),
        ((), (9, 0), False),
        (("flash_attn",), None, False),
    ]:
        node(packages, capability)
        assert flash_attention_usable() is usable, (packages, capability)


@pytest.mark.parametrize(
    ("packages", "capability", "supports", "want"),
    [
        (("flash_attn",), (9, 0), {"eager", "sdpa", "flash_attention_2"}, "flash_attention_2"),
        (("flash_attn",), (9, 0), {"eager", "sdpa"}, "sdpa"),
        (("flash_attn",), (7, 5), {"eager", "sdpa", "flash_attention_2"}, "sdpa"),
        ((), (9, 0), {"eager", "flash_attention_2"}, "eager"),
        ((), None, {"eager"}, "eager"),
    ],
)  # fmt: skip
def test_auto_attention_on_each_kind_of_node(node, monkeypatch, packages, capability,
                                             supports, want):  # fmt: skip
    from snaketune.data import kernels

    node(packages, capability)
    monkeypatch.setattr(kernels, "model_supports", lambda model_dir: supports)
    assert kernels.resolve_attention("auto", "m") == want
    assert kernels.resolve_attention("eager", "m") == "eager"  # the user's choice kept


def test_flash_attention_asked_for_is_refused_naming_what_the_node_lacks(node):
    from snaketune.data.kernels import resolve_attention

    node(("flash_attn",), (8, 0))
    assert resolve_attention("flash_attention_2") == "flash_attention_2"
    fix = 'pip install -e ".[gpu]" on a GPU node, or set attn_implementation: auto'
    for packages, capability, found in [
        (("flash_attn",), (7, 5), "flash-attn installed, NVIDIA H100"),
        ((), None, "flash-attn missing, no GPU"),
    ]:
        node(packages, capability)
        with pytest.raises(UserError) as info:
            resolve_attention("flash_attention_2")
        assert str(info.value) == (
            "attn_implementation flash_attention_2 needs flash-attn and a CUDA GPU of compute "
            f"capability 8.0+ (found: {found}); {fix}"
        )


def test_liger_on_each_kind_of_node(node):
    from snaketune.data.kernels import resolve_liger

    for packages, capability, auto in [
        (("liger_kernel",), (9, 0), True),
        (("liger_kernel",), None, False),
        ((), (9, 0), False),
    ]:
        node(packages, capability)
        assert resolve_liger("auto") is auto, (packages, capability)
        assert resolve_liger(False) is False
    node((), (9, 0))
    assert resolve_liger(True) is True
    node(("liger_kernel",), None)
    with pytest.raises(UserError, match="liger_kernel: true needs a CUDA GPU"):
        resolve_liger(True)


def test_a_kernel_named_in_the_config_must_be_installed(node):
    from snaketune.data.kernels import check_kernels_installed

    node(("flash_attn", "liger_kernel"))
    check_kernels_installed("runs.r", {"attn_implementation": "flash_attention_2",
                                       "liger_kernel": True})  # fmt: skip
    node(())
    check_kernels_installed("runs.r", {"attn_implementation": "sdpa", "liger_kernel": "auto"})
    with pytest.raises(ConfigError, match=r"^runs\.r\.attn_implementation: flash_attention_2"):
        check_kernels_installed("runs.r", {"attn_implementation": "flash_attention_2"})
    with pytest.raises(ConfigError, match=r"^runs\.r\.liger_kernel: true asked for"):
        check_kernels_installed("runs.r", {"liger_kernel": True})


def test_packed_sdpa_on_a_gpu_takes_rows_whole_unless_its_sequences_are_split(node):
    from snaketune.data.kernels import SEGMENTS, training_kernel

    llama = {"model_type": "llama"}
    node((), (9, 0))
    assert training_kernel("sdpa", True, llama) == "sdpa"
    assert training_kernel("sdpa", True, llama, split=True) == SEGMENTS
    assert training_kernel("sdpa", False, llama, split=True) == "sdpa"
    assert training_kernel("flash_attention_2", True, llama, split=True) == "flash_attention_2"
    windowed = {"model_type": "mistral", "sliding_window": 4096}
    assert training_kernel("sdpa", True, windowed, split=True) == "sdpa"
    node((), None)
    assert training_kernel("sdpa", True, llama) == SEGMENTS


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({"sliding_window": 4096}, "sliding-window attention"),
        ({"sliding_window": 4096, "use_sliding_window": False}, None),
        ({"sliding_window": 0}, None),
        ({"sliding_window": None, "layer_types": ["full_attention"]}, None),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window layers"),
        ({"attn_logit_softcapping": 30.0}, "soft-capped attention logits"),
        ({"attn_logit_softcapping": None}, None),
        ({"text_config": {"sliding_window": 512}, "sliding_window": None},
         "sliding-window attention"),
        ({"text_config": {}, "sliding_window": 512}, "sliding-window attention"),
    ],
)  # fmt: skip
def test_what_one_example_at_a_time_cannot_stand_in_for(config, problem):
    """A vision-language model's language model is read (``text_config``); an empty one is
    no language model of its own."""
    from snaketune.data.kernels import segments_problem

    assert segments_problem(config) == problem


def test_the_segments_mask_builds_nothing_and_stops_at_padding():
    import torch

    from snaketune.data.kernels import segment_mask

    assert segment_mask() is None
    assert segment_mask(attention_mask=torch.ones(2, 5, dtype=torch.bool)) is None
    padded = torch.ones(2, 5, dtype=torch.bool)
    padded[1, 4] = False
    with pytest.raises(RuntimeError, match="takes packed or unpadded rows only"):
        segment_mask(attention_mask=padded)


def test_a_model_is_unpackable_only_when_no_kernel_can_pack_it(monkeypatch):
    from snaketune.data import kernels

    problems = {"sdpa": "no masks", "flash_attention_2": "no varlen"}
    monkeypatch.setattr(kernels, "packing_problem", lambda config, a: problems[a])
    assert kernels.unpackable({}) == "no masks"
    problems["flash_attention_2"] = None
    assert kernels.unpackable({}) is None
    problems.update(sdpa=None, flash_attention_2="no varlen")
    assert kernels.unpackable({}) is None


def test_packing_auto_packs_what_can_be_and_pads_the_rest_saying_so(tmp_path, caplog):
    from snaketune.data.kernels import resolve_packing

    llama, bloom = tmp_path / "llama", tmp_path / "bloom"
    for folder, kind in ((llama, "llama"), (bloom, "bloom")):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": kind}))
    with caplog.at_level(logging.INFO, logger="snaketune.data.kernels"):
        assert resolve_packing("auto", llama, "sdpa", "runs.r") == (True, {"model_type": "llama"})
        assert resolve_packing("auto", bloom, "sdpa", "runs.r") == (False, {"model_type": "bloom"})
    assert [r.getMessage() for r in caplog.records] == [
        "runs.r.packing: auto -> packed (sdpa keeps the examples apart)",
        "runs.r.packing: auto -> padded: bloom cannot be packed (BloomForCausalLM takes no "
        "position_ids, so positions cannot restart per example)",
    ]
    assert resolve_packing(True, llama, "sdpa", "runs.r") == (True, {"model_type": "llama"})
    assert resolve_packing(False, bloom, "sdpa", "runs.r") == (False, {})
    with pytest.raises(UserError, match="bloom cannot train on packed sequences"):
        resolve_packing(True, bloom, "sdpa", "runs.r")


def test_the_kernels_a_model_s_class_has(tmp_path, node):
    """Eager always, sdpa and flash-attention 2 as the class says; all three for a model
    not known here; ``auto`` expected as a GPU node with flash-attn installed picks."""
    from snaketune.data.kernels import expected_attention, model_supports

    every = {"eager", "sdpa", "flash_attention_2"}
    assert model_supports(None) == every
    assert model_supports(tmp_path) == every  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    assert model_supports(tmp_path) == every
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bloom"}))
    assert model_supports(tmp_path) == {"eager"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert model_supports(tmp_path) == every
    node(("flash_attn",))  # installed, no GPU here: expected on the GPU node
    assert expected_attention("auto", tmp_path) == "flash_attention_2"
    assert expected_attention("sdpa", tmp_path) == "sdpa"
    node(())
    assert expected_attention("auto", tmp_path) == "sdpa"


def attention_by_hand(query, key, value, cuts, scale):
    """Causal attention of each example [a, b) of a row alone, written out: the scaled
    scores with the future masked, softmax, times the values (each query head reads its
    group's key and value head)."""
    import torch

    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = torch.zeros_like(query)
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        scores = query[:, :, a:b] @ key[:, :, a:b].transpose(-1, -2) * scale
        future = torch.triu(torch.ones(b - a, b - a, dtype=torch.bool), 1)
        out[:, :, a:b] = scores.masked_fill(future, float("-inf")).softmax(-1) @ value[:, :, a:b]
    return out.transpose(1, 2)


def test_one_example_at_a_time_is_each_example_s_causal_attention_alone():
    """sdpa_segments against attention written out, 6 query heads over 2 key heads: the
    boundaries from a row's cu_seq_lens; from each row's own position ids (two rows
    restarting at different places), from one row of them shared; a row that starts inside
    an example (a sequence-parallel slice); no boundaries (plain causal); the default scale
    and a given one; refused: a padding mask, a KV cache, a sliding window."""
    import torch

    from snaketune.data.kernels import segment_attention

    torch.manual_seed(0)
    length, dim = 12, 5
    q, k, v = (
        torch.randn(2, 6, length, dim),
        torch.randn(2, 2, length, dim),
        torch.randn(2, 2, length, dim),
    )
    scale = dim**-0.5

    def check(out, cuts_per_row, s=scale):
        assert out[1] is None
        for r, cuts in enumerate(cuts_per_row):
            want = attention_by_hand(q[r : r + 1], k[r : r + 1], v[r : r + 1], cuts, s)
            torch.testing.assert_close(out[0][r : r + 1], want, rtol=1e-5, atol=1e-5)

    one = (q[:1], k[:1], v[:1])
    bounds = torch.tensor([0, 5, 8, 12])
    check(segment_attention(None, *one, None, cu_seq_lens_q=bounds), [[0, 5, 8, 12]])
    rows = torch.tensor([[*range(5), *range(7)], [*range(3), *range(9)]])
    check(segment_attention(None, q, k, v, None, position_ids=rows), [[0, 5, 12], [0, 3, 12]])
    # two rows: their bounds are the position ids', not a cu_seq_lens of one row
    check(segment_attention(None, q, k, v, None, position_ids=rows, cu_seq_lens_q=bounds),
          [[0, 5, 12], [0, 3, 12]])  # fmt: skip
    shared = torch.tensor([[*range(4), *range(8)]])
    check(segment_attention(None, q, k, v, None, position_ids=shared), [[0, 4, 12]] * 2)
    inside = torch.tensor([[3, 4, 5, *range(6), *range(3)]])
    check(segment_attention(None, *one, None, position_ids=inside), [[0, 3, 9, 12]])
    last_one = torch.tensor([[7, *range(11)]])  # the slice holds one token of an example
    check(segment_attention(None, *one, None, position_ids=last_one), [[0, 1, 12]])
    within = torch.tensor([[*range(40, 52)]])  # a slice inside one long example: no restart
    check(segment_attention(None, *one, None, position_ids=within), [[0, 12]])
    check(segment_attention(None, q, k, v, None), [[0, 12]] * 2)
    check(segment_attention(None, q, k, v, None, scaling=0.3), [[0, 12]] * 2, s=0.3)
    for refused in ({"attention_mask": torch.ones(2, 1, length, length)},
                    {"sliding_window": 4}, {"softcap": 30.0}):  # fmt: skip
        mask = refused.pop("attention_mask", None)
        with pytest.raises(RuntimeError, match="takes packed or unpadded rows only"):
            segment_attention(None, q, k, v, mask, **refused)
    with pytest.raises(RuntimeError, match="takes packed or unpadded rows only"):
        segment_attention(None, q[:, :, -1:], k, v, None)  # a query against a KV cache
    check(segment_attention(None, q, k, v, None, sliding_window=None), [[0, 12]] * 2)
    # a row past 256 tokens (lengths are not small integers Python keeps one object of)
    q, k, v = torch.randn(1, 2, 300, dim), torch.randn(1, 1, 300, dim), torch.randn(1, 1, 300, dim)
    check(segment_attention(None, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 260, 300])),
          [[0, 260, 300]])  # fmt: skip


def test_choices_read_strings_built_at_run_time_as_a_config_s_are(node, tmp_path, monkeypatch):
    """A config's strings are built at run time (YAML), not the code's literals: each
    choice compares them by value."""
    from snaketune.data import kernels

    def built(text):
        return "".join(list(text))  # equal, not the same object

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    node(("flash_attn", "liger_kernel"), (9, 0))
    assert kernels.resolve_attention(built("auto"), tmp_path) == "flash_attention_2"
    assert kernels.resolve_liger(built("auto")) is True
    assert kernels.expected_attention(built("auto"), tmp_path) == "flash_attention_2"
    bloom = tmp_path / "bloom"
    bloom.mkdir()
    (bloom / "config.json").write_text(json.dumps({"model_type": "bloom"}))
    assert kernels.resolve_packing(built("auto"), bloom, "sdpa", "r")[0] is False  # padded
    assert kernels.training_kernel(built("sdpa"), True, {"model_type": "llama"}, split=True) == (
        kernels.SEGMENTS
    )
    node(("liger_kernel",), None)
    assert kernels.resolve_liger(built("auto")) is False  # no GPU: not refused either
    node((), None)
    assert kernels.resolve_attention("sdpa", tmp_path) == "sdpa"  # not flash: not refused
    with pytest.raises(ConfigError):
        kernels.check_kernels_installed("r", {"attn_implementation": built("flash_attention_2")})
    with pytest.raises(UserError):
        kernels.resolve_attention(built("flash_attention_2"))


@pytest.mark.parametrize(
    ("facts", "attention", "problem"),
    [
        ({"flash_attention_2": False, "masking_utils": True}, "flash_attention_2",
         "M does not support flash attention 2"),
        ({"flash_attention_2": False, "masking_utils": True}, "sdpa", None),
        ({"flash_attention_2": True, "masking_utils": False}, "flash_attention_2", None),
        ({"flash_attention_2": True, "masking_utils": False}, "eager",
         "M does not build its masks with transformers' masking_utils, so eager attention "
         "would cross examples"),
    ],
)  # fmt: skip
def test_each_kernel_needs_its_own_support_to_pack(monkeypatch, facts, attention, problem):
    """Flash attention packs through its varlen path, sdpa and eager through
    masking_utils' block-diagonal mask: each is asked only of its own kernel."""
    from snaketune.data import kernels

    monkeypatch.setattr(kernels, "class_facts",
                        lambda config: {"name": "M", "position_ids": True, **facts})  # fmt: skip
    assert kernels.packing_problem({"model_type": "m"}, "".join(list(attention))) == problem


def test_a_model_type_without_a_causal_lm_class_has_no_facts():
    from snaketune.data.kernels import _class_facts

    assert _class_facts("clip") is None  # a config class, no causal LM
    assert _class_facts("no-such-model") is None
    assert _class_facts("llama")["name"] == "LlamaForCausalLM"
