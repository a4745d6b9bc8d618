"""The registry of the pipeline's stages: one record each, the one place in the library that
names the workflow's rules (the scoring stages' rules are their needs', snaketune.methods.needs).

A stage is its rule (and the further rules it runs as: a corpus tokenized in parts), what it
is in words, whose it is (``scope``: a model's, a dataset's, a run's, shared by the runs of one
key, the whole pipeline's), where its outputs go, what ``snaketune status`` reads to call a
run's stage done, and which plans and checks it enters: the memory checked before queueing,
a calibration run's time reused, the rules between a run's training and its final model. The
plans, the checks, ``status``, the calibration and the targets read these records; none
writes a rule's name (tests/test_architecture.py reads every string of the library). The
workflow's rules are these names (tests/test_architecture.py compares the two).

Adding a stage: its record below, its module, its rule in workflow/rules/ and, where it
wants a GPU, its resources in each cluster profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from snaketune.methods.needs import STAGE_NEEDS

SCOPES = ("model", "dataset", "run", "shared", "sweep", "pipeline")


@dataclass(frozen=True)
class Stage:
    """One stage: ``name``, its rule (its script's and its log folder's name); ``label`` in
    words; ``scope`` (one of SCOPES); ``rules``, the further rules it runs as; ``done``, the
    outputs under results/<run>/ of which the first there says a run's stage is done;
    ``folder``, its outputs' folder under results/<run>/ (a run's stage) or results/."""

    name: str
    label: str
    scope: str
    rules: tuple[str, ...] = ()
    done: tuple[str, ...] = ()
    folder: str | None = None
    memory_checked: bool = False  # its jobs' mem_mb checked against its plan before queueing
    calibrated: bool = False  # a finished run's time of it plans another run's (budget.calibrate)
    to_final_model: bool = False  # between a run's training and its final model

    def __post_init__(self) -> None:
        assert self.scope in SCOPES, self

    @property
    def all_rules(self) -> tuple[str, ...]:
        return (self.name, *self.rules)

    def path(self, run: str, *rest: str) -> str:
        """A run's output of this stage, under the working directory."""
        return "/".join(("results", run, self.folder or self.name, *rest))


DOWNLOAD_MODEL = Stage("download_model", "model download", "model")
DOWNLOAD_DATASET = Stage("download_dataset", "dataset download", "dataset")
CLEAN = Stage(
    "clean_dataset", "cleaning", "dataset", rules=("clean_signatures",), memory_checked=True
)
TOKENIZE = Stage(
    "tokenize_dataset", "tokenization", "dataset", rules=("tokenize_part", "index_parts")
)
SHARD = Stage(
    "shard_dataset",
    "shards",
    "run",
    done=("shards/manifest.json",),
    folder="shards",
    calibrated=True,
)
TRAIN = Stage(
    "train",
    "training",
    "run",
    done=("train/provenance.json",),
    folder="train",
    to_final_model=True,
)
CONVERT = Stage(
    "convert_checkpoint",
    "conversion",
    "run",
    done=("lora_adapters/adapter_config.json", "hf/config.json"),
    memory_checked=True,
    calibrated=True,
    to_final_model=True,
)
MERGE = Stage(
    "merge_lora",
    "merge",
    "run",
    done=("merged_model/config.json",),
    folder="merged_model",
    memory_checked=True,
    calibrated=True,
    to_final_model=True,
)
EVALUATE_BASE = Stage(
    "evaluate_base",
    "the base model's evaluation",
    "shared",
    folder="base_eval",
    memory_checked=True,
)
EVALUATE_START = Stage(
    "evaluate_start",
    "the start's evaluation",
    "run",
    folder="start_eval",
    memory_checked=True,
    calibrated=True,
)
EVALUATE = Stage(
    "evaluate",
    "evaluation",
    "run",
    done=("eval/metrics.json",),
    folder="eval",
    memory_checked=True,
    calibrated=True,
)
SELECT_SWEEP = Stage("select_sweep", "a sweep's choice of its member", "sweep")
REPORT = Stage("report", "the report", "pipeline")
PUBLISH = Stage("publish", "publishing", "pipeline", rules=("publish_run",))
FIXTURES = Stage("make_fixtures", "the demo's fixtures", "pipeline", rules=("make_agent_fixtures",))

# every stage, in the order the pipeline goes through them; a run's scoring stages (its
# needs') come before its training
STAGES = (
    DOWNLOAD_MODEL,
    DOWNLOAD_DATASET,
    CLEAN,
    TOKENIZE,
    SHARD,
    TRAIN,
    CONVERT,
    MERGE,
    EVALUATE_BASE,
    EVALUATE_START,
    EVALUATE,
    SELECT_SWEEP,
    REPORT,
    PUBLISH,
    FIXTURES,
)
EVALUATIONS = (EVALUATE_BASE, EVALUATE_START, EVALUATE)


def stages() -> tuple[Stage, ...]:
    """Every stage (read at each call: a test registers one more)."""
    return STAGES


def run_order() -> tuple[str, ...]:
    """The stages a run goes through of its own or shared with its key's runs, in order, by
    rule: its shards, its needs' stages, training, the export, the evaluations."""
    own = [s.name for s in stages() if s.scope in ("run", "shared")]
    at = own.index(TRAIN.name)
    return (*own[:at], *(need.name for need in STAGE_NEEDS), *own[at:])


def with_status() -> tuple[Stage, ...]:
    """The run's stages ``snaketune status`` lists, in order (those with an output saying done)."""
    return tuple(s for s in stages() if s.scope == "run" and s.done)


def memory_checked() -> tuple[str, ...]:
    """The rules whose jobs' memory is checked against their stage's plan before queueing:
    the stages' that say so and every scoring stage's."""
    return (*(s.name for s in stages() if s.memory_checked), *(n.name for n in STAGE_NEEDS))


def calibrated() -> tuple[str, ...]:
    """The stages besides training whose time a calibration run's measures for another run."""
    return tuple(s.name for s in stages() if s.calibrated)


def to_final_model() -> tuple[str, ...]:
    """The rules from a run's training to its final model."""
    return tuple(s.name for s in stages() if s.to_final_model)


def rules() -> set[str]:
    """Every rule of the workflow but ``all`` (snaketune.plan.rulenames), the scoring
    stages' among them."""
    return {r for s in stages() for r in s.all_rules} | {n.name for n in STAGE_NEEDS}
