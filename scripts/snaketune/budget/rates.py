"""The rates a cost estimate assumes where no calibration measured them (a finished run
like it replaces them): the MFU of an update and of a forward pass, the disk's and the
Hub's rates, the share of a GPU's memory bandwidth a decode step reaches, each GPU's
bandwidth; docs/benchmarks.md says where each figure comes from. And the two figures every
plan builds on: a stage's record, and a model's bytes."""

from __future__ import annotations

from typing import Any

# MFU assumed for a GPU run with no calibration of its own: what the product's train stage
# measured (bench/gpu_check.py, docs/benchmarks.md "GPU check"), per kind of update; a run's
# first finished job on its machine replaces it (a calibration)
ASSUMED_MFU = {"lora": 0.252, "full": 0.317}
MFU_SOURCE = "measured on one H200, a 1B Llama at 8,192 tokens a step, 2026-11-28"
# a forward pass without gradients (a scoring stage's): the full fine-tune's measured MFU
FORWARD_MFU = ASSUMED_MFU["full"]
DISK_MB_S = 500.0  # one process reading or writing a parallel filesystem (assumed)
MB = 1e6
DOWNLOAD_MB_S = 100.0  # a model's files from the Hub to the cluster's filesystem
DECODE_SHARE = 0.5  # of a GPU's memory bandwidth one greedy decode step reaches
# the floor of one decode step of transformers' generate() whatever the bytes and FLOPs:
# (seconds a layer, seconds a step), its kernels launched one by one from Python.
# CPU: bench/decode_floor.py on this project's machine (torch 2.13, one thread: 0.42-0.50 ms
# a layer, 0.74-0.82 ms a step at batches 1 and 8). GPU: transformers' own benchmark
# (dataset hf-internal-testing/benchmark_results, 2024-09-04 summary.json): gemma-2b in
# eager mode, no compile, 19.7 ms a token over its 18 layers, its bytes (5 GB) far under
# that at any datacenter GPU's bandwidth: 1.1 ms a layer, the step's own share in it
DECODE_FLOOR_S = {"cpu": (0.46e-3, 0.8e-3), "gpu": (19.7e-3 / 18, 0.0)}
FLOOR_SOURCE = {
    "cpu": "bench/decode_floor.py",
    "gpu": "transformers' benchmark of gemma-2b in eager mode, 19.7 ms a token",
}
# a train job's start-up besides loading its weights, where no calibration measured it: the
# SFT run of bench/plan_matrix.py on this project's machine (2 cores, 2026-12-07, the jobs
# reading the environment's compiled files): its workers' imports, DeepSpeed's engine and
# the rendezvous, 12.2 s in all less its 40 steps at 0.08 s
STARTUP_S = 9.0
# a CPU run's training where no calibration measured it: a step's seconds a token, a fixed
# part (Python, the collectives, the optimizer) and one per FLOP of its update, fitted to
# two trainings on this project's machine (2 cores): the demo's LoRA on its tiny model (0.64
# MFLOP a token, 15,700 tokens/s over its 2 emulated nodes) and bench/train_throughput.py's
# full fine-tune of a 13M Llama (80 MFLOP a token, 1,535 tokens/s)
CPU_S_PER_TOKEN = 59e-6
CPU_FLOP_S = 1.35e11
# once a CPU run is calibrated: its step's fixed part (the DeepSpeed step, the gradients'
# all-reduce between the emulated nodes, the trainer's logging), the rest of the calibration's
# step its tokens; fitted to two continued pre-training runs of the demo's tiny model on this
# project's machine, 16 rows a step of 886 and 4,078 tokens in all, 0.052 and 0.129 s a step
# (bench/plan_matrix.py, 2026-12-07), which puts SFT's step of 2,368 tokens at 0.087 s
# (measured: 0.085)
CPU_STEP_S = 0.030
# a CPU train job of a method that generates while it trains, its start-up beyond one that
# does not (the generation's set-up, the scoring model's load, the trainer's own imports):
# GRPO 0.9 s and on-policy distillation 0.2 s over SFT's on this project's machine
# (bench/plan_matrix.py, 2026-12-07, the jobs reading the environment's compiled files)
GENERATING_STARTUP_S = 0.5
# a CPU stage's process before its work, where no calibration measured it: a LoRA run's
# conversion (its start alone: importing torch, transformers and peft) took 3.1-3.7 s in
# bench/plan_matrix.py on this project's machine (2026-12-07); a data job (pyarrow and numpy
# alone), a shard job of the demo's rows, 0.4-0.8 s
JOB_START_S = 3.5
DATA_JOB_START_S = 0.6
HBM_TB_S = {  # datasheets; most specific first
    "H200": 4.8,
    "H100 PCIe": 2.0,
    "H100 NVL": 3.9,
    "H100": 3.35,
    "A100 80GB": 2.04,
    "A100 64GB": 1.64,
    "A100": 1.55,
    "L40S": 0.864,
}


def stage(seconds: float | None, gpus: int, basis: str) -> dict[str, Any]:
    """One stage's figure: seconds, GPU-hours (``gpus`` held while it runs) and basis."""
    hours = None if seconds is None or not gpus else seconds * gpus / 3600
    return {"s": seconds, "gpu_hours": hours, "gpus": gpus, "basis": basis}


