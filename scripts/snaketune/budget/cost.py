"""What a run will cost, before it is queued: its optimizer steps, the train stage's time
and GPU-hours, and what they advise.

An epoch is the run's examples over the examples one optimizer step takes, as the shard
stage plans it (snaketune.data.shard: whole global batches, the rest left out): the
micro batch over the rows one example becomes (GRPO: its completions) x
gradient_accumulation_steps x the data-parallel ranks (nodes x gpus_per_node over
sequence_parallel). The examples are counted from the tokenized set where it is made
already (exact: overlong rows dropped), else from the source rows (the downloaded copy,
else the local file; a mixture's components by their weights): ``about``, since
tokenization may drop overlong rows; a text corpus's rows from a sample of it tokenized with
the run's tokenizer (snaketune.plan.corpus: a long document is several rows). A run with
``max_steps`` takes that many, counted or not; with ``epochs``, that many epochs of steps.

What it advises, before any GPU time is spent: a run with fewer examples than one step
takes is refused by the shard stage (said here first); one with one step per epoch or
fewer than ``FEW`` steps in all is warned about (a learning-rate schedule and warmup over
a handful of updates mean little); so is a warmup that rounds to no step at all.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from snaketune.budget import rolloutcost
from snaketune.budget.rates import (
    ASSUMED_MFU,
    GENERATING_STARTUP_S,
    MFU_SOURCE,
    outside_steps,
    update_seconds,
)

FEW = 10  # fewer optimizer steps than this in all: warned about
# torch's c10d rendezvous: an agent waiting for the others polls once a second
# (torch.distributed.elastic.rendezvous.dynamic_rendezvous, its SYNC action)
RENDEZVOUS_POLL_S = 1.0


def examples_of(
    config: dict[str, Any], name: str, workdir: Path
) -> tuple[int | None, str, float | None]:
    """A run's training examples, where the count comes from and their tokens (None: not
    known yet): the tokenized set, else before it snaketune.plan.corpus.run_rows (a
    sample, the source's rows, a stated size)."""
    from snaketune.core import parts
    from snaketune.plan.corpus import run_rows
    from snaketune.plan.stages import tokenized

    path = workdir / tokenized(config, name)
    if parts.exists(path):
        lengths = parts.read_table(path, ["length"]).column("length")
        return len(lengths), "the tokenized set", float(pa_sum(lengths))
    return run_rows(config, config["runs"][name], workdir)


def pa_sum(column: Any) -> float:
    import pyarrow.compute as pc

    return pc.sum(column).as_py() or 0.0


def per_step(run: dict[str, Any]) -> int:
    """Examples one optimizer step takes: the global batch of the shard stage's layout
    (snaketune.data.shard.Layout), its micro batch in examples (plan.stages.shard_job)."""
    from snaketune.data.shard import Layout
    from snaketune.methods import method_of

    micro = run["micro_batch_size"] // method_of(run).rows_per_example(run)
    return Layout(
        run["nodes"],
        run["gpus_per_node"],
        max(1, micro),
        run["gradient_accumulation_steps"],
        run.get("sequence_parallel", 1),
    ).global_batch


def steps_of(config: dict[str, Any], name: str, workdir: Path = Path(".")) -> dict[str, Any]:
    """The run's steps: examples, per step, per epoch, in all, and the advice on them
    (``problem``: the shard stage would refuse it; ``warnings``)."""
    run = config["runs"][name]
    examples, basis, tokens = examples_of(config, name, workdir)
    out: dict[str, Any] = {
        "examples": examples,
        "basis": basis,
        "tokens": tokens,  # the examples' tokens (an epoch's); None: not known yet
        "per_step": per_step(run),
        "warnings": [],
    }
    if examples is None and run.get("max_steps") is not None:  # the steps are fixed: no data
        out.update(
            steps=run["max_steps"],
            basis="max_steps (the dataset is not downloaded: its epochs not counted yet)",
        )
        return out
    if examples is None:  # basis: why not, and how to count them now
        return out
    epoch = examples // out["per_step"]
    out["steps_per_epoch"] = epoch
    if epoch == 0:
        out["problem"] = (
            f"runs.{name}: {examples} examples ({basis}), fewer than one "
            f"optimizer step takes ({out['per_step']}: micro_batch_size x "
            "gradient_accumulation_steps x data-parallel GPUs); lower one of "
            "these or add data"
        )
        return out
    total = run["max_steps"] if "max_steps" in run else math.ceil(run["epochs"] * epoch)
    out.update(steps=total, epochs=total / epoch)
    if epoch == 1:
        out["warnings"].append(
            f"one optimizer step per epoch ({examples} examples, "
            f"{out['per_step']} a step): each epoch is a single update"
        )
    if total < FEW:
        out["warnings"].append(
            f"{total} optimizer step(s) in all: fewer than {FEW}; the "
            "learning-rate schedule and warmup mean little over so few "
            "updates (more epochs or data, or a smaller batch)"
        )
    if run.get("warmup_ratio", 0) > 0 and math.ceil(run["warmup_ratio"] * total) >= total:
        out["warnings"].append(
            f"warmup_ratio {run['warmup_ratio']} of {total} steps is the "
            "whole run: the learning rate never reaches its peak"
        )
    return out


ESTIMATE = "estimate.json"  # results/<run>/: the train estimate made when it was queued


def keep(path: Path, estimate: dict[str, Any]) -> None:
    """Write the estimate (whole or not at all)."""
    import time

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({**estimate, "made": time.time()}, indent=1, sort_keys=True))
    tmp.replace(path)


