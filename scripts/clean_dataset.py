"""Clean a dataset before it is tokenized (``datasets.<d>.clean``; snaketune.data.cleaning):
rule clean_signatures signs one part of the sources' rows, rule clean_dataset gathers every
part's signatures and decides which rows go and why.

    python scripts/clean_dataset.py --spec "$(cat clean.json)" --part 00000-of-00002 \
        --data resources/datasets/corpus/data.parquet \
        --heldout resources/datasets/corpus-eval/data.parquet \
        --out results/cleaned/KEY/signatures-00000-of-00002.parquet

    python scripts/clean_dataset.py --spec "$(cat clean.json)" --heldout ... \
        --signatures results/cleaned/KEY/signatures-0000*.parquet \
        --out results/cleaned/KEY/removed.parquet --report results/cleaned/KEY/report.json

Each output is written under a temporary name and renamed once complete.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.app.cli import run
from snaketune.core.io import atomic_paths, sha256_file
from snaketune.core.parts import num_rows, parse_part, row_range
from snaketune.core.provenance import record, write_provenance
from snaketune.data import cleaning
from snaketune.data.conversations import Source


def sources_of(entries: list[dict], paths: list[str]) -> list[Source]:
    if len(paths) != len(entries):
        raise SystemExit(f"{len(paths)} files for {len(entries)} datasets")
    return [Source(e["name"], Path(p), e["spec"]) for e, p in zip(entries, paths, strict=True)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--spec", required=True, help="the cleaning's spec, as JSON")
    parser.add_argument("--heldout", nargs="*", default=[], help="held-out sets' parquet files")
    parser.add_argument("--part", help="sign this part of the rows, PART-of-PARTS")
    parser.add_argument("--data", nargs="*", default=[], help="the sources' parquet files")
    parser.add_argument("--signatures", nargs="*", help="gather: every part's signatures")
    parser.add_argument("--out", required=True, help="signatures, or removed.parquet")
    parser.add_argument("--report", help="gather: the counts (report.json)")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec)
    settings = spec["settings"]
    out = Path(args.out)
    if args.signatures is None:  # rule clean_signatures
        sources = sources_of(spec["sources"], args.data)
        rows = row_range(*parse_part(args.part), sum(num_rows(s.path) for s in sources))
        heldout = cleaning.held_out(sources_of(spec["heldout"], args.heldout), settings)
        with atomic_paths(out) as (tmp,):
            signed = cleaning.signatures(sources, rows, settings, heldout, tmp)
        print(f"signed rows {rows[0]}-{rows[1]} of the sources: {signed} after their filters")
        return 0
    heldout = cleaning.held_out(sources_of(spec["heldout"], args.heldout), settings)
    names = [s["name"] for s in spec["sources"]]
    gather = cleaning.decide([Path(p) for p in args.signatures], names, settings)
    report = gather.counts.report(settings, heldout)
    prov_path = out.with_name("provenance.json")
    with atomic_paths(out, args.report, prov_path) as (tmp, tmp_report, tmp_prov):
        cleaning.write_removed(gather, tmp)
        tmp_report.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        outputs = {out.name: sha256_file(tmp), Path(args.report).name: sha256_file(tmp_report)}
        inputs = {Path(p).name: p for p in args.signatures}
        write_provenance(tmp_prov, record("clean_dataset", out.parent, spec, inputs, outputs))
    removed = report["removed"]
    print(
        f"datasets.{spec['dataset']}: {report['rows']} rows, {report['kept']} kept; removed "
        + ", ".join(f"{n} {why}" for why, n in removed.items())
        + (f"; spans cut from {report['spans_cut']} documents" if report["spans_cut"] else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