def weight_bytes(shape: Any) -> float:
    """A model's saved weights (its config.json's dtype; bf16 when unsaid)."""
    return shape.params * (shape.saved_bytes or 2)


def bandwidth(gpu: str) -> float | None:
    """A GPU's memory bandwidth in bytes/s (None: not known)."""
    name = str(gpu).upper().replace("-", " ")
    for key, tb in HBM_TB_S.items():  # most specific first
        if all(part.upper() in name for part in key.split()):
            return tb * 1e12
    return None


def decode_step(shape: Any, batch: int, gpu: str | None, server: bool = False) -> tuple[float, str]:
    """One decode step of ``generate()`` for ``batch`` sequences on one device, and what
    bounds it: the largest of every weight read at DECODE_SHARE of the GPU's memory
    bandwidth, its FLOPs (2 a weight a sequence) at the peak times FORWARD_MFU, and the
    floor of its layers launched from Python (DECODE_FLOOR_S). ``gpu`` None: this CPU,
    the floor alone (a CPU run's bytes and FLOPs are its calibration's to say). ``server``:
    vLLM generates (CUDA graphs, continuous batching): no launch floor, its bytes and FLOPs."""
    from snaketune.core.throughput import peak_tflops

    where = "cpu" if gpu is None else "gpu"
    per_layer, per_step = DECODE_FLOOR_S[where]
    floor = shape.layers * per_layer + per_step
    bounds = {f"the floor of {shape.layers} layers launched ({FLOOR_SOURCE[where]})": floor}
    if server and gpu is not None:  # its graphs replay a step's kernels at once
        bounds = {"vLLM: no launch floor": 0.0}
    if gpu is not None:
        bw, peak = bandwidth(gpu), peak_tflops(str(gpu).upper())
        if bw is not None:
            bounds["the weights read at the memory bandwidth"] = weight_bytes(shape) / (
                bw * DECODE_SHARE
            )
        if peak is not None:
            flops = 2 * shape.active_params * batch
            bounds["its FLOPs at the assumed MFU"] = flops / (peak * 1e12 * FORWARD_MFU)
    why = max(bounds, key=bounds.__getitem__)
    return bounds[why], why


def forward_seconds(params: float, tokens: float, devices: int, peak: float) -> float:
    """A forward pass without gradients of ``params`` weights over ``tokens`` tokens on
    ``devices`` GPUs of ``peak`` TFLOP/s each: 2 FLOPs a weight a token at FORWARD_MFU."""
    return 2 * params * tokens / (devices * peak * 1e12 * FORWARD_MFU)


def update_seconds(
    shape: Any, tokens: float, squares: float, kind: str, devices: int, peak: float
) -> float:
    """An optimizer step's update over ``tokens`` tokens (``squares``: the sum of its
    sequences' squared lengths, attention's share) on ``devices`` GPUs of ``peak`` TFLOP/s
    each, at the MFU assumed for ``kind`` ("lora" or "full"): its FLOPs
    (snaketune.core.throughput.step_flops) over the matmuls' weights, every weight but an
    input embedding that is not also the head."""
    from snaketune.core.throughput import step_flops

    n = shape.active_params - (0 if shape.tied else shape.vocab * shape.hidden)
    flops = step_flops(n, tokens, squares, shape.layers, shape.hidden, kind == "lora")
    return flops / (devices * peak * 1e12 * ASSUMED_MFU[kind])


def outside_steps(run: dict[str, Any], shape: Any, steps: int, kind: str) -> tuple[float, str]:
    """A train job's seconds outside its steps where no calibration measured them: its
    start-up (STARTUP_S and its weights read at DISK_MB_S) and its checkpoints, each written
    at DISK_MB_S by one writer (at most: ranks write their shares side by side): a full
    fine-tune's bf16 weights and fp32 master weights and Adam moments, 14 bytes a weight; a
    LoRA's adapter, seconds."""
    load = weight_bytes(shape) / (DISK_MB_S * MB)
    saves = steps // run["save_steps"] + (steps % run["save_steps"] > 0)
    each = 14 * shape.params / (DISK_MB_S * MB) if kind == "full" else 0.0
    said = f"start-up {STARTUP_S + load:.0f} s (assumed, the weights read at the disk rate)"
    if each:
        said += f", {saves} checkpoint(s) of {each:.0f} s (14 bytes a weight at the disk rate)"
    return STARTUP_S + load + saves * each, said


def cpu_tokens_per_s(shape: Any, kind: str) -> float:
    """The tokens/s a CPU run's update is assumed to train at (CPU_S_PER_TOKEN, CPU_FLOP_S):
    its FLOPs a token as update_seconds counts them (attention's apart)."""
    from snaketune.core.throughput import step_flops

    n = shape.active_params - (0 if shape.tied else shape.vocab * shape.hidden)
    flops = step_flops(n, 1, 0, shape.layers, shape.hidden, kind == "lora")
    return 1 / (CPU_S_PER_TOKEN + flops / CPU_FLOP_S)