def estimate_columns(run_dir: Path, wall_s: float | None) -> dict[str, Any]:
    """summary.tsv's columns of the train estimate made when the run was queued, and its
    error against what the train stage took (``wall_s``): (took - estimated) / estimated."""
    path = run_dir / ESTIMATE
    if not path.is_file():
        return {}
    e = json.loads(path.read_text())
    out = {"estimated_train_wall_s": round(e["wall_s"], 1), "estimate_basis": e["basis"]}
    if wall_s:
        out["estimate_error"] = round(wall_s / e["wall_s"] - 1, 3)
    return out


def format_steps(name: str, s: dict[str, Any]) -> list[str]:
    """The plan's lines of a run's steps (and its warnings)."""
    if "steps_per_epoch" not in s and "steps" in s:  # max_steps, the data not there yet
        return [f"{name}: {s['steps']:,} optimizer steps ({s['basis']}; {s['per_step']} a step)"]
    if "steps_per_epoch" not in s:
        return [f"{name}: steps: {s['basis']}"]
    if "problem" in s:
        return [f"{name}: steps: {s['problem']}"]
    lines = [
        f"{name}: {s['steps']:,} optimizer steps ({s['steps_per_epoch']:,} per epoch x "
        f"{s['epochs']:.3g} epochs; {s['examples']:,} examples, {s['basis']}; "
        f"{s['per_step']} a step)"
    ]
    if s.get("tokens"):
        step = s["tokens"] / s["examples"] * s["per_step"]
        lines.append(
            f"{name}: tokens: about {amount(step)} a step, {amount(step * s['steps'])} in all "
            f"({amount(s['tokens'])} an epoch, {s['basis']})"
        )
    lines += [f"{name}: warning: {w}" for w in s["warnings"]]
    return lines


