"""The memory of an evaluate job (evaluate_base, evaluate_start, evaluate) per GPU and per
node, and the layout it decides for them.

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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snaketune.budget.memplan import (
    CONTEXT_GIB,
    FRAGMENTATION,
    GIB,
    Shape,
    quant_bytes,
)
from snaketune.plan.pipeline import EVALUATE, EVALUATE_BASE, EVALUATE_START

EVAL_BYTES = 2  # an evaluate job on GPUs runs in bf16 (fp16 where bf16 is missing)


def four_bit_base(shape: Shape, double_quant: bool) -> float:
    """Bytes of a 4-bit base as a run loads it for inference: the decoder linears in 4 bits
    with their constants, the other weights in fp32 after peft's k-bit preparation."""
    return (
        4 * (shape.params - shape.linear_params) + quant_bytes(double_quant) * shape.linear_params
    )


def eval_bytes(
    shape: Shape,
    processes: int,
    batch: int,
    prompt: int,
    new_tokens: int,
    w: int = EVAL_BYTES,
    four_bit: bool | None = None,
    logit_bytes: int | None = None,
) -> dict[str, float]:
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


def eval_gib(
    shape: Shape,
    processes: int,
    batch: int,
    prompt: int,
    new_tokens: int,
    w: int = EVAL_BYTES,
    four_bit: bool | None = None,
) -> dict[str, float]:
    """GiB per GPU of an evaluation (``eval_bytes``) and the total: the weights and the
    larger of the loss pass and generation (one comes after the other), with the margin."""
    parts = {
        k: v / GIB
        for k, v in eval_bytes(shape, processes, batch, prompt, new_tokens, w, four_bit).items()
    }
    used = (
        parts["weights"]
        + parts["gathered_layer"]
        + max(parts["loss_pass"], parts["kv_cache"] + parts["prefill"])
    )
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


def eval_layout(
    run: dict[str, Any], shape: Shape | None, gpu_gib: float | None, final: bool = False
) -> EvalLayout:
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
        return EvalLayout(
            1,
            1,
            figure(1),
            "the adapter on its 4-bit base as trained (export.merged: false) runs on one GPU",
        )
    from snaketune.methods import method_of

    if method_of(run).reward_model:  # snaketune.evaluation.reward_eval: one process
        return EvalLayout(1, 1, figure(1), "a reward model is scored on one GPU")

    if nodes != "auto" and gpus != "auto":
        why = "as set (eval.nodes, eval.gpus_per_node)"
        return EvalLayout(nodes, gpus, figure(nodes * gpus), why)
    if shape is None or gpu_gib is None:
        why = "no config.json to plan from yet" if shape is None else "no `gpu` to plan against"
        return EvalLayout(
            1 if nodes == "auto" else nodes,
            1 if gpus == "auto" else gpus,
            figure(1),
            f"auto: one GPU ({why})",
        )
    node_choices = [nodes] if nodes != "auto" else list(range(1, run["nodes"] + 1))
    gpu_choices = [gpus] if gpus != "auto" else list(range(1, run["gpus_per_node"] + 1))
    for n in node_choices:
        for g in gpu_choices if n == node_choices[0] else gpu_choices[-1:]:
            need = figure(n * g)
            if need is not None and need <= gpu_gib:
                return EvalLayout(
                    n,
                    g,
                    need,
                    f"auto: the fewest GPUs that hold the model "
                    f"({need:.1f} GiB per GPU of {gpu_gib:g})",
                )
    n, g = node_choices[-1], gpu_choices[-1]
    return EvalLayout(
        n,
        g,
        figure(n * g),
        f"auto: no layout of the run's {run['nodes']} "
        f"node(s) x {run['gpus_per_node']} GPU(s) holds the model",
    )


def eval_four_bit(run: dict[str, Any]) -> bool | None:
    """A 4-bit run that keeps its adapter: the double quantization of the base its final
    model is evaluated on (None: any other run)."""
    from snaketune.plan.runspec import RunSpec

    spec = RunSpec.of(run)
    if spec.adapter_only and spec.quantized:
        return bool(spec.quantization["double_quant"])
    return None


