"""What each stage of a run costs besides training's steps, and what the whole pipeline
costs: seconds and GPU-hours per stage (download, tokenize, shard, reference, teacher, train,
convert, merge, evaluate), each with its basis. A finished run like this one (the train
estimate's calibration) gives its stages' measured times (Snakemake's benchmark files);
without one, a GPU run's stages are worked out from the model's bytes and FLOPs at the
assumed rates below (docs/benchmarks.md says where each comes from). Stages whose outputs
are already there cost nothing: Snakemake will not run them again."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from snaketune.budget.rates import (
    DISK_MB_S,
    DOWNLOAD_MB_S,
    MB,
    bandwidth,
    decode_step,
    forward_seconds,
    stage,
    weight_bytes,
)
from snaketune.budget.scoring import NeedContext, plan_of
from snaketune.plan.pipeline import (
    CONVERT,
    EVALUATE,
    EVALUATE_BASE,
    MERGE,
    SHARD,
    TOKENIZE,
    TRAIN,
    run_order,
)


def weights_in(folder: Path) -> bool:
    """Whether a model's weights are there (its download done)."""
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))


def evaluate_seconds(
    config: dict[str, Any], name: str, shape: Any, layout: Any, gpu: str, workdir: Path
) -> dict[str, Any]:
    """An evaluate stage on a GPU: loading the model, then its greedy generations, each
    decode step as rates.decode_step plans it, eval.batch_size examples a step on each
    process; a set that generates nothing (documents: their loss) a forward pass over its
    rows instead."""
    from snaketune.budget.evalplan import eval_examples
    from snaketune.core.throughput import peak_tflops
    from snaketune.evaluation.settings import generates
    from snaketune.methods import method_of

    run, examples = config["runs"][name], eval_examples(config, name, workdir)
    load = weight_bytes(shape) / (DISK_MB_S * MB)
    gpus = layout.processes
    if examples is None:
        return stage(None, gpus, "not estimated: its eval set is not readable yet")
    if method_of(run).reward_model:  # one forward pass per pair
        return stage(
            load,
            gpus,
            f"loading {weight_bytes(shape) / 1e9:.1f} GB at "
            f"{DISK_MB_S:g} MB/s; scoring {examples} pairs is seconds",
        )
    loading = f"loading {weight_bytes(shape) / 1e9:.1f} GB at the assumed disk rate"
    if not generates(config, run):  # its loss alone: one forward pass a row
        peak = peak_tflops(gpu.upper())
        if peak is None:
            return stage(None, gpus, f"not estimated: no peak FLOP/s known for GPU {gpu}")
        tokens = examples * run["max_length"]
        forward = forward_seconds(shape.active_params, tokens, gpus, peak)
        return stage(
            load + forward,
            gpus,
            f"{examples} rows' loss, no generation: a forward pass of at most {tokens:,} "
            f"tokens (every row max_length long) at the assumed MFU; {loading}",
        )
    if bandwidth(gpu) is None:
        return stage(None, gpus, f"not estimated: no memory bandwidth known for GPU {gpu}")
    batches = math.ceil(examples / (run["eval"]["batch_size"] * gpus))
    steps = batches * run["eval"]["max_new_tokens"]
    step_s, bound = decode_step(shape, run["eval"]["batch_size"], gpu)
    return stage(
        load + steps * step_s,
        gpus,
        f"{examples} examples, {steps} decode steps of {step_s * 1e3:.1f} ms ({bound}; at "
        f"most: every answer max_new_tokens long), {loading}",
    )


