"""The memory plan of a run's stages besides training: generation while training, the
reference stage, the evaluate stages (their layout from snaketune.budget.evalplan),
conversion and merge; and the per-job memory the workflow asks the scheduler for."""

from __future__ import annotations

import math
from typing import Any

from snaketune.budget.evalplan import (
    EVAL_FIX,
    LIBRARIES_GIB,
    eval_bytes,
    eval_cpu_gib,
    eval_four_bit,
    eval_layout,
    evaluate_rules,
)
from snaketune.budget.memplan import (
    CONTEXT_GIB,
    FRAGMENTATION,
    GIB,
    SAVED_BYTES,
    Setup,
    Shape,
    model_states,
    quant_bytes,
    reference_copy,
    stored_weights,
)
from snaketune.plan.pipeline import CONVERT, MERGE


def stage_plans(
    config: dict[str, Any],
    name: str,
    shape: Shape,
    gpu_gib: float | None,
    setup: Setup | None = None,
) -> dict[str, dict[str, Any]]:
    """The stages of run ``name`` besides training's steps, planned: generation inside the
    training job (with its ``setup``), the reference and teacher stages, each evaluate stage
    it runs (its layout, GiB per GPU, whether that fits ``gpu_gib``, its CPU memory per node)
    and the CPU memory of conversion, merging and its data's cleaning."""
    from snaketune.budget.scoring import NeedContext, plan_of
    from snaketune.budget.tokenizeplan import clean_memory
    from snaketune.methods import method_of

    run = config["runs"][name]
    out: dict[str, dict[str, Any]] = export_plans(run, shape) | clean_memory(config, name)
    for need in method_of(run).needs(run):  # its needs' stages (snaketune.budget.scoring)
        memory = plan_of(need).memory
        if memory is not None and (plan := memory(NeedContext(config, name, shape, gpu_gib))):
            out[need.name] = plan
    if setup is not None:
        out.update(training_pass_plans(run, shape, setup, gpu_gib))
    if "eval_dataset" not in run:
        return out
    for stage, final in evaluate_rules(config, name).items():
        layout = eval_layout(run, shape, gpu_gib, final)
        fits = None if gpu_gib is None else layout.per_gpu_gib <= gpu_gib
        cpu, cpu_why = eval_cpu_gib(
            shape, layout, saved_bytes(run, shape, final), final and eval_four_bit(run) is not None
        )
        out[stage] = {
            "nodes": layout.nodes,
            "gpus_per_node": layout.gpus_per_node,
            "per_gpu_gib": layout.per_gpu_gib,
            "fits": fits,
            "why": layout.why,
            "sharded": layout.processes > 1,
            "fix": EVAL_FIX,
            "cpu_gib_per_node": cpu,
            "cpu_why": cpu_why,
        }
    return out


def saved_bytes(run: dict[str, Any], shape: Shape, final: bool) -> int | None:
    """Bytes a weight of the checkpoint an evaluate stage loads: the base's (its config.json's
    dtype), or a run's own model as exported (export.dtype; auto: the run's precision)."""
    if not final:
        return shape.saved_bytes
    dtype = run["export"]["dtype"]
    if dtype == "auto":
        return 4 if run["precision"] == "fp32" else 2
    return SAVED_BYTES.get(dtype)


