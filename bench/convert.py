"""Benchmark checkpoint conversion and LoRA merge: time and peak RSS against the tools
users reach for today.

    python bench/convert.py                  # ~300M-parameter Llama, ZeRO-3 on 2 emulated nodes
    python bench/convert.py --layers 4       # quicker, smaller
    python bench/convert.py --layers 2 --hidden 128 --repeat 1   # the suite's short form

The benchmark makes its own checkpoint: a randomly initialised Llama-shaped model (hidden
1024, 24 layers: ~300M parameters) trained for one step, full fine-tuning with ZeRO-3 on 2
emulated nodes (scripts/train.py). Each tool then runs alone in a fresh process under
/usr/bin/time (wall time, peak RSS), after a sync, --repeat times interleaved (median time):
  convert  ours: scripts/convert_checkpoint.py (shards of --shard-size, then the logit gate)
           ours, consolidation only (the same reader and writer, no gate)
           DeepSpeed: zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict (safetensors)
  merge    ours: scripts/merge_lora.py (an rank-16 all-linear adapter with random B)
           peft: PeftModel.from_pretrained(...).merge_and_unload().save_pretrained(...)
Targets (issue 4): peak RSS <= 0.5x DeepSpeed's and time <= 1.2x; the same against peft.
"""

from __future__ import annotations

import sys

# bench/tokenize.py is named like the stdlib's tokenize module, which Python would import
# from this folder (first on sys.path when a script here runs): take the folder off the path.
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore::FutureWarning", "PYTHONPATH": str(ROOT / "scripts")}


def timed(cmd: list[str], out: Path) -> dict:
    """Run ``cmd`` (writing ``out``) under /usr/bin/time; its wall seconds and peak RSS (MiB).

    ``out`` is removed first and the disks are synced, so no tool pays for the write-back
    of the one before it (1 GB of dirty pages costs seconds on this machine).
    """
    subprocess.run(["rm", "-rf", str(out)], check=True)
    os.sync()
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "TIME %e %M", *cmd], capture_output=True, text=True, env=ENV
    )
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    seconds, kib = re.findall(r"TIME ([0-9.]+) (\d+)", proc.stderr)[-1]
    return {"seconds": float(seconds), "peak_rss_mib": int(kib) / 1024}


def median_of(runs: list[dict]) -> dict:
    """Median wall time and the largest peak RSS of repeated runs."""
    times = sorted(r["seconds"] for r in runs)
    return {
        "seconds": times[len(times) // 2],
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
        "all": times,
    }


def make_checkpoint(tmp: Path, layers: int, hidden: int = 1024) -> tuple[Path, int]:
    from snaketune.app.fixtures import FixtureSizes, make_sharded_fixture
    from snaketune.data.shard import Layout
    from snaketune.plan.config import load_yaml, validate_config

    sizes = FixtureSizes(
        train_rows=64,
        test_rows=8,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,  # 2816 at 1024
        layers=layers,
        heads=hidden // 64,
        kv_heads=hidden // 128,
    )
    made = make_sharded_fixture(tmp, sizes, Layout(2, 1, 1, 1))
    config = load_yaml(ROOT / "config" / "config.yaml")
    run = config["runs"]["demo"]
    del run["epochs"], run["lora"]
    run.update(
        method="full",
        max_steps=1,
        micro_batch_size=1,
        gradient_accumulation_steps=1,
        deepspeed="zero3",
        save_steps=10**6,
    )
    run = validate_config(config, ROOT)["runs"]["demo"]
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/train.py"), "--run-spec", json.dumps(run),
         "--shards", str(made["shards"]), "--model", str(made["model"]),
         "--deepspeed", str(ROOT / "config/deepspeed/zero3.json"), "--out", str(tmp / "train")],
        check=True, capture_output=True, env=ENV,
    )  # fmt: skip
    return made["model"], count_params(made["model"])


def count_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118
                shape = st.get_slice(k).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total


