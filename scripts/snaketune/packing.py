"""Collation of planned micro batches, and the attention kernels that decide it.

One component turns the examples of a micro batch (see snaketune.shard for how they are
chosen) into model inputs, in one of three layouts:

- ``padded`` (``packing: false``): one row per example, right-padded to the longest, with an
  attention mask (trl's collator).
- ``varlen`` (packing with flash-attention 2, or with sdpa where there is no GPU): every
  example laid side by side in ONE row, no pad token, position ids restarting at 0 per
  example, and the sequence boundaries (``cu_seq_lens``) for a variable-length kernel (trl's
  padding-free collator). Attention cost follows each example's own length. On GPU the
  kernel is flash-attention's; on CPU it is :func:`segment_attention` (registered with
  transformers as ``sdpa_segments``): PyTorch's sdpa run causally on one example at a
  time, with no mask at all.
- ``rows`` (packing with eager, or with sdpa on a GPU without flash-attn): examples dealt
  into few rows of at most ``row_tokens`` (max_length) tokens, balanced so the rows come
  out nearly equal; position ids restart per example, rows are right-padded to the longest
  row (a few tokens), and NO attention mask: transformers then finds the example boundaries
  from the position ids and builds a block-diagonal causal mask
  (masking_utils.find_packed_sequence_indices), so no token attends to another example.
  These kernels have no variable-length path and pay attention over a whole row (rows^2):
  keeping rows to max_length bounds that, where one long row would square it.

Which runs where was measured (bench/train_throughput.py, docs/benchmarks.md): on CPU,
forward+backward of the same micro batches took about 1,350 ms padded, 1,050 ms as sdpa
rows with the dense mask and 920 ms as one row under ``sdpa_segments``; one long row under
the dense mask is slower than padding. The GPU choice for sdpa without flash-attn (rows) is not
measured: no GPU was lent to this project's sessions.

In every packed layout the first label of each example is -100, so the last token of one
example never learns to predict the next example's first token (position 0 is never a
target in the padded layout either: the same targets either way). Packed batches carry
``use_cache=False``: with a KV cache, transformers skips the packed-sequence check and
every token would attend across examples.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snaketune.errors import ConfigError, UserError
from snaketune.io import IdsLog

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

GPU_EXTRA = 'pip install -e ".[gpu]"'
KERNEL_PACKAGES = {"flash_attention_2": "flash_attn", "liger_kernel": "liger_kernel"}


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


# ----------------------------------------------------------------------------- kernels


def flash_attention_usable() -> bool:
    """flash-attn installed and a CUDA GPU of compute capability 8.0+ (Ampere or newer)."""
    import torch

    return (
        installed("flash_attn")
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] >= 8
    )


def resolve_attention(preference: str) -> str:
    """The attention implementation a run trains with (``auto``: flash-attention 2 where it
    is installed and the GPU supports it, sdpa otherwise)."""
    import torch

    if preference == "auto":
        return "flash_attention_2" if flash_attention_usable() else "sdpa"
    if preference == "flash_attention_2" and not flash_attention_usable():
        package = "installed" if installed("flash_attn") else "missing"
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
        raise UserError(
            "attn_implementation flash_attention_2 needs flash-attn and a CUDA GPU of compute "
            f"capability 8.0+ (found: flash-attn {package}, {gpu}); "
            f"{GPU_EXTRA} on a GPU node, or set attn_implementation: auto"
        )
    return preference


def resolve_liger(preference: bool | str) -> bool:
    """Whether Liger's fused kernels are applied (``auto``: installed and on a GPU)."""
    import torch

    if preference == "auto":
        return installed("liger_kernel") and torch.cuda.is_available()
    if preference and not torch.cuda.is_available():
        raise UserError(
            "liger_kernel: true needs a CUDA GPU (Liger's kernels are Triton); "
            "set liger_kernel: auto to use them only where there is one"
        )
    return bool(preference)


def check_kernels_installed(where: str, run: dict[str, Any]) -> None:
    """Config-time check: a kernel asked for by name must be importable here."""
    if run.get("attn_implementation") == "flash_attention_2" and not installed("flash_attn"):
        raise ConfigError(
            f"{where}.attn_implementation: flash_attention_2 asked for but flash-attn is not "
            f"installed; {GPU_EXTRA} (CUDA GPU nodes), or set attn_implementation: auto"
        )
    if run.get("liger_kernel") is True and not installed("liger_kernel"):
        raise ConfigError(
            f"{where}.liger_kernel: true asked for but liger-kernel is not installed; "
            f"{GPU_EXTRA} (CUDA GPU nodes), or set liger_kernel: auto"
        )


