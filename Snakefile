# snaketune: LLM fine-tuning from raw dataset to evaluated model, local or on SLURM.
#
#   snakemake --profile profiles/local              # the offline demo (config/config.yaml)
#   snakemake --profile profiles/local --configfile my.yaml
#
# Stages and layout: README.md and ../shared/DESIGN.md.
import sys

from snakemake.utils import min_version
from snaketune.config import check_config_files, check_local_sources, validate_config
from snaketune.errors import UserError
from snaketune.io import check_writable
from snaketune.plan import base_evaluations, tokenize_jobs
from snaketune.topology import adapt_accumulation

min_version("9.0")


configfile: "config/config.yaml"


# Our validator instead of snakemake.utils.validate: same JSON Schema (defaults filled),
# but one line naming the key path and the allowed values, and no traceback (a bad
# config is the user's to fix, not a bug).
try:
    check_config_files(workflow.configfiles)
    validate_config(config, workflow.basedir)
    # A run moved to another node count keeps its checkpoints' global batch (and continues
    # from them): its gradient_accumulation_steps adapts (snaketune.topology).
    for note in adapt_accumulation(config):
        print(f"note: {note}", file=sys.stderr)
    # Every tokenized copy the runs need, by key (runs that share tokens share one), and
    # the settings of each base-model evaluation.
    TOKENIZE = tokenize_jobs(config)
    BASE_EVALS = base_evaluations(config)
except UserError as error:
    sys.exit(f"config error: {error}")


include: "workflow/rules/common.smk"
include: "workflow/rules/fixtures.smk"
include: "workflow/rules/download.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/publish.smk"
include: "workflow/rules/sweep.smk"


# Checks of the machine this runs on, before any job: local sources exist (or a rule makes
# them), and the working directory takes new files.
try:
    check_local_sources(config, set(rules.make_fixtures.output))
    check_writable(".", ("results", "resources", "logs", "benchmarks", ".snakemake"))
except UserError as error:
    sys.exit(f"error: {error}")


# Before anything runs or is queued: memory plans of the runs about to train; on SLURM,
# every job's resources against its partition.
onstart:
    before_queueing()


# At the end of a successful pipeline: one line with the report's path and the results.
onsuccess:
    report_line()


wildcard_constraints:
    model=NAME_PATTERN,
    dataset=NAME_PATTERN,
    run=NAME_PATTERN,
    sweep=NAME_PATTERN,
    key=KEY_PATTERN,
    export="hf|lora_adapters",


rule all:
    default_target: True
    input:
        run_targets,
        "results/summary.tsv",
