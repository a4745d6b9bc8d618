"""DeepSpeed checkpoint -> Hugging Face model directory or LoRA adapter, verified.

Weights are consolidated one parameter at a time (snaketune.export.zero_checkpoint) and written as
safetensors shards of at most ``max_shard_size`` bytes, so peak memory is set by the shard
size, not the model size. Before the output is renamed into place, a gate loads it with
transformers (and peft for adapters) and compares its logits on the training job's probe
inputs with the logits the job recorded; a mismatch fails with the size of the difference.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import math
import shutil
import struct
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from snaketune.core.errors import DataError
from snaketune.core.io import atomic_path, parse_size
from snaketune.evaluation import heads
from snaketune.export.zero_checkpoint import ST_NAMES, ZeroCheckpoint, safetensors_refs

log = logging.getLogger(__name__)

# Max |logit difference| accepted by the gates, by the dtype the model is compared in.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# A vision-language base's processor: copied from the base beside the exported model.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
)


# Called with the finished temporary directory and the stage's report, before the rename.
Finish = Callable[[Path, dict], None]

# What training switches on in the model's config and an exported model must not carry, with
# the value a config without the key means: the trainer's ``use_cache`` (transformers'
# TrainingArguments.use_cache, False: generation without a KV cache, each token recomputing
# the whole sequence) and a mixture of experts' router logits (the Router of
# snaketune.methods.training: on, transformers' generate on a padded batch fails in its
# load-balancing loss).
TRAINING_SWITCHES = {"use_cache": True, "output_router_logits": False}


def inference_settings(config, base_model: Path) -> dict[str, object]:
    """``config`` (the trained model's, changed in place) with each of TRAINING_SWITCHES it has
    set back to the base model's value (its config.json; the key's meaning when absent);
    returns what changed, for the report."""
    base = json.loads((base_model / "config.json").read_text())
    restored = {}
    for key, absent in TRAINING_SWITCHES.items():
        want = base.get(key, absent)
        if hasattr(config, key) and getattr(config, key) != want:
            setattr(config, key, want)
            restored[key] = want
    return restored


def export_dtype(choice: str, probe: Path) -> torch.dtype:
    """The output dtype: as asked, or (auto) the precision the run trained in."""
    if choice != "auto":
        return DTYPES[choice]
    with safe_open(str(probe), framework="pt") as st:
        precision = (st.metadata() or {}).get("precision", "fp32")
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


PlanEntry = tuple[str, tuple[int, ...], torch.dtype]  # name, shape, dtype as read


def write_shards(
    plan: Sequence[PlanEntry],
    tensors: Iterable[tuple[str, torch.Tensor]],
    out: Path,
    max_bytes: int,
    dtype: torch.dtype,
    prefix: str = "model",
) -> dict[str, str]:
    """Write ``tensors`` as safetensors shards of at most ``max_bytes``; return the weight map.

    ``plan`` lists the tensors ``tensors`` will yield, in order. The shard headers are
    computed from it first, so each tensor goes to disk as soon as it arrives and only it
    is held in memory (not a whole shard). Floating tensors are cast to ``dtype``. One shard
    is written as ``model.safetensors``; several as ``model-0000k-of-0000n.safetensors``
    with a ``model.safetensors.index.json``, as transformers writes them.
    """
    if not plan:
        raise DataError("the checkpoint holds no tensors")
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = [[]]
    size = 0
    for name, shape, src in plan:
        kind = dtype if src.is_floating_point else src
        nbytes = math.prod(shape) * kind.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tuple(shape), kind, nbytes))
        size += nbytes
    names = (
        [f"{prefix}.safetensors"]
        if len(shards) == 1
        else [f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    stream = iter(tensors)
    for file, entries in zip(names, shards, strict=True):
        head = shard_header(entries)
        with open(out / file, "wb") as fh:
            fh.write(struct.pack("<Q", len(head)) + head)
            for name, shape, kind, _ in entries:
                got, tensor = next(stream, (None, None))
                if got != name or tuple(tensor.shape) != shape:
                    raise RuntimeError(f"write_shards: expected {name} {shape}, got {got}")
                tensor = tensor.to(kind).contiguous().reshape(-1)
                if tensor.numel():
                    fh.write(tensor.view(torch.uint8).numpy())
    if next(stream, None) is not None:
        raise RuntimeError("write_shards: more tensors than planned")
    weight_map = {name: file for file, es in zip(names, shards, strict=True) for name, *_ in es}
    if len(shards) > 1:
        total = sum(e[3] for es in shards for e in es)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def shard_header(entries: list[tuple[str, tuple[int, ...], torch.dtype, int]]) -> bytes:
    """A safetensors file's header for ``entries`` (name, shape, dtype, bytes) in order,
    padded to 8 bytes as safetensors writes it."""
    header: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, shape, kind, nbytes in entries:
        header[name] = {
            "dtype": ST_NAMES[kind],
            "shape": list(shape),
            "data_offsets": [pos, pos + nbytes],
        }
        pos += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    return head + b" " * (-len(head) % 8)


def base_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a model directory's safetensors files (headers only)."""
    shapes = {
        name: ref.shape
        for f in sorted(model_dir.glob("*.safetensors"))
        for name, ref in safetensors_refs(f).items()
    }
    if not shapes:
        raise DataError(f"{model_dir}: no safetensors weights")
    return shapes


