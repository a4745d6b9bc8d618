"""The GPU check: training speed and memory through the product's own train stage, on one
GPU, in one command that is ready before a GPU machine is (issue 59).

    python bench/gpu_prepare.py download         # here, online: the wheels a GPU machine lacks
    python bench/gpu_prepare.py install          # there, after each part is carried
    PYTHONPATH=$PWD/scripts:$PWD/.gpu-site \
    python bench/gpu_check.py --gpu --out gpu_check   # there: ~5 minutes on one H200
    python bench/gpu_check.py --out /tmp/gpu_check    # CPU: tiny sizes (the CI tier runs it)
    python bench/gpu_check.py --gpu --levers --out gpu_check   # the levers of speed, each alone

Each run goes through scripts/train.py (torchrun agent, DeepSpeed ZeRO-2, TRL's trainer,
the metrics callback: the stage itself, not a copy) on one GPU: a Llama-3.2-1B-shaped model
with random weights (its config, nothing downloaded), bf16, micro batches of 4 examples of
2048 tokens each, 30 steps (the first 5 left out):

  full    every weight
  lora    r 16 on every linear layer
  qlora   the same adapter on a 4-bit NF4 base (when bitsandbytes imports)

For each: real tokens/s per GPU, step time and MFU (metrics.jsonl's, against the GPU's
dense bf16 peak: snaketune.core.throughput), peak memory (torch.cuda.max_memory_allocated
in the worker) beside the memory plan's per-GPU figure for the same run
(snaketune.budget.memplan.estimate, its total and the part without the CUDA margin), and
the attention kernel and fused kernels the worker said it used. Then a torch profiler
summary of one forward and backward of the same model in plain transformers (the top
kernels by device time: where a step's time goes), and `pytest -m gpu`. Writes
``<out>/gpu_check.json`` and prints a table (docs/benchmarks.md, "GPU check").

With --levers: the levers of speed instead, each measured alone through the same stage
(levers.json, a table):

  defaults            the product's defaults (ZeRO-2, attention auto, Liger auto, packed
                      rows, torch's fused AdamW: transformers' default optimizer on torch
                      2.8 on), micro batches of 8,192 tokens
  16k, 32k tokens     micro batches of 16,384 and 32,768 tokens (8 and 16 rows)
  sdpa                attention by torch's sdpa, where auto would choose flash-attention
  flash-attention 2   attention: flash_attention_2 (where flash_attn imports; else left out)
  Liger off           liger_kernel: false (its fused linear cross-entropy and kernels off)
  ZeRO-1, ZeRO-0      DeepSpeed's stage 1 (optimizer states partitioned, no bucketed
                      gradient reduction) and stage 0, on one GPU against stage 2

Not among them: ``torch.compile`` of the model (the train stage has no switch for it yet).
Each row: tokens/s per GPU, MFU, the allocated peak, the plan's error against it, the
kernels the worker said it used. On CPU (without --gpu) the same set at the check's tiny
sizes, fewer steps, so the script cannot rot between GPU runs (tests/test_bench.py).

Without --gpu: the same path on this machine's CPU at tiny sizes (a 2-layer Llama, examples
of 256 tokens, 4 steps, fp32, no pytest), so that the script cannot rot between GPU runs.
"""

from __future__ import annotations

import sys

# bench/tokenize.py is named like the stdlib's tokenize module, which Python would import
# from this folder (first on sys.path when a script here runs): take the folder off the path.
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import argparse
import importlib.util
import json
import os
import platform
import re
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
ROOT = Path(__file__).resolve().parents[1]
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
SIZES = {  # (max_length, micro batch, steps, warmup)
    "gpu": (2048, 4, 30, 5),
    "smoke": (256, 2, 4, 1),
}


def throughput_module():
    """bench/train_throughput.py's helpers (the model, the GSM8K-shaped data, one side)."""
    return load_bench("train_throughput")


def load_bench(name: str):
    """bench/<name>.py as a module (by path: bench/ is not on sys.path)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / f"bench/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernels_used(train_out: Path) -> str:
    """The worker's own words for the attention kernel, the batches and the fused kernels
    (its start-up line: 'attention sdpa_segments, varlen batches, Liger kernels')."""
    for log in sorted((train_out / "logs").glob("attempt-*.log")):
        found = re.search(r"attention ([^;]+); resuming", log.read_text())
        if found:
            return found[1]
    return "not logged"


def planned(run: dict, model: Path, on_gpu: bool) -> dict[str, float]:
    """The memory plan's per-GPU figures (GiB) for ``run`` on ``model``."""
    from snaketune.budget.fit import setup_of, shape_and_deepspeed
    from snaketune.budget.memplan import estimate

    spec = {**run, "deepspeed": run.get("deepspeed") or "zero2"}
    shape, deepspeed = shape_and_deepspeed(model / "config.json", spec, ROOT)
    return estimate(shape, setup_of(spec, deepspeed, on_gpu=on_gpu))


