"""The config's vocabulary: the words config validation, the tokenize and shard plans and
the rules all read a run and a dataset with (formats and their fields, what a run trains,
where its model ends up, which datasets a mixture reads).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# For each dataset format: the fields a row must provide (field -> default column name),
# and which of them may be missing or empty.
FORMAT_FIELDS: dict[str, dict[str, str]] = {
    "prompt_response": {"prompt": "prompt", "response": "response"},
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output"},
    "messages": {"messages": "messages"},
    "preference": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
}
# Formats whose rows are pairs of responses to one prompt (method dpo trains on them).
PAIR_FORMATS = {"preference"}
# Methods that may train through a LoRA adapter (with a `lora` block) or every weight.
ADAPTER_OPTIONAL = {"grpo", "dpo"}
# Fields that may be missing or empty, by format (a preference dataset without a prompt
# column holds whole conversations in chosen and rejected that share their prompt turns).
OPTIONAL_FIELDS = {"alpaca": {"input"}, "preference": {"prompt"}}
# Keys of a single (non-mixture) dataset: where its rows come from and how they read.
SINGLE_DATASET_KEYS = ("id", "path", "subset", "split", "revision", "file_format", "format",
                       "columns", "system_prompt", "filters")  # fmt: skip


def trains_lora(run: Mapping[str, Any]) -> bool:
    """Whether a run trains a LoRA adapter (method lora, or grpo or dpo with a `lora`
    block)."""
    return run["method"] == "lora" or (run["method"] in ADAPTER_OPTIONAL and "lora" in run)


def balances_tokens(run: Mapping[str, Any]) -> bool:
    """Whether a run's shard plan balances each step's tokens across ranks: packed runs,
    and DPO runs (padded pairs, but of unequal lengths)."""
    return bool(run["packing"]) or run["method"] == "dpo"


def adapter_kind(run: Mapping[str, Any]) -> str:
    """`lora` or `full`: what a run's checkpoint holds, whatever its method."""
    return "lora" if trains_lora(run) else "full"


# The directory under results/<run>/ of the model a run ends with, by what it trains.
FINAL_MODEL = {"lora": "merged_model", "full": "hf"}


def final_model_dir(run: dict[str, Any]) -> str:
    """results/<run>/<this>: the model a run ends with (merged for LoRA, converted for full)."""
    return FINAL_MODEL[adapter_kind(run)]


def components(config: dict[str, Any], dataset: str) -> list[dict[str, Any]]:
    """The datasets tokenize reads for ``dataset``: itself, or its mixture components."""
    spec = config["datasets"][dataset]
    if spec["source"] != "mixture":
        return [{"name": dataset, "weight": 1.0, "seed": 0}]
    seed = spec.get("seed", 0)
    return [{"name": c["dataset"], "weight": c["weight"], "seed": seed} for c in spec["mixture"]]
