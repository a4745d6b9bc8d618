"""The GPU check: training speed and memory through the product's own train stage, on one
GPU, in one command that is ready before a GPU machine is (issue 59).

    python bench/gpu_prepare.py download         # here, online: the wheels a GPU machine lacks
    python bench/gpu_prepare.py install          # there, after each part is carried
    PYTHONPATH=$PWD/scripts:$PWD/.gpu-site \
    python bench/gpu_check.py --gpu --out gpu_check   # there: ~5 minutes on one H200
    python bench/gpu_check.py --out /tmp/gpu_check    # CPU: tiny sizes (the CI tier runs it)

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
    spec = importlib.util.spec_from_file_location("train_throughput",
                                                  ROOT / "bench/train_throughput.py")  # fmt: skip
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

    spec = {**run, "deepspeed": "zero2"}
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
            run = {"method": "lora" if method != "full" else "full", "max_length": length,
                   "precision": "bf16" if on_gpu else "fp32", "learning_rate": 1e-5,
                   "attn_implementation": "auto", "gradient_checkpointing": False}  # fmt: skip
            if method != "full":
                run["lora"] = {**LORA, "quantize": "4bit" if method == "qlora" else "none"}
            began = time.monotonic()
            try:
                records = tt.train_side(tmp, method, tokenized, model, micro, steps, True, **run)
            except RuntimeError as exc:
                logs = sorted((tmp / f"train-{method}" / "logs").glob("*.log"))
                tails = "".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
                result["runs"][method] = {"error": str(exc)[-1500:], "logs": tails[-6000:]}
                dump(result, out)
                print(f"{method}: failed", flush=True)
                continue
            s = tt.steady(records, warmup)
            plan = planned(tt.run_spec_of(micro, steps, True, **run), model, on_gpu)
            after = records[warmup:]
            step_s = (after[-1]["elapsed_s"] - records[warmup - 1]["elapsed_s"]) / len(after)
            result["runs"][method] = {
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
                "kernels": kernels_used(tmp / f"train-{method}"),
                "loss_first_last": [records[0]["loss"], records[-1]["loss"]],
                "wall_s": round(time.monotonic() - began, 1),
            }
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


def dump(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")


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
    args = parser.parse_args()
    result = check("gpu" if args.gpu else "smoke", args.out, args.only, not args.runs_only)
    print(table(result))
    failed = [name for name, r in result["runs"].items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
