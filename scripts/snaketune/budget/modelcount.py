"""A model counted as transformers builds it: its config.json handed to transformers' own
class (the one its ``architectures`` names, else the auto class of its kind) on the meta
device (no memory, no weights), every parameter read off the built model. The plans take a
model's shape through ``shape_of``: a family no formula knows is counted exactly (linear
attention, latent attention, a vision-language model's towers, each expert); where
transformers cannot build it (custom code), the formulas of snaketune.core.modelshape.
Counting imports torch and transformers (about 5 s on a login node), so each count is kept
(snaketune.core.cache) by the config.json and the installed transformers' version: a config
is counted once per machine (per home directory on a cluster), and the dry runs after it
import neither.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from snaketune.core.cache import remembered, transformers_version
from snaketune.core.configfields import Counted, stacked_params
from snaketune.core.modelshape import Shape


def shape_of(cfg: dict[str, Any], where: str = "config.json") -> Shape:
    """The plans' shape of config.json ``cfg``, counted on the model transformers builds."""
    return Shape.from_config(cfg, where, count(cfg))


# config.json keys that say how a checkpoint is stored or loaded, not what is built
_NOT_BUILT = (
    "architectures",
    "auto_map",
    "quantization_config",
    "transformers_version",
    "model_type",
    "_name_or_path",
)


COUNT_VERSION = 2  # bump when counted_of counts differently (part of the cache key)


def count(cfg: dict[str, Any]) -> Counted | None:
    """``cfg`` (a config.json) counted on the model transformers builds from it, with the
    class its ``architectures`` names (else the auto class of its kind); None where
    transformers cannot build it. Read from the cache when counted before."""
    if transformers_version() is None:
        return None
    text = json.dumps(cfg, sort_keys=True)

    def counted() -> dict[str, Any] | None:
        made = _count(text)
        return None if made is None else dataclasses.asdict(made)

    kept = remembered("model-counts", f"{COUNT_VERSION}\0{text}", counted)
    try:
        return None if kept is None else _counted_from(kept)
    except TypeError:  # a foreign file's fields
        return _count(text)


def _counted_from(kept: dict[str, Any]) -> Counted:
    kept = {k: tuple(map(tuple, v)) if isinstance(v, list) else v for k, v in kept.items()}
    return Counted(**kept)


@functools.lru_cache(maxsize=32)
def _count(text: str) -> Counted | None:
    import torch
    import transformers
    from transformers import AutoConfig

    cfg = json.loads(text)
    try:
        config = AutoConfig.for_model(
            cfg.get("model_type"), **{k: v for k, v in cfg.items() if k not in _NOT_BUILT}
        )
        arch = (cfg.get("architectures") or [None])[0]
        cls = getattr(transformers, arch, None) if arch else None
        if cls is None:
            auto = "vision_config" in cfg and "AutoModelForImageTextToText"
            cls = getattr(transformers, auto or "AutoModelForCausalLM")
        with torch.device("meta"):
            build = getattr(cls, "from_config", None) or cls._from_config
            model = build(config)
    except Exception:  # noqa: BLE001 -- unknown model_type, custom code, a config it refuses
        return None
    return counted_of(model)


def counted_of(model) -> Counted:
    """What ``Counted`` holds, read off a built model."""
    import torch

    language = model.get_decoder() if hasattr(model, "get_decoder") else model
    output = model.get_output_embeddings()
    inside = {id(p) for p in language.parameters()}
    if output is not None:
        inside |= {id(p) for p in output.parameters()}
    params = list(model.parameters())
    linears: dict[tuple[str, int, int], int] = {}
    stacked: dict[tuple[str, int, int, int], int] = {}
    expert_layers = expert_params = largest = 0
    for name, module in language.named_modules():
        own = list(module.parameters(recurse=False))
        largest = max(largest, sum(p.numel() for p in own))
        if isinstance(module, torch.nn.Linear) and module is not output:
            key = (name.rsplit(".", 1)[-1], module.in_features, module.out_features)
            linears[key] = linears.get(key, 0) + 1
        three = stacked_params(module)
        if three:
            expert_layers += 1
            experts = three[0][1].shape[0]
            expert_params = sum(p.numel() for p in own) // experts
            for n, p in three:
                key = (n, p.shape[0], p.shape[1], p.shape[2])
                stacked[key] = stacked.get(key, 0) + 1
    if output is not None:
        largest = max(largest, sum(p.numel() for p in output.parameters(recurse=False)))
    within = {id(m) for m in language.modules()}
    towers: dict[tuple[str, int, int], int] = {}
    for name, module in model.named_modules():  # a vision-language model's towers
        if (
            id(module) not in within
            and isinstance(module, torch.nn.Linear)
            and module is not output
        ):
            key = (name.rsplit(".", 1)[-1], module.in_features, module.out_features)
            towers[key] = towers.get(key, 0) + 1
    return Counted(
        params=sum(p.numel() for p in params),
        linear=sum(i * o * k for (_, i, o), k in linears.items()),
        largest=largest,
        expert_layers=expert_layers,
        expert_params=expert_params,
        linears=tuple((n, i, o, k) for (n, i, o), k in sorted(linears.items())),
        stacked=tuple((n, e, a, b, k) for (n, e, a, b), k in sorted(stacked.items())),
        towers=sum(p.numel() for p in params if id(p) not in inside),
        tower_linears=tuple((n, i, o, k) for (n, i, o), k in sorted(towers.items())),
    )
