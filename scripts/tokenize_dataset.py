"""Tokenize a dataset with a model's chat template: prompt masking, max length policy.

    python scripts/tokenize_dataset.py --spec "$(cat spec.json)" \
        --data resources/datasets/gsm8k/data.parquet --model resources/models/tiny \
        --out results/tokenized/KEY/data.parquet --stats results/tokenized/KEY/stats.json

Writes data.parquet, stats.json and provenance.json beside them, all three renamed into
place once complete. A set of many rows is rendered and encoded by as many worker
processes as the job has cores (its SLURM allocation's CPUs, else its threads:
RAYON_NUM_THREADS; snaketune.core.parts.job_cores). With
``--part 00003-of-00008`` (rule tokenize_part: a dataset with ``parts: 8``) it tokenizes
only that part of the sources' rows (snaketune.core.parts), into part-00003-of-00008.parquet,
its .stats.json and its .provenance.json.

--spec is the tokenize spec the workflow computes (snaketune.plan.stages.tokenize_spec); --data
gives one parquet per source of the spec, in its order. Streams in batches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.app.cli import run
from snaketune.core.errors import DataError
from snaketune.core.imports import load
from snaketune.core.io import atomic_paths, sha256_file
from snaketune.core.parts import job_cores, parse_part
from snaketune.core.provenance import NAME, record, write_provenance
from snaketune.data.chat import TEMPLATE_DATE
from snaketune.data.cleaning import Removed
from snaketune.data.conversations import Source
from snaketune.data.tokenization import tokenize


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--spec", required=True, help="tokenize spec, as JSON")
    parser.add_argument(
        "--data", required=True, nargs="+", help="source parquet files, in spec order"
    )
    parser.add_argument("--model", required=True, help="model directory (tokenizer files)")
    parser.add_argument("--out", required=True, help="output parquet")
    parser.add_argument("--stats", required=True, help="output stats JSON (counts, provenance)")
    parser.add_argument(
        "--part", help="only this part of the rows, PART-of-PARTS (e.g. 00003-of-00008)"
    )
    parser.add_argument("--removed", help="the rows the dataset's cleaning removed")
    args = parser.parse_args(argv)
    part = parse_part(args.part) if args.part else None
    # what loading a plain fast tokenizer imports, with no collections meanwhile (not
    # transformers' AutoTokenizer: its module imports torch through the model configs; a
    # family's own tokenizer class still loads it, then)
    load("transformers.tokenization_utils_tokenizers")
    spec = json.loads(args.spec)
    if len(args.data) != len(spec["sources"]):
        raise SystemExit(f"--data has {len(args.data)} files for {len(spec['sources'])} sources")
    removed = Removed.read(args.removed) if args.removed else None
    sources = [
        Source(s["name"], Path(path), s["spec"], s["weight"], s["seed"], removed)
        for s, path in zip(spec["sources"], args.data, strict=True)
    ]
    template = spec["chat_template"]
    template_text = Path(template["path"]).read_text(encoding="utf-8") if template else None
    out = Path(args.out)
    provenance = out.with_suffix(".provenance.json") if part else out.parent / NAME
    with atomic_paths(out, args.stats, provenance) as (tmp, tmp_stats, tmp_prov):
        try:
            stats = tokenize(
                sources,
                args.model,
                tmp,
                spec["max_length"],
                spec["overlong"],
                template_text,
                model_name=spec["model"],
                part=part,
                workers=job_cores(int(os.environ.get("RAYON_NUM_THREADS", "1"))),
                template_date=spec.get("template_date", TEMPLATE_DATE),
            )
        except DataError as exc:
            if str(exc).startswith(("models.", "datasets.")):
                raise
            raise DataError(f"datasets.{spec['dataset']}: {exc}") from None
        if removed is not None:  # what cleaning removed, beside the counts (report.json)
            stats.cleaned = json.loads(Path(args.removed).with_name("report.json").read_text())
        summary = {
            **dataclasses.asdict(stats),
            "max_length": spec["max_length"],
            "overlong": spec["overlong"],
            **({"part": args.part} if part else {}),
        }
        tmp_stats.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        inputs = {f"data_{s.name}": s.path for s in sources}
        inputs["model"] = args.model
        if removed is not None:
            inputs["removed"] = args.removed
        if template:
            inputs["chat_template"] = template["path"]
        names = {out.name: tmp, Path(args.stats).name: tmp_stats}
        stage = "tokenize_part" if part else "tokenize_dataset"
        dated = {"template_date": stats.template_date} if stats.template_date else {}
        prov = record(stage, out.parent, spec, inputs,
                      {n: sha256_file(t) for n, t in names.items()}, **dated)  # fmt: skip
        write_provenance(tmp_prov, prov)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