def training_pass_plans(
    run: dict[str, Any], shape: Shape, s: Setup, gpu_gib: float | None
) -> dict[str, dict[str, Any]]:
    """Generation inside the training job, planned beside what training keeps on each GPU
    between steps (weights, gradients and optimizer states, memplan.model_states; a frozen
    reference): the held-out pass and GRPO's completions (``generation_passes``). Under
    ZeRO-3 a generation either gathers the whole model onto each GPU
    (eval.gather_for_generation: true, or `auto` when the GPUs have the room) or runs on the
    shards (false: a layer gathered at a time, counted in the weights). The figure required
    is the one the setting may take: gathered for true, the shards for false and auto (which
    falls back to them); the gathered figure is said beside it."""
    resident = sum(model_states(shape, s).values()) + reference_copy(shape, s)
    zero3 = s.stage >= 3
    rest = stored_weights(shape, s) * (1 - 1 / s.gpus) if zero3 else 0.0  # a gather's addition
    setting = run["eval"].get("gather_for_generation", "auto")

    def gib(extra: float) -> float:
        return round((resident + extra) * (1 + FRAGMENTATION) / GIB + CONTEXT_GIB, 2)

    out = {}
    for stage, (loss, gen, what, fix) in generation_passes(run, shape, s).items():
        shards = gib(max(loss, gen or 0.0))
        gathered = gib(max(loss, rest + gen)) if zero3 and gen is not None else None
        need = gathered if gathered is not None and setting is True else shards
        why = f"beside training's states ({resident / GIB:.1f} GiB): {what}"
        fix += (
            ", or give the run more GPUs (ZeRO-3 divides training's states among them)"
            if zero3
            else ", or shard the run's states (deepspeed: zero3)"
        )
        if gathered is not None and setting is True:
            why += "; the whole model gathered onto each GPU (eval.gather_for_generation: true)"
            fix = (
                "set eval.gather_for_generation: false or auto (generate on the shards: "
                "slower, no GPU holds the whole model); or " + fix
            )
        elif gathered is not None:
            verdict = {None: "", True: " (fits)", False: " (does not fit)"}[
                None if gpu_gib is None else gathered <= gpu_gib
            ]
            why += (
                f"; generating on the ZeRO-3 shards (eval.gather_for_generation: "
                f"{str(setting).lower()}; gathered whole: {gathered:.1f} GiB{verdict})"
            )
        out[stage] = {
            "nodes": s.nodes,
            "gpus_per_node": s.gpus_per_node,
            "per_gpu_gib": need,
            "fits": None if gpu_gib is None else need <= gpu_gib,
            "sharded": zero3,
            "why": why,
            "fix": fix,
        }
    return out


def generation_passes(
    run: dict[str, Any], shape: Shape, s: Setup
) -> dict[str, tuple[float, float | None, str, str]]:
    """What each generating pass of a training job adds on a GPU, by stage: (its loss pass's
    bytes, its generation's bytes or None, what they are, what would lower them): the
    held-out pass (eval_steps: a batch's logits, then with answers its greedy generation's
    KV cache and prefill) and GRPO's completions without vLLM (their KV cache)."""
    from snaketune.core.heldout import ANSWERS
    from snaketune.plan.runspec import RunSpec

    w, out = s.bytes_per_weight, {}
    if run.get("eval_steps") is not None and "eval_dataset" in run:
        ev, metric = run["eval"], run["export"]["metric"]
        if metric == "auto":
            metric = RunSpec.of(run).method.heldout_metric
        answers = metric in ANSWERS or bool(ev["during_training_answers"])
        part = eval_bytes(shape, 1, ev["batch_size"], run["max_length"], ev["max_new_tokens"], w)
        out["train/heldout_pass"] = (
            part["loss_pass"],
            part["kv_cache"] + part["prefill"] if answers else None,
            f"eval.batch_size {ev['batch_size']}: its logits"
            + (f", then {ev['max_new_tokens']} new tokens' KV cache" if answers else ""),
            "lower eval.batch_size" + (" or eval.max_new_tokens" if answers else ""),
        )
    if s.completion_length and not s.vllm_share:
        tokens = s.micro_batch_size * s.sequence
        kv = shape.layers * shape.kv_width * w * tokens
        out["train/generation"] = (
            0.0,
            kv,
            f"{s.micro_batch_size} completions' KV cache",
            "lower micro_batch_size or grpo.max_completion_length",
        )
    return out