def assumed_stages(
    config: dict[str, Any],
    name: str,
    shape: Any,
    steps: dict[str, Any],
    tokens: float | None,
    workdir: Path,
) -> dict[str, dict[str, Any]]:
    """A GPU run's own stages besides training, from its model's bytes and FLOPs at the
    assumed rates. ``tokens``: one optimizer step's tokens (a bound before tokenization)."""
    from snaketune.budget.evalplan import eval_layout, evaluate_rules
    from snaketune.budget.memplan import gpu_memory
    from snaketune.core.throughput import peak_tflops
    from snaketune.methods import method_of
    from snaketune.plan.runspec import RunSpec, merged

    run = config["runs"][name]
    given = run.get("gpu", config.get("gpu"))  # a GPU type, or its memory in GiB
    gpu = str(given)
    spec, size = RunSpec.of(run), weight_bytes(shape)
    disk = f"at {DISK_MB_S:g} MB/s (assumed disk rate)"
    out: dict[str, dict[str, Any]] = {}
    if tokens is not None and "steps_per_epoch" in steps:
        epoch = tokens * steps["steps_per_epoch"]  # int32 ids and labels, read and written
        out[SHARD.name] = stage(epoch * 16 / (DISK_MB_S * MB), 0, f"one epoch's tokens {disk}")
        peak = peak_tflops(gpu.upper())
        for need in spec.needs:  # the stages of its needs (snaketune.budget.scoring)
            plan = plan_of(need)
            if plan.seconds is not None and (
                figure := plan.seconds(NeedContext(config, name, shape, None, epoch, peak, workdir))
            ):
                out[need.name] = figure
    if method_of(run).adapter_of(run) == "lora":
        out[CONVERT.name] = stage(0.0, 0, "the adapter alone: seconds")
        if merged(run):
            basis = f"the base read and the merged model written {disk}"
            out[MERGE.name] = stage(2 * size / (DISK_MB_S * MB), 0, basis)
    else:  # the ZeRO checkpoint's fp32 weights read, the model written
        basis = f"fp32 weights read and the model written {disk}"
        out[CONVERT.name] = stage(shape.params * 6 / (DISK_MB_S * MB), 0, basis)
    if "eval_dataset" in run:
        for rule, final in evaluate_rules(config, name).items():
            layout = eval_layout(run, shape, gpu_memory(given), final)
            out[rule] = evaluate_seconds(config, name, shape, layout, gpu, workdir)
    return out


def calibrated_stages(
    config: dict[str, Any],
    name: str,
    measured: dict[str, float],
    source: str,
    shape_at: tuple[Any, Path] | None = None,
) -> dict[str, dict[str, Any]]:
    """A run's own stages as the calibration run's took (``measured``: rule -> seconds); a
    CPU run's evaluations (``shape_at``: the model's shape and the working directory) by
    as much more or less as the assumed rates plan this run's than the calibration run's
    (another eval set, generating or not, a teacher's pass)."""
    from snaketune.budget.evalplan import eval_layout, evaluate_rules
    from snaketune.budget.memplan import gpu_memory
    from snaketune.methods import method_of
    from snaketune.plan.runspec import merged

    run = config["runs"][name]
    gpu = run.get("gpu", config.get("gpu"))
    has = {SHARD.name, CONVERT.name}  # the stages this run has
    if method_of(run).adapter_of(run) == "lora" and merged(run):
        has.add(MERGE.name)
    if "eval_dataset" in run:
        has.update(evaluate_rules(config, name))
    # a rule the calibration did not run (its base evaluated before it) as its evaluate
    like = {
        r: r if r in measured else EVALUATE.name for r in has if r in measured or EVALUATE.name in r
    }
    like = {r: m for r, m in like.items() if m in measured}
    out = {}
    for rule, mine in like.items():
        gpus = 0
        if gpu is not None and rule.startswith(EVALUATE.name):
            gpus = eval_layout(run, None, gpu_memory(gpu), rule == EVALUATE.name).processes
        said = f"as run {source}'s {'' if rule == mine else mine + ' '}took"
        out[rule] = stage(measured[mine], gpus, said)
    if gpu is None and shape_at is not None and source in config["runs"]:
        from snaketune.budget.calibrate import cpu_evaluation, cpu_evaluation_of

        both = [(r, cpu_evaluation_of(config, r, *shape_at)) for r in (name, source)]
        mine, theirs = (
            cpu_evaluation(config["runs"][r], shape_at[0], e) if e[0] is not None else {}
            for r, e in both
        )
        for rule in set(out) & set(mine):
            if like[rule] not in theirs:
                continue
            took, more = out[rule]["s"], mine[rule]["s"] - theirs[like[rule]]["s"]
            if abs(more) >= 0.05 * took:
                said = f"{out[rule]['basis']}, {more:+.1f} s for what this one does otherwise"
                out[rule] = stage(max(took + more, took / 4), 0, f"{said} (assumed rates)")
    return out


