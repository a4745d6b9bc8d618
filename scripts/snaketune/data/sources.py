"""Fetch models and datasets (hub or local) into resources/, recording where they came from.

Hub sources resolve the configured revision to a commit first and download exactly that
commit, so a rerun months later gets the same bytes. Local sources are linked (models)
or converted to parquet in streaming batches (datasets). Each output directory carries a
``provenance.json``: source, requested and resolved revision, sha256 of every file. A Hub
model's config.json alone (``hub_config_json``) is what the plans read before a download.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from snaketune.core.errors import DataError
from snaketune.core.imports import deferred
from snaketune.core.io import atomic_path, atomic_paths, sha256_file, sha256_tree
from snaketune.core.provenance import NAME, record, write_provenance

pa = deferred("pyarrow")
pads = deferred("pyarrow.dataset")
pq = deferred("pyarrow.parquet")

log = logging.getLogger(__name__)

EXTENSIONS = {
    ".parquet": "parquet",
    ".jsonl": "jsonl",
    ".json": "json",
    ".csv": "csv",
}
BATCH_ROWS = 8192
CHUNK_BYTES = 1 << 22
HUB_MODEL_IGNORE = ["original/*", "*.pth", "*.msgpack", "*.h5", "*.ot"]


def _provenance(
    kind: str,
    name: str,
    spec: dict[str, Any],
    artefact: Path,
    outputs: dict[str, str],
    **extra: Any,
) -> dict[str, Any]:
    return record(
        f"download_{kind}", artefact, spec, {}, outputs, kind=kind, name=name, spec=spec, **extra
    )


# ----------------------------------------------------------------------------- models


def _link_tree(src: Path, dst: Path) -> None:
    """Mirror ``src`` into ``dst`` with a symlink per file (no copy of large weights)."""
    dst.mkdir(parents=True)
    for item in sorted(src.iterdir()):
        if item.name.startswith("."):
            continue
        if item.is_dir():
            _link_tree(item, dst / item.name)
        else:
            (dst / item.name).symlink_to(item.resolve())


def model_folder(config: dict[str, Any], name: str, root: Path = Path(".")) -> Path:
    """Where model ``name`` of the config is read from: resources/models/<name> once
    downloaded, else a local model's own path (either may not be there yet)."""
    downloaded = root / "resources" / "models" / name
    spec = config["models"][name]
    if not (downloaded / "config.json").is_file() and spec.get("source") == "local":
        return Path(spec["path"])
    return downloaded


def download_model(name: str, spec: dict[str, Any], out: str | Path) -> None:
    """Materialise model ``name`` in directory ``out`` with a provenance.json."""
    out = Path(out)
    with atomic_path(out) as tmp:
        if spec["source"] == "local":
            src = Path(spec["path"])
            if not (src / "config.json").is_file():
                raise DataError(
                    f"models.{name}.path: {src} has no config.json; point it at a Hugging Face "
                    "model directory (config.json, tokenizer files, weights)"
                )
            _link_tree(src, tmp)
            extra = {"path": str(src.resolve())}
        else:
            from huggingface_hub import HfApi, snapshot_download

            revision = spec.get("revision", "main")
            commit = HfApi().model_info(spec["id"], revision=revision).sha
            log.info("model %s: %s@%s resolved to commit %s", name, spec["id"], revision, commit)
            snapshot_download(
                spec["id"], revision=commit, local_dir=tmp, ignore_patterns=HUB_MODEL_IGNORE
            )
            extra = {"id": spec["id"], "revision": revision, "commit": commit}
        files = sha256_tree(tmp)
        prov = _provenance(
            "model", name, spec, out, files, source=spec["source"], files=files, **extra
        )
        write_provenance(tmp / NAME, prov)


# ----------------------------------------------------------------------------- datasets


def file_format(path: Path, forced: str | None = None) -> str:
    """The format of a local dataset file or directory, from ``forced`` or the extension."""
    if forced:
        return forced
    probe = path
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise DataError(f"{path}: directory holds no data files")
        probe = files[0]
    suffixes = [s for s in probe.suffixes if s != ".gz"]  # data.jsonl.gz reads as jsonl
    fmt = EXTENSIONS.get(suffixes[-1]) if suffixes else None
    if fmt is None:
        raise DataError(
            f"{path}: cannot tell the format from the extension; use .parquet, .jsonl, .json or "
            ".csv, or set file_format"
        )
    return fmt


def _files(path: Path | list[Path]) -> list[Path]:
    """The files of a local dataset: a file, a directory's files, or a list of files."""
    if isinstance(path, list):
        return path
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _is_json_array(path: Path) -> bool:
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(b"[")


