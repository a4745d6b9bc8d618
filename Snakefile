# snaketune: LLM fine-tuning from raw dataset to evaluated model, local or on SLURM.
#
#   snakemake --profile profiles/local              # the offline demo (config/config.yaml)
#   snakemake --profile profiles/local --configfile my.yaml
#
# Stages and layout: README.md and docs/.
import sys
import time
from pathlib import Path

from snakemake.utils import min_version
from snaketune.core.errors import UserError, labelled
from snaketune.budget.checks import at_parse, check_workflow, in_dry_runs
from snaketune.app.summary import report_line
from snaketune.app.terminal import settled
from snaketune.train.attempts import one_start_per_job
from snaketune.train.attemptlog import stopped_since

min_version("9.0")

STARTED = time.time()  # this invocation's start: its train jobs' outcomes are newer


# The demo config, unless config files are given (--configfile, or a profile's
# `configfile`): a config given replaces the demo, in this process and in every job it
# spawns (Snakemake passes a job the config files but not --replace-workflow-config, so a
# default read there would be merged under them).
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


# Our validator instead of snakemake.utils.validate: same JSON Schema (defaults filled),
# but one line per problem naming the key path and the fix, and no traceback (a bad config
# is the user's to fix, not a bug). The same checks as `snaketune validate`: the config,
# local paths, the working directory; a run moved to another node count keeps its
# checkpoints' global batch (its gradient_accumulation_steps adapts); every tokenized copy
# the runs need, by key, and the settings of each base-model evaluation.
try:
    PARSED = at_parse(config, Path(workflow.basedir), workflow.configfiles)
except UserError as error:
    for kind, line in labelled(error):
        print(f"{kind}: {line}", file=sys.stderr)
    sys.exit(1)
for note in PARSED.notes:
    print(f"note: {note}", file=sys.stderr)
TOKENIZE = PARSED.tokenize
BASE_EVALS = PARSED.base_evals
# In the Snakemake inside a cluster job (remote mode), the train jobs it starts refuse a
# second start of their run inside that job: only the submitting Snakemake retries
# (TRAIN_RETRIES, common.smk; snaketune.train.attempts).
one_start_per_job(workflow.remote_exec)


include: "workflow/rules/common.smk"
include: "workflow/rules/fixtures.smk"
include: "workflow/rules/download.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/scoring.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/publish.smk"
include: "workflow/rules/sweep.smk"


# Before anything runs or is queued, and in a dry run too: memory and disk plans of the
# runs about to train, lm-eval's task names; on SLURM, every job's resources against its
# partition (snaketune.budget.checks.before_queueing).
onstart:
    settled()  # Snakemake's own lines first (its logger writes from a thread)
    check_workflow(config, workflow, dry_run=False)


in_dry_runs(
    lambda: (settled(), check_workflow(config, workflow, dry_run=True)),
    lambda: workflow.dryrun,
)


# At the end of a successful pipeline: one line with the report's path and the results.
onsuccess:
    settled()
    report_line()


# A train job stopped (Ctrl-C, scancel) or failed in this invocation: its one line, last.
onerror:
    settled()
    for line in stopped_since(STARTED):
        print(line, file=sys.stderr)


wildcard_constraints:
    model=NAME_PATTERN,
    dataset=NAME_PATTERN,
    run=NAME_PATTERN,
    sweep=NAME_PATTERN,
    key=KEY_PATTERN,
    ref=REF_PATTERN,
    part=PART_PATTERN,
    export="hf|lora_adapters",


rule all:
    default_target: True
    input:
        run_targets,
        "results/summary.tsv",
