"""The plan before anything runs against what runs take, for a matrix of methods and data
on the demo's tiny model, on this machine's CPU: continued pre-training on a corpus of long
documents (Python's own modules) and on one of short ones (their paragraphs), each with a
text held-out set (its loss: no generation), SFT with a generating held-out set, DPO, GRPO
(from the SFT run's model) and on-policy distillation (the SFT run its teacher).

1. In a fresh working directory (the demo's fixtures, nothing downloaded or tokenized):
   `snaketune plan --json`, the plan a user gets before queueing.
2. The SFT run alone through its evaluation (`results/sft/eval/metrics.json`): the
   calibration of the model on this machine.
3. The plan again: the other runs calibrated from SFT, a run of another method.
4. Every run through its evaluation, one job at a time (`--jobs 1`: each job's time its
   own); each run's steps and rows from its shard manifest, each stage's time from
   Snakemake's benchmark files, against both plans.

    python bench/plan_matrix.py
    python bench/plan_matrix.py --steps 40 --keep /tmp/plan-matrix

Prints a table (figure, planned before, planned after SFT, measured, ratios), then the
figures as one JSON line. Targets (issue 105): steps exact, rows within 10% for the corpora,
each stage within 2x before any run and within 30% after the calibration.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

# bench/tokenize.py would shadow the standard library's tokenize from this folder
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("shard_dataset", "train", "convert_checkpoint", "merge_lora", "evaluate")


def corpora(out: Path) -> dict[str, Path]:
    """Two corpora of real text, jsonl, a held-out tail of each: 60 of Python's modules
    (long documents) and the paragraphs of 30 (short ones)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = random.Random(3).sample(sorted(stdlib.glob("*.py")), 90)
    code = [p.read_text(errors="replace") for p in files]
    # each paragraph once (a licence header repeats: the shard stage refuses an eval row
    # that is a training row)
    paragraphs = list(dict.fromkeys(p.strip() for doc in code[60:] for p in doc.split("\n\n")
                                    if p.strip()))  # fmt: skip
    paths = {}
    for name, docs in (("code", code[:60]), ("paragraphs", paragraphs)):
        cut = len(docs) * 9 // 10
        for part, rows in (("train", docs[:cut]), ("test", docs[cut:])):
            path = out / f"{name}-{part}.jsonl"
            path.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
            paths[f"{name}_{part}"] = path
    return paths


