"""Calibrating the time estimate on this cluster: the newest finished run like the one
planned (its measured throughput, the time its train job spent outside the steps, what its
other stages took from Snakemake's benchmark files), and a short run made on purpose to be
one (``snaketune calibrate``: a copy of a run that trains ``max_steps`` steps). Short of
one: a finished run of another method on the same model (``from_other_method``: a step
by its tokens, scoring passes and generation), and on a CPU this machine's assumed rates
(``cpu_assumed``, ``cpu_stages``: rates.CPU_S_PER_TOKEN, JOB_START_S)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from snaketune.plan.pipeline import CONVERT, MERGE, SHARD, TRAIN, calibrated

CALIBRATION = "_calibration"  # the calibration copy of run <run> is run <run>_calibration


def same_shape(a: Any, b: Any) -> bool:
    """Two model shapes alike in their config's fields (counted on a built model or not)."""
    import dataclasses

    return dataclasses.replace(a, counted=None) == dataclasses.replace(b, counted=None)


def calibration(
    config: dict[str, Any], name: str, workdir: Path, shape: Any, any_method: bool = False
) -> dict[str, Any] | None:
    """The newest finished run under ``workdir``/results like this one (the same model
    shape, method, adapter and device kind, or with ``any_method`` of any method and
    adapter; not the run itself): its measured tokens/s
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
            and (any_method or method_of(spec) is method_of(run))
            and (any_method or method_of(spec).adapter_of(spec) == kind)
            and (record["device"] == "cpu") == (gpu is None)
            and spec.get("gpu", gpu) == gpu
        )
        if not same:
            continue
        rows = split_rows(read_jsonl(prov.parent / "metrics.jsonl"))[0]
        if not rows:
            continue
        figures = {**measured(other, record, spec, manifest, rows), "method": spec["method"]}
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
    path = workdir / "benchmarks" / TRAIN.name / f"{run}.tsv"
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


def benchmark_seconds(path: Path) -> float:
    """The wall seconds a Snakemake benchmark file recorded (its ``s`` column)."""
    import csv

    with open(path) as fh:
        return float(next(csv.DictReader(fh, delimiter="\t"))["s"])


def stage_seconds(
    workdir: Path, run: str, rules: tuple[str, ...] | None = None
) -> dict[str, float]:
    """What each of ``run``'s own stages took (Snakemake's benchmark files: seconds): those
    a calibration measures for another run (snaketune.plan.pipeline), or ``rules``."""
    out: dict[str, float] = {}
    for rule in calibrated() if rules is None else rules:
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


def step_split(cal: dict[str, Any]) -> tuple[float, float]:
    """A calibration's step as a fixed part and the tokens/s of the rest: on a CPU
    rates.CPU_STEP_S (at most half its step) and its tokens over what is left; on GPUs its
    tokens/s alone (over all its devices)."""
    from snaketune.budget.rates import CPU_STEP_S

    if cal["device"] != "cpu" or "step_s" not in cal:
        return 0.0, cal["tokens_per_s"]
    fixed = min(CPU_STEP_S, cal["step_s"] / 2)
    return fixed, cal["tokens_per_s"] * cal["step_s"] / (cal["step_s"] - fixed)


def from_other_method(
    config: dict[str, Any],
    name: str,
    workdir: Path,
    shape: Any,
    steps: dict[str, Any],
    measured: tuple[float, float] | None,
    cal: dict[str, Any],
) -> dict[str, Any]:
    """The train stage of a run whose only calibration is a finished run of another method
    on the same model and device kind (``cal``): a step's update over its sequences' tokens
    at the calibration's seconds a token (and on a CPU its fixed part: ``step_split``),
    the passes that only score them (a live reference, teacher or reward models) at a third
    of that for each of their weights against the model's, and its generation (a method
    that generates) as rates.decode_step plans it (on a CPU, generate()'s floor).
    ``measured``: a step's examples' tokens (the tokenized set's, or its rows' text before
    it; None: every sequence at max_length, at most)."""
    from snaketune.budget.rates import decode_step
    from snaketune.budget.scoring import held_params
    from snaketune.methods import method_of

    run = config["runs"][name]
    facts = method_of(run).memory(run, True)
    per, rows = steps["per_step"], method_of(run).rows_per_example(run)
    completion = facts.get("completion_length", 0)
    each = (
        measured[0] / per if measured else run["max_length"] * facts.get("sequences_per_example", 1)
    )
    # an example's tokens; a generating one's prompt beside each of its rows' completions
    tokens = per * rows * (each + completion) if completion else per * each
    devices = run["nodes"] * run["gpus_per_node"]
    fixed, rate = step_split(cal)
    rate *= 1 if cal["device"] == "cpu" else devices / cal["devices"]
    # (a CPU run's emulated nodes share this machine's cores: its rate is the machine's)
    update = fixed + tokens / rate
    scored = sum(held_params(config, run, workdir).values())
    scored += shape.active_params if facts.get("reference") else 0
    scoring = tokens * scored / shape.active_params / (3 * rate)
    gpu = run.get("gpu", config.get("gpu"))
    step, bound = decode_step(shape, run["micro_batch_size"], None if gpu is None else str(gpu))
    decode = run["gradient_accumulation_steps"] * completion  # on each device
    generation = facts.get("generated_share", 1.0) * decode * step if completion else 0.0
    return {
        "train_s": steps["steps"] * (update + scoring + generation),
        "basis": (
            cal.get("said")
            or f"calibrated from run {cal['run']} of method {cal['method']} (its "
            f"{cal['tokens_per_s']:,.0f} tokens/s)"
        )
        + f": a step's update {update:.2f} s over "
        f"{tokens:,.0f} tokens"
        + (f", scoring {scoring:.2f} s" if scoring else "")
        + (
            f", generation {generation:.2f} s ({decode} decode steps of {step * 1e3:.1f} ms: "
            f"{bound})"
            if generation
            else ""
        )
        + ("" if measured else "; every sequence at max_length until the data is readable"),
    }


def cpu_stages(
    config: dict[str, Any],
    name: str,
    shape: Any,
    steps: dict[str, Any],
    evaluation: tuple[int | None, Any, bool, Any],
) -> dict[str, dict[str, Any]]:
    """A CPU run's own stages besides training where no finished run measured them: each a
    process's start (rates.JOB_START_S; the shard job's DATA_JOB_START_S) and its work, the
    bytes at the disk rate; an evaluation's generations as decode steps at generate()'s CPU
    floor (a text set: none), its loss pass at the CPU's assumed rate (``cpu_evaluation``;
    ``evaluation``: stagecost.cpu_evaluation_of's). Seconds; no GPU-hours."""
    from snaketune.budget import rates
    from snaketune.methods import method_of
    from snaketune.plan.runspec import merged

    run, disk = config["runs"][name], rates.DISK_MB_S * rates.MB
    size = shape.params * 4  # fp32 on a CPU
    out = {}
    epoch = steps.get("tokens") or steps["per_step"] * run["max_length"] * steps.get(
        "steps_per_epoch", steps["steps"]
    )
    out[SHARD.name] = rates.stage(
        rates.DATA_JOB_START_S + epoch * 16 / disk,
        0,
        "a data job's start, its tokens at the disk rate",
    )
    lora = method_of(run).adapter_of(run) == "lora"
    out[CONVERT.name] = rates.stage(
        rates.JOB_START_S + (0 if lora else shape.params * 6 / disk), 0, "a job's start (assumed)"
    )
    if lora and merged(run):
        out[MERGE.name] = rates.stage(
            rates.JOB_START_S + 2 * size / disk, 0, "a job's start, the model read and written"
        )
    if "eval_dataset" in run and evaluation[0] is not None:
        out.update(cpu_evaluation(run, shape, evaluation))
    return out


