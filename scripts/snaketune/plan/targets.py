"""What the pipeline's last rules ask for: `all`'s targets, the inputs of the report and of
each sweep's choice, and `publish`'s targets, inputs and settings (for a job's wildcards:
workflow/rules/common.smk)."""

from __future__ import annotations

from typing import Any

from snaketune.data.formats import components
from snaketune.plan.pipeline import CONVERT, TRAIN, to_final_model
from snaketune.plan.runspec import RunSpec
from snaketune.plan.stages import as_json, export_kind, final_model


def run_targets(config: dict[str, Any], sweeps: dict[str, list[str]]) -> list[str]:
    """What `all` asks of each run: its evaluation when it has an eval set, else its model;
    and of each sweep its best member."""
    return [
        f"results/{run}/eval/metrics.json" if "eval_dataset" in r else final_model(config, run)
        for run, r in config["runs"].items()
    ] + [f"results/{sweep}/best.json" for sweep in sweeps]


def sweep_inputs(config: dict[str, Any], members: list[str]) -> dict[str, str]:
    """A sweep's members' training metrics, and their evaluations where they have one."""
    inputs = {}
    for member in members:
        inputs[f"{member}_train"] = f"results/{member}/train/metrics.jsonl"
        if "eval_dataset" in config["runs"][member]:
            inputs[f"{member}_eval"] = f"results/{member}/eval/metrics.json"
    return inputs


def report_inputs(config: dict[str, Any]) -> dict[str, str]:
    """Every run's training metrics and provenance, and its evaluation when it has one."""
    inputs = {}
    for run, r in config["runs"].items():
        inputs[f"{run}_metrics"] = f"results/{run}/train/metrics.jsonl"
        inputs[f"{run}_provenance"] = f"results/{run}/train/provenance.json"
        if "eval_dataset" in r:
            inputs[f"{run}_eval"] = f"results/{run}/eval/metrics.json"
            inputs[f"{run}_samples"] = f"results/{run}/eval/samples.jsonl"
            inputs[f"{run}_lineage"] = f"results/{run}/eval/provenance.json"
        else:
            inputs[f"{run}_lineage"] = final_model(config, run)
    return inputs | {f"{run}_cleaned": path for run, path in cleaned_reports(config).items()}


def cleaned_reports(config: dict[str, Any]) -> dict[str, str]:
    """The cleaning report of each run whose training data is cleaned (datasets.<d>.clean)."""
    from snaketune.plan.clean import folder
    from snaketune.plan.stages import run_tokenize_spec

    specs = {run: run_tokenize_spec(config, run) for run in config["runs"]}
    return {r: f"{folder(s['clean'])}/report.json" for r, s in specs.items() if "clean" in s}


def publish_config(config: dict[str, Any], sweeps: dict[str, list[str]], name: str) -> dict:
    """`publish` settings of a run, or of a sweep (kept in its members' sweep_of)."""
    if name in sweeps:
        return config["runs"][sweeps[name][0]]["sweep_of"].get("publish") or {}
    return config["runs"][name].get("publish") or {}


def publish_settings(config: dict[str, Any], sweeps: dict[str, list[str]], name: str) -> str:
    """The publish settings of a run or sweep, as JSON (ValueError: it has no repo_id)."""
    settings = publish_config(config, sweeps, name)
    if not settings.get("repo_id"):
        raise ValueError(f"results/{name}/publish: run {name} has no publish.repo_id")
    return as_json(settings)


def publish_inputs(config: dict[str, Any], name: str, published: str, sweep: bool) -> dict:
    """The model of the run ``published`` (for a sweep ``name``: its best member), the
    sweep's choice, and the evaluation (its figures go into the model card) if it has one."""
    inputs = {"model": final_model(config, published)}
    if sweep:
        inputs["best"] = f"results/{name}/best.json"
    if "eval_dataset" in config["runs"][published]:
        inputs["metrics"] = f"results/{published}/eval/metrics.json"
    return inputs


def publish_targets(config: dict[str, Any], sweeps: dict[str, list[str]]) -> list[str]:
    """What `publish` asks for: the receipt of every run and sweep with publish.repo_id."""
    return [
        f"results/{name}/publish.json"
        for name in [*config["runs"], *sweeps]
        if publish_config(config, sweeps, name).get("repo_id")
    ]


def publish_spec(config: dict[str, Any], run: str) -> str:
    """The run's config entry and the datasets it trained on (for the model card)."""
    r = config["runs"][run]
    return as_json({**r, "dataset_sources": [c["name"] for c in components(config, r["dataset"])]})


def until_targets(config: dict[str, Any], until: set[str]) -> list[str]:
    """For `--until` on a config whose runs start from others: the targets that stop each
    run at the same rules and build what the later runs need (the earlier runs' final
    models); [] where `--until` works as it is. The rules from a run's training to its final
    model (snaketune.plan.pipeline.to_final_model): `--until` one of them stops a run short of
    the model a run that starts from it (init_from) trains from, and Snakemake stops with "BUG:
    Out of jobs ready to be started" after training the first runs (every rule is tried on a
    chained config in tests/test_workflow.py)."""
    stops = [rule for rule in to_final_model() if rule in until]
    if not stops or not any("init_from" in run for run in config["runs"].values()):
        return []
    out = []
    for name, run in config["runs"].items():
        for rule in stops:
            if rule == TRAIN.name:
                out.append(TRAIN.path(name, "metrics.jsonl"))
            elif rule == CONVERT.name:
                out.append(f"results/{name}/{export_kind(run)}")
            elif RunSpec.of(run).trains_lora:  # its final model (the adapter: merged: false)
                out.append(f"results/{name}/{RunSpec.of(run).final_model}")
    return list(dict.fromkeys(out))


def until_problem(config: dict[str, Any], until: set[str]) -> str | None:
    """The line refusing `--until` on a chained config (``until_targets``), with the
    command to give instead; None where `--until` works."""
    targets = until_targets(config, until)
    if not targets:
        return None
    chains = ", ".join(
        f"{name} from {run['init_from']}"
        for name, run in config["runs"].items()
        if "init_from" in run
    )
    return (
        f"--until {' '.join(sorted(until))}: runs here start from others ({chains}), and a "
        "later run trains from the earlier one's final model, past that boundary "
        "(Snakemake would train the first runs and stop); give the targets instead, "
        "without --until and before your options (after --configfile they would be read as "
        f"config files): snakemake {' '.join(targets)} <your options>"
    )
