"""lm-evaluation-harness tasks on a model already loaded by the evaluate stage.

A run's ``eval.lm_eval`` block names the tasks (lm-eval's own, or the user's task YAMLs
under ``include_path``), ``num_fewshot``, ``limit`` and ``batch_size``. The tasks run through
lm-eval's Python API (``simple_evaluate`` with an ``HFLM`` wrapping our model object), offline:
``HF_DATASETS_OFFLINE`` and ``HF_HUB_OFFLINE`` are set, so a task's data comes from local
files (a task YAML with ``dataset_path: json`` or ``parquet`` and ``data_files``) or from the
datasets cache, never from the network.

Results are kept per task and per metric (lm-eval's ``metric,filter`` key), each with its
standard error; with the base model's results the gain over base is added. Only the
results are kept: the environment report lm-eval adds to them (torch's ``collect_env``) is
not made (:func:`without_environment_report`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from snaketune.core.cache import remembered
from snaketune.core.errors import UserError

log = logging.getLogger(__name__)

INSTALL_HINT = "install it with `pip install -e .[eval]` (lm-eval is pinned there)"


def _import():
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise UserError(f"eval.lm_eval: lm-eval is not installed; {INSTALL_HINT}") from error
    return lm_eval, TaskManager


def task_manager(settings: dict[str, Any]):
    """lm-eval's TaskManager for ``settings``. When every task is found among the user's own
    YAMLs, lm-eval's ~15,000 built-in task files are not indexed (seconds saved)."""
    _, TaskManager = _import()
    include = settings.get("include_path")
    if include:
        own = TaskManager(include_path=str(include), include_defaults=False)
        if all(t in own.all_tasks for t in settings["tasks"]):
            return own
    return TaskManager(include_path=str(include) if include else None)


def unknown_tasks(settings: dict[str, Any]) -> list[str]:
    """The names in ``settings['tasks']`` that lm-eval (with the include path) does not know.
    Remembered (core.cache) by lm-eval's version, the names and the include path's files
    (names, sizes, times): importing lm-eval's task index costs about 1 CPU-s of every
    snakemake command that plans an evaluation, a dry run's included."""
    try:
        version = metadata.version("lm_eval")
    except metadata.PackageNotFoundError:
        _import()  # the one line saying how to install it
        raise
    include = settings.get("include_path")
    where = str(include) if include else None
    key = json.dumps([version, list(settings["tasks"]), where, _files(where)])

    def compute() -> list[str]:
        known = task_manager(settings).all_tasks
        return [t for t in settings["tasks"] if t not in known]

    return remembered("lm_eval_tasks", key, compute)


def _files(include: str | None) -> list[list]:
    """Each file under the include path (a folder or one YAML): its path, size and time."""
    if not include:
        return []
    root = Path(include)
    paths = sorted(root.rglob("*")) if root.is_dir() else [root] if root.exists() else []
    stats = [(p, p.stat()) for p in paths if p.is_file()]
    return [[str(p), st.st_size, st.st_mtime_ns] for p, st in stats]


def check_tasks(config: dict[str, Any], runs: list[str]) -> list[str]:
    """One line per problem with the lm-eval tasks of ``runs`` (those about to evaluate):
    lm-eval missing, or a task name it does not know. Task sets shared by runs are looked up
    once (an index of lm-eval's tasks takes seconds)."""
    problems, seen = [], {}
    for run in runs:
        settings = config["runs"][run].get("eval", {}).get("lm_eval")
        if not settings:
            continue
        key = (tuple(settings["tasks"]), settings.get("include_path"))
        try:
            if key not in seen:
                seen[key] = unknown_tasks(settings)
        except UserError as error:
            return [f"runs.{run}.{error}"]
        if seen[key]:
            where = f" or in {settings['include_path']}" if settings.get("include_path") else ""
            problems.append(
                f"runs.{run}.eval.lm_eval.tasks: lm-eval knows no task "
                f"{', '.join(map(repr, seen[key]))} (not among its own tasks{where}); check "
                "the name (`lm_eval ls tasks` lists them)"
            )
    return problems


def _number(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def collect(results: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """lm-eval's ``results`` -> {task: {"metric,filter": {"value", "stderr"}}}."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            if key in ("alias", "name", "sample_len") or "_stderr," in key:
                continue
            if _number(value) is None:
                continue
            metric, _, filt = key.partition(",")
            stderr = metrics.get(f"{metric}_stderr,{filt}" if filt else f"{metric}_stderr")
            out.setdefault(task, {})[key] = {"value": _number(value), "stderr": _number(stderr)}
    return out


def with_base(tuned: dict, base: dict | None) -> dict:
    """Each tuned figure with the base model's and the gain (tuned - base) where both exist."""
    if not base:
        return tuned
    for task, metrics in tuned.items():
        for key, figure in metrics.items():
            before = base.get(task, {}).get(key, {}).get("value")
            figure["base"] = before
            ok = before is not None and figure["value"] is not None
            figure["gain"] = figure["value"] - before if ok else None
    return tuned


def run_tasks(model, tokenizer, settings: dict[str, Any]) -> dict[str, Any]:
    """Run the tasks of ``settings`` on ``model`` (already loaded, on its device)."""
    lm_eval, _ = _import()
    from lm_eval.models.huggingface import HFLM

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    manager = task_manager(settings)
    missing = [t for t in settings["tasks"] if t not in manager.all_tasks]
    if missing:
        raise UserError(f"eval.lm_eval.tasks: lm-eval does not know {', '.join(missing)}")
    log.info("lm-eval %s: tasks %s", lm_eval.__version__, ", ".join(settings["tasks"]))
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings["batch_size"])
    chat = settings["apply_chat_template"] and tokenizer.chat_template is not None
    with without_environment_report():
        output = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(settings["tasks"]),
            task_manager=manager,
            num_fewshot=settings.get("num_fewshot"),
            limit=settings.get("limit"),
            apply_chat_template=chat,
            log_samples=False,
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
            fewshot_random_seed=0,
        )
    if output is None:  # a rank past the first of a sharded model: rank 0 has the figures
        return {}
    figures = collect(output["results"])
    for task, metrics in figures.items():
        for key, f in metrics.items():
            err = "" if f["stderr"] is None else f" (stderr {f['stderr']:.4f})"
            log.info("lm-eval %s %s: %.4f%s", task, key, f["value"], err)
    return figures


@contextlib.contextmanager
def without_environment_report():
    """lm-eval's ``simple_evaluate`` adds torch's environment report to its results
    (``torch.utils.collect_env``: ``pip list`` over the environment, ``nvidia-smi``, ``lscpu``
    and more, each a subprocess; about 1 CPU-s and 1 s of an evaluation on 2 cores here,
    more where ``pip list`` reads a shared file system), which snaketune never reads (it
    keeps ``results``; the run's own record names the versions: snaketune.core.provenance).
    Within this block lm-eval adds nothing in its place; an lm-eval without that step is
    left as it is."""
    from lm_eval import evaluator

    real = getattr(evaluator, "add_env_info", None)
    if real is None:
        yield
        return
    evaluator.add_env_info = lambda storage: None
    try:
        yield
    finally:
        evaluator.add_env_info = real


def resolve_include_path(value: str, root: Path) -> Path | None:
    """``value`` from the working directory, else from the workflow directory (where the
    project's own task YAMLs live); None when neither exists."""
    for path in (Path(value), root / value):
        if path.is_dir():
            return path.resolve()
    return None