def eval_cpu_gib(
    shape: Shape, layout: EvalLayout, saved: int | None, four_bit: bool
) -> tuple[float, str]:
    """CPU memory per node of an evaluate job, and why (bench/load_memory.py measured the
    loading paths): each of the node's processes imports the libraries and loads the model;
    a checkpoint saved in the evaluation's precision, a 4-bit base, or any load sharded from
    the start (ZeRO-3: tensor by tensor) holds the largest layer at a time (the file stays
    memory-mapped: shared and reclaimable); else the process converts the whole model to 2
    bytes a weight before moving it to its GPU."""
    mapped = four_bit or saved == EVAL_BYTES or layout.processes > 1
    return loading_gib(shape, layout.gpus_per_node, mapped, "process(es)")


def loading_gib(shape: Shape, per_node: int, mapped: bool, who: str) -> tuple[float, str]:
    """CPU memory per node of ``per_node`` processes each importing the libraries and
    loading the model: a layer at a time where the load is ``mapped`` (a checkpoint in the
    GPUs' precision, a 4-bit base, a sharded load), else the whole model at 2 bytes a
    weight; and why, naming them as ``who``."""
    if mapped:
        held, why = shape.largest_layer, "the largest layer at a time (the checkpoint mapped)"
    else:
        held, why = shape.params, "the whole model converted to 2 bytes a weight"
    gib = per_node * (LIBRARIES_GIB + held * EVAL_BYTES / GIB)
    return round(gib, 2), f"{per_node} {who} loading: {why}"


EVAL_FIX = (
    "lower eval.batch_size (its logits and KV cache), or give the run more GPUs per "
    "node or nodes (eval.nodes, eval.gpus_per_node)"
)


LIBRARIES_GIB = 0.35  # torch and transformers imported (bench/convert.py: ~330 MiB)


def scoring_cpu_gib(
    shape: Shape, per_node: int, sharded: bool, four_bit: bool
) -> tuple[float, str]:
    """CPU memory per node of a scoring stage's job (the reference or teacher log-probs), as
    an evaluate job's (``eval_cpu_gib``): its workers load the model a layer at a time from
    a bf16 checkpoint, a 4-bit base or a sharded load, else whole."""
    mapped = sharded or four_bit or shape.saved_bytes == EVAL_BYTES
    return loading_gib(shape, per_node, mapped, "worker(s)")


def scoring_plan(
    run: dict[str, Any],
    shape: Shape,
    per_gpu_gib: float,
    gpu_gib: float | None,
    sharded: bool,
    why: str,
    fix: str,
    four_bit: bool = False,
) -> dict[str, Any]:
    """A scoring stage's memory plan (the reference's or the teacher's log-probs) on the
    run's GPUs: ``per_gpu_gib`` against ``gpu_gib`` (None: not checked), its CPU memory per
    node (scoring_cpu_gib), why it holds what it does and what would lower it."""
    cpu_gib, cpu_why = scoring_cpu_gib(shape, run["gpus_per_node"], sharded, four_bit)
    return {
        "nodes": run["nodes"],
        "gpus_per_node": run["gpus_per_node"],
        "per_gpu_gib": per_gpu_gib,
        "cpu_gib": cpu_gib,
        "cpu_why": cpu_why,
        "fits": None if gpu_gib is None else per_gpu_gib <= gpu_gib,
        "sharded": sharded,
        "why": why,
        "fix": fix,
    }


def eval_examples(config: dict[str, Any], name: str, workdir: Path) -> int | None:
    """The examples an evaluate stage scores, at most eval.limit: its tokenized eval set's
    rows, else before it its source's (a text set's documents by their pieces at
    max_length, as snaketune.plan.corpus.run_rows counts a training set's); None where
    they are not known yet."""
    from snaketune.core import parts
    from snaketune.plan.corpus import run_rows
    from snaketune.plan.stages import tokenized

    run = config["runs"][name]
    if run.get("eval_dataset") not in config["datasets"]:
        rows = None
    elif parts.exists(path := workdir / tokenized(config, name, True)):
        rows = parts.read_table(path, ["length"]).num_rows
    else:
        rows = run_rows(config, run, workdir, "eval_dataset")[0]
    limit = run["eval"].get("limit")
    return limit if rows is None else min(rows, limit or rows)


def evaluate_rules(config: dict[str, Any], name: str) -> dict[str, bool]:
    """The evaluate stages run ``name`` has (rule -> whether it scores the run's own model):
    its own, and its start's (the base's, shared by the runs of one base and eval set)."""
    from snaketune.plan.stages import evaluates_its_start

    run = config["runs"][name]
    out = {EVALUATE.name: True}
    if evaluates_its_start(config, name):
        out[EVALUATE_START.name] = False
    elif "init_from" not in run:
        out[EVALUATE_BASE.name] = False
    return out
