"""A run's 4-bit base (``lora.quantize: 4bit``, QLoRA): the settings transformers loads it
with (bitsandbytes), the record of what the training job really quantized
(``quantization.json`` in the model folder, then the adapter's), and that base as training
computed with it, for the export.

The model a QLoRA run trains is the *dequantized* 4-bit base plus the adapter: each 4-bit
layer's weight is dequantized to the compute dtype for its matmul. The export reproduces
exactly that: :func:`as_trained` quantizes a base tensor as the training job's load did and
dequantizes it, so the merged model compares with the training job's own probe logits at
the precision's usual tolerance (docs/qlora.md has the measurement behind this choice);
convert_checkpoint's gate loads the base in 4 bits as training did (:func:`bnb_config`).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

RECORD = "quantization.json"
BLOCKSIZE = 64  # transformers' Params4bit default: one absmax per 64 weights
INSTALL = 'pip install -e ".[qlora]"'


def hide_bitsandbytes(needed: bool) -> None:
    """In a process that loads no 4-bit model (``needed`` false), bitsandbytes counts as not
    installed. peft imports it at its own import whenever it is installed (peft.helpers):
    its module, and the line it prints about its CPU kernels, for nothing when the run is
    not QLoRA (its ``torch.compile`` calls, which imported torch's compiler, are deferred
    wherever it loads: snaketune.core.imports). A name marked None in sys.modules is what
    importlib (and so peft's and transformers' checks) reads as absent. Call before peft is
    imported."""
    if not needed and "bitsandbytes" not in sys.modules:
        sys.modules["bitsandbytes"] = None  # type: ignore[assignment]


def saved_quantized(model: Path) -> bool:
    """Whether loading the model folder may need bitsandbytes: its config.json names a
    quantization (a model saved quantized), or there is no config.json to tell (an adapter
    folder, whose base decides)."""
    try:
        return "quantization_config" in json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return True


def needs_bitsandbytes(base: Path, trained: Path | None = None) -> bool:
    """Whether an export or evaluation loads ``base`` quantized: the base saved quantized
    (saved_quantized), or ``trained`` (a training job's model folder or its adapter) holds
    the record of a 4-bit run."""
    return (trained is not None and (trained / RECORD).exists()) or saved_quantized(base)


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a precision's name (bf16, fp16, fp32). torch is imported here, not
    at the top: the workflow reads this module while it builds the DAG (a snakemake call, and
    each SLURM job's), which must not pay torch's import."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def settings(quantization: Mapping[str, Any] | None, precision: str) -> dict[str, Any] | None:
    """How to load a 4-bit base (None: an unquantized base), from a run's ``quantization``
    (snaketune.plan.runspec.RunSpec): bits, 4-bit type, double quantization, the dtype the base
    is loaded in (the run's precision) and the compute dtype (``lora.compute_dtype``,
    `auto`: the precision; a 16-bit one falls back to fp32 without a GPU, as the precision
    does)."""
    if quantization is None:
        return None
    import torch

    compute = quantization["compute_dtype"]
    if compute == "auto" or (compute != "fp32" and not torch.cuda.is_available()):
        compute = precision
    return {
        "bits": 4,
        "quant_type": quantization["quant_type"],
        "double_quant": bool(quantization["double_quant"]),
        "blocksize": BLOCKSIZE,
        "load_dtype": precision,
        "compute_dtype": compute,
    }


def bnb_config(q: dict[str, Any]):
    """transformers' BitsAndBytesConfig of ``settings``; the packed weights are stored in the
    compute dtype, so that ZeRO-3 shards them with the other weights."""
    from transformers import BitsAndBytesConfig

    compute = dtype_of(q["compute_dtype"])
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q["quant_type"],
        bnb_4bit_use_double_quant=q["double_quant"],
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_quant_storage=compute,
    )


def record(model, q: dict[str, Any]) -> dict[str, Any]:
    """What the loaded model holds in 4 bits, read from its modules (not assumed from the
    config): the settings, the quantized linear layers' names, the packed bytes, and the
    linear layers left unquantized (the output layer)."""
    import bitsandbytes as bnb
    import torch

    quantized, packed, left = [], 0, []
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = getattr(module.weight, "quant_state", None)
            if state is None or state.quant_type != q["quant_type"]:
                raise RuntimeError(f"{name}: a 4-bit layer without its {q['quant_type']} state")
            quantized.append(name)
            packed += module.weight.numel() * module.weight.element_size()
        elif isinstance(module, torch.nn.Linear):
            left.append(name)
    if not quantized:
        raise RuntimeError("lora.quantize: 4bit, but the loaded model has no 4-bit layer")
    return {**q, "modules": quantized, "packed_bytes": packed, "unquantized_linears": left}


def describe(rec: dict[str, Any]) -> str:
    """One log line: what is 4-bit, checked on the loaded model."""
    return (
        f"4-bit base: {len(rec['modules'])} linear layers in {rec['quant_type']}"
        f"{' (double quantization)' if rec['double_quant'] else ''}, "
        f"{rec['packed_bytes'] / 2**20:.2f} MiB packed, computing in {rec['compute_dtype']}; "
        f"left in {rec['load_dtype']}: {', '.join(rec['unquantized_linears']) or 'none'}"
    )


def exact_on_cpu(model) -> None:
    """Keep bitsandbytes' CPU inference path off: in eval mode without gradients (the probe,
    GRPO's generation) it repacks each 4-bit weight, once and for good, for a bf16 kernel
    whose results differ (measured: 1e-2 on the demo's logits) from the dequantized
    weight's that training computes with."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def read_record(folder: Path) -> dict[str, Any] | None:
    path = folder / RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def write_record(folder: Path, rec: dict[str, Any]) -> None:
    (folder / RECORD).write_text(json.dumps(rec, indent=2) + "\n")


def quantized_tensors(rec: dict[str, Any]) -> set[str]:
    """The base checkpoint's tensor names of the 4-bit layers' weights."""
    return {f"{name}.weight" for name in rec["modules"]}


def as_trained(tensor: torch.Tensor, rec: dict[str, Any]) -> torch.Tensor:
    """A base weight as the training job computed with it: in the load dtype, quantized
    (bitsandbytes, the run's settings) and dequantized to the compute dtype."""
    import bitsandbytes.functional as bf

    load, compute = dtype_of(rec["load_dtype"]), dtype_of(rec["compute_dtype"])
    packed, state = bf.quantize_4bit(
        tensor.to(load).contiguous(),
        blocksize=rec["blocksize"],
        compress_statistics=rec["double_quant"],
        quant_type=rec["quant_type"],
        quant_storage=compute,
    )
    return bf.dequantize_4bit(packed, state).to(compute)


def already_quantized(config: dict[str, Any]) -> str | None:
    """The quantization method of a model whose config.json says it is already quantized
    (FP8, GPTQ, AWQ, a saved bitsandbytes model): bitsandbytes cannot quantize it again."""
    found = config.get("quantization_config") or config.get("text_config", {}).get(
        "quantization_config"
    )
    if not found:
        return None
    return str(found.get("quant_method") or "unknown")


def missing_bitsandbytes() -> str | None:
    """Why a 4-bit run cannot start here (None: it can)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return f"bitsandbytes is not installed: {INSTALL}"
    return None
