"""The model a worker trains: its precision, how it is loaded, the DeepSpeed config as this
machine can run it, what MFU needs, and a fix for DeepSpeed's ZeRO-3 universal load.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from snaketune.core.throughput import FlopsModel, matmul_params, peak_tflops

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_precision(preference: str) -> str:
    """bf16 on GPUs that have it, fp32 on CPU (or what the run forces)."""
    if preference != "auto":
        if preference in ("bf16", "fp16") and not torch.cuda.is_available():
            log.warning("precision %s asked for on CPU: using fp32", preference)
            return "fp32"
        return preference
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def build_model(
    model_dir: Path,
    precision: str,
    attention: str,
    quantize: dict[str, Any] | None = None,
    checkpointing: bool = False,
    device: str | None = None,
    head: str = "lm",
    seed: int | None = None,
):
    """The base model for training (no KV cache: training never reads one, and with one
    transformers would not see packed sequences). With ``quantize`` (snaketune.core.qlora's
    settings) its linear layers are loaded in 4 bits on this process's device and the model
    prepared by peft for k-bit training (the other weights in fp32), on ``device`` (default:
    this rank's GPU, or the CPU). ``head``: ``score`` loads it as a reward model
    (snaketune.evaluation.heads: a causal model gets a new head, drawn from ``seed``)."""
    from snaketune.evaluation import heads

    dtype = DTYPES[precision]
    extra: dict[str, Any] = {}
    if quantize is not None:
        from snaketune.core.qlora import bnb_config, exact_on_cpu

        if device is None:
            gpu = torch.cuda.is_available()
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if gpu else "cpu"
        extra = {"quantization_config": bnb_config(quantize), "device_map": {"": device}}
    model = heads.load(
        model_dir,
        head,
        seed,
        dtype=dtype,
        attn_implementation=attention,
        local_files_only=True,
        **extra,
    )
    model.config.use_cache = False
    if quantize is not None:
        from peft import prepare_model_for_kbit_training

        exact_on_cpu(model)
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    return model


def trainable_in(model, dtype: torch.dtype) -> None:
    """The trainable weights of a quantized model in the run's precision, as loaded. TRL
    casts them to bf16 (the QLoRA paper's choice); DeepSpeed casts them to a 16-bit run's
    precision anyway, and an fp32 run (CPU) needs them fp32 beside its fp32 hidden states.
    The modules trained in full (modules_to_save) get their base module's values back: the
    cast rounded them, and the run would start from a model that is not its base."""
    from peft.utils.other import ModulesToSaveWrapper

    for param in model.parameters():
        if param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)
    for module in model.modules():
        if isinstance(module, ModulesToSaveWrapper):
            for copy in module.modules_to_save.values():
                copy.load_state_dict(module.original_module.state_dict())


def flops_model(run: dict[str, Any], model, world_size: int, lora: bool) -> FlopsModel | None:
    """What MFU needs (on GPU only); ``lora``: the run trains an adapter."""
    if not torch.cuda.is_available():
        return None
    cfg = model.config
    peak = peak_tflops(torch.cuda.get_device_name(), run.get("gpu_peak_tflops"))
    if peak is None:
        log.warning(
            "MFU: peak FLOP/s of %s unknown; set gpu_peak_tflops in the run to report it",
            torch.cuda.get_device_name(),
        )
    return FlopsModel(
        matmul_params(model), cfg.num_hidden_layers, cfg.hidden_size, lora, world_size, peak
    )


def load_deepspeed(path: Path, load_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed JSON for this machine; ``load_universal``: the checkpoint resumed from
    is a universal one (written by another number of ranks: snaketune.train.launch)."""
    config = json.loads(path.read_text())
    if not torch.cuda.is_available():
        # On CPU keep DeepSpeed from building fused GPU kernels; the Trainer's AdamW is used.
        config.pop("optimizer", None)
        zero = config.get("zero_optimization", {})
        for key in ("offload_optimizer", "offload_param"):
            zero.pop(key, None)
        if zero.get("stage") in (1, 2):
            # ZeRO-1/2 allocate their contiguous gradient buckets (reduce_bucket_size
            # elements, two with overlap_comm) at every micro step: cheap from a GPU's
            # caching allocator, a fresh mapping from the CPU's (3-6% of a small model's
            # step, docs/benchmarks.md)
            zero["contiguous_gradients"] = False
    if load_universal:
        config.setdefault("checkpoint", {})["load_universal"] = True
    return config


def untie_optimizer_steps(optimizer) -> int:
    """Give every optimizer state its own ``step`` tensor; returns how many were shared.

    DeepSpeed's ZeRO-3 universal load (0.19) puts one ``step`` tensor object in the state
    of every parameter group, and torch's Adam increments each state's step in place: the
    shared counter then advances once per group and step, and the bias correction of every
    group but the first drifts (measured: losses 1e-3 off four steps after the load)."""
    base = getattr(optimizer, "optimizer", optimizer)
    base = getattr(base, "optimizer", base)  # accelerate's wrapper, then DeepSpeed's
    seen, shared = set(), 0
    for state in getattr(base, "state", {}).values():
        step = state.get("step") if isinstance(state, dict) else None
        if torch.is_tensor(step):
            if id(step) in seen:
                state["step"], shared = step.clone(), shared + 1
            seen.add(id(step))
    return shared


class UniversalLoadFix(TrainerCallback):
    """On a continuation from a universal checkpoint: untie the optimizer steps once the
    checkpoint is loaded, before the first step."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None and untie_optimizer_steps(optimizer):
            log.info("universal checkpoint: the optimizer's shared step counters were untied")


def padded_logits(model, rows: list[dict], pad: int):
    """The logits of ``rows``, right-padded with ``pad`` and masked, one forward pass of
    ``model`` on its device (no gradient)."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), n), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for j, r in enumerate(rows):
        ids[j, : len(r["input_ids"])] = torch.as_tensor(r["input_ids"])
        mask[j, : len(r["input_ids"])] = 1
    from snaketune.data.pictures import inputs_of

    device = next(model.parameters()).device
    pictures = inputs_of(model, rows, ids)  # a picture set's pictures (snaketune.data.pictures)
    with torch.no_grad():
        return model(
            input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False, **pictures
        ).logits
