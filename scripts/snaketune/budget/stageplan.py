"""The memory plan of a run's stages besides training, and the layout it decides for the
evaluate stages (evaluate_base, evaluate_start, evaluate).

An evaluate job holds the model in the GPUs' precision (bf16: 2 bytes a weight) and the
larger of a batch's loss pass (its logits) and a batch's generation (the KV cache, and the
prompt's pass through an MLP while it fills): one comes after the other
(bench/eval_memory.py measures both). Over N GPUs the
weights are sharded (DeepSpeed ZeRO-3, snaketune.evaluation.sharded): 1/N of them on each,
plus the largest layer gathered for its forward. ``eval.nodes`` and ``eval.gpus_per_node``
are `auto` by default: one GPU where the model fits it, else the fewest GPUs of one node
(up to the run's gpus_per_node) that hold it, then more of the run's nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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

EVAL_BYTES = 2  # an evaluate job on GPUs runs in bf16 (fp16 where bf16 is missing)


def four_bit_base(shape: Shape, double_quant: bool) -> float:
    """Bytes of a 4-bit base as a run loads it for inference: the decoder linears in 4 bits
    with their constants, the other weights in fp32 after peft's k-bit preparation."""
    return (
        4 * (shape.params - shape.linear_params) + quant_bytes(double_quant) * shape.linear_params
    )


def eval_bytes(shape: Shape, processes: int, batch: int, prompt: int, new_tokens: int,
               w: int = EVAL_BYTES, four_bit: bool | None = None,
               logit_bytes: int | None = None) -> dict[str, float]:  # fmt: skip
    """Bytes per GPU of an evaluation over ``processes`` GPUs, by what holds it (unrounded);
    ``four_bit`` (its double quantization): a 4-bit run's adapter on its base as trained
    (the decoder linears in 4 bits, the other weights in fp32 after peft's k-bit
    preparation); ``logit_bytes``: bytes a logit costs in the loss pass (on a GPU w + 4:
    the logits and their fp32 copy, moved to the CPU for the loss)."""
    weights = shape.params * w / processes
    if four_bit is not None:
        weights = four_bit_base(shape, four_bit)
    tokens = batch * prompt
    return {
        "weights": weights,
        "gathered_layer": shape.largest_layer * w if processes > 1 else 0,
        "loss_pass": tokens * shape.vocab * (logit_bytes or w + 4),
        # the KV cache of prompt and completion, and the prompt's pass through one MLP
        # (gate, up and their product) while the cache fills
        "kv_cache": shape.layers * shape.kv_width * batch * (prompt + new_tokens) * w,
        "prefill": tokens * shape.mlp_pass * w,
    }


def eval_gib(shape: Shape, processes: int, batch: int, prompt: int, new_tokens: int,
             w: int = EVAL_BYTES, four_bit: bool | None = None) -> dict[str, float]:  # fmt: skip
    """GiB per GPU of an evaluation (``eval_bytes``) and the total: the weights and the
    larger of the loss pass and generation (one comes after the other), with the margin."""
    parts = {k: v / GIB for k, v in eval_bytes(shape, processes, batch, prompt, new_tokens, w,
                                               four_bit).items()}  # fmt: skip
    used = (parts["weights"] + parts["gathered_layer"]
            + max(parts["loss_pass"], parts["kv_cache"] + parts["prefill"]))  # fmt: skip
    parts["total"] = used * (1 + FRAGMENTATION) + CONTEXT_GIB
    return {k: round(v, 2) for k, v in parts.items()}


@dataclass(frozen=True)
class EvalLayout:
    """Where a run's evaluate stages run, and why."""

    nodes: int
    gpus_per_node: int
    per_gpu_gib: float | None  # the plan's figure on that layout (None: not planned)
    why: str

    @property
    def processes(self) -> int:
        return self.nodes * self.gpus_per_node


