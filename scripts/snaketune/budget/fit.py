"""Will a config's runs fit? The memory plan (snaketune.budget.memplan) applied to a config: where
a run's model config.json is (downloaded, local, the Hub's cache or the Hub, asked once),
every run's plan for ``snaketune plan``, and the check the workflow makes before queueing
(against the run's GPU type, or this machine's memory for a run on the local profile).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from snaketune.budget.advice import format_plan, plan_run
from snaketune.budget.evalplan import EvalLayout, eval_layout
from snaketune.budget.memplan import CONTEXT_GIB, GIB, Setup, Shape, estimate, gpu_memory
from snaketune.budget.modelcount import shape_of
from snaketune.budget.modelfiles import (
    download_advice,
    find_config_json,
    locate_config_json,
    model_dir_of,
)
from snaketune.budget.stageplan import (
    cpu_mb,
    format_stages,
    stage_memory,
    stage_plans,
    stage_problems,
)
from snaketune.core.errors import UserError
from snaketune.data import sequence
from snaketune.plan.runspec import RunSpec


def setup_of(run: dict[str, Any], deepspeed: dict[str, Any], on_gpu: bool = True) -> Setup:
    """The estimate's settings from a validated run and its DeepSpeed JSON."""
    zero = deepspeed.get("zero_optimization", {})

    def offloaded(key: str) -> bool:
        return (zero.get(key) or {}).get("device", "none") in ("cpu", "nvme")

    spec = RunSpec.of(run)
    precision = run["precision"]
    if precision == "auto":
        precision = "bf16" if on_gpu else "fp32"
    attention = run["attn_implementation"]
    # what the run's method adds: sequences per planned example (DPO: a pair is 2), its
    # rollouts (GRPO), a reference model (held by a full fine-tune only: LoRA's is the base
    # with the adapter off), a loss on the whole logits (fused_loss False: ORPO's)
    extra = {"sequences_per_example": 1, **spec.method.memory(run, on_gpu)}
    lora = spec.lora or {}
    return Setup(
        adapter=spec.adapter,  # a method plans as its LoRA or full update, plus extra
        stage=int(zero.get("stage", 0)),
        offload_optimizer=offloaded("offload_optimizer"),
        offload_params=offloaded("offload_param"),
        nodes=run["nodes"],
        gpus_per_node=run["gpus_per_node"],
        sequence_parallel=run.get("sequence_parallel", 1),
        micro_batch_size=run["micro_batch_size"] * extra["sequences_per_example"],
        max_length=run["max_length"],
        gradient_checkpointing=bool(run["gradient_checkpointing"]),
        attention="sdpa" if attention == "auto" else attention,  # flash or sdpa: no L^2
        # Liger's fused loss keeps no logits, unless the method's loss reads them whole
        liger=on_gpu and run["liger_kernel"] is True and extra.get("fused_loss", True),
        bytes_per_weight=4 if precision == "fp32" else 2,
        lora_r=lora.get("r", 0),
        lora_targets=lora.get("target_modules", "all-linear"),
        lora_saved=tuple(lora.get("modules_to_save", ())),
        lora_router=bool(lora.get("adapt_router", False)),
        lora_vision=bool(lora.get("adapt_vision", False)),
        completion_length=extra.get("completion_length", 0),
        reference=not spec.trains_lora and extra.get("reference", False),
        vllm_share=extra.get("vllm_share", 0.0),
        quantized=spec.quantized,
        double_quant=bool(spec.quantized and spec.quantization["double_quant"]),
        merged=not spec.adapter_only,
        accumulation=run.get("gradient_accumulation_steps", 1),
    )


def shape_and_deepspeed(
    config_json: Path, run: dict[str, Any], basedir: Path
) -> tuple[Shape, dict[str, Any]]:
    """The model's shape from its config.json, and the run's DeepSpeed JSON as written. A
    run with a 4-bit base on a model that is already quantized: one line (UserError)."""
    from snaketune.core.qlora import already_quantized
    from snaketune.plan.config import resolve_deepspeed

    cfg = json.loads(config_json.read_text())
    method = already_quantized(cfg)
    if method and RunSpec.of(run).quantized:
        raise UserError(
            f"model {run['model']} ({config_json}) is already quantized ({method}): "
            "bitsandbytes cannot quantize it again for lora.quantize: 4bit; use the model's "
            "unquantized release, or drop lora.quantize"
        )
    shape = shape_of(cfg, str(config_json))
    return shape, json.loads(resolve_deepspeed(run["deepspeed"], basedir).read_text())