def profile_step(model_dir: Path, micro: int, length: int, device: str) -> list[dict]:
    """One forward and backward of the model in plain transformers under torch's profiler
    (after one untimed): the 10 operators with the most device time of their own (CPU time
    on CPU), with their share of the step's."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    ids = torch.randint(4, model.config.vocab_size, (micro, length), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
    # self time: an operator's own, not the operators it calls (no time counted twice); on
    # CUDA the kernels alone (an operator's self device time is its kernels' again: the
    # first GPU run listed aten::mm beside the GEMM kernels it launched)
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = list(prof.key_averages())
    if device == "cuda":
        from torch.autograd import DeviceType

        events = [e for e in events if e.device_type == DeviceType.CUDA] or events
    events = sorted(events, key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events if not e.key.startswith("ProfilerStep")) or 1
    return [{"op": e.key, "ms": round(getattr(e, key) / 1000, 3),
             "share": round(getattr(e, key) / total, 4), "calls": e.count}
            for e in events[:10]]  # fmt: skip


def gpu_tests() -> dict:
    """`pytest -m gpu` (the tests that need a CUDA GPU): its summary line and exit code. The
    documented benchmarks' --gpu forms (tests/test_bench.py) are left out: they are whole
    benchmarks, this check among them, for a GPU session of their own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "scripts"), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           "-k", "not test_documented_benchmark_runs", "tests"]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        return {"exit": None, "summary": f"timed out after 300 s: {str(exc.stdout)[-300:]}"}
    lines = [ln for ln in proc.stdout.splitlines() if re.search(r"passed|failed|error", ln)]
    return {"exit": proc.returncode, "summary": lines[-1] if lines else proc.stdout[-300:],
            "failures": proc.stdout[-3000:] if proc.returncode else ""}  # fmt: skip


