"""Attention and fused kernels: which one a run gets (flash-attention 2, sdpa, eager; liger),
whether its model can train packed and under which kernel, and ``sdpa_segments``, the
kernel of packed rows on CPU (PyTorch's sdpa run causally on one example at a time). The
layouts each kernel takes: snaketune.data.packing.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snaketune.core.cache import remembered
from snaketune.core.errors import ConfigError, UserError

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


def resolve_attention(preference: str, model_dir: str | Path | None = None) -> str:
    """The attention implementation a run trains with (``auto``: flash-attention 2 where it
    is installed, the GPU and the model support it, sdpa otherwise, eager for a model whose
    class has no sdpa path: gpt-oss's attention sinks)."""
    import torch

    if preference == "auto":
        supports = model_supports(model_dir)
        if flash_attention_usable() and "flash_attention_2" in supports:
            return "flash_attention_2"
        return "sdpa" if "sdpa" in supports else "eager"
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
        rows.append(
            torch.cat(
                [
                    F.scaled_dot_product_attention(
                        query[r : r + 1, :, a:b],
                        key[r : r + 1, :, a:b],
                        value[r : r + 1, :, a:b],
                        dropout_p=dropout,
                        is_causal=True,
                        scale=scaling,
                    )
                    for a, b in zip(cuts[:-1], cuts[1:], strict=True)
                    if b > a
                ],
                dim=2,
            )
        )
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def segments_problem(config: dict[str, Any]) -> str | None:
    """Why a model (its config.json as a dict) needs more than causal attention within each
    example, so that :func:`segment_attention` cannot stand in for its sdpa, or None."""
    config = config.get("text_config") or config  # a vision-language model's language model
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        return "sliding-window attention"
    if "sliding_attention" in (config.get("layer_types") or []):
        return "sliding-window layers"
    if config.get("attn_logit_softcapping"):
        return "soft-capped attention logits"
    return None


def training_kernel(
    attention: str, packing: bool, config: dict[str, Any], split: bool = False
) -> str:
    """The attention kernel a run trains with: ``attention`` (resolve_attention's choice),
    except packed batches under sdpa without a GPU, or with their sequences split across
    GPUs (``split``: sequence_parallel, whose attention drops the ``rows`` layout's mask),
    which run one example at a time (:data:`SEGMENTS`, registered here) when the model
    needs nothing more than causal attention within an example."""
    import torch

    if (
        packing
        and attention == "sdpa"
        and (split or not torch.cuda.is_available())
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


FACTS_VERSION = 1  # bump when _class_facts reads a class differently (part of the cache key)


def class_facts(config: dict[str, Any]) -> dict[str, Any] | None:
    """What the checks before training read off the causal-LM class of a config.json's
    ``model_type`` in the installed transformers (None where it has none): its name, whether
    its forward takes ``position_ids``, its sdpa and flash-attention support, and whether its
    module builds masks with masking_utils. Importing the class costs torch and transformers
    (about 5 s in a shard job that needs neither), so the facts are kept by model type and
    transformers version (snaketune.core.cache)."""
    model_type = config.get("model_type")
    key = f"{FACTS_VERSION}\0{model_type}"
    return remembered("model-classes", key, lambda: _class_facts(model_type))


def _class_facts(model_type: str | None) -> dict[str, Any] | None:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model(model_type))]
    except (KeyError, ValueError):
        return None
    return {
        "name": cls.__name__,
        "position_ids": "position_ids" in inspect.signature(cls.forward).parameters,
        "sdpa": bool(getattr(cls, "_supports_sdpa", True)),
        "flash_attention_2": bool(getattr(cls, "_supports_flash_attn", False)),
        "masking_utils": "masking_utils" in inspect.getsource(inspect.getmodule(cls)),
    }


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
    facts = class_facts(config)
    name = config.get("model_type", "?")
    if facts is None:
        return f"model type {name!r} has no causal-LM class in the installed transformers"
    cls = facts["name"]
    if not facts["position_ids"]:
        return f"{cls} takes no position_ids, so positions cannot restart per example"
    text = config.get("text_config") or config  # a vision-language model's language model
    other = sorted(
        {
            t
            for t in text.get("layer_types") or []
            if t not in ("full_attention", "sliding_attention")
        }
    )
    if other:
        return f"{cls} has {', '.join(other)} layers, which carry state across examples"
    if attention == "flash_attention_2":
        if not facts["flash_attention_2"]:
            return f"{cls} does not support flash attention 2"
        return None
    if not facts["masking_utils"]:
        return (
            f"{cls} does not build its masks with transformers' masking_utils, so "
            f"{attention} attention would cross examples"
        )
    return None


def unpackable(config: dict[str, Any]) -> str | None:
    """Why no attention implementation can pack a model (its config.json as a dict), or
    None: what the checks before queueing refuse (which kernel a GPU node will pick is not
    known there; the train job checks the one it picks)."""
    problems = [packing_problem(config, a) for a in ("sdpa", "flash_attention_2")]
    return problems[0] if all(problems) else None


def resolve_packing(
    packing: bool | str, model_dir: str | Path, attention: str, where: str
) -> tuple[bool, dict[str, Any]]:
    """Whether a run trains packed, and the model's config.json (as a dict) it read for
    :func:`training_kernel`: ``packing: auto`` packs where the model can take packed
    sequences with ``attention`` and pads where it cannot, saying so in one line; ``true``
    refuses a model that cannot (:func:`check_packing`)."""
    if packing != "auto":
        return bool(packing), check_packing(model_dir, attention, where) if packing else {}
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    problem = packing_problem(config, attention)
    if problem:
        name = Path(model_dir).name
        log.info("%s.packing: auto -> padded: %s cannot be packed (%s)", where, name, problem)
        return False, config
    log.info("%s.packing: auto -> packed (%s keeps the examples apart)", where, attention)
    return True, config


def check_packing(model_dir: str | Path, attention: str, where: str) -> dict[str, Any]:
    """Refuse packing for a model that cannot take packed sequences, with the fix; else
    return the model's config.json (as a dict) it read, for :func:`training_kernel`."""
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    problem = packing_problem(config, attention)
    if problem:
        raise UserError(
            f"{where}.packing: {Path(model_dir).name} cannot train on packed sequences with "
            f"{attention} attention ({problem}); set packing: auto (trains it padded) or false"
        )
    return config


def expected_attention(preference: str, model_dir: str | Path | None = None) -> str:
    """The implementation ``auto`` will pick where this runs (for checks before training)."""
    if preference != "auto":
        return preference
    supports = model_supports(model_dir)
    if installed("flash_attn") and "flash_attention_2" in supports:
        return "flash_attention_2"
    return "sdpa" if "sdpa" in supports else "eager"


def model_supports(model_dir: str | Path | None) -> set[str]:
    """The attention implementations the model's class has (eager always; all of them when
    the model is not known here)."""
    every = {"eager", "sdpa", "flash_attention_2"}
    path = Path(model_dir) / "config.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return every
    facts = class_facts(json.loads(path.read_text(encoding="utf-8")))
    if facts is None:
        return every
    return {"eager"} | {k for k in ("sdpa", "flash_attention_2") if facts[k]}


# ----------------------------------------------------------------------------- collation