def machine_memory_gib() -> float:
    """Total memory of this machine, GiB."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def plan_config(
    config: dict[str, Any],
    workdir: Path,
    basedir: Path,
    gpu: str | float | None = None,
    config_path: str | Path | None = None,
) -> list[dict[str, Any]]:
    """The plan of every run of a validated config; ``gpu`` overrides the runs' own. The
    models are looked for under ``workdir`` (resources/models/), the DeepSpeed presets
    under the workflow directory ``basedir``."""
    from snaketune.budget.cost import estimate, steps_of
    from snaketune.budget.stagecost import costs_of

    plans = []
    for name, run in sorted(config["runs"].items()):
        path, why = locate_config_json(config, run, workdir)
        if path is None:
            raise UserError(
                f"runs.{name}: cannot plan: the config.json of model {run['model']} is not "
                f"in {model_dir_of(config, run, workdir)}: {why}; "
                + download_advice(config_path, run["model"])
            )
        shape, deepspeed = shape_and_deepspeed(path, run, basedir)
        chosen = gpu_memory(gpu if gpu is not None else run.get("gpu", config.get("gpu")))
        setup = run_setup(config, run, deepspeed, workdir)
        plan = {"run": name, **plan_run(shape, setup, chosen)}
        plan["stages"] = stage_plans(config, name, shape, chosen, setup)
        plan["steps"] = steps_of(config, name, workdir)
        plan["estimate"] = estimate(config, name, workdir, shape, plan["steps"])
        plan["costs"] = costs_of(config, name, shape, plan["steps"], plan["estimate"], workdir)
        plans.append(plan)
    return plans


def local_check(
    config: dict[str, Any], name: str, shape: Shape, deepspeed: dict[str, Any], workdir: Path
) -> tuple[dict[str, Any], str]:
    """The plan and line of run ``name`` with no GPU type, all its processes on this machine
    (as a local run checks it, and `snaketune plan` prints it)."""
    run = config["runs"][name]
    plan = check_cpu_run(shape, run, deepspeed, machine_memory_gib(), held(config, run, workdir))
    return plan, cpu_line(name, plan)


def check_cpu_run(
    shape: Shape,
    run: dict[str, Any],
    deepspeed: dict[str, Any],
    machine_gib: float,
    held: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A run on this machine's CPU (every emulated node here): all its processes' memory
    against the machine's (``held``: the weights its needs hold, by Setup field: held)."""
    s = replace(setup_of(run, deepspeed, on_gpu=False), **(held or {}))
    per_process = estimate(shape, s)["total"] - CONTEXT_GIB
    out = plan_run(shape, s, None)
    out["per_gpu_gib"]["total"] = round(per_process, 2)
    out["machine_gib"] = round(machine_gib, 1)
    out["processes"] = s.gpus
    out["fits"] = per_process * s.gpus <= machine_gib
    return out


def run_setup(
    config: dict[str, Any], run: dict[str, Any], deepspeed: dict[str, Any], workdir: Path
) -> Setup:
    """A run's Setup (setup_of) with the weights its needs hold in the train job counted
    (reward models, a live teacher: held)."""
    return replace(setup_of(run, deepspeed), **held(config, run, workdir))


def held(config: dict[str, Any], run: dict[str, Any], workdir: Path) -> dict[str, int]:
    """The weights a run's train job holds for its needs, by Setup field (a GRPO run's reward
    models, a live teacher: snaketune.budget.scoring, through the registry of needs)."""
    from snaketune.budget.scoring import held_params

    return held_params(config, run, workdir)