def export_plans(run: dict[str, Any], shape: Shape) -> dict[str, dict[str, Any]]:
    """CPU memory of convert_checkpoint and merge_lora (no GPU): both stream one tensor at a
    time and gate the written model with a load budget of one shard (docs/benchmarks.md,
    measured at 285M weights); a LoRA run's conversion gates the adapter on its base,
    which stays memory-mapped where it is read in its own dtype; a 4-bit run's base is
    loaded in 4 bits as the training job loaded it (what the 4-bit model weighs, and a
    tensor being quantized)."""
    from snaketune.core.io import parse_size
    from snaketune.plan.runspec import RunSpec

    spec = RunSpec.of(run)
    # a shard holds at most the whole model (fp32: the widest a conversion writes)
    shard = min(parse_size(run["export"]["max_shard_size"]), 4 * shape.params)
    streamed = LIBRARIES_GIB + (4 * shape.largest_layer + 2 * shard) / GIB
    out = {
        CONVERT.name: {
            "cpu_gib": round(streamed, 2),
            "why": "one tensor at a time, the gate's load budget of a shard",
        }
    }
    if spec.trains_lora and spec.quantized:
        # the weights the 4-bit model keeps in its load dtype: the run's precision (bf16 on
        # the GPU nodes the plan is for), or fp32
        w = 4 if run["precision"] == "fp32" else 2
        per_linear = quant_bytes(spec.quantization["double_quant"])
        four_bit = w * (shape.params - shape.linear_params) + per_linear * shape.linear_params
        out[CONVERT.name] = {
            "cpu_gib": round(LIBRARIES_GIB + (four_bit + 4 * shape.largest_layer) / GIB, 2),
            "why": "the adapter's gate loads the base in 4 bits as training did, one tensor "
            "at a time",
        }
    if spec.trains_lora and not spec.adapter_only:
        out[MERGE.name] = {
            "cpu_gib": round(streamed, 2),
            "why": "one base tensor at a time, the gate's load budget of a shard",
        }
    return out


def format_stages(name: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    """One line per planned stage."""
    lines = [
        f"{name}: {stage}: about {p['cpu_gib']:.1f} GiB of CPU memory ({p['why']})"
        for stage, p in stages.items()
        if "cpu_gib" in p
    ]
    for stage, p in stages.items():
        if "cpu_gib" in p:
            continue
        verdict = {True: "fits", False: "does NOT fit", None: "not checked"}[p["fits"]]
        sharded = " (ZeRO-3 shards)" if p["sharded"] else ""
        cpu = (
            f"; about {p['cpu_gib_per_node']:.1f} GiB of CPU memory per node ({p['cpu_why']})"
            if "cpu_gib_per_node" in p
            else ""
        )
        lines.append(
            f"{name}: {stage} on {p['nodes']} node(s) x {p['gpus_per_node']} GPU(s)"
            f"{sharded}: {p['per_gpu_gib']:.1f} GiB per GPU, {verdict}; "
            f"{p['why']}{cpu}"
        )
    return lines


def stage_problems(name: str, stages: dict[str, dict[str, Any]], gpu_gib: float) -> list[str]:
    """A line per stage that cannot fit, with the changes that would."""
    return [
        f"runs.{name}: {stage} needs {p['per_gpu_gib']:.1f} GiB per GPU on "
        f"{p['nodes']} node(s) x {p['gpus_per_node']} GPU(s) ({p['why']}), more than the "
        f"GPU's {gpu_gib:g}; {p['fix']}"
        for stage, p in stages.items()
        if p.get("fits") is False
    ]


def stage_memory(
    name: str, stages: dict[str, dict[str, Any]], asked: dict[tuple[str, str], Any]
) -> list[str]:
    """A line per stage whose job asks less memory (mem_mb, by rule and run; per node) than
    its plan: SLURM would end it once it is loaded."""
    lines = []
    for stage, p in stages.items():
        mem, need = asked.get((stage, name)), cpu_mb(p)
        if need is None or not mem or need <= float(mem):
            continue
        why = p.get("cpu_why", p["why"])
        lines.append(
            f"runs.{name}: its {stage} job asks {float(mem):g} MB of memory "
            f"(mem_mb), but about {need / 1024:.1f} GiB are needed ({why}); "
            f"raise set-resources {stage}: mem_mb to at least "
            f"{math.ceil(need * 1.1)} in the profile"
        )
    return lines


def cpu_mb(plan: dict[str, Any]) -> float | None:
    """MB of CPU memory (per node) a planned stage needs; None: not planned."""
    gib = plan.get("cpu_gib", plan.get("cpu_gib_per_node"))
    return None if gib is None else gib * 1024
