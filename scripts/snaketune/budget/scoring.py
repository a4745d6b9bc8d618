"""Scoring stages as records: work that depends only on a model and tokenized rows, computed
once in a data-parallel stage on the GPUs of the run it serves and read by every run that
shares it (the precomputed reference log-probs of DPO-like runs; a teacher's top-k for
distillation). Each is a ``ScoringStage`` in ``STAGES``, registered like a method: its rule
(workflow/rules/scoring.smk: one rule body, the others ``use rule ... with:`` it), its jobs
and their keys, inputs, the settings its output depends on, its layout (the batch of a
forward pass, whether the model is sharded over the workers), its output's name. The SLURM
profiles give each registered stage its resources (tests/test_slurm_scripts.py checks them).

Adding a scoring stage: its entry script (scripts/<name>.py taking the flags of
``ScoringStage``), its logic in the wing it belongs to, one record here, one ``use rule``
line in workflow/rules/scoring.smk, its resources in each cluster profile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from snaketune.plan import stages, trainjob
from snaketune.plan import teacher as teachers


@dataclass(frozen=True)
class ScoringStage:
    """One scoring stage: the rule ``name`` (its script scripts/<name>.py, its outputs
    results/<name>/<key>/<output>) and what its rule reads of the config."""

    name: str
    output: str  # the file it writes in its key's folder
    # key -> the job (``run``: the first run that reads it, and what else the stage needs)
    jobs: Callable[[dict[str, Any]], dict[str, dict[str, Any]]]
    # what a job reads: tokenized (rows), model, and any further input (a flag of the
    # script); given the workflow's model_of (a run's starting model) and resolve (a run or
    # sweep's name -> the run whose final model it means)
    inputs: Callable[..., dict[str, str]]
    settings: Callable[[dict[str, Any]], str]  # what the output depends on, as flags
    sharded: Callable[[dict[str, Any], dict[str, Any]], bool]  # the model over the workers


def _reference_jobs(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {key: {"run": run} for key, run in trainjob.reference_jobs(config).items()}


def _reference_inputs(
    config: dict[str, Any], job: dict[str, Any], model_of, resolve
) -> dict[str, str]:
    """The tokenized pairs of the first run that reads it, with the model that run starts
    from."""
    return {"tokenized": stages.tokenized(config, job["run"]), "model": model_of(job["run"])}


def _teacher_sharded(config: dict[str, Any], run: dict[str, Any]) -> bool:
    from snaketune.budget import teacherplan

    return teacherplan.sharded(config, run)


REFERENCE = ScoringStage(
    name="reference_logps",
    output="logps.parquet",
    jobs=_reference_jobs,
    inputs=_reference_inputs,
    settings=trainjob.reference_settings,
    sharded=lambda config, run: False,
)
TEACHER = ScoringStage(
    name="teacher_logps",
    output="topk.parquet",
    jobs=teachers.teacher_jobs,
    inputs=lambda config, job, model_of, resolve: teachers.teacher_inputs(config, job, resolve),
    settings=teachers.teacher_settings,
    sharded=_teacher_sharded,
)
STAGES = (REFERENCE, TEACHER)


def stage_named(name: str) -> ScoringStage:
    return next(s for s in STAGES if s.name == name)


def jobs(config: dict[str, Any]) -> dict[str, tuple[ScoringStage, dict[str, Any]]]:
    """Every scoring job the config's runs need: key -> (its stage, the job). A key is
    unique across the stages (each names its model and a digest of what it depends on)."""
    found: dict[str, tuple[ScoringStage, dict[str, Any]]] = {}
    for stage in STAGES:
        for key, job in stage.jobs(config).items():
            if key in found:
                raise ValueError(f"scoring key {key} of {stage.name} is {found[key][0].name}'s")
            found[key] = (stage, job)
    return found


def input_flags(inputs: dict[str, str]) -> str:
    """A job's further inputs (besides its rows and model) as its script's flags."""
    return " ".join(
        f"--{name.replace('_', '-')} {path}"
        for name, path in inputs.items()
        if name not in ("tokenized", "model", "script")
    )
