"""Where a run's LoRA adapters go, on a dense model or a mixture of experts.

On a dense model the run's ``lora.target_modules`` goes to peft as written. On a mixture of
experts transformers 5 stores each layer's routed experts as fused 3-D parameters (no
nn.Linear to target), and peft's own translation of ``all-linear`` and of the Llama names
misses the experts of some families (Qwen2-MoE, gpt-oss) and, where it does translate
(Mixtral, Qwen3-MoE, DeepSeek), moves the shared experts' and the dense layers'
``gate_proj``/``up_proj``/``down_proj`` onto the routed experts instead. So the targets are
resolved here, from the model itself (snaketune.core.modelshape counts the same adapters
for the plan):

- every nn.Linear whose name is targeted (``all-linear``: every one but the output layer):
  attention, the dense layers' MLPs, the shared experts;
- the routed experts' fused parameters through peft's parameter targeting (ParamWrapper: a
  rank-r adapter per expert): ``gate_up_proj`` when gate_proj and up_proj are targeted (at
  rank 2r and alpha 2·alpha, as one rank-r adapter on each would be, peft's own convention)
  and ``down_proj`` when down_proj is;
- the routers (each MoE layer's top-k router; Qwen2-MoE's shared-expert gate) only with
  ``lora.adapt_router: true``: adapting the router moves which experts a token reaches.

On a vision-language model (Qwen3.5, Gemma 4, whole) the adapters go on its language model
alone by default (peft's ``all-linear`` would also adapt the vision tower): its nn.Linear
modules are listed by name, the vision tower and projector stay as they are; with
``lora.adapt_vision: true`` the towers' targeted nn.Linear modules (the vision encoder's
attention and MLP, a projector's linears) are listed too.

peft's translation is switched off while the adapters are made or loaded
(``exact_targets``), so what it builds is what is listed here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from snaketune.core.configfields import stacked_params
from snaketune.core.modelshape import MLP

ADAPTERS = "adapters.json"  # in the checkpoints folder: what carries adapters (``describe``)


def is_router(name: str, module) -> bool:
    """An MoE layer's routing module: its top-k router, Qwen2-MoE's shared-expert gate."""
    return type(module).__name__.endswith("Router") or name.endswith("shared_expert_gate")


def experts_modules(model) -> dict[str, list[str]]:
    """Each module holding fused experts (3-D parameters), with their names."""
    found: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        stacked = [n for n, _ in stacked_params(module)]
        if stacked:
            found[name] = stacked
    return found


def resolve(model, lora: Mapping[str, Any]) -> dict[str, Any]:
    """The LoraConfig targets of ``lora`` (a run's validated LoRA block) on ``model``."""
    import torch

    targets = lora["target_modules"]
    experts = experts_modules(model)
    language = model.get_decoder() if hasattr(model, "get_decoder") else model
    towers = any(True for _ in language_outside(model, language))
    if not experts and not towers:
        return {"target_modules": targets}
    every, router = targets == "all-linear", bool(lora.get("adapt_router", False))
    vision = bool(lora.get("adapt_vision", False))
    names = set(targets) if not every else set()
    output = model.get_output_embeddings()
    inside = {id(m) for m in language.modules()}
    modules, parameters = [], set()
    for name, module in model.named_modules():
        if id(module) not in inside:  # a vision-language model's towers: adapted by a key
            linear = isinstance(module, torch.nn.Linear) and module is not output
            if vision and linear and targeted(name, every, names):
                modules.append(name)
            continue
        if is_router(name, module):
            if router and isinstance(module, torch.nn.Linear):
                modules.append(name)
            elif router:
                parameters.add(f"{suffix(name)}.weight")
        elif (
            isinstance(module, torch.nn.Linear)
            and module is not output
            and targeted(name, every, names)
        ):
            modules.append(name)
    mlp = set(MLP) if every else names & set(MLP)
    for name, stacked in experts.items():
        for param in stacked:  # gate_up_proj (gate and up stacked), down_proj
            kind = "down_proj" if "down" in param else "gate_up_proj"
            wanted = {"down_proj"} if kind == "down_proj" else {"gate_proj", "up_proj"}
            if wanted <= mlp:
                parameters.add(f"{suffix(name)}.{param}")
    if not experts:  # a vision-language model's language model: its linears, as named
        return {"target_modules": modules}
    r, alpha = lora["r"], lora["alpha"]
    return {
        "target_modules": modules,
        "target_parameters": sorted(parameters),
        "rank_pattern": {r".*\.gate_up_proj": 2 * r},
        "alpha_pattern": {r".*\.gate_up_proj": 2 * alpha},
    }


def targeted(name: str, every: bool, names: set[str]) -> bool:
    """Whether the nn.Linear ``name`` is a target (``every``: all-linear; else by its own
    name, the last part of its path)."""
    return every or name.rsplit(".", 1)[-1] in names


def language_outside(model, language):
    """The parameters of ``model`` outside its language model ``language`` (a
    vision-language model's vision tower and projector)."""
    inside = {id(p) for p in language.parameters()}
    output = model.get_output_embeddings()
    inside |= {id(p) for p in output.parameters()} if output is not None else set()
    return (p for p in model.parameters() if id(p) not in inside)


def dropout_where_supported(model, p: float) -> tuple[int, int]:
    """The run's ``lora.dropout`` ``p`` on every adapter of ``model`` (a peft model whose
    config says no dropout: ``peft_config`` on a mixture of experts) but the fused experts'
    (peft's ParamWrapper: an adapter on a 3-D parameter adds B·A to the weight, with no
    input of its own to drop from, and peft refuses a dropout there). Returns the counts of
    adapted modules given it and of expert parameters left without."""
    import torch
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    given = left = 0
    for module in model.modules():
        if isinstance(module, ParamWrapper):
            left += 1
        elif isinstance(module, LoraLayer) and p > 0:
            for name, layer in module.lora_dropout.items():
                if isinstance(layer, torch.nn.Identity):
                    module.lora_dropout[name] = torch.nn.Dropout(p)
            given += 1
    return given, left


def run_dropout(model, p: float) -> str | None:
    """A peft ``model`` whose config left out the run's ``lora.dropout`` ``p`` (adapters on
    fused experts: snaketune.methods.training.peft_config) given it where peft supports it
    (``dropout_where_supported``); the log line that says so, None where nothing changed."""
    config = next(iter(model.peft_config.values()))
    if not getattr(config, "target_parameters", None) or config.lora_dropout == p:
        return None
    given, left = dropout_where_supported(model, p)
    return (
        f"lora.dropout {p} on the {given} adapted linear layers; none on the {left} "
        "adapted fused-expert parameters (peft's adapter on an expert parameter has no "
        "dropout; docs/moe.md)"
    )


def suffix(name: str) -> str:
    """A module's name after its layer's index (model.layers.3.mlp.experts: mlp.experts)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[i + 1 :])
    return name


@contextlib.contextmanager
def exact_targets() -> Iterator[None]:
    """peft's translation of a mixture of experts' targets switched off (the module's
    docstring says why); peft calls it by its module attribute, so it is replaced there."""
    import warnings

    from peft.utils import transformers_weight_conversion as conversion

    kept = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        with warnings.catch_warnings():  # peft checks the patterns against modules only,
            # but they apply to the experts' parameters (tests/test_moe.py counts them)
            warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern")
            yield
    finally:
        conversion.convert_peft_config_for_transformers = kept


def load_adapter(model, adapter):
    """``model`` with the peft adapter saved at ``adapter``, its targets as the run made
    them (``exact_targets``)."""
    from peft import PeftModel

    with exact_targets():
        return PeftModel.from_pretrained(model, str(adapter))


def describe(model) -> dict[str, Any]:
    """What carries adapters on a peft ``model``: the kinds of module (attention, mlp,
    shared experts, experts, router) and the trainable parameters, for the log and the
    provenance."""
    kinds: dict[str, int] = {}
    for name, param in model.named_parameters():
        if "lora_" not in name or not param.requires_grad:
            continue
        owner = name.split(".lora_")[0].replace(".base_layer", "")
        kinds[kind_of(owner)] = kinds.get(kind_of(owner), 0) + param.numel()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"adapter_params": kinds, "trainable_params": trainable}


def read_description(ckpt_dir) -> dict[str, Any] | None:
    """``describe``'s record the training job left in its checkpoints folder (None: no LoRA)."""
    import json

    path = ckpt_dir / ADAPTERS
    return json.loads(path.read_text()) if path.is_file() else None


def kind_of(owner: str) -> str:
    """The kind of module an adapter sits on, from its name."""
    where = suffix(owner)
    last = where.rsplit(".", 1)[-1]
    if last in ("gate", "router", "shared_expert_gate"):
        return "router"
    if "shared_expert" in where:
        return "shared_experts"
    if last == "experts":
        return "experts"
    return "attention" if "attn" in where or "attention" in where else "mlp"
