"""Fetch a dataset (hub at a pinned commit, or a local parquet/jsonl/json/csv) as parquet.

    python scripts/download_dataset.py --name gsm8k --spec '{"source": "local", ...}' \
        --out-dir resources/datasets/gsm8k

Writes data.parquet (converted in streaming batches) and provenance.json (source,
resolved commit or file sha256, row count). Run on a login node.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from snaketune.app.cli import run
from snaketune.data.sources import download_dataset


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--name", required=True, help="dataset name in the config")
    parser.add_argument("--spec", required=True, help="the dataset's config entry, as JSON")
    parser.add_argument(
        "--out-dir", required=True, help="directory for data.parquet and provenance.json"
    )
    args = parser.parse_args(argv)
    download_dataset(args.name, json.loads(args.spec), args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
