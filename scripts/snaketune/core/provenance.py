"""Provenance records and the lineage of an artefact.

Every artefact directory holds a ``provenance.json`` written by the stage that made it::

    {"stage": "merge_lora", "artefact": "results/demo/merged_model",
     "config": {...the settings of this stage...},
     "inputs": {"adapter": {"path": "results/demo/lora_adapters", "provenance_sha256": "..."},
                "base": {"path": "resources/models/tiny", "provenance_sha256": "..."}},
     "outputs": {"model.safetensors": "<sha256>", ...},
     "workflow": {"commit": "<git commit>", "dirty": false, "version": "0.2.0"},
     "versions": {...},
     "host": "...", "hosts": [...], "slurm_job_id": "...", "time": "..."}

An input that is itself an artefact is recorded by the sha256 of its provenance.json (which
lists the sha256 of its files); a plain file by its own sha256. Following the inputs from
any artefact gives its chain back to the raw dataset and the base model:

    snaketune lineage results/demo/merged_model [--verify]
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from snaketune import __version__
from snaketune.core.errors import UserError
from snaketune.core.io import run_context, sha256_file, sha256_tree, versions

NAME = "provenance.json"
WORKFLOW_DIR = Path(__file__).resolve().parents[3]


@functools.cache
def workflow_commit(root: Path = WORKFLOW_DIR) -> dict[str, Any]:
    """The git commit of the workflow checkout and whether it has local changes."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "note": "not a git checkout"}
    return {"commit": commit, "dirty": bool(status.strip())}


def provenance_of(path: str | Path) -> Path | None:
    """The provenance.json describing ``path``: inside it (a directory) or beside it."""
    path = Path(path)
    for candidate in (path / NAME, path.parent / NAME):
        if candidate.is_file():
            return candidate
    return None


def describe_input(path: str | Path) -> dict[str, Any]:
    """An input as provenance records it: its artefact's provenance, or its own hash."""
    path = Path(path)
    entry: dict[str, Any] = {"path": str(path)}
    prov = provenance_of(path)
    if prov is not None:
        entry["provenance"] = str(prov)
        entry["provenance_sha256"] = sha256_file(prov)
    elif path.is_file():
        entry["sha256"] = sha256_file(path)
    elif path.is_dir():
        entry["files"] = sha256_tree(path)
    return entry


def hosts_and_jobs() -> dict[str, Any]:
    """Host name, time and SLURM job id of this process (see io.run_context), and the
    names (never the values) of the secret variables its environment held: whether a job
    saw HF_TOKEN is a common question, and their values are what every log masks."""
    from snaketune.core.redact import MIN_LENGTH, is_secret_name

    ctx = run_context()
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if nodelist:
        ctx["slurm_nodelist"] = nodelist
    ctx["secret_variables"] = sorted(
        k for k, v in os.environ.items() if is_secret_name(k) and len(v) >= MIN_LENGTH
    )
    return ctx


def record(
    stage: str,
    artefact: str | Path,
    config: Any,
    inputs: dict[str, str | Path],
    outputs: dict[str, str],
    **extra: Any,
) -> dict[str, Any]:
    """The provenance of ``artefact`` (``outputs``: its files' sha256 by relative name)."""
    return {
        "stage": stage,
        "artefact": str(artefact),
        "config": config,
        "inputs": {name: describe_input(p) for name, p in inputs.items()},
        "outputs": outputs,
        "workflow": {**workflow_commit(), "version": __version__},
        "versions": versions(),
        **hosts_and_jobs(),
        **extra,
    }


def write_provenance(path: Path, prov: dict[str, Any]) -> None:
    """Write ``prov`` to ``path`` (provenance.json in a finished temporary directory, or the
    temporary of a provenance.json beside the outputs)."""
    path.write_text(json.dumps(prov, indent=2, sort_keys=True, default=str) + "\n")


def output_hashes(directory: Path, names: list[str] | None = None) -> dict[str, str]:
    """sha256 of the files of an artefact directory (all but provenance.json), or of
    ``names`` in it."""
    if names is not None:
        return {n: sha256_file(directory / n) for n in names}
    return {k: v for k, v in sha256_tree(directory).items() if k != NAME}


# ----------------------------------------------------------------------------- lineage


def _root_of(path: Path) -> Path:
    """The working directory of a run: the parent of the path's results/ or resources/."""
    parts = path.resolve().parts
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("results", "resources"):
            return Path(*parts[:i])
    return Path.cwd()


