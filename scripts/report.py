"""Summarise every run: results/summary.tsv (one row per run), training plots per run
(loss, learning rate, tokens/s), and results/summary.html (the table, the plots, base versus
tuned for every metric, and eval samples marked right or wrong, on one page).

    python scripts/report.py --runs '{"demo": {...run config...}}' --results results \
        --benchmarks benchmarks --summary results/summary.tsv --curves results/loss_curves \
        --html results/summary.html

Columns: run, model, method, nodes x devices, steps, final training loss, eval loss,
perplexity, exact match, the base model's exact match, gain over the base (exact match
and loss), wall time of the train job, GPU-hours (GPU runs only); then, per lm-eval task
metric, lm_eval:<task>:<metric,filter> with its base_ and gain_ twins.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.app.cli import run
from snaketune.app.plots import sweep_svg, training_svg
from snaketune.app.report import summary_html, sweep_section
from snaketune.app.summary import summary_row, write_summary
from snaketune.core.io import atomic_paths, read_jsonl
from snaketune.core.provenance import lineage
from snaketune.methods import method_of
from snaketune.plan.runspec import RunSpec


def sweep_sections(runs: dict, rows: list[dict[str, str]], curves: dict[str, list[dict]],
                   evals: dict[str, dict]) -> list[str]:  # fmt: skip
    """The report's section of each sweep (snaketune.plan.sweep): its members compared, the best
    one chosen as results/<sweep>/best.json chooses it."""
    from snaketune.app.selection import best_member
    from snaketune.plan.sweep import sweeps_of

    sections = []
    for sweep, members in sweeps_of(runs).items():
        best = best_member({m: runs[m] for m in members}, evals, curves)
        held_out = {m: evals[m]["loss"] for m in members if m in evals}
        svg = sweep_svg({m: curves[m] for m in members}, held_out, best["best"],
                        f"sweep {sweep}: training loss of each member")  # fmt: skip
        sections.append(sweep_section(sweep, best, rows, svg))
    return sections


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", required=True, help="the config's runs, as JSON")
    parser.add_argument("--results", type=Path, default=Path("results"), help="results directory")
    parser.add_argument(
        "--benchmarks", type=Path, default=Path("benchmarks"), help="benchmark directory"
    )
    parser.add_argument("--summary", type=Path, required=True, help="output TSV")
    parser.add_argument("--curves", type=Path, required=True, help="output directory of <run>.svg")
    parser.add_argument("--html", type=Path, required=True, help="output HTML page")
    parser.add_argument(
        "--cleaned", default="{}", help="each cleaned run's cleaning report.json, as JSON"
    )
    args = parser.parse_args(argv)
    runs = json.loads(args.runs)
    cleaned = {r: json.loads(Path(p).read_text()) for r, p in json.loads(args.cleaned).items()}
    rows, svgs, evals, samples, lineages, curves_of, attempts = [], {}, {}, {}, {}, {}, {}
    with atomic_paths(args.curves, args.summary, args.html) as (curves, summary, html):
        curves.mkdir()
        for name, spec in runs.items():
            train = args.results / name / "train"
            ev = args.results / name / "eval" / "metrics.json"
            rows.append(
                summary_row(
                    name,
                    spec,
                    train,
                    ev if "eval_dataset" in spec else None,
                    args.benchmarks / "train" / f"{name}.tsv",
                )
            )
            metrics = read_jsonl(train / "metrics.jsonl")
            curves_of[name] = metrics
            if "eval_dataset" in spec:
                evals[name] = json.loads(ev.read_text())
            held_out = evals[name].get("loss") if name in evals else None
            provenance = json.loads((train / "provenance.json").read_text())
            exported = provenance.get("exported")
            attempts[name] = provenance.get("attempts") or []
            step = exported["step"] if exported and exported["checkpoint"] == "best" else None
            panel = method_of(spec).panel  # the method's own first panel
            svgs[name] = training_svg(metrics, f"{name}: training", held_out, step, panel)
            (curves / f"{name}.svg").write_text(svgs[name])
            if "eval_dataset" in spec:
                lines = (ev.parent / "samples.jsonl").read_text().splitlines()
                samples[name] = [json.loads(x) for x in lines if x]
            model = args.results / name / RunSpec.of(spec).final_model
            final = ev.parent if "eval_dataset" in spec else model
            href = os.path.relpath(final / "provenance.json", args.html.parent)
            lineages[name] = (href, str(final), "\n".join(lineage(final)))
        write_summary(rows, summary)
        sweeps = sweep_sections(runs, rows, curves_of, evals)
        # runs another config trained in this directory: named, since the page is this one's
        others = sorted(
            p.parents[1].name
            for p in args.results.glob("*/train/provenance.json")
            if p.parents[1].name not in runs
        )
        html.write_text(
            summary_html(
                rows,
                svgs,
                evals,
                samples,
                lineages,
                sweeps=sweeps,
                attempts=attempts,
                others=others,
                cleaned=cleaned,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
