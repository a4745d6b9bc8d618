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

One module imports another for a function it rarely calls:
- transformers' losses (``transformers.loss.loss_utils``, which ``transformers.modeling_utils``
  imports, so every process that loads a model) load the object-detection losses, six of
  which take ``linear_sum_assignment`` from ``scipy.optimize`` for the Hungarian matching of
  DETR-like models, wherever scipy is installed (lm-eval brings it): 0.6 to 1 CPU-s of each
  training rank, evaluation, conversion, merge and scoring worker for a function no
  language model calls.

``defer_at_import`` (called as snaketune loads, before any of its modules can import peft,
DeepSpeed or transformers) has each module of ``DEFERRED`` load with ``torch.compile``
calls made when the compiled function is first called: the same function compiled with the
same settings at the moment it was compiled before (its first call), TorchInductor imported
only by a process that runs one; and each module of ``FUNCTIONS_ON_FIRST_CALL`` load with
the functions it (or a module it loads) takes from the modules named there imported when
first called (the same function, its module imported then). Nothing else changes: a module,
or any other caller, compiles and imports as it always did.

And a module of snaketune's own that the workflow loads to build its DAG (the Snakefile's
input functions and checks) takes numpy and pyarrow as ``deferred`` modules: bound as it
loads, imported on first use, so parsing the workflow needs neither (Snakemake's catalog
lints it where they are not installed) and a process that never reads a table never pays
for them.

And one cost of loading that is Python's own: its cyclic garbage collector runs on every 700
new objects, and as a process imports torch, transformers, peft, TRL and DeepSpeed (some
450,000 objects in a training rank, nearly all of them live) it scans them again and again,
seven full collections among them: about 1.5 CPU-s of a training rank's start here
(docs/benchmarks.md). ``loading()`` turns the collector off while an entry script loads its
modules and freezes what they made (``gc.freeze``: kept out of every later collection)
before turning it back on; the collector then runs as before on everything made after.
What the imports left as cyclic garbage stays frozen with the rest, uncollected: in a
training rank about 12,000 objects, some 10 MiB (tuples, closures, classes made and
dropped, the frames of caught import errors; no file, socket or tensor). Collecting it
first would cost a full scan of every object, 0.3-0.5 CPU-s, a third of the saving."""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import importlib.abc
import importlib.machinery
import signal
import sys
import types
from typing import Any

DEFERRED = ("bitsandbytes", "deepspeed.runtime.zero.muon.original_muon")
# a module -> the modules whose functions it takes (``from M import f``) as it loads
FUNCTIONS_ON_FIRST_CALL = {"transformers.loss.loss_utils": ("scipy.optimize",)}


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


class FunctionsOnFirstCall(types.ModuleType):
    """Stands in for module ``name`` while another module loads: each attribute taken from it
    is a function that imports the real module when first called and calls its function."""

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        name = self.__name__

        def call(*args, **kwargs):
            return getattr(importlib.import_module(name), attr)(*args, **kwargs)

        call.__name__ = call.__qualname__ = attr
        call.__module__ = name
        return call


@contextlib.contextmanager
def functions_on_first_call(names: tuple[str, ...]):
    """Within: each module of ``names`` not yet loaded is a FunctionsOnFirstCall in
    sys.modules (the real one importable again afterwards)."""
    standing = {n: FunctionsOnFirstCall(n) for n in names if n not in sys.modules}
    sys.modules.update(standing)
    try:
        yield
    finally:
        for name, stand_in in standing.items():
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]


class _Loader(importlib.abc.Loader):
    """The module's own loader, the module run with torch.compile deferred (``DEFERRED``)
    or with the functions it takes from other modules loaded on first call."""

    def __init__(self, loader, functions_from: tuple[str, ...] = ()):
        self.loader = loader
        self.functions_from = functions_from

    def __getattr__(self, name: str) -> Any:  # resources, is_package, get_code, ...
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        if self.functions_from:
            with functions_on_first_call(self.functions_from):
                self.loader.exec_module(module)
            return
        import torch

        real = torch.compile
        torch.compile = compiled_on_first_call(real)
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = real


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in DEFERRED and name not in FUNCTIONS_ON_FIRST_CALL:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, FUNCTIONS_ON_FIRST_CALL.get(name, ()))
        return spec


def defer_at_import() -> None:
    """Install the deferrals (once; a module already loaded is left as it is)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


@contextlib.contextmanager
def loading():
    """Python's cyclic garbage collector off while the block loads modules; then every
    object frozen (``gc.freeze``: the modules and their objects, scanned by no later
    collection, the little garbage of their imports with them) and the collector on again.
    For an entry script's imports, before its work makes objects of its own; where the
    collector is already off (the caller's choice, or an enclosing ``loading``), nothing
    changes."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def load(*modules: str) -> None:
    """Import ``modules``, which the process is about to import anyway, under ``loading()``
    (a function's lazy imports, such as transformers' models when it loads one)."""
    with loading():
        for name in modules:
            importlib.import_module(name)


# SLURM's warning ahead of a job's time limit (``--signal=USR1@<seconds>``, sent to every
# process of the job's steps) comes up to a minute before the time it was asked for (SLURM
# checks its timers once a minute). SIGUSR1's default action ends a process: on a short job
# or a slow node it reached a torchrun agent or a rank still loading torch (exit 138), and a
# process a rank started, whose handlers exec resets: DeepSpeed's JIT build of its CPU
# collectives (`ninja` died of it, the rank's build failed, the job with it). Blocked from
# the entry scripts' first lines, it stays pending until the rank takes it at a step end;
# a blocked signal stays blocked in every thread and process started afterwards, across
# fork and exec, so no process of the job dies of it.
_HELD: list[str] = []


def hold_time_warning(block: bool = True) -> None:
    """From now on, a SIGUSR1 to this process, and (``block``) to any process or thread it
    starts later, is held, not fatal (``take_time_warning`` takes it). Called first by a
    rank; by a torchrun agent with ``block=False``: only noted, until torchrun's handler
    replaces the note and passes it on to the workers (a blocked one never reaches it). A
    thread that existed before (none does at an entry script's first line) would still
    receive it: there too it is noted by the handler."""
    signal.signal(signal.SIGUSR1, lambda _signum, _frame: _HELD.append("SIGUSR1"))
    if block:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})


def take_time_warning() -> bool:
    """Whether SLURM's time warning came since the last call (held, or noted by the
    handler); a held one is taken, so the next call says no unless another comes."""
    came = bool(_HELD)
    _HELD.clear()
    if signal.SIGUSR1 in signal.sigpending():
        signal.sigtimedwait({signal.SIGUSR1}, 0)
        came = True
    return came


class deferred(types.ModuleType):  # noqa: N801 (a module's stand-in, named as one)
    """A module bound now and imported when an attribute of it is first read: ``pa =
    deferred("pyarrow")`` in place of ``import pyarrow as pa`` (``pa.table(...)`` imports
    pyarrow then; every read is the module's attribute as it is then)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)

    def __getattr__(self, attr: str) -> Any:
        module = self.__dict__.get("_deferred_module")
        if module is None:
            module = self.__dict__["_deferred_module"] = importlib.import_module(self.__name__)
        return getattr(module, attr)  # the module's own, as it is now (a test may patch it)
