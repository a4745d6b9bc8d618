"""Where the plan finds a run's model files: its folder (downloaded or local), its
config.json there, on the Hub through ``sources``, or given on `snaketune plan`'s command
line; and how to get one the plan cannot read yet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from snaketune.core.errors import UserError
from snaketune.data.sources import hub_config_json, model_folder

# a model's config.json given on `snaketune plan`'s command line (--model-config NAME=PATH):
# the plan reads it, nothing else does
PLANNED_FROM = "planned_from_config_json"


def model_dir_of(config: dict[str, Any], run: dict[str, Any], root: Path) -> Path:
    """Where the run's model (its config.json) is: resources/models/<name> once downloaded,
    else a local model's own path."""
    return model_folder(config, run["model"], root)


def download_advice(config_path: str | Path | None = None, model: str = "<model>") -> str:
    """How to get a Hub model's config.json before planning, with commands that work: the
    download, or the plan from a folder holding config.json alone (--model-config)."""
    path = str(config_path) if config_path else "<your config>"
    return (
        f"download it first (snakemake --profile <profile> --configfile {path} --until "
        f"download_model), or plan offline from a folder holding its config.json alone "
        f"(snaketune plan {path} --model-config {model}=<folder>; config.json is all the "
        "plan reads)"
    )


def model_configs(config: dict[str, Any], given: list[str]) -> None:
    """Put each ``NAME=PATH`` (a config.json, or a folder holding one) into the config's
    model NAME for the plan to read (in place); one line naming a bad entry."""
    for entry in given:
        name, _, path = entry.partition("=")
        where = f"--model-config {entry}"
        if name not in config["models"]:
            known = ", ".join(sorted(config["models"]))
            raise UserError(f"{where}: the config has no model {name!r} (models: {known})")
        file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
        if not file.is_file():
            raise UserError(
                f"{where}: {file} is not a file; give a model's config.json (or "
                "the folder holding it)"
            )
        config["models"][name][PLANNED_FROM] = str(file)


def find_config_json(config: dict[str, Any], run: dict[str, Any], workdir: Path) -> Path | None:
    """The run's model config.json where it can be read now (``locate_config_json``)."""
    return locate_config_json(config, run, workdir)[0]


def locate_config_json(
    config: dict[str, Any], run: dict[str, Any], workdir: Path
) -> tuple[Path | None, str]:
    """The run's model config.json where it can be read now: the downloaded model, a local
    model's path, or (a hub model not yet downloaded) config.json alone from the Hub's cache
    or the Hub. (None, why) when it cannot be read yet; the Hub is asked at most once per
    model and process, and not at all when it is unreachable. ``snaketune plan
    --model-config NAME=PATH`` names one to plan from instead (``PLANNED_FROM``)."""
    spec = config["models"][run["model"]]
    if PLANNED_FROM in spec:
        return Path(spec[PLANNED_FROM]), ""
    local = model_dir_of(config, run, workdir) / "config.json"
    if local.is_file():
        return local, ""
    if spec.get("source") != "hub":
        return None, f"{local.parent} is not there yet (a job makes it)"
    found, why = hub_config_json(spec["id"], spec.get("revision"))
    if found is None:
        return None, f"it is not downloaded yet and {why}"
    return found, ""
