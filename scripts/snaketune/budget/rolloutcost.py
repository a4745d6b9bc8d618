"""The train stage's time of a run that generates while it trains (GRPO, RLOO, on-policy
distillation) on GPUs, before a calibration: a step is its generation, the passes that
score what was generated (the reference model's, the reward models', a live teacher's) and
the student's own training, each worked out at the assumed rates. A calibration (a short
run) replaces it, as for every method.

- **Generation**: each GPU generates its micro batches one after another, each as
  max_completion_length decode steps (every completion taken at its limit: at most), each
  decode step as rates.decode_step plans it: the largest of the student's weights read at
  rates.DECODE_SHARE of the GPU's memory bandwidth, its FLOPs, and the floor of
  transformers' ``generate()`` launching each layer's kernels from Python (rates.
  DECODE_FLOOR_S: a 1B model's step is that floor, not its bytes); where vLLM generates
  (``use_vllm``, installed) its CUDA graphs have no such floor: the bytes and FLOPs alone.
  On-policy distillation generates only on its on-policy share of steps (``lmbda``).
- **Scoring**: a forward pass (2 FLOPs a weight a token, at rates.FORWARD_MFU) of each model
  the step holds besides the student over the step's sequences: the needs' held weights
  (snaketune.budget.scoring.held_params: reward models, a live teacher) and, where the KL
  term is on, the reference model (the student's size).
- **Training**: the sequences (the prompt, its tokenized length where known, else
  max_length, and the completion) at the assumed MFU of the update (rates.ASSUMED_MFU),
  as for every method (core.throughput.step_flops)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from snaketune.budget.rates import (
    ASSUMED_MFU,
    FORWARD_MFU,
    MFU_SOURCE,
    bandwidth,
    decode_step,
    forward_seconds,
    update_seconds,
)


def step_parts(
    config: dict[str, Any],
    name: str,
    workdir: Path,
    shape: Any,
    per_step: int,
    measured: tuple[float, float] | None,
    gpu: str,
) -> dict[str, Any]:
    """One optimizer step's seconds by part (``generation``, ``scoring``, ``training``) on
    the run's GPUs, and what they assume (``basis``); only ``basis`` when the GPU's peak
    FLOP/s or memory bandwidth is not known. ``measured``: the tokenized prompts' tokens and
    squared tokens per step (None before tokenization: every prompt max_length long)."""
    from snaketune.budget.scoring import held_params
    from snaketune.core.throughput import peak_tflops
    from snaketune.methods import method_of

    run = config["runs"][name]
    method = method_of(run)
    peak, bw = peak_tflops(str(gpu).upper()), bandwidth(str(gpu))
    if peak is None or bw is None:
        what = "peak FLOP/s" if peak is None else "memory bandwidth"
        return {"basis": f"no estimate: no {what} known for GPU {gpu}"}
    devices = run["nodes"] * run["gpus_per_node"]
    facts = method.memory(run, True)
    completion = facts["completion_length"]
    rows = method.rows_per_example(run)  # completions of each prompt
    if measured is None:
        prompt, prompt_sq = float(run["max_length"]), float(run["max_length"]) ** 2
    else:
        prompt, prompt_sq = measured[0] / per_step, measured[1] / per_step
    sequences = per_step * rows  # a step's completions, each beside its prompt
    tokens = sequences * (prompt + completion)
    squares = sequences * (prompt_sq + 2 * completion * prompt + completion**2)

    share = facts.get("generated_share", 1.0)
    decode_steps = run["gradient_accumulation_steps"] * completion  # on each GPU
    from snaketune.data.kernels import installed

    server = bool(facts.get("vllm_share")) and installed("vllm")  # vLLM generates
    step_s, bound = decode_step(shape, run["micro_batch_size"], str(gpu), server)
    generation = share * decode_steps * step_s

    scored = sum(held_params(config, run, workdir).values())
    if facts.get("reference"):
        scored += shape.active_params
    scoring = forward_seconds(scored, tokens, devices, peak)

    kind = method.adapter_of(run)
    training = update_seconds(shape, tokens, squares, kind, devices, peak)
    parts = {"generation": generation, "scoring": scoring, "training": training}
    tokenized = measured is not None
    said = (share, decode_steps, step_s, bound, completion, scored, kind, peak, tokenized)
    return {**parts, "basis": basis(parts, str(gpu), *said)}


def basis(
    parts: dict[str, float],
    gpu: str,
    share: float,
    decode_steps: int,
    step_s: float,
    bound: str,
    completion: int,
    scored: int,
    kind: str,
    peak: float,
    tokenized: bool,
) -> str:
    """What step_parts assumed, each part's seconds beside its assumptions."""
    return (
        f"a step: generation {parts['generation']:.1f} s ({share:.0%} of steps, "
        f"{decode_steps} decode steps a GPU of {step_s * 1e3:.1f} ms: {bound}; every "
        f"completion {completion} tokens: at most), scoring "
        f"{parts['scoring']:.1f} s (a forward pass of {scored / 1e9:.2f}B held weights at "
        f"assumed MFU {FORWARD_MFU:.1%}), training {parts['training']:.1f} s (assumed MFU "
        f"{ASSUMED_MFU[kind]:.1%} of {gpu}'s {peak:g} TFLOP/s a GPU, {MFU_SOURCE}); "
        "not calibrated (a short run calibrates it: max_steps: 5)"
        + ("" if tokenized else "; every prompt taken at max_length until the data is tokenized")
    )


def estimate(
    config: dict[str, Any],
    name: str,
    workdir: Path,
    shape: Any,
    steps: dict[str, Any],
    measured: tuple[float, float] | None,
    gpu: str,
) -> dict[str, Any]:
    """The train stage's seconds (``train_s``) as cost.from_flops gives them for the other
    methods: its steps, each its parts (step_parts)."""
    parts = step_parts(config, name, workdir, shape, steps["per_step"], measured, gpu)
    if "training" not in parts:
        return {"basis": parts["basis"]}
    each = {k: parts[k] for k in ("generation", "scoring", "training")}
    train_s = steps["steps"] * sum(each.values())
    return {"train_s": train_s, "outside_s": None, "basis": parts["basis"], "step_parts": each}