def eval_layout(run: dict[str, Any], shape: Shape | None, gpu_gib: float | None,
                final: bool = False) -> EvalLayout:  # fmt: skip
    """The evaluate stages' layout of a validated run: its ``eval.nodes`` and
    ``eval.gpus_per_node`` where given, else (``auto``) the fewest GPUs that hold the
    model, from the plan against ``gpu_gib``; one GPU when either is unknown. ``final``:
    the layout of the run's own model (rule evaluate), which for a 4-bit run that keeps
    its adapter (export.merged: false) is that adapter on the 4-bit base, on one GPU."""
    settings = run["eval"]
    nodes, gpus = settings.get("nodes", "auto"), settings.get("gpus_per_node", "auto")
    size = (settings["batch_size"], run["max_length"], settings["max_new_tokens"])
    four_bit = eval_four_bit(run) if final else None

    def figure(n: int) -> float | None:
        return None if shape is None else eval_gib(shape, n, *size, four_bit=four_bit)["total"]

    if four_bit is not None:  # evaluate.py loads it so on one GPU, whatever eval asks
        return EvalLayout(1, 1, figure(1), "the adapter on its 4-bit base as trained "
                          "(export.merged: false) runs on one GPU")  # fmt: skip
    from snaketune.methods import method_of

    if not method_of(run).generates:  # snaketune.evaluation.reward_eval: one process
        return EvalLayout(1, 1, figure(1), "a reward model is scored on one GPU")

    if nodes != "auto" and gpus != "auto":
        why = "as set (eval.nodes, eval.gpus_per_node)"
        return EvalLayout(nodes, gpus, figure(nodes * gpus), why)
    if shape is None or gpu_gib is None:
        why = "no config.json to plan from yet" if shape is None else "no `gpu` to plan against"
        return EvalLayout(1 if nodes == "auto" else nodes, 1 if gpus == "auto" else gpus,
                          figure(1), f"auto: one GPU ({why})")  # fmt: skip
    node_choices = [nodes] if nodes != "auto" else list(range(1, run["nodes"] + 1))
    gpu_choices = [gpus] if gpus != "auto" else list(range(1, run["gpus_per_node"] + 1))
    for n in node_choices:
        for g in gpu_choices if n == node_choices[0] else gpu_choices[-1:]:
            need = figure(n * g)
            if need is not None and need <= gpu_gib:
                return EvalLayout(n, g, need, f"auto: the fewest GPUs that hold the model "
                                  f"({need:.1f} GiB per GPU of {gpu_gib:g})")  # fmt: skip
    n, g = node_choices[-1], gpu_choices[-1]
    return EvalLayout(n, g, figure(n * g), f"auto: no layout of the run's {run['nodes']} "
                      f"node(s) x {run['gpus_per_node']} GPU(s) holds the model")  # fmt: skip


