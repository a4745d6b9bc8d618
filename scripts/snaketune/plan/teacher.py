"""The teacher stage of distillation runs (the need TEACHER_TOPK): which jobs the runs need, by
what their output depends on, and what each job reads.

A distillation run (snaketune.methods.distill) names its teacher (what its method's
``teacher`` reads from its block): a model of the config (``models``) or a run (or a
sweep: its best member) whose final model teaches. The teacher's top-k log-probs
(snaketune.evaluation.topk) are computed once per (teacher, tokenized rows, k, precision,
attention): the run's training rows, and its eval set for the held-out KL its evaluation
reports. Runs and sweep members that share these share one job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from snaketune.core.io import digest
from snaketune.methods import method_of
from snaketune.methods.needs import TEACHER_TOPK
from snaketune.plan import stages


def teacher_of(run: dict[str, Any]) -> str | None:
    """The name of a run's teacher (None: not a distillation run)."""
    stage = method_of(run).needs(run).get(TEACHER_TOPK)
    return None if stage is None else stage["teacher"]


def top_k(run: dict[str, Any]) -> int:
    """The log-probs per token a distillation run's teacher stage keeps."""
    return method_of(run).needs(run)[TEACHER_TOPK]["top_k"]


def teacher_model(config: dict[str, Any], name: str, resolve: Callable[[str], str] = str) -> str:
    """The directory of teacher ``name``: a model's download, or a run's final model
    (``resolve``: a sweep's best member)."""
    if name in config["models"]:
        return f"resources/models/{name}"
    return stages.final_model(config, resolve(name))


def teacher_key(config: dict[str, Any], run: str, eval_set: bool = False) -> str | None:
    """The teacher top-k a distillation run reads (of its eval set: ``eval_set``), by what
    it depends on; None for other runs or an eval set the run does not have."""
    r = config["runs"][run]
    name = teacher_of(r)
    if name is None or (eval_set and "eval_dataset" not in r):
        return None
    spec = (stages.run_eval_tokenize_spec if eval_set else stages.run_tokenize_spec)(config, run)
    what = {
        "teacher": {"model" if name in config["models"] else "run": name},
        "tokenized": stages.tokenize_key(spec),
        "top_k": top_k(r),
        "precision": r["precision"],
        "attn_implementation": r["attn_implementation"],
    }
    return f"{name}__{digest(what)[:12]}"


def teacher_path(config: dict[str, Any], run: str, eval_set: bool = False) -> str | None:
    key = teacher_key(config, run, eval_set)
    return TEACHER_TOPK.path(key) if key else None


def teacher_jobs(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every teacher_logps job the runs need: key -> the first run that reads it and which
    of its sets (``eval_set``)."""
    jobs: dict[str, dict[str, Any]] = {}
    for run in config["runs"]:
        for eval_set in (False, True):
            key = teacher_key(config, run, eval_set)
            if key is not None:
                jobs.setdefault(key, {"run": run, "eval_set": eval_set})
    return jobs


def teacher_inputs(
    config: dict[str, Any], job: dict[str, Any], resolve: Callable[[str], str] = str
) -> dict[str, str]:
    """What a teacher_logps job reads: the run's tokenized rows (train or eval), the
    teacher's model and the student's (whose tokenizer made the rows)."""
    r = config["runs"][job["run"]]
    return {
        "tokenized": stages.tokenized(config, job["run"], job["eval_set"]),
        "model": teacher_model(config, teacher_of(r), resolve),
        "student_model": f"resources/models/{r['model']}",
    }


def teacher_settings(run: dict[str, Any]) -> str:
    """What the top-k depends on besides the inputs (also in the output's key), as the
    stage's flags."""
    return (
        f"--top-k {top_k(run)} --precision {run['precision']}"
        f" --attn-implementation {run['attn_implementation']}"
    )
