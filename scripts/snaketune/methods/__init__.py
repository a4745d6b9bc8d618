"""Training methods as plug-ins: the registry, the one place that names them all.

Adding a method is one module (see snaketune.methods.sft for the smallest: its data, its
trainer, its step fields, a ``METHOD``) and one line below; docs/architecture.md shows a
skeleton. The worker, the step callback and the launcher name no method.
"""

from __future__ import annotations

from typing import Any

from snaketune.methods.common import Method

# The config's `method` -> the module that trains it (LoRA and full fine-tuning are both
# supervised fine-tuning; whether an adapter is trained is the run's `lora`).
REGISTRY = {
    "lora": "snaketune.methods.sft",
    "full": "snaketune.methods.sft",
    "grpo": "snaketune.methods.grpo",
    "dpo": "snaketune.methods.dpo",
}


def method_of(run: dict[str, Any]) -> Method:
    """The training method of a run (imported on first use: each brings its trainer)."""
    import importlib

    return importlib.import_module(REGISTRY[run["method"]]).METHOD
