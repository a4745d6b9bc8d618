"""Small file helpers: hashing, atomic writes, provenance records, the YAML loader."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from snaketune.core.errors import DataError, UserError

CHUNK = 1 << 20
# Fault injection for the tests and for drills: a process about to publish an output whose
# path contains this text kills itself with SIGKILL first (all data written, nothing renamed).
FAULT_ENV = "SNAKETUNE_KILL_BEFORE_PUBLISH"
STACK = (
    "snaketune",
    "torch",
    "transformers",
    "tokenizers",
    "peft",
    "trl",
    "deepspeed",
    "safetensors",
    "datasets",
    "pyarrow",
    "pandas",
    "huggingface_hub",
    "snakemake",
)


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


def remove_stale_temps(path: str | Path) -> None:
    """Remove temporaries of ``path`` left by killed writers (``.NAME.tmp-PID``)."""
    path = Path(path)
    if path.parent.is_dir():
        for old in path.parent.glob(f".{path.name}.tmp-*"):
            _remove(old)


def fault_point(*paths: str | Path) -> None:
    """SIGKILL this process when ``$SNAKETUNE_KILL_BEFORE_PUBLISH`` is in one of ``paths``."""
    needle = os.environ.get(FAULT_ENV)
    if needle and any(needle in str(p) for p in paths):
        os.kill(os.getpid(), signal.SIGKILL)


def publish(moves: list[tuple[Path, Path]]) -> None:
    """Rename finished temporaries onto their outputs, one after the other (each rename is
    atomic; the data of all of them is complete before the first)."""
    fault_point(*(dest for _, dest in moves))
    for tmp, dest in moves:
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        os.replace(tmp, dest)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path; on success it is renamed to ``path``, on error removed.

    Works for files and directories. An existing ``path`` is replaced only on success.
    """
    with atomic_paths(path) as (tmp,):
        yield tmp


@contextlib.contextmanager
def atomic_paths(*paths: str | Path) -> Iterator[list[Path]]:
    """:func:`atomic_path` for several outputs of one step: all are renamed into place
    only once every one of them is written."""
    paths_ = [Path(p) for p in paths]
    tmps = [tmp_name(p) for p in paths_]
    for p in paths_:
        p.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(p)
    try:
        yield tmps
        publish(list(zip(tmps, paths_, strict=True)))
    finally:
        for t in tmps:
            _remove(t)


def check_writable(root: str | Path, names: tuple[str, ...]) -> None:
    """Each of ``root/NAME`` (or ``root`` where NAME does not exist yet) takes a new file.

    Tried by writing, not by permission bits (root passes those on read-only mounts).
    """
    root = Path(root).resolve()
    for name in names:
        target = root / name if (root / name).is_dir() else root
        probe = target / f".snaketune-write-test-{os.getpid()}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise UserError(
                f"{target} is not writable ({exc.strerror}); run from a directory you can "
                "write to (snakemake --directory DIR) or fix its permissions"
            ) from None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def read_jsonl(path: str | Path) -> list[Any]:
    """The JSON value of every non-blank line of ``path`` (metrics.jsonl and the like)."""
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def written_rows(path: str | Path) -> list[Any]:
    """The rows of a jsonl file a writer may be appending to (live metrics): its complete,
    newline-ended lines; a last line still being written is left for the next read."""
    text = Path(path).read_text(encoding="utf-8")
    return [json.loads(x) for x in text[: text.rfind("\n") + 1].splitlines() if x.strip()]


def write_json(path: str | Path, obj: Any) -> None:
    """Write JSON atomically (sorted keys, indented, trailing newline)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n", "utf-8")


def write_outputs(
    out_dir: Path,
    metrics: dict[str, Any],
    samples: list[dict[str, Any]],
    finish: Callable[[Path, dict[str, Any]], None] | None,
) -> None:
    """An evaluation's directory, written as one: ``metrics.json`` and ``samples.jsonl``,
    ``finish(tmp, metrics)`` run on the complete directory before it is renamed into place."""
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        (tmp / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        if finish is not None:
            finish(tmp, metrics)


def versions() -> dict[str, str]:
    """Installed versions of the packages that shape the outputs."""
    out = {"python": platform.python_version()}
    for name in STACK:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def host_name() -> str:
    """This node's name: SLURM's for it inside a job (what sinfo and --exclude use), else
    the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def run_context() -> dict[str, Any]:
    """Where and when an artefact was made (host, SLURM job id when there is one)."""
    ctx: dict[str, Any] = {
        "host": host_name(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        ctx["slurm_job_id"] = job
    return ctx


class IdsLog:
    """Appends the example ids a rank trains on, one per line (``--log-example-ids``; the
    exact-once tests read it); does nothing without a path."""

    def __init__(self, path: Path | None):
        self._out = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115

    def write(self, ids: list[str]) -> None:
        if self._out is not None:
            self._out.write("".join(f"{i}\n" for i in ids))
            self._out.flush()


def parse_size(text: str) -> int:
    """'5GB' -> bytes (decimal units, as transformers uses)."""
    m = re.fullmatch(r"\s*(\d+)\s*(B|KB|MB|GB|TB)\s*", text.upper())
    if not m:
        raise DataError(f"max_shard_size {text!r}: use a number and a unit, e.g. 2GB or 500MB")
    return int(m.group(1)) * 1000 ** ["B", "KB", "MB", "GB", "TB"].index(m.group(2))


def yaml_safe_loader() -> type:
    """PyYAML's safe loader with libyaml's parser where PyYAML has it (a tenth of the
    pure-Python one's time: the config schema 0.006 CPU-s against 0.056, read by every
    snakemake command), the pure-Python one where it has not."""
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)
