"""LoRA adapters out of a DeepSpeed checkpoint, verified, and merged into their base.

``convert_lora`` writes the adapter (adapter_config.json + adapter_model.safetensors), each
tensor checked non-empty and shaped to fit the base weight it wraps; ``merge_lora`` writes
base + adapter as one model in the export dtype, one base tensor at a time. Both pass the
gate of snaketune.export.convert (the training job's probe logits) before the output is renamed
into place.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from snaketune.core import qlora
from snaketune.core.configfields import experts_of
from snaketune.core.errors import DataError
from snaketune.core.io import atomic_path
from snaketune.evaluation import heads
from snaketune.export.convert import (
    PROCESSOR_FILES,
    TOKENIZER_FILES,
    Finish,
    base_shapes,
    conversion_report,
    copy_files,
    gate,
    gate_written,
    load_model_config,
    loaded_names,
    parse_size,
    probe_logits,
    stop_at_end_of_turn,
    write_shards,
)
from snaketune.export.experts import (
    ExpertPair,
    expert_delta,
    expert_pairs,
    module_of,
    pair_scale,
)
from snaketune.export.zero_checkpoint import ZeroCheckpoint, safetensors_refs
from snaketune.plan.pipeline import TRAIN

log = logging.getLogger(__name__)


def adapter_key(name: str) -> str | None:
    """DeepSpeed/peft training name -> peft's saved adapter key (None: not an adapter tensor):
    ``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight`` and, for an embedding,
    ``...embed_tokens.lora_embedding_A.default`` -> ``...embed_tokens.lora_embedding_A``."""
    if ".modules_to_save." in name:  # a module trained in full: saved under its own name
        return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)
    if ".lora_" not in name:
        return None
    return re.sub(r"\.(lora_[AB]|lora_embedding_[AB])\.[^.]+(\.|$)", r".\1\2", name)


def adapter_target(key: str) -> str:
    """The base weight an adapter tensor wraps (peft's saved key -> base model key)."""
    key = re.sub(r"^base_model\.model\.", "", key)
    return re.sub(r"\.(lora_[AB]\.weight|lora_embedding_[AB])$", ".weight", key)


def is_lora(key: str) -> bool:
    """An adapter's low-rank tensor (else a module trained in full, saved whole)."""
    return ".lora_" in key


def is_embedding(key: str) -> bool:
    return ".lora_embedding_" in key


def lora_delta(key_a: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """The change B @ A makes to the base weight, in the base weight's layout (an
    embedding's adapter is stored transposed: A is (r, vocab), B is (dim, r))."""
    delta = scale * (b.float() @ a.float())
    return delta.T if is_embedding(key_a) else delta


def check_adapter(
    tensors: dict[str, torch.Tensor], base: dict[str, tuple[int, ...]], r: int
) -> None:
    """Every adapter tensor non-empty and shaped to fit the base weight it wraps."""
    if not tensors:
        raise DataError(
            "the checkpoint holds no LoRA tensors (was the run trained with method lora?)"
        )
    for key, t in tensors.items():
        if t.numel() == 0:
            raise DataError(
                f"adapter tensor {key} is empty (shape {tuple(t.shape)}); the adapter was "
                "saved without gathering its ZeRO-3 partitions"
            )
        if is_lora(key) and module_of(key).endswith("experts"):
            continue  # a mixture of experts' fused experts: snaketune.export.experts checks it
        target = adapter_target(key)
        if target not in base:
            raise DataError(f"adapter tensor {key}: the base model has no weight {target}")
        if not is_lora(key):  # a whole module: the base weight's own shape
            if tuple(t.shape) != tuple(base[target]):
                raise DataError(
                    f"adapter tensor {key} has shape {tuple(t.shape)}, the base weight "
                    f"{target} has {base[target]}"
                )
            continue
        out_f, in_f = base[target][0], base[target][-1]
        if is_embedding(key):  # base (vocab, dim): A is (r, vocab), B (dim, r)
            out_f, in_f = in_f, out_f
        want = (r, in_f) if re.search(r"\.lora_(embedding_)?A(\.|$)", key) else (out_f, r)
        if tuple(t.shape) != want:
            raise DataError(
                f"adapter tensor {key} has shape {tuple(t.shape)}, the base weight "
                f"{target} {base[target]} needs {want}"
            )


def convert_lora(
    checkpoint: Path,
    trained: Path,
    base_model: Path,
    out: Path,
    dtype: torch.dtype,
    probe: Path,
    finish: Finish | None = None,
) -> dict:
    """A LoRA run's DeepSpeed checkpoint -> peft adapter directory (only adapter tensors
    read). A reward model's adapter (peft's SEQ_CLS) carries its score head whole."""
    from transformers.utils import logging as hf_logging

    from snaketune.core.lora_targets import load_adapter

    hf_logging.disable_progress_bar()
    ckpt = ZeroCheckpoint(checkpoint)
    adapter_config = json.loads((trained / "adapter_config.json").read_text())
    head = heads.adapter_head(adapter_config)
    tensors = {}
    for name, tensor in ckpt.tensors():
        key = adapter_key(name)
        if key is not None:
            tensors[key] = tensor.to(dtype).contiguous()
    check_adapter(tensors, shapes_with_head(base_model, head), adapter_config["r"])
    with atomic_path(out) as tmp:
        tmp.mkdir()
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        copy_files(("adapter_config.json", qlora.RECORD, *TOKENIZER_FILES), trained, tmp)
        model = load_adapter(gate_base(base_model, head, dtype, qlora.read_record(trained)), tmp)
        data = load_file(str(probe))
        diff = gate(probe_logits(model, data), data, dtype, str(out))
        report = conversion_report("lora", ckpt, len(tensors), diff)
        if finish is not None:
            finish(tmp, report)
    return report


def gate_base(base_model: Path, head: str, dtype: torch.dtype, quantized: dict | None):
    """The base the adapter's gate computes on: memory-mapped in the export dtype, or for a
    4-bit run (``quantized``: its record) loaded in 4 bits with the run's settings, as the
    training job loaded it, on this CPU: what the 4-bit model weighs (0.5 bytes a linear
    weight), not the base dequantized (2 bytes), and each layer computes with its weight
    dequantized to the compute dtype, as training did (snaketune.core.qlora.exact_on_cpu)."""
    if quantized is None:
        return heads.load(base_model, head, dtype=dtype, local_files_only=True)
    base = heads.load(
        base_model,
        head,
        dtype=qlora.dtype_of(quantized["load_dtype"]),
        quantization_config=qlora.bnb_config(quantized),
        device_map={"": "cpu"},
        local_files_only=True,
    )
    qlora.exact_on_cpu(base)
    loaded = qlora.record(base, quantized)["modules"]
    if sorted(loaded) != sorted(quantized["modules"]):
        raise DataError(
            f"{base_model}: loaded in 4 bits, its 4-bit layers are not the ones the run "
            f"recorded ({len(loaded)} against {len(quantized['modules'])})"
        )
    return base


def shapes_with_head(base_model: Path, head: str) -> dict[str, tuple[int, ...]]:
    """The base's tensor shapes, and those a reward model's score head adds to them."""
    config = json.loads((base_model / "config.json").read_text())
    names = loaded_names(base_model)  # the adapter names the modules as loaded
    shapes = {names.get(k, k): v for k, v in base_shapes(base_model).items()}
    return {**shapes, **heads.added_shapes(head, config)}


def lora_scale(adapter_config: dict) -> float:
    """peft's scaling of B @ A: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    r, alpha = adapter_config["r"], adapter_config["lora_alpha"]
    return alpha / r**0.5 if adapter_config.get("use_rslora") else alpha / r


@dataclass
class Adapter:
    """A LoRA adapter's tensors by the base tensor each changes: (A, B) pairs and the
    modules trained in full (modules_to_save), with its scale."""

    pairs: dict[str, tuple[str, torch.Tensor, torch.Tensor]]
    whole: dict[str, torch.Tensor]
    scale: float
    experts: dict[str, ExpertPair]  # a mixture of experts' fused experts, by base tensor
    experts_count: int = 0
    head: str = "lm"  # score: a reward model's (its score head among ``whole``)

    def added(self, refs: dict) -> dict[str, torch.Tensor]:
        """The tensors the merged model has and the base has not (a new score head)."""
        return {name: t for name, t in self.whole.items() if name not in refs}

    @classmethod
    def read(cls, adapter: Path, base_model: Path) -> Adapter:
        config = json.loads((adapter / "adapter_config.json").read_text())
        if config.get("fan_in_fan_out"):
            raise DataError(f"{adapter}: fan_in_fan_out adapters are not supported by merge_lora")
        lora = load_file(str(adapter / "adapter_model.safetensors"))
        shapes = shapes_with_head(base_model, heads.adapter_head(config))
        check_adapter(lora, shapes, config["r"])
        model_config = json.loads((base_model / "config.json").read_text())
        model_config = model_config.get("text_config", model_config)
        experts = expert_pairs(lora, model_config, lambda kind: pair_scale(config, kind), shapes)
        saved = {v: k for k, v in loaded_names(base_model).items()}  # the merge's names
        pairs = {}
        for key, a in lora.items():
            if (".lora_A." in key or key.endswith(".lora_embedding_A")) and not module_of(
                key
            ).endswith("experts"):
                b = lora[re.sub(r"_A(\.weight)?$", r"_B\1", key)]
                target = adapter_target(key)
                pairs[saved.get(target, target)] = (key, a, b)
        whole = {
            saved.get(adapter_target(key), adapter_target(key)): t
            for key, t in lora.items()
            if not is_lora(key)
        }
        return cls(
            pairs,
            whole,
            lora_scale(config),
            experts,
            experts_of(model_config),
            heads.adapter_head(config),
        )


def merged_tensors(
    refs: dict, adapter: Adapter, quantized: dict | None, change: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base's tensors (``refs``, read one at a time) with the adapter merged in: a
    4-bit run's quantized tensors as that run computed with them, a tensor trained in full
    replaced, a LoRA pair's update added. ``change`` counts the merged tensors and their
    largest change."""
    as_trained = qlora.quantized_tensors(quantized) if quantized else set()
    cache: dict = {}  # the experts' changes of the module being written
    # pread, not safe_open: a memory map would keep every page of the base resident
    for name, ref in refs.items():
        t = ref.read().view(ref.shape)
        if name in as_trained:
            t = qlora.as_trained(t, quantized)
        if name in adapter.whole:  # trained in full (modules_to_save): the copy replaces it
            new = adapter.whole[name].to(t.dtype)
            change["max_abs"] = max(change["max_abs"], (new.float() - t.float()).abs().max().item())
            change["merged"] += 1
            t = new
        elif name in adapter.pairs or name in adapter.experts:
            if name in adapter.pairs:
                delta = lora_delta(*adapter.pairs[name], adapter.scale)
            else:
                delta = expert_delta(name, adapter.experts[name], adapter.experts_count, cache)
            change["max_abs"] = max(change["max_abs"], delta.abs().max().item())
            change["merged"] += 1
            t = t.float() + delta
        yield name, t
    for name, t in adapter.added(refs).items():  # after the base's, as merge_lora plans them
        change["merged"] += 1
        yield name, t


def write_config(
    config, dtype: torch.dtype, head: str, adapter: Path, base_model: Path, tmp: Path
) -> str | None:
    """The merged model's config (a reward model's: the sequence classifier the adapter
    was trained as), tokenizer and generation config; what stop_at_end_of_turn did."""
    config.dtype = str(dtype).removeprefix("torch.")
    if not heads.generates(head):
        heads.as_scorer(config, heads.pad_id_of(adapter))
    config.save_pretrained(tmp)
    copy_files(TOKENIZER_FILES, adapter, tmp)
    if not heads.generates(head):  # a reward model generates nothing
        return None
    copy_files(("generation_config.json", *PROCESSOR_FILES), base_model, tmp)
    return stop_at_end_of_turn(tmp)


def unchanged(adapter: Path) -> DataError:
    """An adapter whose every B @ A is zero: the line, with its training's warning."""
    from snaketune.train.vitals import read

    warned = list(read(Path(adapter).parent / TRAIN.folder).values())
    cause = f" Its training warned: {warned[0]}" if warned else " Was the adapter trained?"
    return DataError(
        f"{adapter}: the adapter changes nothing (every B @ A is zero); the merged "
        f"model would equal the base.{cause}"
    )


def merge_lora(
    base_model: Path,
    adapter: Path,
    out: Path,
    dtype: torch.dtype,
    max_shard_size: str,
    probe: Path,
    finish: Finish | None = None,
) -> dict:
    """Base model + LoRA adapter -> one HF model directory, one base tensor at a time.

    Gates: every adapter tensor non-empty; the merged weights differ from the base; the
    merged model's logits on the probe inputs equal the base-with-adapter logits (the
    training job's probe logits). The adapter of a 4-bit run (its quantization.json) is
    merged into the base as that run computed with it: quantized and dequantized again
    (snaketune.core.qlora), written in ``dtype``, never in 4 bits.
    """
    lora = Adapter.read(adapter, base_model)
    change = {"max_abs": 0.0, "merged": 0}
    # a 4-bit run trained the dequantized base: merged into that, it is the model trained
    quantized = qlora.read_record(adapter)
    refs = {
        name: ref
        for f in sorted(base_model.glob("*.safetensors"))
        for name, ref in safetensors_refs(f).items()
        if lora.head == "lm" or not name.startswith("lm_head.")  # a reward model: no LM head
    }
    merged = merged_tensors(refs, lora, quantized, change)
    with ThreadPoolExecutor(1) as pool, atomic_path(out) as tmp:
        base_config = pool.submit(load_model_config, base_model)
        tmp.mkdir()
        plan = [(name, ref.shape, ref.dtype) for name, ref in refs.items()]
        plan += [(name, tuple(t.shape), t.dtype) for name, t in lora.added(refs).items()]
        write_shards(plan, merged, tmp, parse_size(max_shard_size), dtype)
        if change["max_abs"] == 0.0:
            raise unchanged(adapter)
        stops = write_config(base_config.result(), dtype, lora.head, adapter, base_model, tmp)
        # The reference is the training job's probe logits: base + this adapter, as
        # convert_checkpoint's gate verified with peft, so no second model is loaded here.
        diff = gate_written(
            tmp,
            dtype,
            parse_size(max_shard_size),
            load_file(str(probe)),
            f"{out} (vs base + adapter)",
        )
        report = {
            "merged_tensors": change["merged"],
            "max_weight_change": change["max_abs"],
            "max_logit_diff": diff,
            "generation_config": stops,
        }
        if finish is not None:
            finish(tmp, report)
    return report