def amount(n: float) -> str:
    """1_234 -> '1,234'; 228_200 -> '0.228M'; 1.1e10 -> '11.0B'."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.3g}M" if n >= 1e5 else f"{n:,.0f}"


# ----------------------------------------------------------------------------- time


def tokens_per_step(
    config: dict[str, Any], name: str, workdir: Path, per: int
) -> tuple[float, float] | None:
    """Real tokens of one optimizer step and the sum of its examples' squared lengths (the
    attention's share of the FLOPs), from the tokenized set's lengths (None before it)."""
    from snaketune.core import parts
    from snaketune.plan.stages import tokenized

    path = workdir / tokenized(config, name)
    if not parts.exists(path):
        return None
    lengths = parts.read_table(path, ["length"]).column("length").to_numpy()
    if not len(lengths):
        return None
    mean, square = float(lengths.mean()), float((lengths.astype(float) ** 2).mean())
    return mean * per, square * per


def step_tokens(
    config: dict[str, Any], name: str, workdir: Path, steps: dict[str, Any]
) -> tuple[float, float] | None:
    """A step's tokens and squared tokens: the tokenized set's, else before tokenization a
    text set's rows' mean (a sample's, a stated size's), attention at most each row's tokens
    x max_length; None where not known."""
    measured = tokens_per_step(config, name, workdir, steps["per_step"])
    if measured is None and steps.get("tokens"):
        mean = steps["tokens"] / steps["examples"] * steps["per_step"]
        measured = (mean, mean * config["runs"][name]["max_length"])
    return measured


def estimate(
    config: dict[str, Any], name: str, workdir: Path, shape: Any, steps: dict[str, Any]
) -> dict[str, Any]:
    """The train stage's estimated seconds (``train_s``: the steps; ``wall_s``: with the
    time outside them where a calibration measured it) and GPU-hours, and its ``basis``:
    calibrated from a finished run like it (``calibration``), else for a GPU run its FLOPs
    at an assumed MFU (a run that generates while it trains: budget.rolloutcost, a step's
    generation, scoring and update); none for a CPU run without a calibration."""
    from snaketune.budget.calibrate import (
        calibration,
        cpu_assumed,
        from_other_method,
        rows_text_tokens,
        stage_seconds,
        step_split,
    )
    from snaketune.methods import method_of

    run, generates = config["runs"][name], generates_in_training(config["runs"][name])
    if "steps" not in steps:
        return {"basis": "no estimate: the steps are not counted yet"}
    devices, gpu = run["nodes"] * run["gpus_per_node"], run.get("gpu", config.get("gpu"))
    cal = calibration(config, name, workdir, shape)
    measured = step_tokens(config, name, workdir, steps)
    rough = measured or rows_text_tokens(config, name, workdir, steps["per_step"])
    if cal is not None:
        scale = 1 if cal["device"] == "cpu" else devices / cal["devices"]  # per GPU
        if generates or rough is None:  # generation: by the step
            step_s = cal["step_s"] * steps["per_step"] / cal["per_step"] / scale
        else:  # on a CPU a fixed part and the rest by the tokens
            fixed, rate = step_split(cal)
            step_s = fixed + rough[0] / (rate * scale)
        out = {
            "train_s": steps["steps"] * step_s,
            "outside_s": cal["outside_s"] + startup_change(cal, run),
            "basis": f"calibrated from run {cal['run']}",
        }
    elif (other := calibration(config, name, workdir, shape, any_method=True)) is not None:
        out = from_other_method(config, name, workdir, shape, steps, rough, other)
        out["outside_s"] = other["outside_s"] + startup_change(other, run)
        cal = other  # its other stages too: the same model's
    elif gpu is None:  # a CPU run, uncalibrated: this machine's assumed rate
        out = cpu_assumed(config, name, workdir, shape, steps, rough)
        if "train_s" not in out:
            return out
    else:  # a GPU run, uncalibrated: its FLOPs; generating, a step's three parts
        out = (rolloutcost.estimate if generates else from_flops)(
            config, name, workdir, shape, steps, measured, str(gpu)
        )
        if "train_s" not in out:
            return out
        outside, said = outside_steps(run, shape, steps["steps"], method_of(run).adapter_of(run))
        out.update(outside_s=outside, basis=f"{out['basis']}; {said}")
    out["wall_s"] = out["train_s"] + (out["outside_s"] or 0.0)
    out["gpu_hours"] = out["wall_s"] * devices / 3600 if gpu is not None else None
    if cal is not None:  # the other stages of the run, as the calibration's took
        out["calibrated_from"] = cal["run"]
        out["stages"] = stage_seconds(workdir, cal["run"])
    return out


def startup_change(cal: dict[str, Any], run: dict[str, Any]) -> float:
    """Seconds a job of ``run`` starts up in more (or less) than the calibration's did.

    - The launch: a job of several nodes waits in torch's c10d rendezvous for its other
      agents, which polls once a second (``RENDEZVOUS_POLL_S``); a job of one node has
      no one to wait for. Between one node and several that poll is added or taken off;
      what more a cluster's nodes take to start (srun on each) is measured only by a
      calibration of as many nodes.
    - The workers' part (imports, loading, the engine: the calibration's start-up less
      its launch) is CPU work of every process at once: on a CPU run, whose emulated
      nodes share this machine's cores, it scales with the processes over the cores; on
      GPUs each node's processes have cores of their own and it stays as measured.
    - On a CPU, a method that generates while it trains starts up in GENERATING_STARTUP_S
      more than one that does not (and one that does not in as much less)."""
    import os

    if cal.get("startup_s") is None:
        return 0.0
    generating = generates_in_training(run) - generates_in_training({"method": cal["method"]})
    nodes = cal.get("nodes")
    launch = 0.0 if nodes is None else RENDEZVOUS_POLL_S * ((run["nodes"] > 1) - (nodes > 1))
    if cal["device"] != "cpu":
        return launch
    workers = cal["startup_s"] - (cal.get("launch_s") or 0.0)
    cores = os.cpu_count() or 1
    load = max(1.0, run["nodes"] * run["gpus_per_node"] / cores)
    more = workers * (load / max(1.0, cal["devices"] / cores) - 1)
    return launch + more + generating * GENERATING_STARTUP_S


def generates_in_training(run: dict[str, Any]) -> bool:
    """Whether a run's method generates while it trains (GRPO, RLOO, on-policy
    distillation)."""
    from snaketune.data.kinds import kind_named
    from snaketune.methods import method_of

    return kind_named(method_of(run).trains_on).generated_in_training


def from_flops(
    config: dict[str, Any],
    name: str,
    workdir: Path,
    shape: Any,
    steps: dict[str, Any],
    measured: tuple[float, float] | None,
    gpu: str,
) -> dict[str, Any]:
    """The train stage's seconds from its FLOPs at the MFU assumed for its kind (LoRA or
    full); ``measured``: its tokens and squared tokens per step (None before tokenization:
    every example at max_length)."""
    from snaketune.core.throughput import peak_tflops
    from snaketune.methods import method_of

    run = config["runs"][name]
    devices = run["nodes"] * run["gpus_per_node"]
    method = method_of(run)
    bound = measured is None  # before tokenization: every example max_length tokens
    if bound:  # each sequence of an example (a pair's two sides) at max_length
        seqs = steps["per_step"] * method.memory(run, True).get("sequences_per_example", 1)
        measured = (run["max_length"] * seqs, run["max_length"] ** 2 * seqs)
    kind = method.adapter_of(run)
    peak, mfu = peak_tflops(str(gpu).upper()), ASSUMED_MFU[kind]
    if peak is None:
        return {"basis": f"no estimate: no peak FLOP/s known for GPU {gpu}"}
    step_s = update_seconds(shape, measured[0], measured[1], kind, devices, peak)
    return {
        "train_s": steps["steps"] * step_s,
        "outside_s": None,
        "basis": f"assumed MFU {mfu:.1%} of {gpu}'s {peak:g} TFLOP/s a GPU "
        f"({MFU_SOURCE}), not calibrated (a short run calibrates it)"
        + (
            "; every example taken at max_length: at most, until the data is tokenized"
            if bound
            else ""
        ),
    }


def format_estimate(name: str, e: dict[str, Any], devices: int) -> str:
    """The plan's line of a run's train stage estimate."""
    if "wall_s" not in e:
        return f"{name}: train time: {e['basis']}"
    outside = (
        f", {duration(e['outside_s'])} of it start-up and saving"
        if e["outside_s"]
        else ", start-up and saving not counted (a calibration measures them)"
    )
    hours = f", {e['gpu_hours']:.2f} GPU-hours" if e["gpu_hours"] is not None else ""
    return (
        f"{name}: train about {duration(e['wall_s'])} on {devices} device(s){outside}"
        f"{hours} ({e['basis']})"
    )


def duration(seconds: float) -> str:
    """3725 -> '1.0 h', 95 -> '1.6 min', 40 -> '40 s'."""
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"
