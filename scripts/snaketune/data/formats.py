"""The config's vocabulary of datasets: the words config validation, the tokenize plan and
the rules read a dataset with (formats and their fields, which datasets a mixture reads),
and the rows a dataset contributes (its filters, its mixture weight).
What a run trains and where its model ends up are its method's (snaketune.methods).
"""

from __future__ import annotations

import hashlib
from typing import Any

from snaketune.core.errors import DataError
from snaketune.core.imports import deferred

np = deferred("numpy")
pa = deferred("pyarrow")
pc = deferred("pyarrow.compute")

# For each dataset format: the fields a row must provide (field -> default column name),
# and which of them may be missing or empty.
FORMAT_FIELDS: dict[str, dict[str, str]] = {
    "prompt_response": {"prompt": "prompt", "response": "response"},
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output"},
    "messages": {"messages": "messages", "tools": "tools"},
    "preference": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
    "labelled": {"prompt": "prompt", "completion": "completion", "label": "label"},
    "text": {"text": "text"},
}
# Fields that may be missing or empty, by format (a preference dataset without a prompt
# column holds whole conversations in chosen and rejected that share their prompt turns; a
# messages dataset's tools: snaketune.data.toolcalls).
OPTIONAL_FIELDS = {"alpaca": {"input"}, "preference": {"prompt"}, "messages": {"tools"}}
NOT_TEXT = ("tools", "label")  # a format's fields that hold no text to compare (cleaning)


def text_columns(spec: dict[str, Any]) -> list[str]:
    """The columns holding a dataset's text: its format's fields, tools and labels aside."""
    cols: list[str] = []
    for name, default in FORMAT_FIELDS[spec["format"]].items():
        if name not in NOT_TEXT:
            col = spec.get("columns", {}).get(name, default)
            cols.extend(col if isinstance(col, list) else [col])
    return list(dict.fromkeys(cols))


# Keys of a single (non-mixture) dataset: where its rows come from and how they read.
SINGLE_DATASET_KEYS = (
    "id",
    "files",
    "path",
    "subset",
    "split",
    "revision",
    "file_format",
    "format",
    "columns",
    "system_prompt",
    "filters",
)


def components(config: dict[str, Any], dataset: str) -> list[dict[str, Any]]:
    """The datasets tokenize reads for ``dataset``: itself, or its mixture components."""
    spec = config["datasets"][dataset]
    if spec["source"] != "mixture":
        return [{"name": dataset, "weight": 1.0, "seed": 0}]
    seed = spec.get("seed", 0)
    return [{"name": c["dataset"], "weight": c["weight"], "seed": seed} for c in spec["mixture"]]


def has_pictures(config: dict[str, Any], dataset: str) -> bool:
    """Whether ``dataset`` (or a component of its mixture) holds pictures (False for a
    dataset the config does not define: its own check names it)."""
    from snaketune.data.kinds import has_pictures as pictured
    from snaketune.data.kinds import kind_of_source

    specs = config["datasets"]
    if not isinstance(specs.get(dataset), dict):
        return False
    parts = [specs.get(c["name"]) for c in components(config, dataset)]
    return any(isinstance(p, dict) and pictured(kind_of_source(p)) for p in parts)


# ----------------------------------------------------------------------------- filters, mixture


def filter_mask(batch: pa.RecordBatch, filters: list[dict[str, Any]], name: str) -> pa.Array | None:
    """Boolean mask of the rows that pass every filter (None when there are none)."""
    mask = None
    for flt in filters:
        col, op, value = flt["column"], flt["op"], flt["value"]
        arr = batch.column(col)
        if op in ("in", "not_in"):
            hit = pc.is_in(arr, value_set=pa.array(value))
            cond = hit if op == "in" else pc.invert(hit)
        else:
            fn = {
                "==": pc.equal,
                "!=": pc.not_equal,
                "<": pc.less,
                "<=": pc.less_equal,
                ">": pc.greater,
                ">=": pc.greater_equal,
            }[op]
            try:
                cond = fn(arr, pa.scalar(value))
            except (pa.ArrowNotImplementedError, pa.ArrowInvalid) as exc:
                raise DataError(
                    f"datasets.{name}.filters: cannot compare column {col!r} ({arr.type}) "
                    f"with {value!r}; use a value of the column's type"
                ) from exc
        cond = pc.fill_null(cond, False)
        mask = cond if mask is None else pc.and_(mask, cond)
    return mask


def multiplicity(rows: int, weight: float, seed: int, name: str) -> np.ndarray:
    """How many times each raw row enters a mixture: floor(weight), plus one for a seeded
    subset of round(frac * rows) rows."""
    whole = int(np.floor(weight))
    frac = weight - whole
    counts = np.full(rows, whole, dtype=np.int64)
    extra = int(round(frac * rows))
    if extra:
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        counts[rng.choice(rows, size=extra, replace=False)] += 1
    return counts