def make_adapter(base: Path, out: Path, probe: Path) -> None:
    code = f"""
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
model = get_peft_model(AutoModelForCausalLM.from_pretrained({str(base)!r}),
                       LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
for name, p in model.named_parameters():
    if "lora_B" in name:
        torch.nn.init.normal_(p, std=0.01)
model.save_pretrained({str(out)!r})
# the merge gate's reference: base + adapter logits on probe inputs (the train stage records
# these for a trained adapter; this adapter is random, so record them here)
from safetensors.torch import load_file, save_file
probe = load_file({str(probe)!r})
with torch.no_grad():
    logits = model(input_ids=probe["input_ids"]).logits.float()
save_file({{"input_ids": probe["input_ids"], "logits": logits}}, {str(out / "probe.safetensors")!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=ENV)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / f).exists():
            (out / f).write_bytes((base / f).read_bytes())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layers", type=int, default=24, help="decoder layers (24: ~300M parameters)"
    )
    parser.add_argument(
        "--shard-size", default="200MB", help="our converter's and merger's max shard size"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each tool (median time)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (a multiple of 128)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        base, n_params = make_checkpoint(tmp, args.layers, args.hidden)
        train = tmp / "train"
        ckpt, probe = train / "final_checkpoint", train / "probe.safetensors"
        py = sys.executable
        adapter = tmp / "adapter"
        make_adapter(base, adapter, probe)
        tools = {
            "convert: ours (scripts/convert_checkpoint.py, with gate)": (tmp / "ours",
                [py, str(ROOT / "scripts/convert_checkpoint.py"), "--method", "full", "--checkpoint", str(ckpt),
                 "--trained", str(train / "model"), "--base", str(base), "--probe", str(probe),
                 "--out", str(tmp / "ours"), "--max-shard-size", args.shard_size, "--dtype", "float32"]),
            "convert: ours, consolidation only": (tmp / "ours-only",
                [py, "-c", "import sys, torch; from pathlib import Path; "
                 "from snaketune.export.convert import write_shards; from snaketune.core.io import parse_size; "
                 "from snaketune.export.zero_checkpoint import ZeroCheckpoint; "
                 "o = Path(sys.argv[2]); o.mkdir(); c = ZeroCheckpoint(sys.argv[1]); "
                 "write_shards(c.plan(), c.tensors(), o, parse_size(sys.argv[3]), torch.float32)",
                 str(ckpt), str(tmp / "ours-only"), args.shard_size]),
            "convert: DeepSpeed zero_to_fp32 (safetensors, 5GB shards)": (tmp / "deepspeed",
                [py, "-c", "import sys; from deepspeed.utils.zero_to_fp32 import "
                 "convert_zero_checkpoint_to_fp32_state_dict as c; c(sys.argv[1], sys.argv[2], "
                 "safe_serialization=True)", str(ckpt), str(tmp / "deepspeed")]),
            "merge: ours (scripts/merge_lora.py, with gates)": (tmp / "merged-ours",
                [py, str(ROOT / "scripts/merge_lora.py"), "--base", str(base), "--adapter", str(adapter),
                 "--probe", str(adapter / "probe.safetensors"), "--out", str(tmp / "merged-ours"),
                 "--max-shard-size", args.shard_size, "--dtype", "float32"]),
            "merge: peft merge_and_unload + save_pretrained": (tmp / "merged-peft",
                [py, "-c", "import sys; from peft import PeftModel; from transformers import AutoModelForCausalLM; "
                 "m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sys.argv[1]), sys.argv[2]); "
                 "m.merge_and_unload().save_pretrained(sys.argv[3])", str(base), str(adapter), str(tmp / "merged-peft")]),
        }  # fmt: skip
        runs: dict[str, list[dict]] = {name: [] for name in tools}
        for _ in range(args.repeat):  # interleaved, so a slow spell of the machine hits all
            for name, (out, cmd) in tools.items():
                runs[name].append(timed(cmd, out))
        results = {name: median_of(r) for name, r in runs.items()}
    print(
        f"model: Llama-shaped, {n_params / 1e6:.0f}M parameters (fp32 {n_params * 4 / 2**20:.0f} MiB); "
        f"ZeRO-3 checkpoint of 2 emulated nodes; our shards {args.shard_size}; {os.cpu_count()} cores"
    )
    print(f"{'what':<60}{'median s':>9}{'peak RSS MiB':>14}  all runs (s)")
    for name, r in results.items():
        every = " ".join(f"{t:.1f}" for t in r["all"])
        print(f"{name:<60}{r['seconds']:>9.1f}{r['peak_rss_mib']:>14.0f}  {every}")
    ours, ds = (
        results["convert: ours (scripts/convert_checkpoint.py, with gate)"],
        results["convert: DeepSpeed zero_to_fp32 (safetensors, 5GB shards)"],
    )
    only = results["convert: ours, consolidation only"]
    mo, mp = (
        results["merge: ours (scripts/merge_lora.py, with gates)"],
        results["merge: peft merge_and_unload + save_pretrained"],
    )
    print(
        f"convert, ours / DeepSpeed: RSS {ours['peak_rss_mib'] / ds['peak_rss_mib']:.2f}, time "
        f"{ours['seconds'] / ds['seconds']:.2f} (consolidation only: RSS "
        f"{only['peak_rss_mib'] / ds['peak_rss_mib']:.2f}, time {only['seconds'] / ds['seconds']:.2f})"
    )
    print(
        f"merge, ours / peft: RSS {mo['peak_rss_mib'] / mp['peak_rss_mib']:.2f}, time "
        f"{mo['seconds'] / mp['seconds']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