def stage_plans(config: dict[str, Any], name: str, shape: Shape, gpu_gib: float | None,
                setup: Setup | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The stages of run ``name`` besides training's steps, planned: generation inside the
    training job (with its ``setup``), the reference and teacher stages, each evaluate stage
    it runs (its layout, GiB per GPU, whether that fits ``gpu_gib``, its CPU memory per node)
    and the CPU memory of conversion and merging."""
    run = config["runs"][name]
    from snaketune.budget.teacherplan import memory_plan

    out: dict[str, dict[str, Any]] = {
        **export_plans(run, shape),
        **reference_plan(run, shape, gpu_gib),
        **memory_plan(config, run, gpu_gib),
    }
    if setup is not None:
        out.update(training_pass_plans(run, shape, setup, gpu_gib))
    if "eval_dataset" not in run:
        return out
    from snaketune.plan.stages import evaluates_its_start

    stages = {"evaluate": True}
    if evaluates_its_start(config, name):
        stages["evaluate_start"] = False
    elif "init_from" not in run:
        stages["evaluate_base"] = False
    for stage, final in stages.items():
        layout = eval_layout(run, shape, gpu_gib, final)
        fits = None if gpu_gib is None else layout.per_gpu_gib <= gpu_gib
        cpu, cpu_why = eval_cpu_gib(shape, layout, saved_bytes(run, shape, final), final and
                                    eval_four_bit(run) is not None)  # fmt: skip
        out[stage] = {"nodes": layout.nodes, "gpus_per_node": layout.gpus_per_node,
                      "per_gpu_gib": layout.per_gpu_gib, "fits": fits, "why": layout.why,
                      "sharded": layout.processes > 1, "fix": EVAL_FIX,
                      "cpu_gib_per_node": cpu, "cpu_why": cpu_why}  # fmt: skip
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


def eval_four_bit(run: dict[str, Any]) -> bool | None:
    """A 4-bit run that keeps its adapter: the double quantization of the base its final
    model is evaluated on (None: any other run)."""
    from snaketune.plan.runspec import RunSpec

    spec = RunSpec.of(run)
    if spec.adapter_only and spec.quantized:
        return bool(spec.quantization["double_quant"])
    return None


def eval_cpu_gib(shape: Shape, layout: EvalLayout, saved: int | None, four_bit: bool
                 ) -> tuple[float, str]:  # fmt: skip
    """CPU memory per node of an evaluate job, and why (bench/load_memory.py measured the
    loading paths): each of the node's processes imports the libraries and loads the model;
    a checkpoint saved in the evaluation's precision, a 4-bit base, or any load sharded from
    the start (ZeRO-3: tensor by tensor) holds the largest layer at a time (the file stays
    memory-mapped: shared and reclaimable); else the process converts the whole model to 2
    bytes a weight before moving it to its GPU."""
    per_node = layout.gpus_per_node
    if four_bit or saved == EVAL_BYTES or layout.processes > 1:
        held, why = shape.largest_layer, "the largest layer at a time (the checkpoint mapped)"
    else:
        held, why = shape.params, "the whole model converted to 2 bytes a weight"
    gib = per_node * (LIBRARIES_GIB + held * EVAL_BYTES / GIB)
    return round(gib, 2), f"{per_node} process(es) loading: {why}"


EVAL_FIX = ("lower eval.batch_size (its logits and KV cache), or give the run more GPUs per "
            "node or nodes (eval.nodes, eval.gpus_per_node)")  # fmt: skip


def reference_plan(run: dict[str, Any], shape: Shape, gpu_gib: float | None
                   ) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The reference log-probs stage of a run that needs it (a DPO run's precomputed
    reference): data parallel on the run's GPUs, each worker holding the whole reference
    model (its 4-bit base for a 4-bit run) and one batch of pairs through one layer at a
    time (no gradients; TRL's fused head: no whole logits)."""
    from snaketune.plan.runspec import RunSpec

    spec = RunSpec.of(run)
    if not spec.reference_stage:
        return {}
    w = EVAL_BYTES
    weights = shape.params * w
    if spec.quantized:
        weights = four_bit_base(shape, bool(spec.quantization["double_quant"]))
    tokens = 2 * run["micro_batch_size"] * run["max_length"]  # both sides of each pair
    passing = tokens * (4 * shape.hidden + shape.mlp_pass) * w
    total = round(((weights + passing) / GIB) * (1 + FRAGMENTATION) + CONTEXT_GIB, 2)
    return {"reference_logps": {
        "nodes": run["nodes"], "gpus_per_node": run["gpus_per_node"], "per_gpu_gib": total,
        "fits": None if gpu_gib is None else total <= gpu_gib, "sharded": False,
        "why": f"each worker holds the whole reference model ({weights / GIB:.1f} GiB)",
        "fix": f"set {spec.method.block}.reference: live (the training job holds the "
               "reference, sharded with the policy under ZeRO-3), or use GPUs with more memory",
    }}  # fmt: skip


def training_pass_plans(run: dict[str, Any], shape: Shape, s: Setup, gpu_gib: float | None
                        ) -> dict[str, dict[str, Any]]:  # fmt: skip
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
        fix += (", or give the run more GPUs (ZeRO-3 divides training's states among them)"
                if zero3 else ", or shard the run's states (deepspeed: zero3)")  # fmt: skip
        if gathered is not None and setting is True:
            why += "; the whole model gathered onto each GPU (eval.gather_for_generation: true)"
            fix = ("set eval.gather_for_generation: false or auto (generate on the shards: "
                   "slower, no GPU holds the whole model); or " + fix)  # fmt: skip
        elif gathered is not None:
            verdict = {None: "", True: " (fits)", False: " (does not fit)"}[
                None if gpu_gib is None else gathered <= gpu_gib]  # fmt: skip
            why += (f"; generating on the ZeRO-3 shards (eval.gather_for_generation: "
                    f"{str(setting).lower()}; gathered whole: {gathered:.1f} GiB{verdict})"
                    )  # fmt: skip
        out[stage] = {"nodes": s.nodes, "gpus_per_node": s.gpus_per_node, "per_gpu_gib": need,
                      "fits": None if gpu_gib is None else need <= gpu_gib, "sharded": zero3,
                      "why": why, "fix": fix}  # fmt: skip
    return out


def generation_passes(run: dict[str, Any], shape: Shape, s: Setup
                      ) -> dict[str, tuple[float, float | None, str, str]]:  # fmt: skip
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
            part["loss_pass"], part["kv_cache"] + part["prefill"] if answers else None,
            f"eval.batch_size {ev['batch_size']}: its logits"
            + (f", then {ev['max_new_tokens']} new tokens' KV cache" if answers else ""),
            "lower eval.batch_size" + (" or eval.max_new_tokens" if answers else ""),
        )  # fmt: skip
    if s.completion_length and not s.vllm_share:
        tokens = s.micro_batch_size * s.sequence
        kv = shape.layers * shape.kv_width * w * tokens
        out["train/generation"] = (0.0, kv, f"{s.micro_batch_size} completions' KV cache",
                                   "lower micro_batch_size or grpo.max_completion_length"
                                   )  # fmt: skip
    return out


