"""Read a DeepSpeed ZeRO checkpoint one parameter at a time, without loading it whole.

DeepSpeed's checkpoint files are torch zip archives. ``load_refs`` unpickles one with the
tensor data left on disk: every tensor becomes a :class:`TensorRef` (file, byte offset,
dtype, shape), read later with ``os.pread`` into memory this process owns and frees. So a
parameter costs only its own bytes, and nothing of the file stays mapped (with
``torch.load(mmap=True)`` every page read stays resident for as long as the load lives).

``ZeroCheckpoint`` knows the two layouts of the fp32 master weights (the same layouts
DeepSpeed's own ``zero_to_fp32`` reads):

- ZeRO-1/2: per parameter group, each rank holds one contiguous slice of the group's flat
  fp32 vector; a parameter is a run of the concatenation of those slices.
- ZeRO-3: every parameter is split across all ranks, ceil(numel / world) elements each, at
  the same offset in each rank's flat vector.

Frozen parameters (the base model of a LoRA run) come from the model-states files.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from snaketune.core.errors import DataError


@dataclass
class TensorRef:
    """A tensor stored in a torch zip file, not yet read."""

    path: str
    offset: int  # bytes from the start of the file to element 0 of this tensor
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def read(self, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements [start, start + count) of the flattened tensor, as a new 1-D tensor."""
        count = self.numel - start if count is None else count
        size = torch.empty(0, dtype=self.dtype).element_size()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = bytearray(count * size)
            view, pos, done = memoryview(data), self.offset + start * size, 0
            while done < len(data):
                n = os.preadv(fd, [view[done:]], pos + done)
                if n <= 0:
                    raise DataError(f"{self.path}: file ends early (truncated checkpoint?)")
                done += n
        finally:
            os.close(fd)
        return (
            torch.frombuffer(data, dtype=self.dtype) if count else torch.empty(0, dtype=self.dtype)
        )


@dataclass
class _StorageRef:
    path: str
    offset: int
    dtype: torch.dtype


def _rebuild_tensor(storage: _StorageRef, storage_offset, size, stride, *args) -> TensorRef:
    expected = tuple(reversed(list(_contiguous_strides(size))))
    if tuple(stride) != expected and math.prod(size) > 1:
        raise DataError(
            f"{storage.path}: a non-contiguous tensor in the checkpoint is not supported"
        )
    itemsize = torch.empty(0, dtype=storage.dtype).element_size()
    return TensorRef(
        storage.path, storage.offset + storage_offset * itemsize, storage.dtype, tuple(size)
    )


def _contiguous_strides(size) -> Iterator[int]:
    stride = 1
    for dim in reversed(list(size)):
        yield stride
        stride *= dim


def _rebuild_parameter(data, *args, **kwargs):
    return data


def _rebuild_from_type(func, _new_type, args, _state):
    return func(*args)  # a tensor subclass (e.g. Parameter): keep the plain reference


def _record_offsets(path: Path) -> tuple[str, dict[str, int]]:
    """Archive prefix and the byte offset of every data record of a torch zip file."""
    offsets = {}
    with open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
        prefix = zf.namelist()[0].split("/", 1)[0]
        for info in zf.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise DataError(f"{path}: compressed checkpoint records are not supported")
            fh.seek(info.header_offset)
            header = fh.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            offsets[info.filename] = info.header_offset + 30 + name_len + extra_len
    return prefix, offsets


