"""Publish a run's final model to the Hugging Face Hub (or, with dry_run, only write the
folder that would be uploaded).

    python scripts/publish.py --run demo --spec '{...}' --model results/demo/merged_model \
        --metrics results/demo/eval/metrics.json --settings '{"repo_id": "me/demo", ...}' \
        --out results/demo/publish --receipt results/demo/publish.json

Writes --out (model safetensors, tokenizer, README.md model card) and --receipt (what was
done: the repo, private or not, dry run or the uploaded commit). The token is read from
HF_TOKEN or the login cache by huggingface_hub, never from the config or the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.app.cli import run


def main(argv: Sequence[str] | None = None) -> int:
    from snaketune.core.io import atomic_paths, write_json
    from snaketune.export.hub import build_folder, upload

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", required=True, help="run name")
    parser.add_argument("--spec", type=json.loads, required=True,
                        help="the run's config entry, with dataset_sources, as JSON")  # fmt: skip
    parser.add_argument("--model", type=Path, required=True, help="the run's final model")
    parser.add_argument("--metrics", type=Path, default=None, help="its eval metrics.json")
    parser.add_argument("--settings", type=json.loads, required=True,
                        help="the run's publish block, as JSON")  # fmt: skip
    parser.add_argument("--resources", type=Path, default=Path("resources"),
                        help="downloaded models and datasets (their provenance)")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="the folder to upload")
    parser.add_argument("--receipt", type=Path, required=True, help="what was published")
    args = parser.parse_args(argv)
    settings = args.settings
    with atomic_paths(args.out, args.receipt) as (folder, receipt):
        build_folder(args.run, args.spec, args.model, args.metrics, args.resources, settings,
                     folder)  # fmt: skip
        done = {"run": args.run, "repo_id": settings["repo_id"], "private": settings["private"],
                "dry_run": settings["dry_run"], "folder": str(args.out)}  # fmt: skip
        if not settings["dry_run"]:
            done.update(upload(folder, settings["repo_id"], settings["private"]))
            kind = "private" if settings["private"] else "public"
            print(f"published {args.run} to {done['url']} ({kind})")
        else:
            print(f"dry run: {args.out} is what would be uploaded to {settings['repo_id']}")
        write_json(receipt, done)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
