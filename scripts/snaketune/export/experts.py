"""LoRA adapters on a mixture of experts' fused experts, merged into the base's tensors.

peft adapts a fused 3-D parameter (experts x out x in; gpt-oss: experts x in x out) with
one low-rank pair per expert, stored stacked: A is (rank·experts, in) read as experts x rank
x in, B is (out, rank·experts) read as out x rank x experts (peft's ParamWrapper); expert
e's change is B[:, :, e] @ A[e] times the scale. Its saved keys name the experts module (a
second adapted parameter of the same module nests under ``base_layer``), so which
parameter a pair adapts is told from its shapes: gate and up stacked (in = hidden, out = 2 x
the experts' width) or down (in = the width, out = hidden).

The base checkpoint holds the experts as transformers 5 saves them, one tensor per expert
(``<experts>.<e>.gate_proj.weight``, ``up_proj``, ``down_proj``: gate and up are the first
and second half of the stacked change), or fused as in memory (``<experts>.gate_up_proj``,
``<experts>.down_proj``; gpt-oss's in bf16: experts x in x out, the change transposed); a
layout neither (Mixtral's w1/w2/w3 names, gpt-oss's MXFP4-quantized experts) is refused in
one line naming ``export.merged: false``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from snaketune.core.configfields import experts_of
from snaketune.core.errors import DataError

TRANSPOSED = ("gpt_oss",)  # its fused experts are stored experts x in x out


@dataclass
class ExpertPair:
    """One adapted experts parameter: its stacked pair, kind (gate_up or down), scale."""

    module: str  # the experts module's name in the base (model.layers.0.mlp.experts)
    kind: str
    a: torch.Tensor
    b: torch.Tensor
    scale: float
    transposed: bool = False  # the base stores the fused tensor experts x in x out (gpt-oss)

    def delta(self, experts: int) -> torch.Tensor:
        """Each expert's change, experts x out x in."""
        a = self.a.float().reshape(experts, -1, self.a.shape[-1])
        b = self.b.float().reshape(self.b.shape[0], -1, experts)
        return torch.einsum("ore,eri->eoi", b, a) * self.scale


def module_of(key: str) -> str:
    """The base module an adapter key sits on (peft's wrappers and prefix left out)."""
    key = re.sub(r"^base_model\.model\.", "", key).split(".lora_")[0]
    return key.replace(".base_layer", "")


def expert_pairs(
    lora: dict[str, torch.Tensor], config: dict, scale_of, shapes: dict[str, tuple[int, ...]]
) -> dict[str, ExpertPair]:
    """The adapter's pairs on fused experts, by the base tensor each changes (``shapes``:
    the base checkpoint's), each checked against it; ``scale_of(kind)``: a pair's scale."""
    experts = experts_of(config)
    if not experts:
        return {}
    h = config["hidden_size"]
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    found: dict[str, ExpertPair] = {}
    for key_a, a in lora.items():
        if ".lora_A" not in key_a or not module_of(key_a).endswith("experts"):
            continue
        b = lora[key_a.replace(".lora_A", ".lora_B")]
        kind = {(h, 2 * width): "gate_up", (width, h): "down"}.get((a.shape[1], b.shape[0]))
        if kind is None or a.shape[0] % experts:
            raise DataError(
                f"adapter tensor {key_a} {tuple(a.shape)} fits neither the "
                f"experts' gate and up ({h} -> {2 * width}) nor their down "
                "projection"
            )
        transposed = config.get("model_type") in TRANSPOSED
        pair = ExpertPair(module_of(key_a), kind, a, b, scale_of(kind), transposed)
        for name in base_tensors(pair, experts, shapes):
            found[name] = pair
    return found


def base_tensors(pair: ExpertPair, experts: int, shapes: dict) -> list[str]:
    """The base tensors ``pair`` changes; refused where the base stores them otherwise."""
    fused = f"{pair.module}.{'gate_up_proj' if pair.kind == 'gate_up' else 'down_proj'}"
    if fused in shapes:
        return [fused]
    names = ("gate_proj", "up_proj") if pair.kind == "gate_up" else ("down_proj",)
    per_expert = [f"{pair.module}.{e}.{n}.weight" for e in range(experts) for n in names]
    if all(n in shapes for n in per_expert):
        return per_expert
    raise DataError(
        f"{pair.module}: the base checkpoint stores its experts in a layout merge_lora does "
        f"not write into (neither {fused} nor {per_expert[0]}); set export.merged: false "
        "to keep the adapter, which evaluation and publish load on the base"
    )


def expert_delta(name: str, pair: ExpertPair, experts: int, cache: dict) -> torch.Tensor:
    """The change of base tensor ``name`` (fused, or one expert's gate, up or down)."""
    if id(pair) not in cache:  # every expert's change, once per pair (a module's two kept)
        if any(kept.module != pair.module for kept, _ in cache.values()):
            cache.clear()
        cache[id(pair)] = (pair, pair.delta(experts))
    delta = cache[id(pair)][1]
    match = re.search(r"\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
    if match is None:  # the fused tensor itself, as the base stores it
        return delta.transpose(1, 2) if pair.transposed else delta
    e, which = int(match.group(1)), match.group(2)
    half = delta.shape[1] // 2
    return {"gate_proj": delta[e, :half], "up_proj": delta[e, half:], "down_proj": delta[e]}[which]


def pair_scale(adapter_config: dict, kind: str) -> float:
    """peft's scale of a pair on the experts: alpha / r (rsLoRA: / sqrt(r)), each from the
    config's rank and alpha patterns where one names the stacked gate and up."""
    r, alpha = adapter_config["r"], adapter_config["lora_alpha"]
    if kind == "gate_up":
        r = next(
            (
                v
                for k, v in (adapter_config.get("rank_pattern") or {}).items()
                if k.endswith("gate_up_proj")
            ),
            r,
        )
        alpha = next(
            (
                v
                for k, v in (adapter_config.get("alpha_pattern") or {}).items()
                if k.endswith("gate_up_proj")
            ),
            alpha,
        )
    return alpha / r**0.5 if adapter_config.get("use_rslora") else alpha / r