def check_runs(
    config: dict[str, Any],
    runs: list[str],
    workdir: Path,
    basedir: Path,
    local: bool,
    mem_mb: dict[str, Any] | None = None,
    stage_mem: dict[tuple[str, str], Any] | None = None,
) -> list[str]:
    """The workflow's check before anything is queued: a line per run that cannot fit.

    Against ``gpu`` (the run's or the config's); without it, a run whose jobs run on this
    machine (``local``) against this machine's memory, others not at all. A run whose jobs
    are queued (not ``local``) has its CPU memory per node checked against its train job's
    (``mem_mb``, by run), and its conversion and merge jobs' (``stage_mem``, by rule and
    run) against their plans. A run whose model's config.json cannot be read yet (a model a job
    will build or download) is skipped, with a log line. ``skip_memory_check`` turns a
    refusal into a warning.
    """
    import sys

    def say(line: str) -> None:
        print(f"memory plan: {line}", file=sys.stderr)

    found = []
    for name in runs:
        run = config["runs"][name]
        path = find_config_json(config, run, workdir)
        if path is None:
            say(f"{name}: skipped for now (the model's config.json is not there yet)")
            continue
        shape, deepspeed = shape_and_deepspeed(path, run, basedir)
        found += model_problems(name, run, shape, path)
        gpu, setup = run.get("gpu", config.get("gpu")), run_setup(config, run, deepspeed, workdir)
        if not local and (mem_mb or {}).get(name):
            found += job_memory(name, plan_run(shape, setup, None), float(mem_mb[name]))
        later = stage_checks(config, name, shape, setup, local, stage_mem or {}, say)
        if gpu is not None:
            plan = plan_run(shape, setup, gpu_memory(gpu))
            line = format_plan(name, plan)
        elif local:
            plan, line = local_check(config, name, shape, deepspeed, workdir)
        else:
            say(
                f"{name}: not checked: no GPU type set (set `gpu:` in the config, or "
                "`config: [gpu=h100-80gb]` in the profile)"
            )
            found += later
            continue
        if plan["fits"] is not False:
            say(line)
        elif run.get("skip_memory_check"):
            say(f"{line} (skip_memory_check is set: going ahead)")
        else:
            found.append(f"{line} (or set skip_memory_check: true on the run)")
        found += later
    return found


def stage_checks(
    config: dict[str, Any],
    name: str,
    shape: Shape,
    setup: Setup,
    local: bool,
    stage_mem: dict[tuple[str, str], Any],
    say,
) -> list[str]:
    """The plans of run ``name``'s other stages, said; a line per stage that cannot fit its
    GPUs, or (queued jobs) whose job asks less memory than it needs."""
    run = config["runs"][name]
    gpu = gpu_memory(run.get("gpu", config.get("gpu")))
    stages = stage_plans(config, name, shape, gpu, setup)
    for line in format_stages(name, stages):
        say(line)
    if run.get("skip_memory_check"):
        return []
    return stage_problems(name, stages, gpu) + (
        [] if local else stage_memory(name, stages, stage_mem)
    )


def job_memory(name: str, plan: dict[str, Any], mem_mb: float) -> list[str]:
    """A line when the run's CPU memory per node (loading the model in each process, or
    offload) is more than its train job asks of each node (mem_mb): SLURM would end the job
    once it is loaded."""
    need = plan["cpu_gib_per_node"]
    if need * 1024 <= mem_mb:
        return []
    return [
        f"runs.{name}: its train job asks {mem_mb:g} MB of memory per node (mem_mb), but "
        f"{need:.1f} GiB per node are needed ({plan['cpu_why']}); raise set-resources "
        f"train: mem_mb to at least {math.ceil(need * 1.1 * 1024)} in the profile (with "
        "10% to spare), or lower gpus_per_node"
    ]


# ----------------------------------------------------------------------------- evaluate


@functools.lru_cache(maxsize=64)
def _shape(path: str) -> Shape:
    import json

    return shape_of(json.loads(Path(path).read_text()), path)


def run_eval_layout(
    config: dict[str, Any], name: str, workdir: Path = Path("."), final: bool = False
) -> EvalLayout:
    """``eval_layout`` of run ``name`` of a validated config: its model's config.json where
    it can be read now (snaketune.budget.fit.locate_config_json), its `gpu` (or the config's)."""
    run = config["runs"][name]
    settings = run["eval"]
    if settings.get("nodes", "auto") != "auto" and settings.get("gpus_per_node", "auto") != "auto":
        return eval_layout(run, None, None, final)  # as set: nothing to read
    shape = readable_shape(config, run, workdir)
    return eval_layout(run, shape, gpu_memory(run.get("gpu", config.get("gpu"))), final)


