"""What a model's config.json says of its experts and its attention, under each family's
names (``moe_fields``, ``attention_fields``), and what the count on the meta device gives
(``Counted``: parameters, linears, the largest module, stacked expert tensors, whose
module class names them experts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from snaketune.core.errors import UserError

MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "gpt_oss", "olmoe")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class Counted:
    """A model as transformers builds it from its config.json (on the meta device)."""

    params: int  # every parameter (tied ones once)
    linear: int  # the language model's nn.Linear weights (what a 4-bit base quantizes)
    largest: int  # the largest single module's own parameters (ZeRO-3's gathering unit)
    expert_layers: int  # modules holding fused experts (3-D parameters)
    expert_params: int  # one routed expert's parameters
    # the language model's nn.Linear modules by name: (name, in, out, how many)
    linears: tuple[tuple[str, int, int, int], ...] = ()
    # each fused expert parameter: (name, experts, in, out, how many layers)
    stacked: tuple[tuple[str, int, int, int, int], ...] = ()
    towers: int = 0  # parameters outside the language model (vision, audio, projector)
    # the towers' nn.Linear modules by name, as ``linears`` (lora.adapt_vision's targets)
    tower_linears: tuple[tuple[str, int, int, int], ...] = ()


def stacked_params(module) -> list[tuple[str, Any]]:
    """A module's fused experts' parameters (3-D: one slice an expert), with their names;
    none for any other module (a convolution's 3-D kernel: Qwen3.5's linear attention)."""
    if not type(module).__name__.endswith("Experts"):
        return []
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() == 3]


def experts_of(cfg: dict[str, Any]) -> int:
    """Routed experts per MoE layer named by a config (its config.json or ``to_dict()``; 0:
    a dense model)."""
    return next((cfg[k] for k in EXPERT_KEYS if cfg.get(k)), 0)


def moe_fields(cfg: dict[str, Any], where: str, counted: Counted | None = None) -> dict[str, Any]:
    """The experts of a mixture of experts' config.json (nothing for a dense model); of a
    family the formulas do not know, from the model transformers builds (``counted``)."""
    kind = cfg.get("model_type")
    experts = experts_of(cfg)
    if not experts:
        return {}
    if kind not in MOE_TYPES and counted is not None and counted.expert_layers:
        width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        shared = cfg.get("shared_expert_intermediate_size") or 0
        shared = shared or (cfg.get("n_shared_experts") or 0) * width
        top_k = cfg.get("num_experts_per_tok") or cfg.get("top_k_experts") or 1
        return {
            "experts": experts,
            "experts_per_token": top_k,
            "expert_intermediate": width,
            "moe_layers": counted.expert_layers,
            "shared_intermediate": shared,
        }
    if kind not in MOE_TYPES:
        raise UserError(
            f"{where}: cannot plan memory for model_type {kind!r}: a mixture of experts the "
            f"plan does not count (it counts {', '.join(MOE_TYPES)}); set skip_memory_check: "
            "true on the run to go without"
        )
    layers, deepseek = cfg["num_hidden_layers"], kind.startswith("deepseek")
    if kind in ("qwen3_moe", "qwen2_moe"):
        step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    else:
        moe_layers = layers - (cfg.get("first_k_dense_replace") or 0 if deepseek else 0)
    width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if deepseek:
        shared = (cfg.get("n_shared_experts") or 0) * width
    return {
        "experts": experts,
        "experts_per_token": cfg["num_experts_per_tok"],
        "expert_intermediate": width,
        "moe_layers": moe_layers,
        "shared_intermediate": shared,
        "shared_gate": kind == "qwen2_moe",
        "biases": kind == "gpt_oss",
    }


def attention_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """What sets an attention block's parameters apart from Llama's."""
    kind, heads = cfg.get("model_type"), cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv = cfg.get("num_key_value_heads") or heads
    out: dict[str, Any] = {}
    if kind in ("qwen3", "qwen3_moe"):  # an RMSNorm over each head's queries and keys
        out["qk_norm"] = 2 * head_dim
    elif kind == "olmoe":  # over all queries and all keys
        out["qk_norm"] = (heads + kv) * head_dim
    if kind in ("deepseek_v2", "deepseek_v3"):
        out["mla"] = (
            cfg.get("q_lora_rank") or 0,
            cfg["kv_lora_rank"],
            cfg["qk_nope_head_dim"],
            cfg["qk_rope_head_dim"],
            cfg["v_head_dim"],
        )
    return out
