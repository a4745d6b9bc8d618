"""Index a dataset tokenized in parts (rule index_parts): each part's file, rows and
sha256, and the set's stats summed, checked as one tokenize job's would be. The parts stay
where they are: the stages that read the set read them through the index
(snaketune.core.parts).

    python scripts/index_parts.py --spec "$(cat spec.json)" --model resources/models/tiny \
        --parts results/tokenized/KEY/part-00000-of-00002.parquet \
                results/tokenized/KEY/part-00001-of-00002.parquet \
        --out results/tokenized/KEY/parts.json

Writes parts.json and parts.provenance.json beside it, renamed into place once complete.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.app.cli import run
from snaketune.core.io import atomic_paths, sha256_file
from snaketune.core.parts import write_index
from snaketune.core.provenance import record, write_provenance
from snaketune.data.conversations import Stats
from snaketune.data.tokens import check_result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--spec", required=True, help="tokenize spec, as JSON")
    parser.add_argument("--model", required=True, help="model directory (its vocabulary)")
    parser.add_argument("--parts", required=True, nargs="+", help="the part files, in order")
    parser.add_argument("--out", required=True, help="the index to write (parts.json)")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec)
    out = Path(args.out)
    parts = [Path(p) for p in args.parts]
    with atomic_paths(out, out.with_suffix(".provenance.json")) as (tmp, tmp_prov):
        limits = {"max_length": spec["max_length"], "overlong": spec["overlong"]}
        check = functools.partial(
            check_result, **limits, model_dir=args.model, model_name=spec["model"]
        )
        write_index(parts, tmp, spec, Stats, check)
        inputs = {p.name: p for p in parts}
        prov = record("index_parts", out.parent, spec, inputs, {out.name: sha256_file(tmp)})
        write_provenance(tmp_prov, prov)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
