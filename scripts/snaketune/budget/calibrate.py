"""Calibrating the time estimate on this cluster: the newest finished run like the one
planned (its measured throughput, the time its train job spent outside the steps, what its
other stages took from Snakemake's benchmark files), and a short run made on purpose to be
one (``snaketune calibrate``: a copy of a run that trains ``max_steps`` steps)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

CALIBRATION = "_calibration"  # the calibration copy of run <run> is run <run>_calibration


def same_shape(a: Any, b: Any) -> bool:
    """Two model shapes alike in their config's fields (counted on a built model or not)."""
    import dataclasses

    return dataclasses.replace(a, counted=None) == dataclasses.replace(b, counted=None)


def calibration(
    config: dict[str, Any], name: str, workdir: Path, shape: Any
) -> dict[str, Any] | None:
    """The newest finished run under ``workdir``/results like this one (the same model
    shape, method, adapter and device kind; not the run itself): its measured tokens/s
    (over all its devices) and its train job's time outside the steps (start-up, saving,
    export; a first job's one-time op builds left out), from its provenance and shard
    manifest. None: no such run yet."""
    from snaketune.budget.modelcount import shape_of
    from snaketune.core.heldout import split_rows
    from snaketune.core.io import read_jsonl
    from snaketune.methods import method_of

    run = config["runs"][name]
    kind = method_of(run).adapter_of(run)
    gpu = run.get("gpu", config.get("gpu"))
    found = []
    for prov in (workdir / "results").glob("*/train/provenance.json"):
        other = prov.parent.parent.name
        try:
            record = json.loads(prov.read_text())
            spec = json.loads((prov.parent / "run_config.json").read_text())
            manifest = json.loads((prov.parent.parent / "shards/manifest.json").read_text())
            model = json.loads(
                (workdir / "resources/models" / spec["model"] / "config.json").read_text()
            )
        except (OSError, ValueError, KeyError):
            continue
        seg = record.get("segments") or {}
        if other == name or not seg.get("train_s") or record.get("device") is None:
            continue
        same = (
            same_shape(shape_of(model), shape)
            and method_of(spec) is method_of(run)
            and method_of(spec).adapter_of(spec) == kind
            and (record["device"] == "cpu") == (gpu is None)
            and spec.get("gpu", gpu) == gpu
        )
        if not same:
            continue
        rows = split_rows(read_jsonl(prov.parent / "metrics.jsonl"))[0]
        if not rows:
            continue
        figures = measured(other, record, spec, manifest, rows)
        figures["outside_s"] += before_launcher(workdir, other, seg)
        found.append((prov.stat().st_mtime, figures))
    return max(found, key=lambda f: f[0])[1] if found else None


def before_launcher(workdir: Path, run: str, seg: dict[str, Any]) -> float:
    """Seconds run ``run``'s train job spent before its launcher began (the rule's shell
    and Python start, which its segments do not see): its Snakemake benchmark less the
    segments' wall time; 0 without a benchmark, or for a run of several jobs (whose wall
    time holds the waits between them)."""
    if seg.get("before_launcher_s") is not None:  # recorded by the job itself
        return float(seg["before_launcher_s"])
    path = workdir / "benchmarks" / "train" / f"{run}.tsv"
    if seg.get("jobs") != 1 or not path.is_file() or seg.get("wall_s") is None:
        return 0.0
    try:
        return max(0.0, benchmark_seconds(path) - seg["wall_s"])
    except (OSError, ValueError, KeyError, StopIteration):
        return 0.0


def measured(
    run: str, record: dict[str, Any], spec: dict[str, Any], manifest: dict, rows: list[dict]
) -> dict[str, Any]:
    """A finished run's figures the estimate scales: its tokens/s and step time, its
    devices, and its train job's time outside the steps less the one-time op builds of a
    machine's first job (snaketune.train.startup), with its start-up apart."""
    seg = record["segments"]
    tokens = sum(s["tokens"] for s in manifest["shards"]) / manifest["steps_per_epoch"]
    steps = rows[-1]["step"]
    builds = seg.get("compile_s") or 0.0  # one-time: a machine's first job's op builds
    return {
        "run": run,
        "tokens_per_s": tokens * steps / seg["train_s"],
        "step_s": seg["train_s"] / steps,
        "per_step": manifest["global_batch"],
        "devices": spec["nodes"] * spec["gpus_per_node"],
        "nodes": spec["nodes"],
        "outside_s": seg.get("outside_training_s", 0.0) - builds,
        "startup_s": seg.get("startup_s"),  # of the time outside: a job's start-up
        "launch_s": seg.get("launch_s"),  # of that: until its workers started
        "device": record["device"],
    }


# the stages a run has of its own, after training (and its shard plan before it)
RUN_STAGES = ("shard_dataset", "convert_checkpoint", "merge_lora", "evaluate_start", "evaluate")


def benchmark_seconds(path: Path) -> float:
    """The wall seconds a Snakemake benchmark file recorded (its ``s`` column)."""
    import csv

    with open(path) as fh:
        return float(next(csv.DictReader(fh, delimiter="\t"))["s"])


def stage_seconds(workdir: Path, run: str, rules: tuple[str, ...] = RUN_STAGES) -> dict[str, float]:
    """What each of ``run``'s own stages took (Snakemake's benchmark files: seconds)."""
    out: dict[str, float] = {}
    for rule in rules:
        folder = workdir / "benchmarks" / rule
        # <run>.tsv, or <run>.<what>.tsv (convert_checkpoint: demo.lora_adapters.tsv)
        for path in sorted(folder.glob("*.tsv")) if folder.is_dir() else ():
            if path.name.split(".")[0] == run:
                out[rule] = out.get(rule, 0.0) + benchmark_seconds(path)
    return out


def calibration_config(config: dict[str, Any], name: str, steps: int) -> dict[str, Any]:
    """The config of a short calibration of run ``name`` (``config`` as the user wrote it):
    the same model, data, method, adapter, batch, topology and GPU, trained ``steps``
    optimizer steps from its base model (not from the run an init_from names; a sweep's
    first values), evaluated as it is (its evaluate stages are measured too), never
    published, alone in the config."""
    from snaketune.core.errors import UserError

    runs = config.get("runs") or {}
    if name not in runs:
        known = ", ".join(sorted(runs)) or "none"
        raise UserError(f"calibrate: the config has no run {name!r} (its runs: {known})")
    run = copy.deepcopy(runs[name])
    start = run.pop("init_from", None)
    while start in runs and "model" not in run:  # the model its chain starts from
        run["model"] = runs[start].get("model")
        start = runs[start].get("init_from")
    for path, values in (run.pop("sweep", None) or {}).items():  # its first member
        *parents, last = path.split(".")
        target = run
        for key in parents:
            target = target.setdefault(key, {})
        target[last] = values[0]
    for key in ("epochs", "publish"):
        run.pop(key, None)
    run["max_steps"] = steps
    return {**copy.deepcopy(config), "runs": {name + CALIBRATION: run}}
