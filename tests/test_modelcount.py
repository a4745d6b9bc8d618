"""The model count's reading of a built model (snaketune.budget.modelcount.counted_of) on
models built here by hand, every figure written out from their shapes: the parameters (a
tied weight once), the language model's linear weights, the largest module, the fused
experts, the towers outside the language model; and ``count``'s cache and its refusals."""

from __future__ import annotations

import math

import torch
from torch import nn

H, KV, W, V, E = 8, 4, 6, 60, 3  # hidden, kv width, expert width, vocabulary, experts


class MoeExperts(nn.Module):  # fused experts: 3-D, one slice an expert (and a 2-D bias)
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * W))
        self.down_proj = nn.Parameter(torch.empty(E, W, H))
        self.bias = nn.Parameter(torch.empty(E, 2 * W))


class Layer(nn.Module):
    def __init__(self, moe: bool):
        super().__init__()
        self.q_proj = nn.Linear(H, H, bias=False)
        self.k_proj = nn.Linear(H, KV)  # a bias: not a linear weight
        self.norm = nn.LayerNorm(H)
        if moe:
            self.experts = MoeExperts()
        else:
            self.up_proj, self.down_proj = nn.Linear(H, 2 * W, bias=False), nn.Linear(2 * W, H)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList([Layer(True), Layer(False), Layer(True)])


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, H, 2)
        self.blocks = nn.ModuleList([nn.Linear(H, H) for _ in range(2)])
        self.mlps = nn.ModuleList([nn.ModuleDict({"fc": nn.Linear(H, H)}) for _ in range(3)])
        self.proj = nn.Linear(H, 2 * H)


class WithTower(nn.Module):
    """A vision-language model: a decoder, a tower, an output layer with a bias (the
    largest module) or none (a reward model's score is elsewhere)."""

    def __init__(self, output: bool = True, tied: bool = False):
        super().__init__()
        self.decoder, self.tower = Decoder(), Tower()
        self.lm_head = nn.Linear(H, V, bias=not tied) if output else None
        if tied:
            self.lm_head.weight = self.decoder.embed_tokens.weight

    def get_decoder(self):
        return self.decoder

    def get_output_embeddings(self):
        return self.lm_head


class Flat(nn.Module):
    """A model that is its own decoder (no get_decoder): its output layer is among its
    modules, and not a linear weight of the language model."""

    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(H, 2 * H, bias=False)
        self.lm_head = nn.Linear(H, V, bias=False)

    def get_output_embeddings(self):
        return self.lm_head


def numel(*shapes):
    return sum(math.prod(shape) for shape in shapes)


# each layer's attention and norm; a dense layer's MLP; an experts module's parameters
ATTENTION = numel((H, H), (KV, H), (KV,), (H,), (H,))
DENSE = numel((2 * W, H), (H, 2 * W), (H,))
EXPERTS = numel((E, H, 2 * W), (E, W, H), (E, 2 * W))
TOWER = numel((H, 3, 2, 2), (H,)) + 5 * numel((H, H), (H,)) + numel((2 * H, H), (2 * H,))
LINEARS = (("down_proj", 2 * W, H, 1), ("k_proj", H, KV, 3), ("q_proj", H, H, 3),
           ("up_proj", H, 2 * W, 1))  # fmt: skip
LINEAR = 3 * (H * H + H * KV) + 2 * (H * 2 * W)


