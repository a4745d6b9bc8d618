"""A user's tools (``file.py:function``, as a user's rewards are named) run for a rank's
rollouts, each call in a child process of the rank's own, so that no tool can take a rank
down: a call that raises comes back as the tool's text (``ToolFailed``, its type and
message), one that runs past ``timeout_s`` is ended with its process (a new one is started
for the next call), one whose process dies (a crash, ``os._exit``) likewise, and what a tool
returns or prints beyond ``max_chars`` is cut. Each kind is counted (``Counts``).

``functions()`` gives each tool as a function with the user's own name, signature and
docstring (what TRL's GRPOTrainer reads to describe the tool to the model) that calls the
runner: GRPO with tools (snaketune.tools.tooluse) hands them to TRL's GRPOTrainer.
"""

from __future__ import annotations

import functools
import inspect
import io
import itertools
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from snaketune.core.errors import UserError


class ToolFailed(RuntimeError):
    """A tool call that gave no result: its text is what the model is told."""


@dataclass
class Counts:
    """Calls, and those that raised, ran past the time limit, killed their process, or
    were cut to ``max_chars``."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    died: int = 0
    cut: int = 0


# an environment's methods that are not tools: their values go back as they are (JSON)
ENVIRONMENT_OWN = ("reset", "get_reward")
# a tool process's start (a spawned interpreter importing the user's tools): not counted in
# a call's ``timeout_s``, which would otherwise end every restarted process of a slow start
STARTUP_S = 300.0
READY = "ready"  # what the tool process sends once its tools are loaded
PARENT_POLL_S = 0.5  # how often a tool process looks for its rank


def _watch_parent(parent: int) -> None:
    """End this tool process once its rank is gone: a rank killed (SIGKILL, the OOM killer)
    while a tool hung left the tool running for ever, its pipe never read again."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def _dispatch(tools: dict, environment, held: dict, name, kwargs: dict) -> Any:
    """A call: a tool's by its name, or (slot, method) an environment instance's (``reset``
    makes the slot's instance the first time; a slot lost with an earlier process is told)."""
    if not isinstance(name, tuple):
        return tools[name](**kwargs)
    slot, method = name
    if method == "reset" and slot not in held:
        held[slot] = environment()
    if method == "get_reward" and slot not in held:
        return None  # its state went with an ended process: no reward for this rollout
    if slot not in held:
        raise RuntimeError(
            "the environment's state was lost with its process (an earlier call hung or "
            "crashed it); answer without it"
        )
    return getattr(held[slot], method)(**kwargs)


def _serve(conn, keys: list[str], max_chars: int, environment: str | None = None) -> None:
    """The child's loop: load the tools (and the environment class), then answer (name,
    kwargs) with (status, text, cut) until told None; what a tool prints is kept (to
    ``max_chars``) after its result."""
    from snaketune.evaluation.rewards import _load

    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    tools = {key.rsplit(":", 1)[1]: _load(key) for key in keys}
    cls, held = (_load(environment) if environment else None), {}
    conn.send(READY)
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the rank is gone: so is its tool process
            return
        if message is None:
            return
        name, kwargs = message
        printed, real = io.StringIO(), (sys.stdout, sys.stderr)
        sys.stdout = sys.stderr = printed
        try:
            out = _dispatch(tools, cls, held, name, kwargs)
            if isinstance(name, tuple) and name[1] in ENVIRONMENT_OWN:  # a value, not text
                conn.send(("ok", json.dumps(out, default=str), False))
                continue
            text, status = out if isinstance(out, str) else json.dumps(out, default=str), "ok"
        except Exception as exc:  # noqa: BLE001 -- the tool's own failure, told to the model
            text, status = f"{type(exc).__name__}: {exc}", "error"
        finally:
            sys.stdout, sys.stderr = real
        extra = printed.getvalue()
        if extra:
            text = f"{text}\n[printed] {extra}"
        conn.send((status, text[:max_chars], len(text) > max_chars))


