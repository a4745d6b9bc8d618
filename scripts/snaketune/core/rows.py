"""A tokenized row's parts, read the same way everywhere: the prompt is every token before
the first trained label, the answer the trained labels (IGNORE_INDEX marks the rest).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

IGNORE_INDEX = -100  # labels of tokens the loss skips (prompt tokens, padding)


def prompt_length(labels: Sequence[int]) -> int:
    """Tokens before the first trained label (all of them when none is trained)."""
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def prompt_and_answer(input_ids: Sequence[int], labels: Sequence[int]) -> tuple[list, list]:
    """The prompt's token ids and the answer's (the trained labels)."""
    first = prompt_length(labels)
    return list(input_ids[:first]), [t for t in labels if t != IGNORE_INDEX]


def pad_id(tokenizer: Any) -> int:
    """The id to pad with: the tokenizer's pad token, else its end-of-sequence token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def with_labels(table: Any) -> Any:
    """A tokenized table (pyarrow) with every row's labels: a text row stores none (null:
    every token is trained, snaketune.data.text), so its labels are its input ids."""
    if "labels" not in table.column_names or table.column("labels").null_count == 0:
        return table
    import pyarrow.compute as pc

    labels = table.column("labels")
    filled = pc.if_else(pc.is_null(labels), table.column("input_ids"), labels)
    return table.set_column(table.column_names.index("labels"), "labels", filled)
