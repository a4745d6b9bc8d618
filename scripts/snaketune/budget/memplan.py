"""Will a run fit on its GPUs? A per-GPU memory estimate from the model's config.json alone.

Per GPU, for N GPUs in all, P parameters, T of them trained (all of them for full
fine-tuning; the adapters' for LoRA), w bytes per 16-bit (or 32-bit) weight:

- weights: w·P, ZeRO-3: w·P/N plus the largest layer gathered (4 bytes per parameter of
  it, DeepSpeed's own figure); ZeRO-3 with parameter offload: only the gathered layer;
- gradients: (w + 4)·T (16-bit and fp32 copies; fp32 training: 4·T), divided by N from
  ZeRO-2 on; ZeRO-3: 4·T/N (the 16-bit gradients are reduce-scattered in buckets straight
  into the fp32 partition); 0 with optimizer offload (reduced to CPU in buckets); under
  ZeRO-2 with one micro batch a step they are made as backward frees the activations, so
  the smaller of the two is taken off (``not_at_once``);
- optimizer: Adam's two fp32 moments and the fp32 master weights, 12·T (fp32 training
  without ZeRO: 8·T; a ZeRO optimizer copies even fp32 weights into its partition), divided
  by N from ZeRO-1 on; 0 with optimizer offload (then in CPU memory);
- activations: tokens of a micro batch (micro_batch_size x max_length, the worst case packed
  or not) x per layer (8h + 4·kv + 4·I)·w bytes (the tensors a Llama-shaped decoder layer
  keeps for backward), for every layer without gradient checkpointing, or the layer inputs
  (h·w per token per layer) plus one layer recomputed with it; eager attention adds its
  micro x heads x max_length^2 score and probability matrices per attention layer, a
  sliding-window layer's too (transformers' eager kernel applies the window as a mask on
  the whole matrix), none per linear-attention layer (the config's layer_types); the
  logits add
  tokens x vocab x (w + 8) bytes (16-bit logits, the fp32 copy the loss takes and its
  gradient), none with Liger's fused linear cross-entropy; with ``sequence_parallel: N``
  each GPU holds 1/N of the tokens (and of their logits); weights, gradients and optimizer
  states are not split by it;
- GRPO: sequences are prompt and completion (max_length + max_completion_length tokens);
  training keeps the activations of micro_batch_size completions of that length and the
  logits of their completion tokens; generating them (without vLLM) holds a KV cache of
  2 x layers x kv x w bytes per token (linear-attention layers keep a fixed state, not
  counted), which is freed before the training pass (the larger
  of the two counts); full fine-tuning with beta > 0 holds a frozen reference copy (w·P,
  divided by N under ZeRO-3); with vLLM (use_vllm true or auto) its share of each GPU
  (vllm_gpu_memory_utilization x the GPU's memory) holds its weights and KV cache;
- DPO: a micro batch of n pairs is 2n sequences (chosen and rejected sides); full
  fine-tuning with reference: live holds a frozen reference copy as GRPO's; a precomputed
  reference (rule reference_logps) and a LoRA run's (the adapter off) hold none. The
  logits are counted in full, though TRL scores DPO through a chunked LM head (an
  overcount: the plan errs on the side of fitting);
- a 4-bit base (lora.quantize, QLoRA): the decoder's linear weights take 0.5 bytes each
  plus their quantization constants (an fp32 absmax per 64 weights, 1/16 byte; with double
  quantization an 8-bit one, 1/64 byte, and an fp32 per 256 blocks), divided by N under
  ZeRO-3; the other weights (embeddings, output layer, norms) stay at w bytes; the
  activations add the largest 4-bit layer dequantized for its matmul (w bytes a weight);
- margin: 1.5 GiB for the CUDA context and NCCL buffers, plus 10% of the rest for
  fragmentation.

The model-state figures (weights, gradients, optimizer) are DeepSpeed's own estimators'
(``estimate_zero2_model_states_mem_needs``, ``estimate_zero3_model_states_mem_needs``;
tests/test_memplan.py checks them within 10%). CPU memory per node is what offload needs
(DeepSpeed's 1.5 buffer factor included) or, without offload, what loading the model takes
in every process of the node (``cpu_per_node``: a 4-bit base streams onto the GPUs); the
check before queueing compares it with the train job's memory (mem_mb).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The model's shape (every parameter of a dense model or a mixture of experts) lives in
# snaketune.core.modelshape; the plans import it from here too.
from snaketune.core.errors import UserError
from snaketune.core.modelshape import LINEARS, REQUIRED, SAVED_BYTES, Shape  # noqa: F401

GIB = 1024**3
# Usable memory of each GPU, GiB (what the driver reports, a little under the name's figure).
GPUS: dict[str, float] = {
    "a100-40gb": 39.4,
    "a100-64gb": 63.4,  # Leonardo's A100 64 GB
    "a100-80gb": 79.2,
    "h100-80gb": 79.6,
    "h200-141gb": 139.8,
    "l40s-48gb": 44.4,
}


def gpu_memory(name_or_gib: str | float | None) -> float | None:
    """GiB of one GPU from a table name (``h100-80gb``) or a number; None: not set."""
    if name_or_gib is None:
        return None
    if isinstance(name_or_gib, int | float):
        return float(name_or_gib)
    try:
        return GPUS[str(name_or_gib).lower()]
    except KeyError:
        raise UserError(
            f"gpu: {name_or_gib!r} is not a known GPU ({', '.join(GPUS)}); give one of them "
            "or its memory in GiB (e.g. gpu: 94)"
        ) from None


CONTEXT_GIB = 1.5
FRAGMENTATION = 0.10
BUFFER = 1.5  # DeepSpeed's additional_buffer_factor for CPU memory


@dataclass(frozen=True)
class Setup:
    """The run settings the estimate depends on."""

    adapter: str  # what trains: full (every weight) or lora
    stage: int  # ZeRO stage
    offload_optimizer: bool
    offload_params: bool
    nodes: int
    gpus_per_node: int
    micro_batch_size: int
    max_length: int
    gradient_checkpointing: bool
    attention: str  # eager, sdpa, flash_attention_2 (auto: sdpa or flash, no max_length^2)
    liger: bool
    bytes_per_weight: int  # 2 (bf16/fp16) or 4 (fp32)
    lora_r: int = 0
    lora_targets: Any = "all-linear"
    lora_saved: tuple[str, ...] = ()
    lora_router: bool = False  # a mixture of experts' routers adapted too (lora.adapt_router)
    lora_vision: bool = False  # a vision-language model's towers adapted too (lora.adapt_vision)
    completion_length: int = 0  # GRPO: max_completion_length (0: not GRPO)
    # a frozen copy of the model: GRPO full fine-tuning with beta > 0, DPO full fine-tuning
    # with reference: live
    reference: bool = False
    vllm_share: float = 0.0  # GRPO with vLLM: its share of each GPU's memory
    quantized: bool = False  # a 4-bit base (lora.quantize: 4bit)
    double_quant: bool = True  # its quantization constants quantized too
    merged: bool = True  # a LoRA run writes its merged model (export.merged)
    sequence_parallel: int = 1  # GPUs sharing each sequence: activations and logits split
    reward_model_params: int = 0  # GRPO's "model:<run>" rewards: held whole on every GPU
    # on-policy distillation's live teacher: whole on every GPU, or sharded over them (ZeRO-3)
    teacher_params: int = 0
    accumulation: int = 1  # micro batches per optimizer step (gradient_accumulation_steps)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def sequence(self) -> int:
        """Tokens of one sequence: max_length, or for GRPO prompt and completion."""
        return self.max_length + self.completion_length


def trained_params(shape: Shape, s: Setup) -> int:
    """T: a LoRA run's adapter parameters (and modules_to_save)."""
    return shape.lora_params(s.lora_r, s.lora_targets, s.lora_saved, s.lora_router, s.lora_vision)


