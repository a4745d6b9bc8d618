"""A run's settings, resolved once.

snaketune.plan.config.validate_config fills every run's keys from the schema's defaults (its
method's block and, for a run that trains an adapter, its LoRA block included): code reads
a validated run's keys as they are and never restates a default. ``RunSpec.of`` derives,
in this one place, the facts the stages, the plans, the launcher and the worker ask of a
run: its method, what its checkpoint holds, whether its base is 4-bit and how, whether it
needs the reference stage, how its shard plan balances ranks, where its final model is.
It is cheap (no I/O, no heavy import), so every reader builds it from the run it holds
(the rules from the config, the train job from its --run-spec JSON).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from snaketune.core.heldout import greater_is_better
from snaketune.data.kinds import kind_named
from snaketune.methods import Method, method_of
from snaketune.methods.needs import Need

# The directory under results/<run>/ of the model a run ends with, by what it trains.
FINAL_MODEL = {"lora": "merged_model", "full": "hf"}
ADAPTER_ONLY = "lora_adapters"  # a LoRA run with export.merged: false ends with its adapter
# The LoRA keys that decide how a 4-bit base is quantized (and so what a model computes).
QUANTIZATION_KEYS = ("quantize", "quant_type", "double_quant", "compute_dtype")


def merged(run: Mapping[str, Any]) -> bool:
    """export.merged (a train job's spec, which carries no export block: true)."""
    return bool(run.get("export", {}).get("merged", True))


@dataclass(frozen=True)
class RunSpec:
    """The facts derived from one validated run (schema defaults filled)."""

    method: Method
    adapter: str  # "lora" or "full": what the run's checkpoint holds
    # its LoRA block (None: every weight trains; validation refuses one on such a run)
    lora: Mapping[str, Any] | None
    # a 4-bit base's settings (QUANTIZATION_KEYS of the LoRA block), None: not quantized
    quantization: Mapping[str, Any] | None
    # what it needs besides its rows and model (snaketune.methods.needs), with its settings
    needs: Mapping[Need, Mapping[str, Any]]
    balances_tokens: bool  # its shard plan balances each step's tokens across ranks
    final_model: str  # results/<run>/<this>: the model the run ends with

    @classmethod
    def of(cls, run: Mapping[str, Any]) -> RunSpec:
        method = method_of(run)
        adapter = method.adapter_of(run)
        lora = run.get("lora")
        quantized = lora is not None and lora["quantize"] != "none"
        return cls(
            method=method,
            adapter=adapter,
            lora=lora,
            quantization={k: lora[k] for k in QUANTIZATION_KEYS} if quantized else None,
            needs=method.needs(run),
            balances_tokens=bool(run["packing"]) or kind_named(method.trains_on).balances_tokens,
            final_model=ADAPTER_ONLY
            if adapter == "lora" and not merged(run)
            else FINAL_MODEL[adapter],
        )

    @property
    def adapter_only(self) -> bool:
        """Its final model is its adapter (export.merged: false): loaded on its base."""
        return self.final_model == ADAPTER_ONLY

    @property
    def quantized(self) -> bool:
        """A 4-bit base (lora.quantize)."""
        return self.quantization is not None

    @property
    def trains_lora(self) -> bool:
        return self.adapter == "lora"


def heldout_metric(run: dict[str, Any]) -> str | None:
    """The held-out figure a run is judged by (export.metric; `auto`: its method's own);
    None for a run that scores nothing while training."""
    spec = run.get("heldout")
    if not spec:
        return None
    return spec["metric"] if spec["metric"] != "auto" else method_of(run).heldout_metric


def kept_best(run: dict[str, Any]) -> tuple[str, bool] | None:
    """The held-out metric whose best checkpoint pruning keeps (export.checkpoint: best)."""
    metric = heldout_metric(run)
    if metric is None or run["heldout"]["checkpoint"] != "best":
        return None
    return metric, greater_is_better(metric)
