"""What a run needs besides its rows and its model: the registry of needs, one record each.

A method states its run's needs (``Method.needs(run)``: each record with what it asks of
it, the teacher and its top-k, the reward models' runs); nothing else decides them. A need
either has its own stage (``runs_in == "stage"``: a Snakemake rule of that name,
workflow/rules/scoring.smk, computed once on the GPUs of the run it serves and read by every
run that shares it, its output results/<name>/<key>/<output>) or is held inside the train
job on the run's GPUs (``runs_in == "train"``: a reward model scoring completions, a live
teacher scoring the student's). What a
need costs, its jobs and their inputs are the budget's (snaketune.budget.scoring: one plan
per record, which the stage, memory, disk and cost plans, the checks before queueing and
``snaketune status`` read); the SLURM profiles give each stage need its resources.

The names of the scoring stages' rules are written here and nowhere else in the library
(tests/test_architecture.py reads the syntax tree): a plan asks a record its ``name``.
Adding a need: its record here, its plan in snaketune.budget.scoring, and, for a stage, its
entry script, one ``use rule`` line in workflow/rules/scoring.smk and its resources in each
cluster profile.
"""

from __future__ import annotations

from dataclasses import dataclass

# where a need is met: its own stage job, or inside the train job on the run's GPUs
PLACES = ("stage", "train")


@dataclass(frozen=True)
class Need:
    """One kind of need: ``name`` (a stage's rule, and the train job's input of that name),
    ``label`` (in words, for the plans' lines), ``runs_in`` (one of PLACES) and, for a
    stage, the file its job writes in its key's folder."""

    name: str
    label: str
    runs_in: str
    output: str | None = None
    # the train job reads its path as ``--stage-input <name>=<path>`` (a stage's output, a
    # live teacher's model; reward models' folders travel in the job's spec instead)
    passed: bool = True

    def __post_init__(self) -> None:
        assert self.runs_in in PLACES, self.runs_in
        assert (self.output is not None) == (self.runs_in == "stage"), self

    @property
    def stage(self) -> bool:
        """Whether it is met by a stage of its own (a rule of its name)."""
        return self.runs_in == "stage"

    def path(self, key: str) -> str:
        """A stage job's output, under the working directory."""
        return f"results/{self.name}/{key}/{self.output}"


# DPO's and KTO's precomputed reference log-probs (reference: precomputed)
REFERENCE = Need("reference_logps", "reference log-probs", "stage", "logps.parquet")
# offline distillation's teacher top-k of every label token (settings: teacher, top_k)
TEACHER_TOPK = Need("teacher_logps", "teacher top-k", "stage", "topk.parquet")
# GRPO's and RLOO's reward models (settings: runs, the runs that trained them), held whole on
# every GPU of the train job
REWARD_MODELS = Need("reward_models", "reward models", "train", passed=False)
# on-policy distillation's teacher (settings: teacher), held on the run's GPUs beside the
# student (sharded with it under ZeRO-3) and scoring each completion the student samples
LIVE_TEACHER = Need("teacher", "live teacher", "train")

NEEDS = (REFERENCE, TEACHER_TOPK, REWARD_MODELS, LIVE_TEACHER)
STAGE_NEEDS = tuple(n for n in NEEDS if n.stage)
PASSED_NEEDS = tuple(n for n in NEEDS if n.passed)  # the train job's --stage-input names


def need_named(name: str) -> Need:
    return next(n for n in NEEDS if n.name == name)
