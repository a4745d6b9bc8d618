"""Work a third-party package does as it loads, deferred to when it is used.

Two modules every stage may load wrap kernels in ``torch.compile`` as they load.
``torch.compile`` compiles nothing until the wrapped function runs, but each call imports
TorchInductor: up to 2.5 CPU-s a process here, 0.7 to 1 in a training rank, which imports
part of it anyway (docs/benchmarks.md).
- bitsandbytes (installed for QLoRA): peft imports it whenever it is installed. A stage that
  loads no 4-bit model hides it (snaketune.core.qlora.hide_bitsandbytes); every other
  process that imports peft loads it: a QLoRA run's ranks, conversion, merge and
  evaluation, an adapter evaluated on its base, the reference and teacher workers.
- DeepSpeed's Muon optimizer (``deepspeed.runtime.zero.muon.original_muon``): DeepSpeed
  imports it in every ``deepspeed.initialize`` that wraps an optimizer in ZeRO (its check of
  the supported optimizers), so every training rank of every method loaded it.

``defer_compile_at_import`` (called as snaketune loads, before any of its modules can
import peft or DeepSpeed) has each module of ``DEFERRED`` load with ``torch.compile`` calls
made when the compiled function is first called: the same function compiled with the same
settings at the moment it was compiled before (its first call), TorchInductor imported only
by a process that runs one. Nothing else changes: a module, or any other caller, compiles as
it always did."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any

DEFERRED = ("bitsandbytes", "deepspeed.runtime.zero.muon.original_muon")


def compiled_on_first_call(compile_):
    """``compile_`` (torch.compile) made when a compiled function is first called; a
    module (or anything but a plain function) is compiled at once, as before."""

    def deferred(model=None, **settings):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: deferred(fn, **settings)
        if not callable(model) or not hasattr(model, "__code__"):
            return compile_(model, **settings)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_(model, **settings)
            return compiled(*args, **kwargs)

        return call

    return deferred


class _Loader(importlib.abc.Loader):
    """The module's own loader, the module run with torch.compile deferred."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # resources, is_package, get_code, ...
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        import torch

        real = torch.compile
        torch.compile = compiled_on_first_call(real)
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = real


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in DEFERRED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def defer_compile_at_import() -> None:
    """Install the deferral for ``DEFERRED`` (once; a package already loaded is left)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
