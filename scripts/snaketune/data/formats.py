"""The config's vocabulary of datasets: the words config validation, the tokenize plan and
the rules read a dataset with (formats and their fields, which datasets a mixture reads).
What a run trains and where its model ends up are its method's (snaketune.methods).
"""

from __future__ import annotations

from typing import Any

# For each dataset format: the fields a row must provide (field -> default column name),
# and which of them may be missing or empty.
FORMAT_FIELDS: dict[str, dict[str, str]] = {
    "prompt_response": {"prompt": "prompt", "response": "response"},
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output"},
    "messages": {"messages": "messages"},
    "preference": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
    "labelled": {"prompt": "prompt", "completion": "completion", "label": "label"},
}
# Fields that may be missing or empty, by format (a preference dataset without a prompt
# column holds whole conversations in chosen and rejected that share their prompt turns).
OPTIONAL_FIELDS = {"alpaca": {"input"}, "preference": {"prompt"}}
# Keys of a single (non-mixture) dataset: where its rows come from and how they read.
SINGLE_DATASET_KEYS = ("id", "path", "subset", "split", "revision", "file_format", "format",
                       "columns", "system_prompt", "filters")  # fmt: skip


def components(config: dict[str, Any], dataset: str) -> list[dict[str, Any]]:
    """The datasets tokenize reads for ``dataset``: itself, or its mixture components."""
    spec = config["datasets"][dataset]
    if spec["source"] != "mixture":
        return [{"name": dataset, "weight": 1.0, "seed": 0}]
    seed = spec.get("seed", 0)
    return [{"name": c["dataset"], "weight": c["weight"], "seed": seed} for c in spec["mixture"]]