def stored_weights(shape: Shape, s: Setup) -> float:
    """Bytes of the frozen and trained weights as a run holds them, all of them: w bytes a
    weight, or for a 4-bit base its decoder linears in 4 bits with their constants."""
    w, p = s.bytes_per_weight, shape.params
    if s.quantized:
        return w * (p - shape.linear_params) + quant_bytes(s.double_quant) * shape.linear_params
    return w * p


def model_states(shape: Shape, s: Setup) -> dict[str, float]:
    """Bytes per GPU of weights, gradients and optimizer states."""
    n, w, p = s.gpus, s.bytes_per_weight, shape.params
    t = p if s.adapter == "full" else trained_params(shape, s)
    mixed = w == 2
    base = stored_weights(shape, s)
    if s.stage >= 3:
        gathered = 4 * shape.largest_layer
        weights = gathered if s.offload_params else gathered + base / n
    else:
        weights = base
    # ZeRO-3 reduce-scatters the 16-bit gradients in buckets into the fp32 partition
    grad_bytes = (w + 4) if mixed and s.stage < 3 else 4
    grads = 0.0 if s.offload_optimizer else grad_bytes * t / (n if s.stage >= 2 else 1)
    # Adam's moments and the fp32 master weights: a ZeRO optimizer keeps its fp32 partition
    # as a copy even of fp32 weights (stage 0 in fp32 steps the weights themselves)
    optim_bytes = 12 if mixed or s.stage >= 1 else 8
    optim = 0.0 if s.offload_optimizer else optim_bytes * t / (n if s.stage >= 1 else 1)
    return {"weights": weights, "gradients": grads, "optimizer": optim}