class ToolRunner:
    """The tools ``keys`` (and the instances of ``environment``, a ``file.py:Class`` key)
    served by a child process of this one (``close`` ends it)."""

    def __init__(
        self,
        keys: list[str],
        timeout_s: float,
        max_chars: int,
        environment: str | None = None,
    ):
        self.keys, self.timeout_s, self.max_chars = list(keys), timeout_s, max_chars
        self.environment = environment
        self._environment_class: type | None = None
        self.counts = Counts()
        self._process = self._conn = None

    def _start(self) -> bool:
        context = multiprocessing.get_context("spawn")  # no fork of a rank's threads
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve,
            args=(child, self.keys, self.max_chars, self.environment),
            daemon=True,
        )
        self._process.start()
        child.close()
        # a call's time limit counts from a loaded process: a first call that waited on the
        # start of an interpreter on a loaded node was ended, and so was the next process's
        try:
            if self._conn.poll(STARTUP_S) and self._conn.recv() == READY:
                return True
        except EOFError:  # it died loading the tools
            return False
        return False

    def _end(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
        self._process = self._conn = None

    def call(self, name: str | tuple[int, str], kwargs: dict[str, Any]) -> str:
        """Tool ``name``'s result as text (``(slot, method)``: an environment instance's
        method); ``ToolFailed`` with the text the model is told."""
        if self._process is None or not self._process.is_alive():
            self._end()
            if not self._start():
                self._end()
                self.counts.calls += 1
                self.counts.died += 1
                raise ToolFailed(
                    f"{name}'s process did not start: it died loading the tools, or took "
                    f"over {STARTUP_S:g} s"
                )
        self.counts.calls += 1
        self._conn.send((name, kwargs))
        if not self._conn.poll(self.timeout_s):
            self._end()
            self.counts.timeouts += 1
            raise ToolFailed(f"{name} did not finish within {self.timeout_s:g} s")
        try:
            status, text, cut = self._conn.recv()
        except EOFError:
            self._end()
            self.counts.died += 1
            raise ToolFailed(f"{name}'s process ended without a result") from None
        self.counts.cut += bool(cut)
        if status == "error":
            self.counts.errors += 1
            raise ToolFailed(text)
        return text

    def close(self) -> None:
        """End the child process (a rank's last call)."""
        if self._process is not None and self._process.is_alive():  # (its pipe with it)
            self._conn.send(None)
            self._process.join(timeout=5)
        self._end()

    def functions(self) -> list[Callable[..., str]]:
        """Each tool as a function with the user's name, signature and docstring."""
        from snaketune.evaluation.rewards import _load

        out = []
        for key in self.keys:
            original = _load(key)
            if not callable(original):
                raise UserError(f"tools: {key} names no function")
            name = key.rsplit(":", 1)[1]

            @functools.wraps(original)
            def call(*args, _name=name, _original=original, **kwargs):
                bound = inspect.signature(_original).bind(*args, **kwargs)
                return self.call(_name, dict(bound.arguments))

            out.append(call)
        return out

    def environment_class(self) -> type:
        """The environment as a class TRL's ``environment_factory`` makes: each instance a
        slot of the child's, each public method (``reset``, ``get_reward`` and the tools)
        with the user's name, signature and docstring, run there as a tool call is."""
        from snaketune.evaluation.rewards import _load

        if self._environment_class is not None:  # one class: its instances, distinct slots
            return self._environment_class
        user = _load(self.environment)
        slots = itertools.count()
        members: dict[str, Any] = {"__init__": lambda proxy: setattr(proxy, "slot", next(slots))}
        for name, original in inspect.getmembers(user, predicate=inspect.isfunction):
            if name.startswith("_"):
                continue

            @functools.wraps(original)
            def method(proxy, *args, _name=name, _original=original, **kwargs):
                bound = inspect.signature(_original).bind(proxy, *args, **kwargs)
                given = dict(list(bound.arguments.items())[1:])
                for param in inspect.signature(_original).parameters.values():
                    if param.kind is param.VAR_KEYWORD:  # **kwargs: their own names
                        given.update(given.pop(param.name, {}))
                text = self.call((proxy.slot, _name), given)
                return json.loads(text) if _name in ENVIRONMENT_OWN else text

            members[name] = method
        self._environment_class = type(user.__name__, (), members)
        return self._environment_class