def config(work: Path, steps: int) -> dict:
    """The demo's model and sets, the corpora, and a run of each kind (CPU, the demo's
    two emulated nodes)."""
    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    demo = cfg["runs"].pop("demo")
    pairs = yaml.safe_load((ROOT / "config/dpo_demo.yaml").read_text())["datasets"]
    cfg["datasets"].update(pairs)
    for name, path in corpora(work / "resources").items():
        cfg["datasets"][name] = {"source": "local", "path": str(path), "format": "text"}
    common = {k: v for k, v in demo.items() if k not in ("epochs", "dataset", "eval_dataset")}
    common.update(max_steps=steps, save_steps=steps, eval={"limit": 64, "max_new_tokens": 16,
                                                            "batch_size": 32})  # fmt: skip
    runs = {
        "sft": {**common, "dataset": "arith", "eval_dataset": "arith_test"},
        "dpo": {**common, "dataset": "arith_pairs", "eval_dataset": "arith_pairs_test",
                "method": "dpo", "micro_batch_size": 16},
        # from the SFT run's model, as the GRPO demo (the base earns no reward to learn from)
        "grpo": {**{k: v for k, v in common.items() if k != "model"}, "init_from": "sft",
                 "dataset": "arith", "eval_dataset": "arith_test", "method": "grpo",
                 "grpo": {"num_generations": 4, "max_completion_length": 12,
                          "rewards": {"correctness": 1.0}},
                 "micro_batch_size": 16, "max_steps": steps // 2, "save_steps": steps // 2},
        "opd": {**{k: v for k, v in common.items() if k not in ("lora",)}, "dataset": "arith",
                "eval_dataset": "arith_test", "method": "opd",
                "opd": {"teacher": "sft", "max_completion_length": 12},
                "micro_batch_size": 16, "max_steps": steps // 2, "save_steps": steps // 2},
    }  # fmt: skip
    for corpus, length in (("code", 256), ("paragraphs", 64)):
        runs[f"cpt_{corpus}"] = {**common, "dataset": f"{corpus}_train", "max_length": length,
                                 "eval_dataset": f"{corpus}_test", "epochs": 1,
                                 "micro_batch_size": 8}  # fmt: skip
        del runs[f"cpt_{corpus}"]["max_steps"]
    cfg["runs"] = runs
    return cfg


def plan(work: Path, cfg_path: Path) -> dict[str, dict]:
    cmd = [sys.executable, "-m", "snaketune.app.cli", "plan", str(cfg_path), "--root", str(ROOT),
           "--json"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        sys.exit(f"snaketune plan failed:\n{proc.stdout}{proc.stderr}")
    return {p["run"]: p for p in json.loads(proc.stdout)}


def snakemake(work: Path, cfg_path: Path, *targets: str) -> None:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"),
           "--profile", str(ROOT / "profiles/local"), "--configfile", str(cfg_path),
           "--directory", str(work), "--jobs", "1", *targets]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"snakemake failed:\n{(proc.stdout + proc.stderr)[-4000:]}")


def planned(p: dict) -> dict:
    """A run's plan: steps, examples, tokens, and each stage's seconds (None: none)."""
    stages = {k: v["s"] for k, v in (p.get("costs") or {}).get("stages", {}).items()}
    return {"steps": p["steps"].get("steps"), "examples": p["steps"].get("examples"),
            "basis": p["steps"].get("basis"), "train_basis": p["estimate"].get("basis"),
            **{s: stages.get(s) for s in STAGES}}  # fmt: skip


def measured(work: Path, run: str) -> dict:
    """What the run did: its examples (the tokenized set's rows the shard plan took), its
    last logged step, each stage's seconds."""
    from snaketune.budget.calibrate import stage_seconds

    manifest = json.loads((work / "results" / run / "shards/manifest.json").read_text())
    took = stage_seconds(work, run, STAGES)
    lines = (work / "results" / run / "train/metrics.jsonl").read_text().splitlines()
    steps = max(json.loads(line).get("step", 0) for line in lines if line.strip())
    return {"examples": manifest["examples"], "steps": steps, **{s: took.get(s) for s in STAGES}}


def ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="max_steps of the fixed runs")
    parser.add_argument("--keep", help="work here (kept) instead of a temporary folder")
    args = parser.parse_args(argv)
    work = Path(args.keep or tempfile.mkdtemp(prefix="plan-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    from snaketune.app.fixtures import make_fixtures

    make_fixtures(work / "resources/fixtures")
    cfg_path = work / "matrix.yaml"
    cfg_path.write_text(yaml.safe_dump(config(work, args.steps), sort_keys=False))
    before = {r: planned(p) for r, p in plan(work, cfg_path).items()}
    snakemake(work, cfg_path, "results/sft/eval/metrics.json")
    after = {r: planned(p) for r, p in plan(work, cfg_path).items()}
    snakemake(work, cfg_path)
    rows = []
    for run in before:
        took = measured(work, run)
        for what in ("steps", "examples", *STAGES):
            b, a, m = before[run].get(what), after[run].get(what), took.get(what)
            if b is None and a is None and m is None:
                continue
            rows.append({"run": run, "figure": what, "before": b, "after": a, "measured": m})
    print(f"{'run':10}{'figure':20}{'before':>12}{'after SFT':>12}{'measured':>12}"
          f"{'before/m':>10}{'after/m':>10}")  # fmt: skip
    for r in rows:
        cells = [f"{x:>12.1f}" if isinstance(x, float) else f"{x if x is not None else '-':>12}"
                 for x in (r["before"], r["after"], r["measured"])]  # fmt: skip
        print(
            f"{r['run']:10}{r['figure']:20}{''.join(cells)}"
            f"{ratio(r['before'], r['measured']):>10}{ratio(r['after'], r['measured']):>10}"
        )
    for run in before:
        print(f"{run}: before: {before[run]['train_basis']}; after: {after[run]['train_basis']}")
    print(json.dumps(rows))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
