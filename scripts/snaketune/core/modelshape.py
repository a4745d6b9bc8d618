"""A model's shape from its config.json: what the plans need of it, with every parameter
counted on the model transformers itself builds from that config.json, on the meta device
(no memory, no weights; ``counted``), so a family the plan has never seen is counted
exactly: linear attention's projections (Qwen3.5, Qwen3-Next), latent attention (DeepSeek),
per-layer inputs (Gemma), a vision-language model's towers, each expert of a mixture of
experts. The activations are estimated from the config (hidden width, heads, each layer's
kind: full, sliding-window or linear attention).

Where transformers cannot build the model (a model_type it does not know, custom code), the
count falls back to the formulas below for dense decoders (Llama, Mistral, Qwen2/3 and
alike) and the mixtures of experts of ``MOE_TYPES`` as transformers 5 builds them: each MoE
layer holds its routed experts as two fused 3-D parameters (gate and up stacked: experts x
2·I x h; down: experts x h x I), a router (experts x h), and for some families shared
experts or leading dense layers. A mixture of experts of any other model_type that
transformers cannot build is refused: counting only its active parameters would plan a
model several times too small. tests/test_moe.py and tests/test_families.py check the counts
against models built on the meta device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from snaketune.core.configfields import (
    Counted,
    attention_fields,
    moe_fields,
)
from snaketune.core.errors import UserError

# config.json's dtype (torch_dtype before transformers 5): the bytes of a saved weight
SAVED_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape:
    """What the plans need from a model's config.json."""

    hidden: int
    intermediate: int  # a dense layer's MLP width
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    saved_bytes: int | None = None  # bytes a weight of the checkpoint (its dtype); None: unsaid
    experts: int = 0  # routed experts of each MoE layer (0: a dense model)
    experts_per_token: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0  # layers whose MLP routes to experts (the rest: dense MLPs)
    shared_intermediate: int = 0  # the shared experts' width in each MoE layer, summed
    shared_gate: bool = False  # Qwen2-MoE: a sigmoid gate (h -> 1) on the shared expert
    biases: bool = False  # gpt-oss: biases on attention output, experts and router; sinks
    qk_norm: int = 0  # parameters of the query and key norms of each layer
    # DeepSeek's latent attention: (q_lora_rank or 0, kv_lora_rank, nope, rope, v head dims)
    mla: tuple[int, int, int, int, int] | None = None
    # each layer's attention: full_attention, sliding_attention, linear_attention (the
    # config's layer_types; empty: every layer full)
    layer_kinds: tuple[str, ...] = ()
    window: int = 0  # a sliding-window layer's window
    counted: Counted | None = None  # the model as transformers builds it (None: formulas)

    @classmethod
    def from_config(
        cls, cfg: dict[str, Any], where: str = "config.json", counted: Counted | None = None
    ) -> Shape:
        """The shape of config.json ``cfg``; its parameters as ``counted`` (the model
        transformers builds: snaketune.budget.modelcount) where given, else by the
        formulas."""
        cfg = cfg.get("text_config", cfg)
        missing = [k for k in REQUIRED if k not in cfg]
        if missing:
            raise UserError(
                f"{where}: cannot plan memory for model_type {cfg.get('model_type')!r} (no "
                f"{', '.join(missing)}); set skip_memory_check: true on the run to go without"
            )
        h, heads, kind = cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("model_type")
        return cls(
            hidden=h,
            intermediate=cfg.get("intermediate_size") or 4 * h,
            layers=cfg["num_hidden_layers"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or h // heads,
            vocab=cfg["vocab_size"],
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", kind in ("qwen2", "qwen2_moe", "gpt_oss"))),
            saved_bytes=SAVED_BYTES.get(str(cfg.get("dtype", cfg.get("torch_dtype")))),
            **moe_fields(cfg, where, counted),
            **attention_fields(cfg),
            layer_kinds=tuple(cfg.get("layer_types") or ()),
            window=cfg.get("sliding_window") or 0,
            counted=counted,
        )

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def attention_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear of one attention block."""
        h, heads = self.hidden, self.heads
        if self.mla is not None:
            q_rank, kv_rank, nope, rope, v = self.mla
            qk = heads * (nope + rope)
            q = (
                {"q_a_proj": (h, q_rank), "q_b_proj": (q_rank, qk)}
                if q_rank
                else {"q_proj": (h, qk)}
            )
            return {
                **q,
                "kv_a_proj_with_mqa": (h, kv_rank + rope),
                "kv_b_proj": (kv_rank, heads * (nope + v)),
                "o_proj": (heads * v, h),
            }
        kv, q = self.kv_heads * self.head_dim, heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}

    def mlp_shapes(self, width: int) -> dict[str, tuple[int, int]]:
        h = self.hidden
        return {"gate_proj": (h, width), "up_proj": (h, width), "down_proj": (width, h)}

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear of a decoder layer: its attention and a dense MLP (an MoE
        layer's shared experts where every layer routes)."""
        width = self.intermediate
        if self.moe and self.moe_layers == self.layers:
            width = self.shared_intermediate or self.expert_intermediate
        return {**self.attention_shapes(), **self.mlp_shapes(width)}

    @property
    def attention_params(self) -> int:
        """Parameters of one attention block and the layer's two norms."""
        count = sum(i * o for i, o in self.attention_shapes().values()) + 2 * self.hidden
        if self.qkv_bias:
            count += (self.heads + 2 * self.kv_heads) * self.head_dim
        if self.biases:  # gpt-oss: the output's bias and a sink per head
            count += self.hidden + self.heads
        if self.mla is not None:  # the latent projections' norms
            count += self.mla[0] + self.mla[1]
        return count + self.qk_norm

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        width = self.expert_intermediate
        return 3 * self.hidden * width + (2 * width + self.hidden if self.biases else 0)

    @property
    def router_params(self) -> int:
        """Parameters of one MoE layer's routing: its router, Qwen2-MoE's shared-expert gate."""
        return self.experts * (self.hidden + self.biases) + self.hidden * self.shared_gate

    @property
    def attention_layers(self) -> dict[str, int]:
        """Layers by their attention: full, sliding (a window), linear (a fixed state)."""
        kinds = self.layer_kinds or ("full_attention",) * self.layers
        out = {"full": 0, "sliding": 0, "linear": 0}
        for kind in kinds:
            key = "linear" if "linear" in kind else "sliding" if "sliding" in kind else "full"
            out[key] += 1
        return out

    @property
    def params(self) -> int:
        """Every parameter, each expert's included (a vision-language model's towers too)."""
        if self.counted is not None:
            return self.counted.params
        dense = (self.layers - self.moe_layers) * 3 * self.hidden * self.intermediate
        moe = self.moe_layers * (
            self.experts * self.expert_params
            + self.router_params
            + 3 * self.hidden * self.shared_intermediate
        )
        embed = self.vocab * self.hidden
        return (
            embed * (1 if self.tied else 2)
            + self.layers * self.attention_params
            + dense
            + moe
            + self.hidden
        )

    @property
    def active_params(self) -> int:
        """Parameters a token passes through: the routed experts it is not sent to left out."""
        idle = self.experts - self.experts_per_token
        each = self.counted.expert_params if self.counted is not None else self.expert_params
        return self.params - self.moe_layers * idle * each

    @property
    def ffn_width(self) -> int:
        """The MLP width a token passes through in a layer (an MoE layer: its experts' and the
        shared ones'), the widest of the model's layers."""
        routed = self.experts_per_token * self.expert_intermediate + self.shared_intermediate
        if not self.moe:
            return self.intermediate
        return max(routed, self.intermediate if self.moe_layers < self.layers else 0)

    @property
    def mlp_pass(self) -> int:
        """Elements per token an MLP's pass holds at once: a dense MLP's gate, up and their
        product (3 x width); an MoE layer's, for each of the token's experts, its copy of
        the hidden state in, gate and up, their product, its output and its weighted output
        (3 x (hidden + the experts' width)), and the shared experts' three (measured on an
        H100 in bf16: docs/benchmarks.md)."""
        if not self.moe:
            return 3 * self.intermediate
        routed = self.experts_per_token * 3 * (self.hidden + self.expert_intermediate)
        routed += 3 * self.shared_intermediate
        return max(routed, 3 * self.intermediate if self.moe_layers < self.layers else 0)

    @property
    def kv_width(self) -> int:
        """Elements a token keeps in one layer's KV cache (keys and values)."""
        if self.mla is not None:  # transformers caches the projected keys and values
            _, _, nope, rope, v = self.mla
            return self.heads * (nope + rope + v)
        return 2 * self.kv_heads * self.head_dim

    @property
    def linear_params(self) -> int:
        """Parameters of the decoder layers' nn.Linear weights (what a 4-bit base quantizes:
        bitsandbytes replaces nn.Linear layers; fused experts stay in the run's precision)."""
        if self.counted is not None:
            return self.counted.linear
        dense = (self.layers - self.moe_layers) * 3 * self.hidden * self.intermediate
        shared = self.moe_layers * (
            3 * self.hidden * self.shared_intermediate + self.hidden * self.shared_gate
        )
        return (
            self.layers * sum(i * o for i, o in self.attention_shapes().values()) + dense + shared
        )

    @property
    def largest_layer(self) -> int:
        """Parameters of the largest single module (DeepSpeed's ZeRO-3 gathering unit): an
        MoE layer's experts are one module."""
        if self.counted is not None:
            return self.counted.largest
        linears = [i * o for i, o in self.linear_shapes().values()]
        return max(self.vocab * self.hidden, self.experts * self.expert_params, *linears)

    def lora_params(
        self,
        r: int,
        targets: str | list[str],
        saved: Sequence[str] = (),
        router: bool = False,
        vision: bool = False,
    ) -> int:
        """Trainable parameters: the adapters over ``targets`` (LINEARS' names: an attention
        block's own names for DeepSeek's), ``router`` adapted too, a vision-language model's
        towers' linears with ``vision`` (lora.adapt_vision), and the modules of ``saved``
        (modules_to_save, trained in full). On an MoE layer's fused experts an adapter of
        rank r·experts is their stack of one rank-r adapter per expert (peft's ParamWrapper),
        gate and up together at rank 2r, as two rank-r adapters would be."""
        every = targets == "all-linear"
        if self.counted is not None:
            count = self.counted_adapters(r, targets, router)
            if vision:
                count += sum(
                    r * (i + o) * k
                    for n, i, o, k in self.counted.tower_linears
                    if every or n in set(targets)
                )
            return count + self.vocab * self.hidden * len(set(saved) & {"lm_head", "embed_tokens"})
        attention = self.attention_shapes()
        names = set(LINEARS) | set(attention) if every else set(targets)
        count = self.layers * sum(r * (i + o) for n, (i, o) in attention.items() if n in names)
        mlp = [n for n in MLP if n in names]
        for width, layers in (
            (self.intermediate, self.layers - self.moe_layers),
            (self.shared_intermediate, self.moe_layers),
        ):
            count += layers * sum(
                r * (i + o) for n, (i, o) in self.mlp_shapes(width).items() if n in mlp and width
            )
        if self.moe:
            count += self.moe_layers * self.expert_adapters(r, mlp, router)
        if not every and "embed_tokens" in targets:  # A (r, vocab), B (dim, r)
            count += r * (self.vocab + self.hidden)
        return count + self.vocab * self.hidden * len(set(saved) & {"lm_head", "embed_tokens"})

    def counted_adapters(self, r: int, targets: str | list[str], router: bool) -> int:
        """The adapters of ``lora_params`` on the model transformers builds: each targeted
        nn.Linear of the language model (``all-linear``: every one, as peft's and
        snaketune.core.lora_targets' own choice; a router only with ``router``), the fused
        experts' parameters, an embedding named in ``targets``."""
        every = targets == "all-linear"
        names = set() if every else set(targets)
        count = sum(
            r * (i + o) * k
            for n, i, o, k in self.counted.linears
            if (every or n in names) and (router or n != "shared_expert_gate")
        )
        mlp = set(MLP) if every else names & set(MLP)
        if self.counted.stacked and ("gate_proj" in mlp) != ("up_proj" in mlp):
            self.expert_adapters(r, sorted(mlp), False)  # its refusal
        for n, e, a, b, k in self.counted.stacked:
            wanted = {"down_proj"} if "down" in n else {"gate_proj", "up_proj"}
            if wanted <= mlp:
                count += k * (r if "down" in n else 2 * r) * e * (a + b)
        if router and self.moe:  # the top-k routers (a parameter each, not an nn.Linear)
            count += self.moe_layers * r * (self.hidden + self.experts)
        if not every and "embed_tokens" in targets:  # A (r, vocab), B (dim, r)
            count += r * (self.vocab + self.hidden)
        return count

    def expert_adapters(self, r: int, mlp: list[str], router: bool) -> int:
        """An MoE layer's adapter parameters on its experts (and its routing, ``router``)."""
        if ("gate_proj" in mlp) != ("up_proj" in mlp):
            raise UserError(
                "lora.target_modules: gate_proj and up_proj are one fused parameter on a "
                "mixture of experts' experts (gate_up_proj); name both, or neither"
            )
        h, e, width = self.hidden, self.experts, self.expert_intermediate
        count = 2 * r * e * (h + 2 * width) if "gate_proj" in mlp else 0
        count += r * e * (h + width) if "down_proj" in mlp else 0
        if router:
            count += r * (h + e) + (r * (h + 1) if self.shared_gate else 0)
        return count
