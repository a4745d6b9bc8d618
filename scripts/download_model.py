"""Fetch a model (hub id at a pinned commit, or a local directory) into resources/models/.

    python scripts/download_model.py --name tiny --spec '{"source": "local", "path": "..."}' \
        --out resources/models/tiny

Writes the Hugging Face model directory with a provenance.json (source, resolved commit,
sha256 of every file). Run on a login node: compute nodes are often offline.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from snaketune.app.cli import run
from snaketune.data.sources import download_model


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--name", required=True, help="model name in the config")
    parser.add_argument("--spec", required=True, help="the model's config entry, as JSON")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    download_model(args.name, json.loads(args.spec), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