def test_a_vision_language_model_with_experts_is_counted_as_written_out():
    from snaketune.budget.modelcount import counted_of

    counted = counted_of(WithTower())
    decoder = numel((V, H)) + 3 * ATTENTION + DENSE + 2 * EXPERTS
    assert counted.params == decoder + TOWER + numel((V, H), (V,))
    assert counted.linear == LINEAR
    assert counted.largest == numel((V, H), (V,))  # the output layer with its bias
    assert (counted.expert_layers, counted.expert_params) == (2, EXPERTS // E)
    assert counted.linears == LINEARS
    assert counted.stacked == (("down_proj", E, W, H, 2), ("gate_up_proj", E, H, 2 * W, 2))
    assert counted.towers == TOWER
    assert counted.tower_linears == (
        ("0", H, H, 1), ("1", H, H, 1), ("fc", H, H, 3), ("proj", H, 2 * H, 1)
    )  # fmt: skip
    assert type(counted.expert_params) is int  # a count, kept as one


def test_without_an_output_layer_the_largest_is_the_decoder_s_and_a_tied_weight_counts_once():
    from snaketune.budget.modelcount import counted_of

    counted = counted_of(WithTower(output=False))
    assert counted.largest == max(numel((V, H)), EXPERTS)
    assert counted.towers == TOWER and counted.linear == LINEAR
    tied = counted_of(WithTower(tied=True))
    assert tied.params == numel((V, H)) + 3 * ATTENTION + DENSE + 2 * EXPERTS + TOWER
    assert tied.towers == TOWER


def test_a_model_that_is_its_own_decoder_keeps_its_output_layer_out_of_its_linears():
    from snaketune.budget.modelcount import counted_of

    counted = counted_of(Flat())
    assert counted.linears == (("up_proj", H, 2 * H, 1),)
    assert counted.linear == H * 2 * H and counted.largest == V * H
    assert counted.towers == 0 and counted.tower_linears == () and counted.expert_layers == 0


LLAMA = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "vocab_size": 64, "tie_word_embeddings": False,
         "architectures": ["LlamaForCausalLM"], "transformers_version": "0.0",
         "quantization_config": {"quant_method": "none"}}  # fmt: skip


def test_a_count_is_kept_and_read_back_and_a_foreign_file_is_counted_again(monkeypatch):
    from snaketune.budget import modelcount
    from snaketune.core.configfields import Counted

    made = Counted(params=10, linear=4, largest=3, expert_layers=0, expert_params=0,
                   linears=(("q", 2, 2, 1),), stacked=(), towers=0, tower_linears=())  # fmt: skip
    fresh = Counted(params=99, linear=0, largest=0, expert_layers=0, expert_params=0)
    keys = []

    def remembered(kind, key, compute):
        keys.append((kind, key))
        return kept

    monkeypatch.setattr(modelcount, "remembered", remembered)
    monkeypatch.setattr(modelcount, "_count", lambda text: fresh)  # counted again
    kept = {**made.__dict__, "linears": [["q", 2, 2, 1]], "stacked": []}  # as JSON keeps it
    assert modelcount.count({"b": 1, "a": 2}) == made
    assert keys == [("model-counts", f'{modelcount.COUNT_VERSION}\0{{"a": 2, "b": 1}}')]
    kept = None  # transformers could not build it
    assert modelcount.count({"a": 2}) is None
    kept = {"params": 1, "not_a_field": 2}  # another version's file
    assert modelcount.count({"a": 2}) == fresh
    monkeypatch.setattr(modelcount, "transformers_version", lambda: None)
    assert modelcount.count({"a": 2}) is None


def test_a_count_goes_through_the_cache_and_what_cannot_be_built_is_kept_as_none(
    tmp_path, monkeypatch
):
    from snaketune.budget import modelcount

    monkeypatch.setenv("SNAKETUNE_CACHE", str(tmp_path))
    counted = modelcount.count(LLAMA)
    assert counted is not None and counted.params > 0
    assert modelcount.count({"model_type": "no-such-model"}) is None
    assert len(list((tmp_path / "model-counts").iterdir())) == 2  # both kept


def test_a_config_is_built_by_the_class_it_names_and_an_unknown_one_is_not_counted():
    from transformers import AutoConfig, AutoModelForCausalLM

    from snaketune.budget.modelcount import _count

    cfg = LLAMA
    import json

    counted = _count(json.dumps(cfg))
    built = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version",
                                                       "quantization_config", "model_type")}  # fmt: skip
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **built))
    assert counted.params == sum(p.numel() for p in model.parameters())
    reward = _count(json.dumps({**cfg, "architectures": ["LlamaForSequenceClassification"]}))
    assert reward.params < counted.params  # a score head of 2, not the vocabulary's
    assert _count(json.dumps({**cfg, "architectures": ["NoSuchClass"]})) == counted
    both = ["LlamaForCausalLM", "LlamaForSequenceClassification"]  # the first is built
    assert _count(json.dumps({**cfg, "architectures": both})) == counted
    assert _count(json.dumps({"model_type": "no-such-model"})) is None