def layout_for(packing: bool, kernel: str) -> str:
    """Which collation a run uses with the attention kernel it trains with (see
    :func:`training_kernel`): padded, varlen (flash-attention 2, sdpa_segments) or rows
    (sdpa, eager)."""
    if not packing:
        return "padded"
    return "varlen" if kernel in ("flash_attention_2", SEGMENTS) else "rows"


# ----------------------------------------------------------------------------- sdpa per example

SEGMENTS = "sdpa_segments"
# what segment_attention cannot honour; a model using any of them trains on rows instead
_SEGMENT_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "position_bias")


def segment_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
) -> tuple[torch.Tensor, None]:
    """Attention of packed rows one example at a time (transformers' attention interface):
    PyTorch's scaled_dot_product_attention, causal, over each example's own tokens, so no
    token can see another example and no mask is built or read. The boundaries come from
    the collator's ``cu_seq_lens_q`` (one row) or from where ``position_ids`` restart at 0;
    a row without either is one sequence (plain causal attention).

    It serves inputs that need no mask (packed rows, unpadded rows) and refuses the others
    (padding, a KV cache, sliding windows, soft-capping), which snaketune never gives it:
    its mask function (:func:`segment_mask`) builds nothing and stops at a padding mask."""
    import torch
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv

    if (
        attention_mask is not None
        or query.shape[2] != key.shape[2]
        or any(kwargs.get(k) is not None for k in _SEGMENT_UNSUPPORTED)
    ):
        raise RuntimeError(f"{SEGMENTS} attention takes packed or unpadded rows only")
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    batch, length = query.shape[0], query.shape[2]
    bounds = kwargs.get("cu_seq_lens_q")
    positions = kwargs.get("position_ids")
    rows = []
    for r in range(batch):
        if bounds is not None and batch == 1:
            cuts = [int(c) for c in bounds.tolist()]
        elif positions is not None:
            row = positions[r if positions.shape[0] > 1 else 0]
            cuts = (row == 0).nonzero().flatten().tolist() + [length]
        else:
            cuts = [0, length]
        if cuts[0] != 0:
            cuts.insert(0, 0)
        rows.append(torch.cat([
            F.scaled_dot_product_attention(
                query[r : r + 1, :, a:b], key[r : r + 1, :, a:b], value[r : r + 1, :, a:b],
                dropout_p=dropout, is_causal=True, scale=scaling,
            )
            for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a
        ], dim=2))  # fmt: skip
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def segments_problem(config: dict[str, Any]) -> str | None:
    """Why a model (its config.json as a dict) needs more than causal attention within each
    example, so that :func:`segment_attention` cannot stand in for its sdpa, or None."""
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        return "sliding-window attention"
    if "sliding_attention" in (config.get("layer_types") or []):
        return "sliding-window layers"
    if config.get("attn_logit_softcapping"):
        return "soft-capped attention logits"
    return None


def training_kernel(attention: str, packing: bool, config: dict[str, Any]) -> str:
    """The attention kernel a run trains with: ``attention`` (resolve_attention's choice),
    except packed batches under sdpa without a GPU, which run one example at a time
    (:data:`SEGMENTS`, registered here) when the model needs nothing more than causal
    attention within an example."""
    import torch

    if (
        packing
        and attention == "sdpa"
        and not torch.cuda.is_available()
        and segments_problem(config) is None
    ):
        register_segment_attention()
        return SEGMENTS
    return attention


def segment_mask(*, attention_mask=None, **kwargs) -> None:
    """The mask function of :data:`SEGMENTS` (transformers' mask interface): no mask, since
    :func:`segment_attention` finds each example's bounds itself; a padding mask (padded
    or left-padded rows, which it cannot honour) stops the forward."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise RuntimeError(f"{SEGMENTS} attention takes packed or unpadded rows only")
    return None


def register_segment_attention() -> None:
    """Make :data:`SEGMENTS` a transformers ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SEGMENTS, segment_attention)
    AttentionMaskInterface.register(SEGMENTS, segment_mask)


# ----------------------------------------------------------------------------- model check


def _causal_lm_class(config: dict[str, Any]):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = config.get("model_type")
    try:
        cfg = AutoConfig.for_model(model_type)
        return AutoModelForCausalLM._model_mapping[type(cfg)]
    except (KeyError, ValueError):
        return None