def check(mode: str, out: Path, only: list[str] | None = None, extras: bool = True) -> dict:
    import torch

    tt = throughput_module()
    on_gpu = mode == "gpu"
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA GPU here (without --gpu: the CPU form)")
    length, micro, steps, warmup = SIZES[mode]
    methods = ["full", "lora"] + (["qlora"] if importlib.util.find_spec("bitsandbytes") else [])
    methods = [m for m in methods if not only or m in only]
    result = {"mode": mode, "date": time.strftime("%Y-%m-%d %H:%M"),
              "device": torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu",
              "torch": torch.__version__, "max_length": length, "micro_batch_size": micro,
              "steps": steps, "warmup": warmup, "runs": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, params = tt.make_model(tmp / "model", gpu=on_gpu, layers=2)
        result["params"] = params
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        # Examples of max_length tokens each: a micro batch of `micro` examples is then
        # micro x max_length tokens, the batch the memory plan and the MFU goal are about
        # (micro_batch_size counts examples: GSM8K-shaped ones, ~150 tokens, would fill a
        # tenth of it; the first GPU run measured that by mistake).
        lengths = np.full(micro * (steps + 1), length, dtype=np.int64)
        tokenized = tt.write_tokenized(tmp / "tokenized.parquet", lengths, vocab)
        for method in methods:
            result["runs"][method] = measure_run(tt, tmp, method, method, tokenized, model,
                                                 SIZES[mode], on_gpu)  # fmt: skip
            dump(result, out)  # each run's figures kept, should a later one not end
            print(f"{method}: {json.dumps(result['runs'][method])}", flush=True)
        try:
            if not extras:
                raise RuntimeError("left out (--runs-only)")
            result["profile"] = profile_step(model, micro, length, "cuda" if on_gpu else "cpu")
        except Exception as exc:  # the runs' figures stand without it
            result["profile"] = [{"op": f"profile failed: {exc!r}"[:300], "ms": 0, "share": 0,
                                  "calls": 0}]  # fmt: skip
        print(f"profile: {json.dumps(result['profile'][:5])}", flush=True)
    result["gpu_tests"] = {"summary": "not run yet"}
    dump(result, out)
    result["gpu_tests"] = (gpu_tests() if on_gpu and extras else
                           {"summary": "not run (the CPU form or --runs-only)"})  # fmt: skip
    dump(result, out)
    return result


def measure_run(tt, tmp: Path, label: str, method: str, tokenized: Path, model: Path,
                sizes: tuple[int, int, int, int], on_gpu: bool, **overrides) -> dict:  # fmt: skip
    """One run through the train stage (``method``: full, lora or qlora; ``sizes``: max_length,
    micro batch, steps, warm-up steps; ``overrides``: run keys set otherwise than the check's
    own): its figures, or its error and logs."""
    length, micro, steps, warmup = sizes
    run = {"method": "lora" if method != "full" else "full", "max_length": length,
           "precision": "bf16" if on_gpu else "fp32", "learning_rate": 1e-5,
           "attn_implementation": "auto", "gradient_checkpointing": False}  # fmt: skip
    if method != "full":
        run["lora"] = {**LORA, "quantize": "4bit" if method == "qlora" else "none"}
    run.update(overrides)
    began = time.monotonic()
    try:
        records = tt.train_side(tmp, label, tokenized, model, micro, steps, True, **run)
    except RuntimeError as exc:
        logs = sorted((tmp / f"train-{label}" / "logs").glob("*.log"))
        tails = "".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
        print(f"{label}: failed", flush=True)
        return {"error": str(exc)[-1500:], "logs": tails[-6000:]}
    s = tt.steady(records, warmup)
    plan = planned(tt.run_spec_of(micro, steps, True, **run), model, on_gpu)
    after = records[warmup:]
    step_s = (after[-1]["elapsed_s"] - records[warmup - 1]["elapsed_s"]) / len(after)
    return {
        "tokens_per_s_per_gpu": round(s["tokens_per_s"], 1),
        "step_s": round(step_s, 4),
        "mfu": None if s["mfu"] != s["mfu"] else round(s["mfu"], 4),
        "peak_gib": round(s["peak_gib"], 3),
        "plan_gib": plan["total"],
        "plan_without_margin_gib": round(plan["total"] - plan["margin"], 3),
        # what max_memory_allocated measures is the plan less its margin (the CUDA
        # context, NCCL's buffers, fragmentation: memory the allocator does not count)
        "plan_error": round((plan["total"] - plan["margin"]) / s["peak_gib"] - 1, 4)
        if on_gpu
        else None,
        "plan_total_error": round(plan["total"] / s["peak_gib"] - 1, 4) if on_gpu else None,
        "kernels": kernels_used(tmp / f"train-{label}"),
        "loss_first_last": [records[0]["loss"], records[-1]["loss"]],
        "wall_s": round(time.monotonic() - began, 1),
    }


def dump(result: dict, out: Path) -> None:
    dump_named(result, out, "gpu_check.json")


def dump_named(result: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(result, indent=2) + "\n")


def table(result: dict) -> str:
    lines = [f"{result['mode']}: {result['device']}, torch {result['torch']}; "
             f"{result['params'] / 1e6:.0f}M weights, rows of {result['max_length']} tokens "
             f"packed, micro batch {result['micro_batch_size']}, {result['steps']} steps "
             f"(first {result['warmup']} left out)",
             "| run | tokens/s per GPU | step s | MFU | peak GiB | plan GiB (less margin) | plan error | kernels |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for name, r in result["runs"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][-200:]!r} |||||||")
            continue
        mfu = "" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        err = "" if r["plan_error"] is None else f"{100 * r['plan_error']:+.1f}%"
        lines.append(f"| {name} | {r['tokens_per_s_per_gpu']:,.0f} | {r['step_s']:.3f} | {mfu} | "
                     f"{r['peak_gib']:.2f} | {r['plan_gib']:.2f} ({r['plan_without_margin_gib']:.2f}) | "
                     f"{err} | {r['kernels']} |")  # fmt: skip
    lines.append("where one forward and backward goes (plain transformers, the profiler's top "
                 "operators): " + ", ".join(f"{p['op']} {100 * p['share']:.0f}%"
                                            for p in result["profile"][:5]))  # fmt: skip
    lines.append(f"pytest -m gpu: {result['gpu_tests']['summary']}")
    return "\n".join(lines)


# (label, method, rows a micro batch (x the check's micro batch of 4 rows), run keys)
LEVERS = [
    ("full, defaults", "full", 1, {}),
    ("full, 16k tokens", "full", 2, {}),
    ("full, 32k tokens", "full", 4, {}),
    ("full, sdpa", "full", 1, {"attn_implementation": "sdpa"}),
    ("full, flash-attention 2", "full", 1, {"attn_implementation": "flash_attention_2"}),
    ("full, Liger off", "full", 1, {"liger_kernel": False}),
    ("full, ZeRO-1", "full", 1, {"deepspeed": "zero1"}),
    ("full, ZeRO-0", "full", 1, {"deepspeed": "ZERO0"}),
    ("lora, defaults", "lora", 1, {}),
    ("lora, 16k tokens", "lora", 2, {}),
    ("lora, 32k tokens", "lora", 4, {}),
    ("lora, Liger off", "lora", 1, {"liger_kernel": False}),
]
ZERO0 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 1000000,
}


