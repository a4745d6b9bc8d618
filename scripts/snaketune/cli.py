"""Shared plumbing of the entry scripts, and the ``snaketune`` command.

snaketune validate config/config.yaml     # check a config, print the plan
snaketune fixtures resources/fixtures     # build the offline demo fixtures
snaketune lineage results/demo/merged_model [--verify]
                                          # the chain of artefacts behind a result
snaketune plan config.yaml [--gpu h100-80gb | --gpu-memory 80] [--json]
                                          # per-GPU memory of each run: will it fit?
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from snaketune.errors import UserError


def setup_logging(level: int = logging.INFO) -> None:
    """Timestamped log lines; non-zero ranks (torchrun's RANK) log warnings only. Values of
    secret environment variables are masked (snaketune.redact)."""
    from snaketune.redact import RedactingFilter

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=level if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    redacting = RedactingFilter()
    for handler in logging.getLogger().handlers:
        handler.addFilter(redacting)


def run(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Call an entry script's ``main``; a UserError becomes one line on stderr and exit 2."""
    setup_logging()
    try:
        return main(argv)
    except UserError as exc:
        from snaketune.redact import redact, secret_values

        print(f"error: {redact(str(exc), secret_values())}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="snaketune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    val = sub.add_parser("validate", help="validate a config and print the tokenize plan")
    val.add_argument("config", help="path to the YAML config")
    val.add_argument("--root", default=".", help="workflow directory (holds config/deepspeed/)")
    fix = sub.add_parser("fixtures", help="build the offline demo fixtures")
    fix.add_argument("out", help="output directory, e.g. resources/fixtures")
    lin = sub.add_parser("lineage", help="print the chain of artefacts behind an artefact")
    lin.add_argument("artefact", help="an artefact directory, e.g. results/demo/merged_model")
    lin.add_argument(
        "--verify", action="store_true", help="also recompute each artefact's file hashes"
    )
    pla = sub.add_parser(
        "plan",
        help="per-GPU memory and disk estimates of each run, and whether they fit (exit 1 if not)",
    )
    pla.add_argument("config", help="path to the YAML config")
    pla.add_argument("--root", default=".", help="workflow directory (holds config/deepspeed/)")
    which = pla.add_mutually_exclusive_group()
    which.add_argument("--gpu", help="GPU type from the table (h100-80gb, a100-40gb, ...)")
    which.add_argument("--gpu-memory", type=float, metavar="GIB", help="GPU memory in GiB")
    pla.add_argument("--json", action="store_true", help="one JSON list, a dict per run")
    args = parser.parse_args(argv)

    def _main(_: Sequence[str] | None) -> int:
        if args.command == "validate":
            from snaketune.config import load_config
            from snaketune.plan import tokenize_jobs

            config = load_config(args.config, args.root)
            plan = {
                "runs": sorted(config["runs"]),
                "tokenized": sorted(tokenize_jobs(config, Path(args.root))),
            }
            print(json.dumps(plan, indent=2))
        elif args.command == "plan":
            from snaketune.config import load_config
            from snaketune.diskplan import disk_plan_of, format_disk
            from snaketune.memplan import format_plan, plan_config

            config = load_config(args.config, args.root)
            plans = plan_config(config, Path(args.root), args.gpu_memory or args.gpu)
            root = Path(args.root)
            for plan in plans:  # the model's config.json is there: plan_config read it
                plan["disk"] = disk_plan_of(config, plan["run"], root, root)
            if args.json:
                print(json.dumps(plans, indent=2))
            else:
                for plan in plans:
                    print(format_plan(plan["run"], plan))
                    print(format_disk(plan["run"], plan["disk"]))
            bad = [p for p in plans if p["fits"] is False or not p["disk"]["fits"]]
            return 1 if bad else 0
        elif args.command == "lineage":
            from snaketune.provenance import lineage

            problems: list[str] = []
            for line in lineage(args.artefact, check=args.verify, problems=problems):
                print(line)
            if problems:
                print(f"error: {len(problems)} file(s) differ from their provenance: "
                      f"{'; '.join(problems)}", file=sys.stderr)  # fmt: skip
                return 1
        else:
            from snaketune.fixtures import make_fixtures

            for name, path in make_fixtures(args.out).items():
                print(f"{name}: {path}")
        return 0

    return run(_main)


if __name__ == "__main__":
    sys.exit(main())