def readable_shape(config: dict[str, Any], run: dict[str, Any], workdir: Path) -> Shape | None:
    """The run's model shape where its config.json can be read now; None while it cannot,
    or for an architecture the plan cannot count (the train check says so)."""
    path, _ = locate_config_json(config, run, workdir)
    try:
        return _shape(str(path)) if path is not None else None
    except UserError:
        return None


def eval_job_layout(
    config: dict[str, Any], run: str, job_side: bool, final: bool = False
) -> tuple[int, int]:
    """(nodes, GPUs per node) of an evaluate job of ``run``: its plan's layout
    (snaketune.budget.stageplan), or inside a SLURM job what the job was given (the layout
    decided when it was queued: config.json may have been downloaded since)."""
    import os

    if job_side and os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_GPUS_ON_NODE"):
        return int(os.environ.get("SLURM_JOB_NUM_NODES", 1)), int(os.environ["SLURM_GPUS_ON_NODE"])
    layout = run_eval_layout(config, run, final=final)
    return layout.nodes, layout.gpus_per_node


def planned_mem_mb(
    config: dict[str, Any], name: str, stage: str, floor: int, workdir: Path = Path(".")
) -> int:
    """The memory (mem_mb, per node) a job of ``stage`` for run ``name`` asks by default: its
    stage's plan (snaketune.budget.stageplan) with a tenth to spare, and at least ``floor``;
    ``floor`` while the model's config.json cannot be read (a profile's set-resources
    replaces it; the check before queueing compares either with the plan)."""
    run = config["runs"][name]
    shape = readable_shape(config, run, workdir)
    if shape is None:
        return floor
    stages = stage_plans(config, name, shape, gpu_memory(run.get("gpu", config.get("gpu"))))
    need = cpu_mb(stages.get(stage, {}))
    return floor if need is None else max(floor, math.ceil(need * 1.1))


def model_problems(
    name: str, run: dict[str, Any], shape: Shape, config_json: Path | None = None
) -> list[str]:
    """What the run's settings ask of its model that the model is not: a router's loss on a
    dense model, a sequence split its attention heads do not divide, packing where no
    attention implementation can pack it (linear attention, no position ids), tools where
    its chat template's calls cannot be parsed."""
    found = []
    if run.get("packing") is True and config_json is not None:  # auto pads such a model
        from snaketune.data.kernels import unpackable

        why = unpackable(json.loads(config_json.read_text()))
        if why:
            found.append(
                f"runs.{name}.packing: model {run['model']} cannot train on packed "
                f"sequences ({why}); set packing: auto (trains it padded) or false"
            )
    from snaketune.methods import calls_tools
    from snaketune.tools.tooluse import template_problem

    if calls_tools(run) and config_json is not None:
        why = template_problem(config_json.parent)
        if why:
            found.append(
                f"runs.{name}.grpo.tools: model {run['model']} cannot call tools here ({why}); "
                "start from a model of such a family"
            )
    if run.get("router_aux_loss_coef", "auto") != "auto" and not shape.moe:
        found.append(
            f"runs.{name}.router_aux_loss_coef: model {run['model']} is not a "
            "mixture of experts (its config.json names no experts); drop the "
            "key"
        )
    split = sequence.check_model(f"runs.{name}", run, shape.heads, shape.kv_heads)
    return found + ([split] if split else [])


def cpu_line(name: str, plan: dict[str, Any]) -> str:
    """The verdict of a CPU run (no GPU type set) against this machine's memory."""
    verdict = "fits" if plan["fits"] else "does NOT fit"
    return (
        f"{name}: no GPU type set (config key gpu): a CPU run, {plan['processes']} "
        f"process(es) x {plan['per_gpu_gib']['total']:.2f} GiB against this "
        f"machine's {plan['machine_gib']:.1f} GiB: {verdict}"
    )