def quant_bytes(double_quant: bool) -> float:
    """Bytes per 4-bit weight with its constants (bitsandbytes' blocks of 64): the packed
    half byte, an fp32 absmax per block, or with double quantization an 8-bit absmax per
    block and an fp32 constant per 256 blocks."""
    return 0.5 + (1 / 64 + 4 / (64 * 256) if double_quant else 4 / 64)


def activations(shape: Shape, s: Setup) -> float:
    """Bytes per GPU of what forward keeps for backward (and the logits); for GRPO the
    larger of that and the KV cache of generating the completions (without vLLM)."""
    w, h, kv = s.bytes_per_weight, shape.hidden, shape.kv_width // 2
    tokens = s.micro_batch_size * s.sequence / s.sequence_parallel  # this GPU's slice
    layer = tokens * (8 * h + 4 * kv + 4 * shape.ffn_width) * w
    kinds = shape.attention_layers  # eager attention's scores: by each layer's attention
    # the eager kernel masks a sliding window on the whole matrix: as a full layer's
    scores = {"full": s.sequence**2, "sliding": s.sequence**2, "linear": 0}
    eager = 2 * s.micro_batch_size * shape.heads * w if s.attention == "eager" else 0
    if s.gradient_checkpointing:
        one = max(scores[k] for k, n in kinds.items() if n)
        kept = shape.layers * tokens * h * w + layer + eager * one
    else:
        kept = shape.layers * layer + eager * sum(n * scores[k] for k, n in kinds.items())
    if s.quantized:  # one 4-bit layer dequantized for its matmul at a time
        kept += w * max(i * o for i, o in shape.linear_shapes().values())
    scored = s.micro_batch_size * s.completion_length if s.completion_length else tokens
    logits = 0 if s.liger else scored * shape.vocab * (w + 8)
    if s.completion_length and not s.vllm_share:
        kv_cache = (shape.layers - kinds["linear"]) * shape.kv_width * w * tokens
        return max(kept + logits, kv_cache)
    return kept + logits


def not_at_once(parts: dict[str, float], s: Setup) -> float:
    """Bytes of the gradients and the activations never held together: under ZeRO-2 with one
    micro batch a step, backward makes each layer's gradients as it frees that layer's
    activations, so the peak is the larger of the two (the activations at the start of
    backward, measured on an H200: docs/benchmarks.md), not their sum; with gradient
    accumulation the gradients of the earlier micro batches stay beside the next one's
    activations (counted together). ZeRO-3 keeps a flat gradient partition from the start
    and ZeRO-0/1 fp32 gradients from the first step: counted together as well."""
    if s.stage != 2 or s.accumulation > 1 or s.offload_optimizer:
        return 0.0
    return min(parts["gradients"], parts["activations"])


