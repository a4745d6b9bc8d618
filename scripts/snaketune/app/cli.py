"""Check, plan and trace snaketune fine-tuning runs without running them.

  snaketune validate my.yaml            check a config as the workflow does (every problem
                                        at once); print its runs, sweeps and tokenized copies
  snaketune plan my.yaml --gpu h100-80gb
                                        per-GPU memory and disk of each run; exit 1 if one
                                        does not fit, with the cheapest change that does
  snaketune lineage results/demo/merged_model [--verify]
                                        the chain of artefacts behind a result
  snaketune fixtures resources/fixtures build the offline demo model and datasets

Relative paths in the config start from the directory you run it in (where the workflow's
results/ and resources/ are). The workflow itself runs with snakemake --profile profiles/...
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from snaketune import __version__
from snaketune.core.errors import UserError, print_error

# (This module is also the entry scripts' shared plumbing: setup_logging and run.)


def setup_logging(level: int = logging.INFO) -> None:
    """Timestamped log lines; non-zero ranks (torchrun's RANK) log warnings only. Values of
    secret environment variables are masked (snaketune.core.redact)."""
    from snaketune.core.redact import RedactingFilter

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
        print_error(exc)
        return 2


def _parser() -> argparse.ArgumentParser:
    from snaketune.budget.memplan import GPUS
    from snaketune.plan.schema import WORKFLOW_ROOT

    parser = argparse.ArgumentParser(
        prog="snaketune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"snaketune {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    root_help = f"workflow directory (holds workflow/schemas/ and config/deepspeed/; default {WORKFLOW_ROOT})"  # noqa: E501
    _validate_parser(sub, root_help)
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
    pla.add_argument("--root", default=str(WORKFLOW_ROOT), help=root_help)
    which = pla.add_mutually_exclusive_group()
    table = ", ".join(f"{name} ({gib:g} GiB usable)" for name, gib in GPUS.items())
    which.add_argument("--gpu", help=f"GPU type, one of: {table}; default: each run's `gpu`")
    which.add_argument("--gpu-memory", type=float, metavar="GIB", help="GPU memory in GiB")
    pla.add_argument("--json", action="store_true", help="one JSON list, a dict per run")
    pla.add_argument(
        "--model-config",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="plan model NAME from this config.json (or the folder holding it), e.g. a Hub "
        "model's on a login node without its weights; repeatable",
    )
    sta = sub.add_parser(
        "status",
        help="where the pipeline in a directory is: each run's stages, a training's step and "
        "ETA, failures, headline figures",
    )
    sta.add_argument("directory", nargs="?", default=".", help="its working directory")
    sta.add_argument(
        "--watch", type=float, metavar="SECONDS", help="print it again every SECONDS until Ctrl-C"
    )
    _deploy_parser(sub, root_help)
    cal = sub.add_parser(
        "calibrate",
        help="write the config of a short run that calibrates a run's time estimate, and the "
        "command that trains it",
    )
    cal.add_argument("config", help="path to the YAML config")
    cal.add_argument("run", help="the run to calibrate (its model, method, batch and GPUs)")
    cal.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    cal.add_argument("--out", help="where to write its config (default calibrate-<run>.yaml)")
    cal.add_argument("--root", default=str(WORKFLOW_ROOT), help=root_help)
    return parser


def _deploy_parser(sub, root_help: str) -> None:
    from snaketune.plan.schema import WORKFLOW_ROOT

    dep = sub.add_parser(
        "deploy",
        help="lay out a project of your own that uses this workflow as a Snakemake module "
        "(snakedeploy's layout, from this clone, its module path absolute)",
    )
    dep.add_argument("dest", help="the project's folder (new or empty)")
    dep.add_argument("--root", default=str(WORKFLOW_ROOT), help=root_help)


def _validate_parser(sub, root_help: str) -> None:
    from snaketune.plan.schema import WORKFLOW_ROOT

    val = sub.add_parser(
        "validate", help="check a config as the workflow does; print its runs and tokenized copies"
    )
    val.add_argument("config", help="path to the YAML config")
    val.add_argument("--root", default=str(WORKFLOW_ROOT), help=root_help)
    val.add_argument(
        "--show-row",
        type=int,
        metavar="N",
        help="print row N of each run's dataset as tokenize renders it, trained tokens in « »",
    )
    val.add_argument("--run", help="with --show-row: only this run")


def _calibrate(args: argparse.Namespace) -> int:
    import yaml

    from snaketune.budget.calibrate import CALIBRATION, calibration_config
    from snaketune.plan.config import load_config
    from snaketune.plan.schema import load_yaml

    written = calibration_config(load_yaml(args.config), args.run, args.steps)
    out = Path(args.out or f"calibrate-{args.run}.yaml")
    out.write_text(yaml.safe_dump(written, sort_keys=False))
    load_config(out, args.root)  # what the workflow will read: checked now
    name = args.run + CALIBRATION
    print(
        f"calibrate: {out}: run {name}, {args.steps} steps of {args.run}'s model, method, "
        "batch and GPUs; train it once (later plans in this directory are calibrated from "
        f"it, its train stage and the stages after it):\n  snakemake --profile "
        f"profiles/<cluster> --configfile {out}"
    )
    return 0


def _status(args: argparse.Namespace) -> int:
    import time

    from snaketune.app.status import status

    while True:
        print("\n".join(status(Path(args.directory))), flush=True)
        if not args.watch:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
        print(f"--- {time.strftime('%H:%M:%S')}")


def _validate(args: argparse.Namespace) -> int:
    from snaketune.budget.checks import at_parse
    from snaketune.budget.scoring import STAGES
    from snaketune.plan.schema import load_yaml
    from snaketune.plan.sweep import sweeps_of

    config = load_yaml(args.config)
    parsed = at_parse(config, Path(args.root), [args.config])
    for note in parsed.notes:
        print(f"note: {note}", file=sys.stderr)
    plan = {
        "runs": sorted(config["runs"]),
        "sweeps": sweeps_of(config["runs"]),
        "tokenized": sorted(parsed.tokenize),
        # each stage need's jobs, each computed once (DPO runs' precomputed reference
        # log-probs: key -> its runs; distillation runs' teacher top-k: key -> the run and
        # set it serves)
        **{stage.name: stage.listing(config) for stage in STAGES},
    }
    # the JSON whole, then the lines on stderr: one write and a flush, so that a terminal
    # showing both never gets a line run into its closing brace
    sys.stdout.write(json.dumps(plan, indent=2) + "\n")
    sys.stdout.flush()
    for line in _template_lines(config, Path.cwd(), args.show_row, args.run):
        print(line, file=sys.stderr)
    read = parsed.datasets_read
    print(
        f"validate: {args.config} passed: the schema and the cross-key checks of "
        f"{len(config['runs'])} run(s), local paths, the working directory, the first rows "
        f"of {len(read)} dataset(s){' (' + ', '.join(read) + ')' if read else ''}; memory, "
        "disk and SLURM partitions are checked by a dry run (snakemake -n)",
        file=sys.stderr,
    )
    return 0


def _template_lines(config: dict, workdir: Path, row: int | None, only: str | None) -> list[str]:
    """A line per model on this machine: how its template's assistant tokens are found;
    with ``row``, that row of each run's dataset with its trained tokens marked."""
    from snaketune.core.errors import DataError
    from snaketune.data.chat import TEMPLATE_DATE
    from snaketune.data.formats import components
    from snaketune.data.peek import show_row
    from snaketune.data.sources import model_folder
    from snaketune.data.tokens import renderer_for
    from snaketune.plan.stages import chat_template

    lines, renderers = [], {}
    for name, run in sorted(config["runs"].items()):
        model = run["model"]
        folder = workdir / model_folder(config, model, workdir)
        if model not in renderers:
            renderers[model] = None
            if (folder / "tokenizer_config.json").is_file():
                template = chat_template(config, model, workdir)
                text = (workdir / template["path"]).read_text() if template else None
                try:
                    date = config["models"][model].get("template_date", TEMPLATE_DATE)
                    renderers[model] = renderer_for(folder, text, date)
                    lines.append(f"models.{model}: {renderers[model].describe()}")
                except DataError as exc:
                    lines.append(f"models.{model}: {exc}")
        if row is None or (only and name != only) or renderers[model] is None:
            continue
        for part in components(config, run["dataset"]):
            spec = config["datasets"][part["name"]]
            local = spec["source"] == "local"
            downloaded = f"resources/datasets/{part['name']}/data.parquet"
            path = workdir / (spec["path"] if local else downloaded)
            if not path.exists():
                lines.append(f"runs.{name}: datasets.{part['name']} is not on this machine yet")
                continue
            shown = show_row(renderers[model], part["name"], spec, path, local, row)
            lines.append(f"runs.{name}: datasets.{part['name']} row {row} (trained: « »):\n{shown}")
    return lines


def _plan(args: argparse.Namespace) -> int:
    from snaketune.budget.advice import format_plan
    from snaketune.budget.cost import format_estimate, format_steps
    from snaketune.budget.diskplan import (
        disk_plan_of,
        format_disk,
        format_shared,
        shared_filesystems,
    )
    from snaketune.budget.fit import plan_config
    from snaketune.budget.modelfiles import model_configs
    from snaketune.budget.stagecost import format_costs, format_pipeline
    from snaketune.budget.stageplan import format_stages
    from snaketune.plan.config import load_config

    config = load_config(args.config, args.root)
    model_configs(config, args.model_config)
    workdir, root = Path("."), Path(args.root)
    chosen = args.gpu_memory or args.gpu
    plans = plan_config(config, workdir, root, chosen, args.config)
    for plan in plans:  # the model's config.json is there: plan_config read it
        gpu = chosen or config["runs"][plan["run"]].get("gpu", config.get("gpu"))
        # a run without a GPU type runs as the local profile runs it (the dry run's figures)
        plan["disk"] = disk_plan_of(config, plan["run"], workdir, root, gpu is not None)
        plan["cpu_line"] = None if gpu is not None else _cpu_line(config, plan["run"], root)
    shared = shared_filesystems({p["run"]: p["disk"] for p in plans})
    for plan in plans:  # the runs it shares its filesystem with, added up
        plan["disk"]["shared"] = next((g for g in shared if plan["run"] in g["runs"]), None)
    if args.json:
        print(json.dumps(plans, indent=2))
    else:
        for plan in plans:
            print(plan.pop("cpu_line") or format_plan(plan["run"], plan))
            for line in format_steps(plan["run"], plan["steps"]):
                print(line)
            run = config["runs"][plan["run"]]
            print(
                format_estimate(plan["run"], plan["estimate"], run["nodes"] * run["gpus_per_node"])
            )
            for line in format_costs(plan["run"], plan["costs"]):
                print(line)
            for line in format_stages(plan["run"], plan["stages"]):
                print(line)
            print(format_disk(plan["run"], plan["disk"]))
        for group in shared:
            print(format_shared(group))
        for line in format_pipeline([plan["costs"] for plan in plans]):
            print(line)
    bad = [
        p
        for p in plans
        if p["fits"] is False
        or not p["disk"]["fits"]
        or "problem" in p["steps"]
        or any(s.get("fits") is False for s in p["stages"].values())
    ]
    return 1 if bad or any(not g["fits"] for g in shared) else 0


def _cpu_line(config: dict, name: str, root: Path) -> str:
    """The memory line of a run with no GPU type, as the checks before a local run say it."""
    from snaketune.budget.fit import local_check, shape_and_deepspeed
    from snaketune.budget.modelfiles import find_config_json

    run = config["runs"][name]
    shape, deepspeed = shape_and_deepspeed(find_config_json(config, run, Path(".")), run, root)
    return local_check(config, name, shape, deepspeed, Path("."))[1]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    def _main(_: Sequence[str] | None) -> int:
        if args.command == "validate":
            return _validate(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "calibrate":
            return _calibrate(args)
        if args.command == "status":
            return _status(args)
        if args.command == "deploy":
            from snaketune.app.deploy import deploy

            written = deploy(Path(args.root), Path(args.dest))
            print(
                f"deploy: {args.dest}: {', '.join(written)}; then: cd {args.dest} && "
                "snakemake --profile profiles/local"
            )
            return 0
        if args.command == "lineage":
            from snaketune.core.provenance import lineage

            problems: list[str] = []
            for line in lineage(args.artefact, check=args.verify, problems=problems):
                print(line)
            if problems:
                print(
                    f"error: {len(problems)} file(s) differ from their provenance: "
                    f"{'; '.join(problems)}",
                    file=sys.stderr,
                )
                return 1
            return 0
        from snaketune.app.fixtures import make_fixtures

        for name, path in make_fixtures(args.out).items():
            print(f"{name}: {path}")
        return 0

    return run(_main)


if __name__ == "__main__":
    sys.exit(main())