def packing_problem(config: dict[str, Any], attention: str) -> str | None:
    """Why a model (its config.json as a dict) cannot train on packed sequences with
    ``attention``, or None when it can. What transformers needs (read in its source):

    - the causal-LM forward takes ``position_ids`` (ALiBi models such as bloom and mpt, and
      recurrent ones such as mamba and rwkv, do not: nothing restarts at an example);
    - sdpa / eager: the model builds its masks with transformers.masking_utils, the code
      that turns restarting position ids into a block-diagonal mask;
    - flash_attention_2: the model supports flash attention (its varlen path);
    - no linear-attention or state-space layers (``layer_types``): those mix examples of a
      row in their state, whatever the attention mask.
    """
    cls = _causal_lm_class(config)
    name = config.get("model_type", "?")
    if cls is None:
        return f"model type {name!r} has no causal-LM class in the installed transformers"
    if "position_ids" not in inspect.signature(cls.forward).parameters:
        return f"{cls.__name__} takes no position_ids, so positions cannot restart per example"
    other = sorted(
        {
            t
            for t in config.get("layer_types") or []
            if t not in ("full_attention", "sliding_attention")
        }
    )
    if other:
        return f"{cls.__name__} has {', '.join(other)} layers, which carry state across examples"
    if attention == "flash_attention_2":
        if not getattr(cls, "_supports_flash_attn", False):
            return f"{cls.__name__} does not support flash attention 2"
        return None
    source = inspect.getsource(inspect.getmodule(cls))
    if "masking_utils" not in source:
        return (
            f"{cls.__name__} does not build its masks with transformers' masking_utils, so "
            f"{attention} attention would cross examples"
        )
    return None


def check_packing(model_dir: str | Path, attention: str, where: str) -> dict[str, Any]:
    """Refuse packing for a model that cannot take packed sequences, with the fix; else
    return the model's config.json (as a dict) it read, for :func:`training_kernel`."""
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    problem = packing_problem(config, attention)
    if problem:
        raise UserError(
            f"{where}.packing: {Path(model_dir).name} cannot train on packed sequences with "
            f"{attention} attention ({problem}); set packing: false"
        )
    return config


def expected_attention(preference: str) -> str:
    """The implementation ``auto`` will pick where this runs (for checks before training)."""
    if preference != "auto":
        return preference
    return "flash_attention_2" if installed("flash_attn") else "sdpa"


# ----------------------------------------------------------------------------- collation


def fill_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of the examples in each row. Of the layouts into r rows of at most
    ``capacity`` tokens (r from the fewest possible, two more tried), the one with the
    fewest tokens once rows are padded to the longest, each balanced like the ranks of a
    step (snaketune.shard.balanced_bins). An example longer than ``capacity`` gets a row of
    its own; no example is ever cut."""
    import numpy as np

    from snaketune.shard import balanced_bins

    n, sizes = len(lengths), np.asarray(lengths, dtype=np.int64)
    fewest = max(1, -(-int(sizes.sum()) // capacity))
    best, best_cost = [[i] for i in range(n)], float("inf")
    for r in range(min(fewest, n), min(fewest + 2, n) + 1):
        bins = balanced_bins(sizes, r)
        loads = np.bincount(bins, weights=sizes, minlength=r)
        alone = np.bincount(bins, minlength=r) == 1
        if (loads[~alone] > capacity).any():
            continue
        if r * int(loads.max()) < best_cost:
            best = [np.flatnonzero(bins == q).tolist() for q in range(r)]
            best_cost = r * int(loads.max())
    return best


def packed_rows(
    examples: list[dict[str, Any]], row_tokens: int, pad_token_id: int
) -> dict[str, torch.Tensor]:
    """The ``rows`` layout (see the module docstring)."""
    import torch

    lengths = [len(e["input_ids"]) for e in examples]
    rows = fill_rows(lengths, max(row_tokens, *lengths))
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n = lengths[i]
            ids[r, at : at + n] = torch.as_tensor(examples[i]["input_ids"])
            labels[r, at + 1 : at + n] = torch.as_tensor(examples[i]["labels"][1:])
            positions[r, at : at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(width - at)  # padding: a segment of its own
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "use_cache": False}


class Collator:
    """Collates a planned micro batch in the run's layout, counting real and padded tokens
    (and logging example ids when asked)."""

    def __init__(
        self, layout: str, pad_token_id: int, row_tokens: int, ids_log: Path | None = None
    ):
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        self.layout, self.pad_token_id, self.row_tokens = layout, pad_token_id, row_tokens
        self._trl = DataCollatorForLanguageModeling(
            pad_token_id=pad_token_id, padding_free=layout == "varlen"
        )
        self.tokens = 0  # real (example) tokens
        self.padded = 0  # tokens in the model's input, padding included
        self.samples = 0
        self.squares = 0  # sum of squared example lengths (attention FLOPs, throughput.py)
        self._ids_log = IdsLog(ids_log)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        self._ids_log.write([e["example_id"] for e in examples])
        plain = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
        if self.layout == "rows":
            batch = packed_rows(plain, self.row_tokens, self.pad_token_id)
        else:
            batch = self._trl(plain)
            if self.layout == "varlen":
                batch["use_cache"] = False
        lengths = [len(e["input_ids"]) for e in examples]
        self.tokens += sum(lengths)
        self.squares += sum(n * n for n in lengths)
        self.padded += batch["input_ids"].numel()
        self.samples += len(examples)
        return batch
