"""DPO's reference: the reference_logps stage against a live reference in every step.

    python bench/dpo_reference.py                       # CPU: the demo's pairs, 2 x 1
    python bench/dpo_reference.py --steps 32 --method full

The demo's fixtures (tiny Llama, the arithmetic task's 2048 preference pairs) tokenized and
sharded for 2 emulated nodes x 1 process, then through the real stages:

- scripts/reference_logps.py: the reference's log-probs of every pair, 2 workers;
- scripts/train.py, ``--steps`` steps of DPO (ZeRO-2, fp32), once with the reference
  precomputed (read from the stage's parquet) and once live (LoRA: the adapter off; full:
  a frozen copy of the model in every worker).

Prints the stage's wall time, each training run's wall time, median step time and real
tokens/s (steps after the first), and the losses' largest relative difference. What a
precomputed reference saves per run is (live - precomputed) training time; the stage is
paid once per (starting model, tokenized pairs), by every run and sweep member after it.
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
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
ROOT = Path(__file__).resolve().parents[1]


def prepare(work: Path, pairs: int | None = None) -> dict[str, Path]:
    """Fixtures, the pairs (the first ``pairs`` of them; all: None) tokenized and sharded for
    2 x 1 (the DPO demo's layout)."""
    from snaketune.app.fixtures import make_fixtures
    from snaketune.data.conversations import Source
    from snaketune.data.shard import Layout, shard
    from snaketune.data.sources import download_dataset
    from snaketune.data.tokenization import tokenize

    paths = make_fixtures(work / "fixtures")
    rows = (paths["arith"] / "pairs-train.jsonl").read_text().splitlines(keepends=True)
    (work / "pairs.jsonl").write_text("".join(rows[:pairs]))
    spec = {"source": "local", "path": str(work / "pairs.jsonl"),
            "format": "preference", "columns": {"prompt": "question"}}  # fmt: skip
    data = download_dataset("pairs", spec, work / "dataset")
    tokenize([Source("pairs", data, spec)], paths["model"], work / "pairs.parquet", 256)
    manifest = shard(work / "pairs.parquet", work / "shards", Layout(2, 1, 32, 1), 42, True)
    (work / "shards" / "manifest.json").write_text(json.dumps(manifest))
    return {"model": paths["model"], "tokenized": work / "pairs.parquet", "shards": work / "shards"}


def run_spec(method: str, steps: int, reference: str) -> dict:
    from snaketune.plan.config import load_yaml, validate_config

    config = load_yaml(ROOT / "config" / "config.yaml")
    overlay = load_yaml(ROOT / "config" / "dpo_demo.yaml")
    config["datasets"].update(overlay["datasets"])
    run = overlay["runs"]["dpo_demo"]
    del run["init_from"]
    run.update(model="tiny", max_steps=steps, save_steps=10 * steps)
    if method == "full":
        del run["lora"]
    run["dpo"]["reference"] = reference
    config["runs"] = {"b": run}
    spec = validate_config(config, ROOT)["runs"]["b"]
    return {k: v for k, v in spec.items() if k not in ("eval", "eval_dataset", "export")}


def train(work: Path, spec: dict, data: dict[str, Path]) -> tuple[float, list[dict]]:
    out = work / "train"
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--run-spec", json.dumps(spec),
           "--shards", str(data["shards"]), "--model", str(data["model"]),
           "--deepspeed", str(ROOT / "config" / "deepspeed" / "zero2.json"), "--out", str(out),
           "--stage-input", f"reference_logps={data['logps']}"]  # fmt: skip
    began = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    seconds = time.monotonic() - began
    if proc.returncode != 0:
        raise SystemExit(f"train failed:\n{proc.stderr[-3000:]}{proc.stdout[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return seconds, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--steps", type=int, default=32, help="DPO steps per training run")
    parser.add_argument("--method", choices=("lora", "full"), default="lora", help="what trains")
    parser.add_argument("--pairs", type=int, default=None,
                        help="the demo's first this many pairs (default: all 2048)")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dpo-bench-") as tmp:
        work = Path(tmp)
        data = prepare(work, args.pairs)
        count = pq.ParquetFile(data["tokenized"]).metadata.num_rows
        logps = work / "ref" / "logps.parquet"
        began = time.monotonic()
        subprocess.run([sys.executable, str(ROOT / "scripts" / "reference_logps.py"),
                        "--tokenized", str(data["tokenized"]), "--model", str(data["model"]),
                        "--nodes", "2", "--gpus-per-node", "1", "--batch-pairs", "32",
                        "--precision", "fp32", "--out", str(logps)], check=True,
                       capture_output=True)  # fmt: skip
        stage = time.monotonic() - began
        print(f"reference_logps: {count} pairs, 2 workers: {stage:.1f} s")
        losses = {}
        for reference in ("precomputed", "live"):
            (work / reference).mkdir()
            spec = run_spec(args.method, args.steps, reference)
            seconds, rows = train(work / reference, spec, {**data, "logps": logps})
            elapsed = [m["elapsed_s"] for m in rows]
            step_s = statistics.median(
                b - a for a, b in zip(elapsed[1:-1], elapsed[2:], strict=True)
            )
            tps = statistics.median(m["tokens_per_s"] for m in rows[1:])
            losses[reference] = rows
            print(f"train {args.method}, reference {reference}: {args.steps} steps in "
                  f"{seconds:.1f} s (whole stage), median step {step_s:.3f} s, "
                  f"median {tps:.0f} real tokens/s")  # fmt: skip
        for key in ("loss", "reward_chosen", "reward_margin", "logp_chosen"):
            pairs = zip(losses["precomputed"][1:], losses["live"][1:], strict=True)
            worst = max(abs(a[key] - b[key]) / max(abs(b[key]), 1e-12) for a, b in pairs)
            print(f"largest relative difference of {key}, precomputed vs live: {worst:.2e}"
                  + (" (Trainer logs the loss to 4 decimals)" if key == "loss" else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
