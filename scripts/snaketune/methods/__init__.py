"""Training methods as plug-ins: the registry, the one place that names them all.

Adding a method is one module (see snaketune.methods.sft for the smallest: its data, its
trainer, its step fields, a ``METHOD``; snaketune.methods.dpo for one with its own config
block, data kind and stage) and one line below; docs/architecture.md has the checklist.
Nothing outside this package names a method: config validation, the plans, the stages,
the report and publish ask the run's ``Method`` (``method_of``); the facts derived from a
run and its method are snaketune.plan.runspec.RunSpec's.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from snaketune.methods.common import Method

# The config's `method` -> the module and the Method in it. LoRA and full fine-tuning are
# both supervised fine-tuning, with an adapter or every weight.
REGISTRY = {
    "lora": ("snaketune.methods.sft", "LORA"),
    "full": ("snaketune.methods.sft", "FULL"),
    "grpo": ("snaketune.methods.grpo", "METHOD"),
    "dpo": ("snaketune.methods.dpo", "METHOD"),
    "reward": ("snaketune.methods.reward_model", "METHOD"),
    "simpo": ("snaketune.methods.simpo", "METHOD"),
    "orpo": ("snaketune.methods.orpo", "METHOD"),
    "kto": ("snaketune.methods.kto", "METHOD"),
    "rloo": ("snaketune.methods.rloo", "METHOD"),
    "distill": ("snaketune.methods.distill", "METHOD"),
    "opd": ("snaketune.methods.opd", "METHOD"),
}


def method_named(name: str) -> Method:
    module, attribute = REGISTRY[name]
    return getattr(importlib.import_module(module), attribute)


def method_of(run: Mapping[str, Any]) -> Method:
    """The training method of a run."""
    return method_named(run["method"])


def methods() -> dict[str, Method]:
    """Every method, by its config name."""
    return {name: method_named(name) for name in REGISTRY}


def calls_tools(run: Mapping[str, Any]) -> bool:
    """Whether a run calls tools (its method's block's ``tools`` or ``environment``)."""
    from snaketune.tools.tooluse import uses_tools

    block = method_of(run).block
    return bool(block) and uses_tools(run.get(block, {}))


def reward_runs(run: Mapping[str, Any]) -> list[str]:
    """The runs whose reward models ``run`` scores with (its method's need of reward models,
    snaketune.methods.needs: the ``model:`` keys of GRPO's and RLOO's ``rewards``)."""
    from snaketune.methods.needs import REWARD_MODELS

    if run.get("method") not in REGISTRY:
        return []
    return list(method_of(run).needs(run).get(REWARD_MODELS, {}).get("runs", []))


def reward_model_runs(runs: Mapping[str, Mapping[str, Any]]) -> set[str]:
    """The runs of a config that train a reward model (a score head), which ``model:<run>``
    rewards and metrics may name (a run whose method the schema has not checked: none)."""
    return {
        name
        for name, run in runs.items()
        if run.get("method") in REGISTRY and method_named(run["method"]).reward_model
    }


def compose_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The config schema with what each method owns put into the run schema (in place):
    `method`'s names and what each does, each method's own block, and which methods take
    `init_from`."""
    import yaml

    from snaketune.core.io import yaml_safe_loader

    run = schema["properties"]["runs"]["additionalProperties"]["properties"]
    every = methods()
    run["method"] = {
        "description": run["method"]["description"]
        + " "
        + "; ".join(f"`{name}`: {m.summary}" for name, m in every.items())
        + ".",
        "enum": list(every),
    }
    for m in every.values():
        if m.block is not None:
            run[m.block] = yaml.load(m.schema, Loader=yaml_safe_loader())  # noqa: S506
    starters = ", ".join(name for name, m in every.items() if m.starts_from_runs)
    described = f"{run['init_from']['description']} Methods: {starters}."
    run["init_from"] = {**run["init_from"], "description": described}
    return schema