def load_refs(path: str | Path) -> Any:
    """Unpickle a torch checkpoint with every tensor left on disk as a TensorRef."""
    path = Path(path)
    try:
        prefix, offsets = _record_offsets(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise DataError(f"{path}: not a readable torch checkpoint ({exc})") from exc

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module == "torch._utils" and name == "_rebuild_tensor_v2":
                return _rebuild_tensor
            if module == "torch._utils" and name.startswith("_rebuild_parameter"):
                return _rebuild_parameter
            if module == "torch._tensor" and name == "_rebuild_from_type_v2":
                return _rebuild_from_type
            return super().find_class(module, name)

        def persistent_load(self, pid):
            _, storage_type, key, _location, _numel = pid
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type._dtype
            return _StorageRef(str(path), offsets[f"{prefix}/data/{key}"], dtype)

    with zipfile.ZipFile(path) as zf, zf.open(f"{prefix}/data.pkl") as fh:
        return Unpickler(fh).load()


# ----------------------------------------------------------------------------- layouts


def _natural(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


class ZeroCheckpoint:
    """The fp32 weights of a ZeRO-1/2/3 checkpoint directory (the one holding ``latest``)."""

    def __init__(self, directory: str | Path, tag: str | None = None):
        directory = Path(directory)
        if tag is None:
            latest = directory / "latest"
            if not latest.is_file():
                raise DataError(
                    f"{directory}: no `latest` file; not a DeepSpeed checkpoint directory"
                )
            tag = latest.read_text().strip()
        self.dir = directory / tag
        optim = sorted(self.dir.glob("*_optim_states.pt"), key=_natural)
        if not optim:
            raise DataError(f"{self.dir}: no optimizer state files (*_optim_states.pt)")
        first = load_refs(optim[0])["optimizer_state_dict"]
        self.stage = int(first["zero_stage"])
        count = first["partition_count"]
        self.world = int(count[0] if isinstance(count, list | tuple) else count)
        expected = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(self.world)]
        missing = [name for name in expected if not (self.dir / name).is_file()]
        if missing or len(optim) != self.world:
            raise DataError(
                f"{self.dir}: checkpoint of {self.world} ranks is missing "
                f"{', '.join(missing) or 'files'}; "
                "it is incomplete (a rank did not finish writing) and cannot be converted"
            )
        key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
        self.flat = [load_refs(self.dir / name)["optimizer_state_dict"][key] for name in expected]
        if self.stage == 3:
            model_files = [
                self.dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(self.world)
            ]
        else:
            model_files = [self.dir / "mp_rank_00_model_states.pt"]
        for f in model_files:
            if not f.is_file():
                raise DataError(f"{self.dir}: {f.name} is missing; the checkpoint is incomplete")
        self.model_states = [load_refs(f) for f in model_files]
        state = self.model_states[0]
        self.param_shapes: list[dict[str, torch.Size]] = state["param_shapes"]
        self.frozen_shapes: dict[str, torch.Size] = state.get("frozen_param_shapes") or {}
        self.buffer_names: list[str] = state.get("buffer_names") or []
        self.shared: dict[str, str] = state.get("shared_params") or {}

    def shape(self, name: str) -> tuple[int, ...]:
        for group in self.param_shapes:
            if name in group:
                return tuple(group[name])
        if name in self.frozen_shapes:
            return tuple(self.frozen_shapes[name])
        if name in self.shared:
            return self.shape(self.shared[name])
        return self.model_states[0]["module"][name].shape

    def plan(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) of what :meth:`tensors` yields, in the same order."""
        module = self.model_states[0]["module"]
        names = [*self.frozen_shapes, *(n for group in self.param_shapes for n in group)]
        fp32 = [(name, self.shape(name), torch.float32) for name in names]
        buffers = [(name, self.shape(name), module[name].dtype) for name in self.buffer_names]
        return [*fp32, *buffers, *((name, self.shape(name), torch.float32) for name in self.shared)]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, fp32 tensor) for every parameter and buffer, one at a time."""
        sources = set(self.shared.values())
        kept: dict[str, torch.Tensor] = {}  # only the sources of tied weights
        for name, tensor in self._params():
            if name in sources:
                kept[name] = tensor
            yield name, tensor
        for name in self.buffer_names:
            yield name, self.model_states[0]["module"][name].read().view(self.shape(name))
        for name, source in self.shared.items():
            yield name, kept[source]

    def _params(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._frozen()
        yield from (self._zero3() if self.stage == 3 else self._zero2())

    def _frozen(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in self.frozen_shapes.items():
            numel = math.prod(shape)
            if self.stage == 3:
                parts = [ms["frozen_param_fragments"][name] for ms in self.model_states]
                yield name, torch.cat([p.read() for p in parts])[:numel].view(tuple(shape))
            else:
                yield (
                    name,
                    self.model_states[0]["frozen_param_fragments"][name].read().view(tuple(shape)),
                )

    def _group_reader(self, rank: int):
        """Read [start, start+count) of rank's flat groups, concatenated."""
        groups = self.flat[rank]
        sizes = [g.numel for g in groups]

        def read(start: int, count: int) -> torch.Tensor:
            out, g, base = [], 0, 0
            while count > 0:
                while start >= base + sizes[g]:
                    base += sizes[g]
                    g += 1
                take = min(count, base + sizes[g] - start)
                out.append(groups[g].read(start - base, take))
                start, count = start + take, count - take
            return torch.cat(out) if len(out) > 1 else out[0]

        return read

    def _zero3(self) -> Iterator[tuple[str, torch.Tensor]]:
        readers = [self._group_reader(r) for r in range(self.world)]
        offset = 0
        for group in self.param_shapes:
            for name, shape in group.items():
                numel = math.prod(shape)
                part = math.ceil(numel / self.world)
                pieces = [read(offset, part) for read in readers]
                yield name, torch.cat(pieces)[:numel].view(tuple(shape))
                offset += part

    def _zero2(self) -> Iterator[tuple[str, torch.Tensor]]:
        for g, group in enumerate(self.param_shapes):
            parts = [self.flat[r][g] for r in range(self.world)]
            bounds = [0]
            for p in parts:
                bounds.append(bounds[-1] + p.numel)
            offset = 0
            for name, shape in group.items():
                numel = math.prod(shape)
                yield name, _read_span(parts, bounds, offset, numel).view(tuple(shape))
                offset += numel


def _read_span(parts: list[TensorRef], bounds: list[int], start: int, count: int) -> torch.Tensor:
    """Elements [start, start+count) of the concatenation of ``parts``."""
    out = []
    for i, part in enumerate(parts):
        lo, hi = max(start, bounds[i]), min(start + count, bounds[i + 1])
        if lo < hi:
            out.append(part.read(lo - bounds[i], hi - lo))
    return torch.cat(out) if len(out) > 1 else out[0]


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}


def safetensors_refs(path: str | Path) -> dict[str, TensorRef]:
    """The tensors of a safetensors file as TensorRefs (read with pread, never mapped)."""
    import json

    path = Path(path)
    with open(path, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    refs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, _ = info["data_offsets"]
        refs[name] = TensorRef(
            str(path), 8 + size + start, _ST_DTYPES[info["dtype"]], tuple(info["shape"])
        )
    return refs