def run_stages(
    config: dict[str, Any],
    name: str,
    shape: Any,
    steps: dict[str, Any],
    train: dict[str, Any],
    workdir: Path,
) -> dict[str, dict[str, Any]]:
    """Every stage of run ``name`` of its own (train included, from ``train``: the train
    estimate), in the order it goes through them; empty where nothing is estimated."""
    from snaketune.budget.cost import tokens_per_step

    run = config["runs"][name]
    gpu = run.get("gpu", config.get("gpu"))
    out: dict[str, dict[str, Any]] = {}
    if "wall_s" in train:
        devices = run["nodes"] * run["gpus_per_node"] if gpu is not None else 0
        out[TRAIN.name] = stage(train["wall_s"], devices, train["basis"])
    if "stages" in train:
        cal = (train["stages"], train["calibrated_from"])
        out.update(calibrated_stages(config, name, *cal, (shape, workdir)))
    elif gpu is None and "wall_s" in train:  # a CPU run before a calibration
        from snaketune.budget.calibrate import cpu_evaluation_of, cpu_stages

        evaluation = cpu_evaluation_of(config, name, shape, workdir)
        out.update(cpu_stages(config, name, shape, steps, evaluation))
    elif gpu is not None and "per_step" in steps:
        measured = tokens_per_step(config, name, workdir, steps["per_step"])
        if measured is not None:
            tokens = measured[0]
        elif steps.get("tokens"):  # before tokenization: a sample's or a stated size's mean
            tokens = steps["tokens"] / steps["examples"] * steps["per_step"]
        else:
            tokens = steps["per_step"] * run["max_length"]
        out.update(assumed_stages(config, name, shape, steps, tokens, workdir))
    return {rule: out[rule] for rule in run_order() if rule in out}


def shared_stages(
    config: dict[str, Any], shapes: dict[str, Any], workdir: Path
) -> dict[str, dict[str, Any]]:
    """The stages the runs share, once each and only where their outputs are not there yet:
    a model's download (its bytes at DOWNLOAD_MB_S), a dataset's tokenization (its tokens at
    a measured rate: snaketune.budget.tokenizeplan)."""
    from snaketune.budget.tokenizeplan import clean_cost, tokenize_cost
    from snaketune.core import parts as tokenized_set
    from snaketune.plan.stages import parts_of, tokenized

    out: dict[str, dict[str, Any]] = {}
    for name, shape in shapes.items():
        run = config["runs"][name]
        model, folder = run["model"], workdir / "resources/models" / run["model"]
        done = weights_in(folder)
        if shape is not None and not done and f"download_model {model}" not in out:
            size, hub = weight_bytes(shape), config["models"][model]["source"] == "hub"
            rate = DOWNLOAD_MB_S if hub else DISK_MB_S
            where = "assumed Hub rate" if hub else "a local model copied: assumed disk rate"
            out[f"download_model {model}"] = stage(
                size / (rate * MB), 0, f"{size / 1e9:.1f} GB at {rate:g} MB/s ({where})"
            )
        sets = {run["dataset"]: tokenized(config, name)}
        if run.get("eval_dataset") in config["datasets"]:
            sets[run["eval_dataset"]] = tokenized(config, name, eval_set=True)
        for dataset, path in sets.items():
            out.update({k: v for k, v in download_costs(config, dataset, workdir) if k not in out})
            out.update(clean_cost(config, dataset, name, workdir))
            key = f"{TOKENIZE.name} {Path(path).parent.name}"
            if key not in out and not tokenized_set.exists(workdir / path):
                parts = parts_of(config, dataset, workdir / Path(path).parent)
                out[key] = tokenize_cost(config, dataset, run["max_length"], workdir, parts)
    return out