@functools.lru_cache(maxsize=4)  # the converter and the merge ask twice: one meta model
def loaded_names(model_dir: Path) -> dict[str, str]:
    """The checkpoint's tensor names that transformers loads under another name (a
    vision-language model saved in its family's published layout: Gemma 3's
    ``language_model.model.*`` is ``model.language_model.*`` once loaded), each to the
    loaded name; empty for a model loaded under its checkpoint's names. The adapters name
    the loaded modules; the merge writes the checkpoint's names."""
    if not heads.is_vision_language(model_dir):
        return {}  # imports nothing more (the merge's reader thread imports as it did)
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    with torch.device("meta"):
        model = heads.auto_class("lm", model_dir).from_config(AutoConfig.from_pretrained(model_dir))
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    state = model.state_dict()
    out = {}
    for key in base_shapes(model_dir):
        new, _ = rename_source_key(key, renamings, [], model.base_model_prefix, state)
        if new != key:
            out[key] = new
    return out


def gate_written(model_dir: Path, dtype: torch.dtype, budget: int, probe: dict, what: str) -> float:
    """Load the model just written within about ``budget`` bytes (accelerate keeps the
    layers that do not fit on disk and loads each only for its forward pass) and gate its
    probe logits; return the max difference."""
    trim_heap()
    scratch = model_dir / ".offload"
    model = heads.auto_class(heads.head_of(model_dir), model_dir).from_pretrained(
        model_dir,
        dtype=dtype,
        device_map="auto",
        max_memory={"cpu": budget},
        offload_folder=str(scratch),
        local_files_only=True,
    )
    diff = gate(probe_logits(model, probe), probe, dtype, what)
    del model
    shutil.rmtree(scratch, ignore_errors=True)
    return diff


def trim_heap() -> None:
    """Give the heap's freed pages back to the OS (glibc keeps them after large tensors
    are freed, so the gate's load would come on top of the writer's high-water mark)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def probe_logits(model, probe: dict[str, torch.Tensor]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=probe["input_ids"]).logits.float()


def gate(
    logits: torch.Tensor, probe: dict[str, torch.Tensor], dtype: torch.dtype, what: str
) -> float:
    """Fail unless ``logits`` match the training job's probe logits; return the max diff.
    The tolerance is relative: TOLERANCE times the largest reference logit (at least 1),
    as rounding error grows with the logits' size."""
    diff = (logits - probe["logits"]).abs().max().item()
    tol = TOLERANCE[dtype] * max(1.0, probe["logits"].abs().max().item())
    if not diff <= tol:
        raise DataError(
            f"{what}: logits on the probe inputs differ from the reference by {diff:.3g} "
            f"(tolerance {tol:g} in {str(dtype).removeprefix('torch.')}); the output is wrong"
        )
    log.info("%s: probe logits match the reference within %.3g (tolerance %g)", what, diff, tol)
    return diff


def copy_files(names: Iterable[str], src: Path, dst: Path) -> None:
    for name in names:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def load_model_config(model_dir: Path):
    """The model's config, with the modules the gate's load needs already imported.

    Run in a thread while the shards are written: importing transformers and the model's
    modules takes seconds of Python, and file writes release the GIL, so the two overlap.
    """
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    auto = heads.auto_class(heads.head_of(model_dir), model_dir)
    auto._model_mapping[type(config)]  # noqa: B018 -- imports the modeling module
    return config


def stop_at_end_of_turn(model_dir: Path) -> str | None:
    """The exported model stops where its chat template ends an assistant turn (Qwen base
    models stop on <|endoftext|>, their template ends a turn with <|im_end|>): see
    snaketune.data.tokenization.add_end_of_turn. Logged and recorded in the report."""
    from snaketune.data.tokens import add_end_of_turn

    done = add_end_of_turn(model_dir)
    if done:
        log.warning("%s", done)
    return done


def conversion_report(kind: str, ckpt: ZeroCheckpoint, tensors: int, diff: float) -> dict:
    """What convert_checkpoint prints and records: the checkpoint's shape and the gate."""
    return {
        "kind": kind,
        "zero_stage": ckpt.stage,
        "ranks": ckpt.world,
        "tensors": tensors,
        "max_logit_diff": diff,
    }


def convert_full(
    checkpoint: Path,
    trained: Path,
    base_model: Path,
    out: Path,
    max_shard_size: str,
    dtype: torch.dtype,
    probe: Path,
    finish: Finish | None = None,
) -> dict:
    """A full fine-tune's DeepSpeed checkpoint -> HF model directory, with the base model's
    inference settings (``inference_settings``).

    ``finish(tmp, report)`` runs on the complete directory before it is renamed into place
    (the scripts write provenance.json there)."""
    ckpt = ZeroCheckpoint(checkpoint)
    # A tied lm_head (tie_word_embeddings) is recorded by DeepSpeed as shared with the input
    # embeddings; it is left out and transformers ties it again on load.
    plan = [entry for entry in ckpt.plan() if entry[0] not in ckpt.shared]
    weights = ((name, t) for name, t in ckpt.tensors() if name not in ckpt.shared)
    with ThreadPoolExecutor(1) as pool, atomic_path(out) as tmp:
        config = pool.submit(load_model_config, trained)
        tmp.mkdir()
        weight_map = write_shards(plan, weights, tmp, parse_size(max_shard_size), dtype)
        copy_files(CONFIG_FILES + TOKENIZER_FILES, trained, tmp)
        copy_files(PROCESSOR_FILES, base_model, tmp)
        config = config.result()
        config.dtype = str(dtype).removeprefix("torch.")
        restored = inference_settings(config, base_model)
        config.save_pretrained(tmp)
        # a reward model (a score head) generates nothing
        stops = stop_at_end_of_turn(tmp) if heads.head_of(tmp) == "lm" else None
        diff = gate_written(tmp, dtype, parse_size(max_shard_size), load_file(str(probe)), str(out))
        report = {
            **conversion_report("full", ckpt, len(weight_map), diff),
            "generation_config": stops,
            "restored": restored,  # training's switches set back to the base's
        }
        if finish is not None:
            finish(tmp, report)
    return report