LIBRARIES_GIB = 0.35  # torch and transformers imported (bench/convert.py: ~330 MiB)


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
    shard = parse_size(run["export"]["max_shard_size"])
    streamed = LIBRARIES_GIB + (4 * shape.largest_layer + 2 * shard) / GIB
    out = {"convert_checkpoint": {"cpu_gib": round(streamed, 2), "why": "one tensor at a "
                                  "time, the gate's load budget of a shard"}}  # fmt: skip
    if spec.trains_lora and spec.quantized:
        # the weights the 4-bit model keeps in its load dtype: the run's precision (bf16 on
        # the GPU nodes the plan is for), or fp32
        w = 4 if run["precision"] == "fp32" else 2
        per_linear = quant_bytes(spec.quantization["double_quant"])
        four_bit = w * (shape.params - shape.linear_params) + per_linear * shape.linear_params
        out["convert_checkpoint"] = {
            "cpu_gib": round(LIBRARIES_GIB + (four_bit + 4 * shape.largest_layer) / GIB, 2),
            "why": "the adapter's gate loads the base in 4 bits as training did, one tensor "
                   "at a time",
        }  # fmt: skip
    if spec.trains_lora and not spec.adapter_only:
        out["merge_lora"] = {
            "cpu_gib": round(streamed, 2),
            "why": "one base tensor at a time, the gate's load budget of a shard",
        }
    return out


def format_stages(name: str, stages: dict[str, dict[str, Any]]) -> list[str]:
    """One line per planned stage."""
    lines = [f"{name}: {stage}: about {p['cpu_gib']:.1f} GiB of CPU memory ({p['why']})"
             for stage, p in stages.items() if "cpu_gib" in p]  # fmt: skip
    for stage, p in stages.items():
        if "cpu_gib" in p:
            continue
        verdict = {True: "fits", False: "does NOT fit", None: "not checked"}[p["fits"]]
        sharded = " (ZeRO-3 shards)" if p["sharded"] else ""
        cpu = (f"; about {p['cpu_gib_per_node']:.1f} GiB of CPU memory per node "
               f"({p['cpu_why']})" if "cpu_gib_per_node" in p else "")  # fmt: skip
        lines.append(f"{name}: {stage} on {p['nodes']} node(s) x {p['gpus_per_node']} GPU(s)"
                     f"{sharded}: {p['per_gpu_gib']:.1f} GiB per GPU, {verdict}; "
                     f"{p['why']}{cpu}")  # fmt: skip
    return lines


def stage_problems(name: str, stages: dict[str, dict[str, Any]], gpu_gib: float) -> list[str]:
    """A line per stage that cannot fit, with the changes that would."""
    return [f"runs.{name}: {stage} needs {p['per_gpu_gib']:.1f} GiB per GPU on "
            f"{p['nodes']} node(s) x {p['gpus_per_node']} GPU(s) ({p['why']}), more than the "
            f"GPU's {gpu_gib:g}; {p['fix']}"
            for stage, p in stages.items() if p.get("fits") is False]  # fmt: skip


def stage_memory(name: str, stages: dict[str, dict[str, Any]],
                 asked: dict[tuple[str, str], Any]) -> list[str]:  # fmt: skip
    """A line per stage whose job asks less memory (mem_mb, by rule and run; per node) than
    its plan: SLURM would end it once it is loaded."""
    lines = []
    for stage, p in stages.items():
        mem, need = asked.get((stage, name)), cpu_mb(p)
        if need is None or not mem or need <= float(mem):
            continue
        why = p.get("cpu_why", p["why"])
        lines.append(f"runs.{name}: its {stage} job asks {float(mem):g} MB of memory "
                     f"(mem_mb), but about {need / 1024:.1f} GiB are needed ({why}); "
                     f"raise set-resources {stage}: mem_mb to at least "
                     f"{math.ceil(need * 1.1)} in the profile")  # fmt: skip
    return lines


def cpu_mb(plan: dict[str, Any]) -> float | None:
    """MB of CPU memory (per node) a planned stage needs; None: not planned."""
    gib = plan.get("cpu_gib", plan.get("cpu_gib_per_node"))
    return None if gib is None else gib * 1024