def levers(mode: str, out: Path, only: list[str] | None = None) -> dict:
    """Each lever of LEVERS (``only``: labels holding one of these words) through
    measure_run, written to ``out``/levers.json as it goes."""
    import torch

    tt = throughput_module()
    on_gpu = mode == "gpu"
    length, micro, steps, warmup = SIZES[mode]
    if not on_gpu:
        steps, warmup = 3, 1
    flash = importlib.util.find_spec("flash_attn") is not None
    chosen = [lv for lv in LEVERS if not only or any(w in lv[0] for w in only)]
    result = {"mode": mode, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
              "torch": torch.__version__, "max_length": length, "rows_per_micro": micro,
              "steps": steps, "warmup": warmup, "levers": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "zero0.json").write_text(json.dumps(ZERO0))
        model, result["params"] = tt.make_model(tmp / "model", gpu=on_gpu, layers=2)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        rows = np.full(micro * max(m for _, _, m, _ in chosen) * (steps + 1), length, np.int64)
        tokenized = tt.write_tokenized(tmp / "tokenized.parquet", rows, vocab)
        for i, (label, method, times, keys) in enumerate(chosen):
            if keys.get("attn_implementation") == "flash_attention_2" and not flash:
                result["levers"][label] = {"skipped": "flash_attn is not installed here"}
                continue
            keys = {k: str(tmp / "zero0.json") if v == "ZERO0" else v for k, v in keys.items()}
            sizes = (length, micro * times, steps, warmup)
            got = measure_run(tt, tmp, f"lever-{i}", method, tokenized, model, sizes,
                                    on_gpu, **keys)  # fmt: skip
            got["tokens_per_micro_batch"] = length * micro * times
            got["defaults"] = label.endswith("defaults")
            result["levers"][label] = got
            dump_named(result, out, "levers.json")
            print(f"{label}: {json.dumps(got)[:400]}", flush=True)
    return result


def levers_table(result: dict) -> str:
    """The lever table as docs/benchmarks.md records it."""
    lines = [f"{result['mode']}: {result['device']}, torch {result['torch']}; "
             f"{result['params'] / 1e6:.0f}M weights, rows of {result['max_length']} tokens, "
             f"{result['steps']} steps (first {result['warmup']} left out)",
             "| lever | tokens a micro batch | tokens/s per GPU | MFU | peak GiB | plan error | "
             "kernels |", "|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for label, r in result["levers"].items():
        if "skipped" in r or "error" in r:
            why = r.get("skipped") or f"failed: {r['error'][-160:]!r}"
            lines.append(f"| {label} | {why} ||||||")
            continue
        mfu = "" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        err = "" if r["plan_error"] is None else f"{100 * r['plan_error']:+.1f}%"
        name = f"{label} (**defaults**)" if r["defaults"] else label
        lines.append(f"| {name} | {r['tokens_per_micro_batch']:,} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {mfu} | {r['peak_gib']:.2f} | {err} | "
                     f"{r['kernels']} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--gpu", action="store_true",
                        help="the GPU check (without: the CPU form, tiny sizes, a few steps)")  # fmt: skip
    parser.add_argument("--only", type=lambda v: v.split(","), default=None,
                        help="these runs alone (full,lora,qlora)")  # fmt: skip
    parser.add_argument("--runs-only", action="store_true",
                        help="the training runs alone: no profile, no pytest -m gpu")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("gpu_check"),
                        help="folder for gpu_check.json (the device tool's $OUT there)")  # fmt: skip
    parser.add_argument("--levers", action="store_true",
                        help="the levers of speed instead: levers.json and a table")  # fmt: skip
    args = parser.parse_args()
    if args.levers:
        got = levers("gpu" if args.gpu else "smoke", args.out, args.only)
        print(levers_table(got))
        return 1 if any("error" in r for r in got["levers"].values()) else 0
    result = check("gpu" if args.gpu else "smoke", args.out, args.only, not args.runs_only)
    print(table(result))
    failed = [name for name, r in result["runs"].items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