def iter_local_batches(path: Path | list[Path], fmt: str):
    """Stream a local dataset (a file, a directory or a list of files) as record batches (a
    JSON array file is read whole)."""
    if fmt == "json" and isinstance(path, Path) and path.is_file() and _is_json_array(path):
        with open(path, encoding="utf-8") as fh:
            rows = json.load(fh)
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise DataError(f"{path}: a .json dataset must be a list of objects or JSON lines")
        table = pa.Table.from_pylist(rows)
        yield from table.to_batches(max_chunksize=BATCH_ROWS)
        return
    arrow_fmt = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}[fmt]
    where = [str(p) for p in path] if isinstance(path, list) else str(path)
    dataset = pads.dataset(where, format=arrow_fmt)
    if fmt != "parquet" and _empty_struct(dataset.schema):
        # {} values (a call with no arguments, a tool with no parameters) are structs of no
        # fields, which parquet cannot hold: read as null (the tool-call reader takes it as {})
        rows = [_no_empty(r) for r in dataset.to_table().to_pylist()]
        yield from pa.Table.from_pylist(rows).to_batches(max_chunksize=BATCH_ROWS)
        return
    yield from dataset.to_batches(batch_size=BATCH_ROWS)


def _empty_struct(t) -> bool:
    """Whether an Arrow type (or schema) holds a struct of no fields anywhere."""
    if isinstance(t, pa.Schema):
        return any(_empty_struct(f.type) for f in t)
    if pa.types.is_struct(t):
        return t.num_fields == 0 or any(_empty_struct(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _empty_struct(t.value_type)
    return False


def _no_empty(value):
    """``value`` with every empty object (and every key Arrow filled in as null) left out."""
    if isinstance(value, dict):
        kept = {k: _no_empty(v) for k, v in value.items() if v is not None}
        return kept or None
    if isinstance(value, list):
        return [_no_empty(v) for v in value]
    return value


KINDS = {
    list: "a list",
    dict: "an object",
    str: "a string",
    bool: "true or false",
    int: "a number",
    float: "a number",
}
# what a field of a format must hold, where a row gives it another kind
SHAPES = {
    "messages": 'a list of turns, e.g. [{"role": "user", "content": "..."}, '
    '{"role": "assistant", "content": "..."}]'
}


def jsonl_row_problem(path: Path | list[Path]) -> str | None:
    """Why a JSON lines file cannot be one table, in the user's terms (pyarrow only says
    which kinds clashed): the first row whose field holds another kind of value than the
    first row that gives that field (row and line numbers from 0 and 1), or a line that is
    not a JSON object. None: every row agrees."""
    first: dict[str, tuple[str, int]] = {}
    row = 0
    for file in _files(path):
        with open(file, encoding="utf-8", errors="replace") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    return f"line {number}: not JSON ({exc.msg}); each line must be one object"
                if not isinstance(record, dict):
                    return f"line {number}: {KINDS.get(type(record), 'a value')}, not an object"
                for field, value in record.items():
                    if value is None:
                        continue
                    kind = KINDS.get(type(value), type(value).__name__)
                    seen = first.setdefault(field, (kind, row))
                    if seen[0] != kind:
                        want = SHAPES.get(field, seen[0])
                        return (
                            f"row {row} (line {number}): `{field}` is {kind}; it must be "
                            f"{want}, as in row {seen[1]}"
                        )
                row += 1
    return None


def check_utf8(path: Path | list[Path]) -> None:
    """Fail on the first byte sequence that is not UTF-8, naming its line."""
    import codecs

    for file in _files(path):
        decoder = codecs.getincrementaldecoder("utf-8")()
        line, offset = 1, 0
        with open(file, "rb") as fh:
            for block in iter(lambda: fh.read(CHUNK_BYTES), b""):
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as exc:
                    bad = block[exc.start]
                    line += block[: exc.start].count(b"\n")
                    raise DataError(
                        f"{file} is not valid UTF-8 (byte 0x{bad:02x} at offset "
                        f"{offset + exc.start}, line {line}); re-encode it as UTF-8, e.g. "
                        "iconv -f latin1 -t utf-8"
                    ) from None
                line += block.count(b"\n")
                offset += len(block)
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                raise DataError(
                    f"{file} is not valid UTF-8 (it ends inside a character); re-encode it as UTF-8"
                ) from None


def convert_local(path: Path | list[Path], fmt: str, out: Path) -> int:
    """Convert a local dataset (a file, a directory or a list of files) to one parquet file
    in batches; return the row count."""
    if fmt != "parquet":
        check_utf8(path)
    writer = None
    rows = 0
    try:
        for batch in iter_local_batches(path, fmt):
            batch.validate(full=True)  # the JSON reader lets invalid UTF-8 into strings
            if writer is None:
                writer = pq.ParquetWriter(out, batch.schema)
            writer.write_batch(batch)
            rows += batch.num_rows
    except (pa.ArrowInvalid, UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = str(exc).splitlines()[0].split("?: ")[-1]  # arrow's last clause is the reason
        row = jsonl_row_problem(path) if fmt == "jsonl" else None
        if row is not None:
            raise DataError(f"{path}: {row} (pyarrow: {reason})") from exc
        raise DataError(
            f"{path}: cannot read as {fmt} ({reason}); fix the file, or set file_format if "
            "the extension misleads"
        ) from exc
    finally:
        if writer is not None:
            writer.close()
    return rows


def download_dataset(name: str, spec: dict[str, Any], out_dir: str | Path) -> Path:
    """Write dataset ``name`` as ``out_dir/data.parquet`` plus ``out_dir/provenance.json``."""
    out_dir = Path(out_dir)
    data = out_dir / "data.parquet"
    with atomic_paths(data, out_dir / NAME) as (tmp, tmp_prov):
        if spec["source"] == "local":
            src = Path(spec["path"])
            if not src.exists():
                raise DataError(f"datasets.{name}.path: {src} does not exist; fix the path")
            try:
                fmt = file_format(src, spec.get("file_format"))
                rows = convert_local(src, fmt, tmp)
            except DataError as exc:
                raise DataError(f"datasets.{name}.path: {exc}") from None
            extra = {"path": str(src.resolve()), "file_format": fmt, "files": sha256_tree(src)}
        else:
            rows, extra = _from_hub(name, spec, tmp, out_dir / "files")
        if rows == 0:
            raise DataError(
                f"datasets.{name}: the dataset has no rows; check the path, split or file"
            )
        outputs = {"data.parquet": sha256_file(tmp)}
        prov = _provenance(
            "dataset",
            name,
            spec,
            out_dir,
            outputs,
            source=spec["source"],
            rows=rows,
            output=outputs,
            **extra,
        )
        write_provenance(tmp_prov, prov)
    log.info("dataset %s: %d rows -> %s", name, rows, data)
    return data


def _from_hub(name: str, spec: dict[str, Any], tmp: Path, folder: Path) -> tuple[int, dict]:
    """A Hub dataset at its resolved commit into the parquet ``tmp``: its ``files`` (globs)
    fetched one by one into ``folder`` and converted (snaketune.core.hubfiles), else the
    split ``datasets`` loads. Returns the rows and the provenance's fields."""
    from huggingface_hub import HfApi

    revision = spec.get("revision", "main")
    commit = HfApi().dataset_info(spec["id"], revision=revision).sha
    log.info("dataset %s: %s@%s resolved to commit %s", name, spec["id"], revision, commit)
    extra = {"id": spec["id"], "revision": revision, "commit": commit}
    if "files" in spec:
        from snaketune.core.hubfiles import chosen, fetch

        files = chosen(name, spec["id"], commit, spec["files"])
        local = fetch(spec["id"], commit, files, folder)
        try:
            rows = convert_local(local, file_format(local[0]), tmp)
        except DataError as exc:
            raise DataError(f"datasets.{name}.files: {exc}") from None
        return rows, {**extra, "files": files}
    import datasets

    split = spec.get("split", "train")
    ds = datasets.load_dataset(spec["id"], spec.get("subset"), split=split, revision=commit)
    ds.to_parquet(str(tmp))
    return ds.num_rows, {**extra, "subset": spec.get("subset"), "split": split}


@functools.cache
def hub_config_json(repo_id: str, revision: str | None) -> tuple[Path | None, str]:
    """config.json of a Hub model from the local cache, else from the Hub when it answers:
    (path, "") or (None, why). Offline (HF_HUB_OFFLINE) or unreachable: no download tried."""
    from huggingface_hub import constants, hf_hub_download

    try:
        return Path(
            hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=True)
        ), ""
    except Exception:  # not in the cache
        pass
    if constants.HF_HUB_OFFLINE:
        return None, "this machine is offline (HF_HUB_OFFLINE is set)"
    if not hub_reachable(constants.ENDPOINT):
        return None, f"the Hub ({constants.ENDPOINT}) cannot be reached from here"
    try:
        return Path(hf_hub_download(repo_id, "config.json", revision=revision)), ""
    except Exception as exc:  # gated without a token, no such repo or revision
        return None, f"the Hub refused it ({str(exc).splitlines()[0][:200]})"


@functools.cache
def hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub's host opens within ``timeout`` seconds."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False