def cpu_evaluation(
    run: dict[str, Any], shape: Any, evaluation: tuple[int, Any, bool, Any]
) -> dict[str, dict[str, Any]]:
    """A CPU run's evaluate stages at the assumed rates (``evaluation``: its eval set's rows
    scored, its evaluate rules, whether they generate, and its live teacher's shape or
    None): a job's start, the model read, its loss pass and its greedy decode steps; the
    run's own evaluation also loads the teacher and scores its completions, and the base's
    where the base generated, one example at a time (snaketune.evaluation.teacher_nll)."""
    import math

    from snaketune.budget import rates

    examples, rules, generates, teacher = evaluation
    disk, length = rates.DISK_MB_S * rates.MB, run["max_length"]
    loss = examples * length / rates.cpu_tokens_per_s(shape, "lora") / 3
    seconds = rates.JOB_START_S + shape.params * 4 / disk + loss
    said = f"a job's start, {examples} rows' loss at the CPU's assumed rate"
    if generates:
        step, _ = rates.decode_step(shape, run["eval"]["batch_size"], None)
        decode = math.ceil(examples / run["eval"]["batch_size"]) * run["eval"]["max_new_tokens"]
        seconds += decode * step
        said += f", {decode} decode steps of {step * 1e3:.1f} ms (generate()'s CPU floor)"
    out = {}
    for rule, own in rules.items():
        out[rule] = rates.stage(seconds, 0, said)
        if own and teacher is not None and generates:
            passes = 1 + any(not o for o in rules.values())  # the base's completions too
            each = rates.decode_step(teacher, 1, None)[0] + length / (
                rates.cpu_tokens_per_s(teacher, "lora") * 3
            )
            scored = teacher.params * 4 / disk + passes * examples * each
            out[rule] = rates.stage(
                seconds + scored,
                0,
                f"{said}; the teacher read and its NLL of {passes} x {examples} completions "
                f"({scored:.1f} s)",
            )
    return out


