# Plain helpers for the rules (no rules here). Logic lives in scripts/snaketune/.
import json
from pathlib import Path

from snaketune.config import resolve_deepspeed
from snaketune.plan import run_tokenize_spec, tokenize_jobs, tokenize_key

# Entry scripts, found from the Snakefile so that --directory can move a run elsewhere.
SCRIPTS = Path(workflow.basedir) / "scripts"
NAME_PATTERN = "[A-Za-z][A-Za-z0-9_-]{0,63}"
KEY_PATTERN = "[A-Za-z0-9_-]+__[A-Za-z0-9_-]+__[0-9a-f]{12}"

# Every tokenized copy the runs need, by key; runs that share tokens share one entry.
TOKENIZE = tokenize_jobs(config)


def as_json(value):
    """A config value as compact JSON for a script's --spec argument."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def model_spec(wildcards):
    return as_json(config["models"][wildcards.model])


def dataset_spec(wildcards):
    return as_json(config["datasets"][wildcards.dataset])


def model_source(wildcards):
    """The local model directory as an input (so a rule can make it), none for the hub."""
    spec = config["models"][wildcards.model]
    return {"source": spec["path"]} if spec["source"] == "local" else {}


def dataset_source(wildcards):
    """The local dataset file as an input (so a rule can make it), none for the hub."""
    spec = config["datasets"][wildcards.dataset]
    return {"source": spec["path"]} if spec["source"] == "local" else {}


def tokenize_inputs(wildcards):
    """Downloaded sources, model directory and chat template of a tokenized copy."""
    spec = TOKENIZE[wildcards.key]
    inputs = {
        "data": [
            f"resources/datasets/{s['name']}/data.parquet" for s in spec["sources"]
        ],
        "model": f"resources/models/{spec['model']}",
    }
    if spec["chat_template"]:
        inputs["template"] = spec["chat_template"]["path"]
    return inputs


def tokenize_spec(wildcards):
    return as_json(TOKENIZE[wildcards.key])


def run_tokenized(wildcards):
    """The tokenized copy a run trains on."""
    key = tokenize_key(run_tokenize_spec(config, wildcards.run))
    return f"results/tokenized/{key}/data.parquet"


def run_model(wildcards):
    return f"resources/models/{config['runs'][wildcards.run]['model']}"


def run_deepspeed(wildcards):
    """The run's DeepSpeed JSON: a preset from config/deepspeed/ or the user's file."""
    return str(
        resolve_deepspeed(
            config["runs"][wildcards.run]["deepspeed"], Path(workflow.basedir)
        )
    )


def run_spec(wildcards):
    return as_json(config["runs"][wildcards.run])


def train_threads(wildcards):
    """Processes of a run on one machine (the local profile runs every emulated node here)."""
    run = config["runs"][wildcards.run]
    return run["nodes"] * run["gpus_per_node"]


def export_kind(run):
    """Where convert_checkpoint writes a run: hf/ (full) or lora_adapters/ (LoRA)."""
    return "lora_adapters" if config["runs"][run]["method"] == "lora" else "hf"


def convert_inputs(wildcards):
    """No extra inputs; refuses the export directory of the other method."""
    if wildcards.export != export_kind(wildcards.run):
        raise ValueError(
            f"results/{wildcards.run}/{wildcards.export}: run {wildcards.run} makes "
            f"results/{wildcards.run}/{export_kind(wildcards.run)}"
        )
    return {}


def final_model(run):
    """The model a run ends with: the merged model (LoRA) or the converted one (full)."""
    kind = export_kind(run)
    return f"results/{run}/{'merged_model' if kind == 'lora_adapters' else kind}"


def final_models(wildcards):
    return [final_model(run) for run in config["runs"]]