def reference_copy(shape: Shape, s: Setup) -> float:
    """Bytes per GPU of a frozen reference model (full fine-tuning: GRPO with beta > 0, DPO
    with a live reference)."""
    if not s.reference:
        return 0.0
    return s.bytes_per_weight * shape.params / (s.gpus if s.stage >= 3 else 1)


def cpu_per_node(shape: Shape, s: Setup) -> float:
    """Bytes of CPU memory per node a run's processes hold of their own (the checkpoint's
    memory-mapped pages, shared by the node's processes and reclaimable, left out), by how
    the model reaches the GPUs (bench/load_memory.py measured the CPU side): offloaded
    states (DeepSpeed's buffer factor included); a checkpoint loaded in its own dtype, or a
    4-bit base loaded straight onto the GPU (device_map), stays mapped until each tensor is
    moved: the largest layer per process; else each process converts the whole model to w
    bytes a weight before DeepSpeed moves it (the worker builds the model before the
    trainer, so ZeRO-3 does not partition the load)."""
    p, t = shape.params, shape.params if s.adapter == "full" else 0
    if s.offload_optimizer or s.offload_params:
        states = 16 * t if s.offload_optimizer else 0
        states += 2 * p if s.offload_params else 0
        return states / s.nodes * BUFFER
    if s.quantized or shape.saved_bytes == s.bytes_per_weight:
        return shape.largest_layer * s.bytes_per_weight * s.gpus_per_node
    return p * s.bytes_per_weight * s.gpus_per_node


def cpu_why(shape: Shape, s: Setup) -> str:
    """What ``cpu_per_node`` counts for ``s``, in words."""
    if s.offload_optimizer or s.offload_params:
        return "the states offloaded to CPU memory, DeepSpeed's buffers included"
    if s.quantized:
        return (
            f"a 4-bit base streams onto the GPUs: the largest layer at a time in each of "
            f"{s.gpus_per_node} process(es)"
        )
    if shape.saved_bytes == s.bytes_per_weight:
        return (
            f"the checkpoint, saved in the run's precision, stays memory-mapped (shared, "
            f"reclaimable) until moved to the GPUs: the largest layer at a time in each of "
            f"{s.gpus_per_node} process(es)"
        )
    return (
        f"each of {s.gpus_per_node} process(es) converts the whole model to "
        f"{s.bytes_per_weight} bytes a weight before DeepSpeed moves it to its GPU"
    )


def estimate(shape: Shape, s: Setup, gpu_gib: float | None = None) -> dict[str, float]:
    """GiB per GPU: each part, the margin and the total (vLLM's share needs ``gpu_gib``)."""
    parts = {**model_states(shape, s), "activations": activations(shape, s)}
    if s.reference:
        parts["reference"] = reference_copy(shape, s)
    if s.reward_model_params:  # whole on every GPU, in the run's precision
        parts["reward_models"] = float(s.reward_model_params * s.bytes_per_weight)
    if s.teacher_params:  # in the run's precision; ZeRO-3 shards it as it does the student
        held = s.teacher_params / (s.gpus if s.stage == 3 else 1)
        parts["teacher"] = float(held * s.bytes_per_weight)
    overlap = not_at_once(parts, s)
    if overlap:
        parts["not_at_once"] = -overlap
    body = sum(parts.values())
    parts["margin"] = CONTEXT_GIB * GIB + FRAGMENTATION * body
    if s.vllm_share and gpu_gib is not None:
        parts["vllm"] = s.vllm_share * gpu_gib * GIB
    gib = {k: v / GIB for k, v in parts.items()}
    gib["total"] = sum(gib.values())
    return {k: round(v, 2) for k, v in gib.items()}
