"""A run's memory plan against its GPU: the verdict, and when it does not fit the cheapest
change (or set of changes) that does (the formulas: snaketune.budget.memplan).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from snaketune.budget.memplan import GIB, Setup, Shape, cpu_per_node, cpu_why, estimate


def not_counted(s: Setup, gpu_gib: float | None) -> list[str]:
    """What the estimate leaves out for this run, in words (empty: nothing known)."""
    out = []
    if s.vllm_share and gpu_gib is None:
        out.append(f"vLLM's share ({s.vllm_share:g} of each GPU's memory; no GPU type set)")
    return out


def changes(s: Setup) -> list[tuple[str, Setup]]:
    """Changes that lower the per-GPU memory, cheapest first."""
    out: list[tuple[str, Setup]] = []
    m = s.micro_batch_size
    while m > 1:
        m //= 2
        out.append(
            (
                f"micro_batch_size: {m} (raise gradient_accumulation_steps to keep the "
                "global batch)",
                replace(s, micro_batch_size=m),
            )
        )
    if not s.gradient_checkpointing:
        out.append(("gradient_checkpointing: true", replace(s, gradient_checkpointing=True)))
    if s.stage < 3:
        out.append(("deepspeed: zero3", replace(s, stage=3)))
        out.append(
            (
                "deepspeed: zero3 with gradient_checkpointing: true",
                replace(s, stage=3, gradient_checkpointing=True),
            )
        )
    if s.adapter == "lora" and not s.quantized:
        out.append(("lora.quantize: 4bit (QLoRA)", replace(s, quantized=True)))
        out.append(
            (
                "lora.quantize: 4bit with gradient_checkpointing: true",
                replace(s, quantized=True, gradient_checkpointing=True),
            )
        )
        both = replace(s, quantized=True, stage=3, gradient_checkpointing=True)
        out.append(
            ("lora.quantize: 4bit with deepspeed: zero3 and gradient_checkpointing: true", both)
        )
    if not (s.offload_optimizer and s.offload_params) and not s.quantized:
        out.append(
            (
                "deepspeed: zero3_offload (optimizer and weights in CPU memory)",
                replace(
                    s,
                    stage=3,
                    offload_optimizer=True,
                    offload_params=True,
                    gradient_checkpointing=True,
                ),
            )
        )
    nodes = s.nodes
    while nodes < 64:
        nodes *= 2
        out.append((f"nodes: {nodes}", replace(s, nodes=nodes)))
    return out


NOTHING_FITS = (
    "nothing tried fits (up to 3 of: a smaller micro batch, gradient checkpointing, "
    "ZeRO-3 or its offload, a 4-bit base, up to 64 nodes): use GPUs with more memory"
)


def _groups(s: Setup) -> list[list[tuple[float, str, dict[str, Any]]]]:
    """The changes to combine, by group (one of each group at most): (cost, words, the
    settings it changes). Costs rank what a change takes from the run: a smaller micro batch
    (the global batch kept by accumulation) least, then recomputed activations, ZeRO-3's
    gathers, a 4-bit base, CPU offload, and more GPUs most."""
    micro, m, halvings = [], s.micro_batch_size, 0
    while m > 1:
        m, halvings = m // 2, halvings + 1
        micro.append(
            (
                1 + 0.1 * halvings,
                f"micro_batch_size: {m} (raise "
                "gradient_accumulation_steps to keep the global batch)",
                {"micro_batch_size": m},
            )
        )
    groups = [micro]
    if not s.gradient_checkpointing:
        groups.append([(2, "gradient_checkpointing: true", {"gradient_checkpointing": True})])
    zero = []
    if s.stage < 3:
        zero.append((3, "deepspeed: zero3", {"stage": 3}))
    if not (s.offload_optimizer and s.offload_params) and not s.quantized:
        zero.append(
            (
                6,
                "deepspeed: zero3_offload (optimizer and weights in CPU memory)",
                {"stage": 3, "offload_optimizer": True, "offload_params": True},
            )
        )
    groups.append(zero)
    if s.adapter == "lora" and not s.quantized:
        groups.append([(4, "lora.quantize: 4bit (QLoRA)", {"quantized": True})])
    nodes, more = s.nodes, []
    while nodes < 64:
        nodes *= 2
        more.append((8 * len(more) + 8, f"nodes: {nodes}", {"nodes": nodes}))
    groups.append(more)
    return [g for g in groups if g]


def cheapest_combination(
    shape: Shape, s: Setup, gpu_gib: float, most: int = 3
) -> tuple[list[str], float] | None:
    """The cheapest set of at most ``most`` changes (``_groups``) that together fit
    ``gpu_gib``: (their words, the total GiB per GPU then); None when none does."""
    from itertools import combinations, product

    groups, best = _groups(s), None
    for k in range(2, most + 1):
        for chosen in combinations(groups, k):
            for picks in product(*chosen):
                cost = sum(c for c, _, _ in picks)
                changed = replace(s, **{k: v for _, _, d in picks for k, v in d.items()})
                total = estimate(shape, changed, gpu_gib)["total"]
                if total <= gpu_gib and (best is None or (cost, total) < best[:2]):
                    best = (cost, total, [what for _, what, _ in picks])
    return None if best is None else (best[2], best[1])


def plan_run(shape: Shape, s: Setup, gpu_gib: float | None) -> dict[str, Any]:
    """The plan of one run: per-GPU parts, CPU per node, fits, and the cheapest change."""
    per_gpu = estimate(shape, s, gpu_gib)
    out: dict[str, Any] = {
        "params": shape.params,
        "active_params": shape.active_params,  # a mixture of experts: those a token reaches
        "experts": shape.experts,
        "per_gpu_gib": per_gpu,
        "gpu_gib": gpu_gib,
        "cpu_gib_per_node": round(cpu_per_node(shape, s) / GIB, 2),
        "cpu_why": cpu_why(shape, s),
        "fits": None if gpu_gib is None else per_gpu["total"] <= gpu_gib,
        "suggestion": None,
        "not_counted": not_counted(s, gpu_gib),
        "quantized": s.quantized,
    }
    if out["fits"] is False:
        for what, changed in changes(s):
            total = estimate(shape, changed, gpu_gib)["total"]
            if total <= gpu_gib:
                out["suggestion"] = f"{what} (then {total:.1f} GiB per GPU)"
                break
        else:
            together = cheapest_combination(shape, s, gpu_gib)
            if together is None:
                out["suggestion"] = NOTHING_FITS
            else:
                what, total = together
                out["suggestion"] = (
                    f"no single change fits; together: {'; '.join(what)} "
                    f"(then {total:.1f} GiB per GPU)"
                )
    return out


def format_plan(run: str, plan: dict[str, Any]) -> str:
    """One line: the run, the per-GPU total and its parts, against what the GPU has; what
    it leaves out, if anything."""
    g = plan["per_gpu_gib"]
    names = (
        "weights",
        "gradients",
        "optimizer",
        "activations",
        "not_at_once",
        "reference",
        "reward_models",
        "teacher",
        "vllm",
        "margin",
    )
    labels = {
        "reference": "reference copy",
        "reward_models": "reward models",
        "teacher": "live teacher",
        "vllm": "vLLM",
        "not_at_once": "gradients and activations not held at once",
    }
    if plan.get("quantized"):
        labels["weights"] = "weights (4-bit base)"
    shown = [k for k in names if k in g and (round(g[k], 1) or k != "not_at_once")]
    parts = ", ".join(f"{labels.get(k, k)} {g[k]:.1f}" for k in shown)
    against = "no GPU type set" if plan["gpu_gib"] is None else f"GPU {plan['gpu_gib']:.1f} GiB"
    verdict = {True: "fits", False: "does NOT fit", None: "not checked"}[plan["fits"]]
    moe = ""
    if plan.get("experts"):
        moe = (
            f" [a mixture of {plan['experts']} experts: {plan['params'] / 1e9:.1f}B weights, "
            f"{plan['active_params'] / 1e9:.1f}B active per token]"
        )
    line = (
        f"{run}: {g['total']:.1f} GiB per GPU ({parts}) against {against}: {verdict}; "
        f"CPU {plan['cpu_gib_per_node']:.1f} GiB per node{moe}"
    )
    if plan["suggestion"]:
        line += f"; cheapest change that fits: {plan['suggestion']}"
    if plan.get("not_counted"):
        line += f"; not counted: {', '.join(plan['not_counted'])}"
    return line
