"""The checks a user needs before anything runs: one function each, two doors.

``at_parse`` is what the Snakefile runs when it reads the config, and what ``snaketune
validate`` runs: the schema and the cross-key checks (every bad entry at once), local paths
(every missing one at once), the first rows of each dataset a run reads (snaketune.data.peek),
the working directory, a run moved to another node count, the tokenize and base-evaluation
plans. ``before_queueing`` is what the workflow runs once it knows which jobs it will run,
in a real run (``onstart``) and in a dry run alike: the memory and disk plans of the runs
about to train, lm-eval's task names, and on SLURM every job's resources against its
partition; a real run keeps each train estimate once nothing is refused.

    snaketune validate my.yaml          # at_parse, from any directory
    snakemake --profile P -n            # at_parse, then before_queueing, nothing run
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snaketune.budget.planlines import check_steps, keep_all
from snaketune.budget.scoring import STAGES as SCORING_STAGES
from snaketune.core.errors import ConfigProblems, UserError, error_lines
from snaketune.methods.needs import NEEDS
from snaketune.plan.pipeline import EVALUATE, EVALUATE_BASE, EVALUATE_START, TRAIN, memory_checked

# What rules make_fixtures and make_agent_fixtures make (workflow/rules/fixtures.smk;
# tests/test_config.py checks they agree): local paths under them need not exist before the
# workflow runs.
FIXTURE_OUTPUTS = (
    "resources/fixtures/tiny-llama",
    "resources/fixtures/gsm8k-demo/train.jsonl",
    "resources/fixtures/gsm8k-demo/test.jsonl",
    "resources/fixtures/arith-demo/train.jsonl",
    "resources/fixtures/arith-demo/test.jsonl",
    "resources/fixtures/arith-demo/pairs-train.jsonl",
    "resources/fixtures/arith-demo/pairs-test.jsonl",
    "resources/fixtures/tiny-agent",
    "resources/fixtures/agent-demo/transcripts.jsonl",
    "resources/fixtures/agent-demo/train.jsonl",
    "resources/fixtures/agent-demo/test.jsonl",
)
WORKDIR_ENTRIES = ("results", "resources", "logs", "benchmarks", ".snakemake")


@dataclass(frozen=True)
class Parsed:
    """What the workflow keeps of the parse-time checks."""

    notes: list[str]  # lines to show (a run whose accumulation adapted)
    tokenize: dict[str, dict[str, Any]]  # every tokenized copy, by key
    base_evals: dict[str, dict[str, Any]]  # every base-model evaluation, by key
    datasets_read: list[str]  # the datasets whose first rows were read and checked


def at_parse(
    config: dict[str, Any],
    basedir: Path,
    config_files: Iterable[str | Path] = (),
    workdir: Path = Path("."),
) -> Parsed:
    """Validate ``config`` in place (defaults filled, sweeps expanded) and check what the
    workflow needs of this machine. Raises ConfigError (ConfigProblems: a line a problem)."""
    from snaketune.core.io import check_writable
    from snaketune.methods import compose_schema  # the schema validate_config reads
    from snaketune.plan.config import check_local_sources, validate_config
    from snaketune.plan.schema import check_config_files, load_schema
    from snaketune.plan.stages import base_evaluations, parts_notes, tokenize_jobs
    from snaketune.plan.topology import adapt_accumulation

    quoted = check_config_files(list(config_files), compose_schema(load_schema(basedir)))
    lines = list(quoted)
    try:
        validate_config(config, basedir)
    except UserError as exc:
        if not (quoted or isinstance(exc, ConfigProblems)):  # the schema or a chain
            raise
        lines += [line for line in error_lines(exc) if line not in quoted]
    try:
        check_local_sources(config, set(FIXTURE_OUTPUTS))
    except UserError as exc:
        lines += error_lines(exc)
    other, read = check_dataset_heads(config, workdir, lines)
    try:
        check_writable(str(workdir), WORKDIR_ENTRIES)
    except UserError as exc:
        other.append(str(exc))
    if lines or other:
        raise ConfigProblems(lines, other)
    notes = adapt_accumulation(config, workdir / "results")
    jobs = tokenize_jobs(config)
    return Parsed(notes + parts_notes(jobs), jobs, base_evaluations(config), read)


def check_dataset_heads(
    config: dict[str, Any], workdir: Path, named: list[str]
) -> tuple[list[str], list[str]]:
    """A line per dataset a run reads whose first rows tokenize would refuse (a missing
    column, rows not in its format: snaketune.data.peek), and the datasets read: a local
    file, or a Hub dataset once downloaded. Not read: a dataset a line of ``named`` names
    already, a file a rule makes (the demo's fixtures) or one not there yet, a Hub dataset
    not downloaded yet."""
    from snaketune.data.formats import components
    from snaketune.data.peek import check_dataset

    runs, datasets = config.get("runs"), config.get("datasets")
    if not isinstance(runs, dict) or not isinstance(datasets, dict):
        return [], []

    def refused(name: str) -> bool:
        return any(line.startswith((f"datasets.{name}:", f"datasets.{name}.")) for line in named)

    used = []
    for run in runs.values():
        for key in ("dataset", "eval_dataset"):
            if isinstance(run, dict) and run.get(key) in datasets and not refused(run[key]):
                used += [c["name"] for c in components(config, run[key])]
    found, read = [], []
    for name in dict.fromkeys(used):
        spec = datasets[name]
        if refused(name) or not isinstance(spec, dict) or "source" not in spec:
            continue
        local = spec["source"] == "local"
        path = Path(spec["path"]) if local else Path("resources/datasets", name, "data.parquet")
        if local and str(path) in FIXTURE_OUTPUTS and not (workdir / path).exists():
            continue
        if (workdir / path).exists():
            problem = check_dataset(name, spec, workdir / path, local)
            found += [problem] if problem else []
            read.append(name)
    return found, read


@dataclass(frozen=True)
class Job:
    """What the checks read of one job of the workflow's plan."""

    rule: str
    wildcards: dict[str, str]
    resources: dict[str, Any]
    local: bool


def unreadable_models(
    config: dict[str, Any], runs: list[str], workdir: Path
) -> tuple[list[str], dict[str, list[str]]]:
    """Split ``runs`` into those whose model's config.json can be read now and, by reason,
    those whose cannot (a Hub model not downloaded yet on an offline machine)."""
    from snaketune.budget.modelfiles import locate_config_json

    ready, waiting = [], {}
    for name in runs:
        run = config["runs"][name]
        path, why = locate_config_json(config, run, workdir)
        if path is None:
            waiting.setdefault(f"model {run['model']}: {why}", []).append(name)
        else:
            ready.append(name)
    return ready, waiting


def before_queueing(
    config: dict[str, Any],
    jobs: list[Job],
    workdir: Path,
    basedir: Path,
    local_exec: bool,
    record: bool = False,
) -> list[str]:
    """A line per problem that would make a queued job fail or never start: runs about to
    train that do not fit their GPUs' memory or their results filesystem (one by one and
    together), lm-eval tasks lm-eval does not know, SLURM jobs their partition cannot take.
    Notes (what fits, what could not be checked and why) go to stderr."""
    from snaketune.budget.diskplan import check_disk_runs
    from snaketune.budget.fit import check_runs, readable_shape
    from snaketune.budget.modelfiles import download_advice
    from snaketune.evaluation.lmeval import check_tasks

    training = sorted({job.wildcards["run"] for job in jobs if job.rule == TRAIN.name})
    runs, waiting = unreadable_models(config, training, workdir)
    for why, names in waiting.items():
        model = config["runs"][names[0]]["model"]
        hub = config["models"][model]["source"] == "hub"
        print(
            f"plans: not checked yet: run(s) {', '.join(names)} ({why}); memory and disk "
            "are checked when the workflow runs once the model is there"
            + (f"; to check them now, {download_advice(model=model)}" if hub else ""),
            file=sys.stderr,
        )
    mem_mb = of_training(jobs, "mem_mb")
    shared = shared_jobs(config, jobs)
    stage_mem = {
        (job.rule, planned_run(job, shared)): job.resources.get("mem_mb")
        for job in jobs
        if job.rule in memory_checked()
    }
    found = check_runs(config, runs, workdir, basedir, local_exec, mem_mb, stage_mem)
    found += check_disk_runs(config, runs, workdir, basedir, not local_exec)
    found += check_tasks(config, sorted(evaluated_runs(jobs, config)))
    runtime = of_training(jobs, "runtime")
    shapes = {name: readable_shape(config, config["runs"][name], workdir) for name in training}
    found += check_steps(config, shapes, workdir, runtime, estimates := [] if record else None)
    for name in training:  # what changed since a run's last training, by key
        for line in changed_settings(config, name, workdir)[:MAX_CHANGES]:
            print(f"plan: {name}: retrains: {line}", file=sys.stderr)
    if not local_exec:
        found += check_partitions([job for job in jobs if not job.local])
    if not found and estimates:  # nothing refused: each estimate kept for the summary
        keep_all(estimates)
    return found


def meant_for_slurm(jobs: list[Job]) -> bool:
    """Whether the jobs are meant for SLURM, seen from a dry run (whose executor is local): a
    job that names a SLURM partition or account (the cluster profiles' default resources)."""
    named = ("slurm_partition", "slurm_account")
    return any(job.resources.get(key) for job in jobs for key in named)


def of_training(jobs: list[Job], resource: str) -> dict[str, Any]:
    """Each train job's ``resource`` (mem_mb, runtime), by run."""
    return {j.wildcards["run"]: j.resources.get(resource) for j in jobs if j.rule == TRAIN.name}


def planned_run(job: Job, shared: dict[tuple[str, str], str]) -> str:
    """The run a job's plan is of: its own, or a shared job's (``shared_jobs``)."""
    if "run" in job.wildcards:
        return job.wildcards["run"]
    return shared[(job.rule, next(iter(job.wildcards.values())))]


def shared_jobs(config: dict[str, Any], jobs: list[Job]) -> dict[tuple[str, str], str]:
    """The run each shared job's plan is of, by (rule, key), computed once where such jobs
    are among ``jobs``: the first run that reads a base model's evaluation or a scoring
    stage's output."""
    from snaketune.budget.scoring import jobs as scoring_jobs
    from snaketune.plan.clean import cleaned_by
    from snaketune.plan.pipeline import CLEAN
    from snaketune.plan.stages import base_evaluations

    rules = {job.rule for job in jobs}
    found: dict[tuple[str, str], str] = {}
    if EVALUATE_BASE.name in rules:
        found |= {
            (EVALUATE_BASE.name, k): job["run"] for k, job in base_evaluations(config).items()
        }
    if rules & {stage.name for stage in SCORING_STAGES}:
        found |= {(stage.name, k): job["run"] for k, (stage, job) in scoring_jobs(config).items()}
    if CLEAN.name in rules:  # a cleaning's plan: a run training on the dataset it cleans
        found |= {(CLEAN.name, key): run for key, run in cleaned_by(config).items()}
    return found


def evaluated_runs(jobs: list[Job], config: dict[str, Any]) -> set[str]:
    """The runs whose evaluation (or whose base model's) is among ``jobs``."""
    from snaketune.plan.stages import base_evaluations

    runs = {
        job.wildcards["run"] for job in jobs if job.rule in (EVALUATE.name, EVALUATE_START.name)
    }
    base = [job.wildcards["key"] for job in jobs if job.rule == EVALUATE_BASE.name]
    if base:
        evals = base_evaluations(config)
        runs |= {evals[key]["run"] for key in base}
    return runs


def check_partitions(jobs: list[Job]) -> list[str]:
    """Every SLURM job against its partition (and its --signal lead against its runtime);
    where this machine has no SLURM (``sinfo`` not found: a dry run away from the cluster),
    one note and no partition checked."""
    from snaketune.budget.slurmfit import check_jobs, check_signal_leads

    if not jobs:
        return []
    asked = [(job.rule, job.resources) for job in jobs]
    leads = check_signal_leads(asked)
    if shutil.which("sinfo") is None:
        print(
            "slurm: partitions not checked: sinfo not found (not a SLURM login node); "
            "they are checked when the workflow runs there",
            file=sys.stderr,
        )
        return leads
    return leads + check_jobs(asked, [job.wildcards.get("run") for job in jobs])


def check_workflow(
    config: dict[str, Any], workflow: Any, root: Path, all_name: str, dry_run: bool
) -> None:
    """The workflow's door to ``before_queueing``, given Snakemake's ``workflow`` object, the
    workflow's folder ``root`` and what our rule ``all`` is called (a module's prefix:
    snaketune.plan.rulenames): the jobs about to run (``workflow.dag.needrun_jobs()``), before
    any runs (onstart) or once they are known in a dry run; one line per problem, then exit
    1. On SLURM (a real run), a watch then cancels a pending job whose reason can never clear
    (snaketune.budget.slurmfit)."""
    import os

    from snaketune.budget.slurmfit import PendingWatch
    from snaketune.plan.rulenames import local_name, local_names
    from snaketune.plan.targets import until_problem

    # `--until` a rule between training and the final model, on a config whose runs start
    # from others: Snakemake would train the first runs and stop ("BUG: Out of jobs ready to
    # be started"); refused before anything runs, naming the targets that do the same
    problem = until_problem(config, local_names(workflow.dag_settings.until or (), all_name))
    if problem:
        refuse([problem], dry_run)
    # a dry run runs every job locally; whether a rule is local on the cluster is its own
    local_rules = {r.name for r in workflow.rules if r.norun} | set(workflow._localrules)
    named = [(local_name(j.rule.name, all_name), j) for j in workflow.dag.needrun_jobs()]
    jobs = [
        Job(ours, dict(j.wildcards_dict), dict(j.resources.items()), j.rule.name in local_rules)
        for ours, j in named
        if ours is not None  # a rule of the project around the module: not ours to check
    ]
    local = workflow.local_exec and not (dry_run and meant_for_slurm(jobs))
    found = before_queueing(config, jobs, Path("."), root, local, not dry_run)
    if found:
        refuse(found, dry_run)
    if not local and not dry_run:
        PendingWatch(os.getcwd()).start()


def refuse(found: list[str], dry_run: bool) -> None:
    """Print each problem and exit 1 (nothing run or queued)."""
    for line in found:
        print(f"error: {line}", file=sys.stderr)
    what = "a dry run" if dry_run else "queueing"
    print(f"error: {len(found)} problem(s) found before {what}; nothing was run", file=sys.stderr)
    sys.exit(1)


class _OnceTheJobsAreKnown:
    """A logging filter on Snakemake's logger that calls ``callback`` once, at the first
    ``run_info`` record (the job counts, logged once the plan of jobs is complete and
    before anything runs). It never hides a record."""

    def __init__(self, callback: Any, dry_run: Any) -> None:
        self.callback, self.dry_run, self.done = callback, dry_run, False

    def filter(self, record: Any) -> bool:
        if not self.done and str(getattr(record, "event", "")) == "run_info":
            self.done = True
            if self.dry_run():  # a real run checks in onstart, right after
                self.callback()
        return True


def in_dry_runs(callback: Any, dry_run: Any, logger_name: str = "snakemake.logging") -> None:
    """Run ``callback`` in a dry run (``dry_run()`` true) once the jobs are known: Snakemake
    runs no ``onstart`` handler in a dry run (nor a module's in any run), but logs the job
    counts there at that point."""
    import logging

    logging.getLogger(logger_name).addFilter(_OnceTheJobsAreKnown(callback, dry_run))


MAX_CHANGES = 12  # keys named per run (a new run's whole spec is no news)
EXTRAS = ("heldout", *(need.name for need in NEEDS), "prompt_sources")  # paths and sources
UNSET = object()


def changed_settings(config: dict[str, Any], name: str, workdir: Path) -> list[str]:
    """The keys of run ``name`` whose values differ from its last training's
    (results/<run>/train/run_config.json), as `runs.<run>.dpo.beta: 0.1 -> 0.2`: why
    Snakemake retrains it, in the config's words (its own reason is the spec's whole diff)."""
    import json

    from snaketune.plan.trainjob import train_spec

    path = workdir / "results" / name / "train/run_config.json"
    if not path.is_file():
        return []
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return []
    return _diff(old, json.loads(train_spec(config["runs"][name])), f"runs.{name}")


def _diff(old: Any, new: Any, path: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted((set(old) | set(new)) - set(EXTRAS)):
            out += _diff(old.get(key, UNSET), new.get(key, UNSET), f"{path}.{key}")
        return out
    return [] if old == new else [f"{path}: {_said(old)} -> {_said(new)}"]


def _said(value: Any) -> str:
    import json

    return "(unset)" if value is UNSET else json.dumps(value)