def _load(prov_path: Path) -> dict[str, Any]:
    try:
        return json.loads(prov_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{prov_path}: cannot read provenance ({exc})") from exc


def _summary(prov: dict[str, Any]) -> str:
    bits = [prov.get("time", "?"), f"on {prov.get('host', '?')}"]
    if prov.get("slurm_job_id"):
        bits.append(f"SLURM job {prov['slurm_job_id']}")
    hosts = prov.get("hosts")
    if isinstance(hosts, dict):
        hosts = sorted(set(hosts.values()))
    if hosts:
        bits.append(f"nodes: {', '.join(hosts)}")
    commit = (prov.get("workflow") or {}).get("commit")
    if commit:
        bits.append(f"workflow {commit[:10]}{'+changes' if prov['workflow'].get('dirty') else ''}")
    return ", ".join(bits)


def _source(prov: dict[str, Any]) -> str | None:
    """Where a download stage's bytes came from."""
    if prov.get("source") == "hub":
        return f"hub {prov.get('id')}@{prov.get('commit')}"
    if prov.get("source") == "local":
        files = prov.get("files", {})
        first = next(iter(sorted(files.items())), None)
        digest = f" ({len(files)} files, {first[0]} sha256 {first[1][:16]})" if first else ""
        return f"local {prov.get('path')}{digest}"
    return None


def verify(prov_path: Path, prov: dict[str, Any]) -> list[str]:
    """Files of the artefact whose sha256 no longer matches (or that are gone)."""
    base = prov_path.parent
    bad = []
    for name, want in sorted(prov.get("outputs", {}).items()):
        f = base / name
        if not f.is_file():
            bad.append(f"{name} missing")
        elif sha256_file(f) != want:
            bad.append(f"{name} changed")
    return bad


def evaluations_of(root: Path, artefact: Path) -> Iterator[str]:
    """A line for each evaluation (results/*/eval/) of the model ``artefact``."""
    target = str(artefact.resolve())
    for ev in sorted(root.glob("results/*/eval/provenance.json")):
        prov = _load(ev)
        model = prov.get("inputs", {}).get("model", {}).get("path")
        if model and str((root / model).resolve()) == target:
            metrics = ev.parent / "metrics.json"
            figures = ""
            if metrics.is_file():
                m = json.loads(metrics.read_text())
                figures = ": " + ", ".join(
                    f"{k} {f['value']:.4g}" for k, f in list((m.get("figures") or {}).items())[:3]
                )
            yield f"evaluated in {ev.parent.relative_to(root)}{figures}"


def lineage(
    path: str | Path, check: bool = False, problems: list[str] | None = None
) -> Iterator[str]:
    """Lines of the chain of artefacts behind ``path``, newest first, indented by depth.

    With ``check``, every artefact's files are hashed again; mismatches are listed in the
    output and appended to ``problems``."""
    path = Path(path)
    root = _root_of(path)
    start = provenance_of(path)
    if start is None:
        raise UserError(
            f"{path}: no provenance.json in or beside it; give an artefact directory "
            "(e.g. results/RUN/merged_model) made by this workflow"
        )
    seen: set[Path] = set()

    def walk(prov_path: Path, label: str, depth: int) -> Iterator[str]:
        pad = "  " * depth + ("<- " if depth else "")
        prov = _load(prov_path)
        where = prov.get("artefact", str(prov_path.parent))
        head = f"{pad}{label}{where} [{prov.get('stage', '?')}]"
        if prov_path.resolve() in seen:
            yield f"{head} (see above)"
            return
        seen.add(prov_path.resolve())
        yield f"{head} {_summary(prov)}"
        detail = "  " * (depth + 1) + "   "
        source = _source(prov)
        if source:
            yield f"{detail}source: {source}"
        for name, entry in sorted(prov.get("inputs", {}).items()):
            if "sha256" in entry:
                yield f"{detail}{name}: {entry['path']} sha256 {entry['sha256'][:16]}"
        if check:
            bad = verify(prov_path, prov)
            if problems is not None:
                problems.extend(f"{where}: {b}" for b in bad)
            n = len(prov.get("outputs", {}))
            yield f"{detail}verify: " + (f"{n} files ok" if not bad else "; ".join(bad))
        for name, entry in sorted(prov.get("inputs", {}).items()):
            if "provenance" not in entry:
                continue
            parent = root / entry["provenance"]
            if not parent.is_file():
                yield f"{pad}  <- {name}: {entry['path']} (provenance gone)"
                continue
            note = ""
            if sha256_file(parent) != entry.get("provenance_sha256"):
                note = "(remade since) "
            yield from walk(parent, f"{name}: {note}", depth + 1)

    yield from walk(start, "", 0)
    yield from evaluations_of(root, start.parent)
