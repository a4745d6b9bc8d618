"""Small file helpers: hashing, atomic writes, provenance records."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import socket
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

CHUNK = 1 << 20
STACK = ("snaketune", "torch", "transformers", "tokenizers", "datasets", "pyarrow", "pandas")


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def sha256_tree(path: str | Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (or of ``path`` itself), by relative name."""
    path = Path(path)
    if path.is_file():
        return {path.name: sha256_file(path)}
    return {
        str(p.relative_to(path)): sha256_file(p)
        for p in sorted(path.rglob("*"))
        if p.is_file() and not p.name.startswith(".snakemake")
    }


def digest(obj: Any) -> str:
    """sha256 of the canonical JSON form of ``obj``."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tmp_name(path: str | Path) -> Path:
    """A temporary sibling of ``path`` (same filesystem, so rename is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path; on success it is renamed to ``path``, on error removed.

    Works for files and directories. An existing ``path`` is replaced only on success.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    _remove(tmp)
    try:
        yield tmp
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def write_json(path: str | Path, obj: Any) -> None:
    """Write JSON atomically (sorted keys, indented, trailing newline)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n", "utf-8")


def versions() -> dict[str, str]:
    """Installed versions of the packages that shape the outputs."""
    out = {"python": platform.python_version()}
    for name in STACK:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def run_context() -> dict[str, Any]:
    """Where and when an artefact was made (host, SLURM job id when there is one)."""
    ctx: dict[str, Any] = {
        "host": socket.gethostname(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        ctx["slurm_job_id"] = job
    return ctx
