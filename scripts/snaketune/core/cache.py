"""What snaketune can compute again but need not: figures read off the installed
transformers (a model counted on the meta device, the facts of a model family's class),
which cost an import of torch and transformers (about 5 s) in a process that needs neither,
and which lm-eval task names lm-eval knows (an import of its task index, about 1 s).
Each is kept as a small JSON file keyed by what it was computed from and the installed
transformers' version, under ``$SNAKETUNE_CACHE``, else ``$XDG_CACHE_HOME/snaketune``, else
``~/.cache/snaketune`` (per home directory on a cluster). A torn or foreign file is computed
again; a read-only home computes each time.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """Where snaketune keeps what it can compute again."""
    if os.environ.get("SNAKETUNE_CACHE"):
        return Path(os.environ["SNAKETUNE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "snaketune"


def extensions_dir(prefix: str | None = None, base_prefix: str | None = None) -> Path:
    """torch's extension cache (DeepSpeed's JIT-built ops) of this Python environment: its
    own folder, so that two environments on one machine (two clones, a user's two venvs on
    a cluster's shared home) never rebuild each other's ops in turn, as torch's one default
    folder makes them do. Inside a virtual environment where it is writable
    (``<venv>/torch_extensions``), else ``~/.cache/torch_extensions/env-<digest of the
    environment's path>``. ``TORCH_EXTENSIONS_DIR`` set by the user wins (the callers only
    set it where it is unset)."""
    prefix = prefix or sys.prefix
    base_prefix = base_prefix or sys.base_prefix
    if prefix != base_prefix and os.access(prefix, os.W_OK):
        return Path(prefix) / "torch_extensions"
    key = hashlib.sha256(str(Path(prefix).resolve()).encode()).hexdigest()[:12]
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torch_extensions" / f"env-{key}"


def transformers_version() -> str | None:
    """The installed transformers' version (part of every key), None where it is missing."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def remembered(kind: str, key: str, compute: Callable[[], Any]) -> Any:
    """``compute()`` (a JSON value) for ``key``, from ``cache_dir()/kind`` when computed
    before, else computed and kept there. The key is hashed with the installed transformers'
    version."""
    digest = hashlib.sha256(f"{transformers_version()}\0{key}".encode()).hexdigest()[:32]
    path = cache_dir() / kind / f"{digest}.json"
    if path.is_file():
        try:
            return json.loads(path.read_text(encoding="utf-8"))["value"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a torn or foreign file: computed again below
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"value": value}), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: computed each time
    return value