def download_costs(
    config: dict[str, Any], dataset: str, workdir: Path
) -> list[tuple[str, dict[str, Any]]]:
    """The downloads of a dataset's Hub sources not downloaded yet: their files' bytes (a
    ``files`` choice, as the Hub lists them where it answers), else a text set's stated
    tokens at the tokenize plan's bytes a token (its text: compressed files are smaller),
    at the assumed Hub rate; not estimated where neither is known."""
    from snaketune.budget.tokenizeplan import BYTES_PER_TOKEN
    from snaketune.data.formats import components
    from snaketune.plan.corpus import stated
    from snaketune.plan.stages import sources_bytes

    out = []
    for part in components(config, dataset):
        name = part["name"]
        if config["datasets"][name]["source"] != "hub":
            continue
        if (workdir / "resources/datasets" / name / "data.parquet").is_file():
            continue
        size, how = sources_bytes(config, name), "its files as the Hub lists them"
        said = stated(config, name)[0]
        if size is None and said and said.get("tokens"):
            size = said["tokens"] * BYTES_PER_TOKEN
            how = f"the tokens {said['from']} states, at {BYTES_PER_TOKEN:g} bytes a token"
        if size is None:
            out.append(
                (
                    f"download_dataset {name}",
                    stage(None, 0, "not estimated: its size is not known before the download"),
                )
            )
            continue
        basis = f"{size / 1e9:.1f} GB ({how}) at {DOWNLOAD_MB_S:g} MB/s (assumed Hub rate)"
        out.append((f"download_dataset {name}", stage(size / (DOWNLOAD_MB_S * MB), 0, basis)))
    return out


def total(stages: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The stages added up: seconds one after another (independent jobs may overlap) and
    GPU-hours; ``missing`` counts the stages without a figure."""
    every = [s for group in stages for s in group.values()]
    known = [s for s in every if s["s"] is not None]
    return {
        "s": sum(s["s"] for s in known),
        "gpu_hours": sum(s["gpu_hours"] or 0.0 for s in known),
        "missing": len(every) - len(known),
    }


def format_stage_costs(name: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    """A line per stage of ``name`` (a run, or `pipeline` for the shared stages) and, where
    it has any, its total."""
    from snaketune.budget.cost import duration

    lines = []
    for rule, s in stages.items():
        if rule == TRAIN.name:  # the train line says it, with its basis
            continue
        if s["s"] is None:
            lines.append(f"{name}: {rule}: {s['basis']}")
            continue
        hours = f", {s['gpu_hours']:.2f} GPU-hours on {s['gpus']} GPU(s)" if s["gpu_hours"] else ""
        lines.append(f"{name}: {rule}: about {duration(s['s'])}{hours} ({s['basis']})")
    return lines


def format_total(what: str, t: dict[str, Any]) -> str:
    from snaketune.budget.cost import duration

    left = f"; {t['missing']} stage(s) not estimated" if t["missing"] else ""
    hours = f", {t['gpu_hours']:.2f} GPU-hours" if t["gpu_hours"] else ""
    return f"{what}: about {duration(t['s'])} one stage after another{hours}{left}"


def costs_of(
    config: dict[str, Any],
    name: str,
    shape: Any,
    steps: dict[str, Any],
    train: dict[str, Any],
    workdir: Path,
) -> dict[str, Any]:
    """Run ``name``'s costs: its own stages, the shared ones it waits on that are not done
    yet, and its own stages' total (the plan's and the dry run's figures, and --json's)."""
    from snaketune.plan.stages import run_eval_tokenize_spec, tokenize_key

    own = run_stages(config, name, shape, steps, train, workdir)
    shared = shared_stages(config, {name: shape}, workdir)
    if EVALUATE_BASE.name in own:  # once per base model and eval set, and not again once done
        key = tokenize_key(run_eval_tokenize_spec(config, name))
        base = own.pop(EVALUATE_BASE.name)
        if not (workdir / "results/base_eval" / key / "metrics.json").is_file():
            shared[f"evaluate_base {key}"] = base
    return {"stages": own, "shared": shared, "total": total([own])}


def format_costs(name: str, costs: dict[str, Any]) -> list[str]:
    """The plan's lines of a run's stages besides training, and its total."""
    lines = format_stage_costs(name, costs["stages"])
    if len(costs["stages"]) > 1:
        lines.append(format_total(f"{name}: its stages in all", costs["total"]))
    return lines


def format_pipeline(costs: list[dict[str, Any]]) -> list[str]:
    """The shared stages (each once) and the whole pipeline's total, of every run's costs."""
    shared: dict[str, dict[str, Any]] = {}
    for c in costs:
        shared.update(c["shared"])
    lines = format_stage_costs("pipeline", shared)
    every = [c["stages"] for c in costs] + [shared]
    if any(every):
        line = format_total("pipeline: every run and stage", total(every))
        blind = sum(1 for c in costs if TRAIN.name not in c["stages"])  # no train estimate
        lines.append(
            line
            + (f"; {blind} run(s) not estimated (their train time and stages)" if blind else "")
        )
    return lines