def cpu_evaluation_of(
    config: dict[str, Any], name: str, shape: Any, workdir: Path
) -> tuple[int | None, dict[str, bool], bool, Any]:
    """What a CPU run's evaluate stages do (calibrate.cpu_evaluation's ``evaluation``): its
    eval set's rows scored, its evaluate rules, whether they generate, its live teacher's
    shape (None: none, or not readable now)."""
    from snaketune.budget.evalplan import eval_examples, evaluate_rules
    from snaketune.budget.teacherplan import live_shape
    from snaketune.evaluation.settings import generates

    run = config["runs"][name]
    if "eval_dataset" not in run:
        return None, {}, False, None
    rules = evaluate_rules(config, name)
    teacher = live_shape(config, run, workdir)
    return eval_examples(config, name, workdir), rules, generates(config, run), teacher


def rows_text_tokens(
    config: dict[str, Any], name: str, workdir: Path, per: int
) -> tuple[float, float] | None:
    """Before tokenization, a step's tokens as the tokenize plan counts its rows' text (4
    bytes a token, a chat row at most max_length; snaketune.budget.tokenizeplan.tokens_of),
    attention at most each row's tokens x max_length; None where the rows cannot be read."""
    from snaketune.budget.tokenizeplan import tokens_of

    run = config["runs"][name]
    counted = tokens_of(config, run["dataset"], run["max_length"], workdir)
    if counted is None or not counted[1]:
        return None
    mean = counted[0] / counted[1] * per
    return mean, mean * run["max_length"]


def cpu_assumed(
    config: dict[str, Any],
    name: str,
    workdir: Path,
    shape: Any,
    steps: dict[str, Any],
    rough: tuple[float, float] | None,
) -> dict[str, Any]:
    """A CPU run's train stage with no calibration: its update at this machine's assumed
    rate (rates.cpu_tokens_per_s), its scoring and generation as a run of another method
    calibrates them (calibrate.from_other_method), start-up and saving assumed. None for a
    run that has finished here (a run is not its own calibration)."""
    from snaketune.budget.rates import cpu_tokens_per_s, outside_steps
    from snaketune.methods import method_of

    run = config["runs"][name]
    if (workdir / "results" / name / "train/provenance.json").is_file():
        return {  # its estimate is kept beside its time
            "basis": f"no estimate: run {name} has finished here (its time is in its "
            "provenance), and no other run of this model has to calibrate from"
        }
    kind = method_of(run).adapter_of(run)
    rate = cpu_tokens_per_s(shape, kind)
    said = (
        f"not calibrated: this CPU's assumed {rate:,.0f} tokens/s for a {kind} update of "
        "this model (a short run calibrates it: max_steps: 20)"
    )
    out = from_other_method(
        config,
        name,
        workdir,
        shape,
        steps,
        rough,
        {"said": said, "tokens_per_s": rate, "device": "cpu"},
    )
    outside, why = outside_steps(run, shape, steps["steps"], kind)
    return {**out, "outside_s": outside, "basis": f"{out['basis']}; {why}"}
