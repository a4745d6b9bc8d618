"""From a validated config to what the rules need: tokenization keys and per-step specs.

A tokenized copy is keyed by everything that determines its tokens: the dataset entry
(and each mixture component's), the model's tokenizer source, the chat template's
content, max_length and the overlong policy. Runs that differ only in training keys
share one copy; a change to any of those makes a new one, and the old one stays for
runs that still use it. Changes to the bytes of a local file behind the same config are
caught by Snakemake's rerun triggers (the download rule's input changes).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from snaketune.errors import ConfigError
from snaketune.io import digest
from snaketune.tokenization import TOKENIZE_VERSION
from snaketune.vocabulary import SINGLE_DATASET_KEYS, components

MODEL_TOKEN_KEYS = ("source", "id", "path", "revision")
DATASET_TOKEN_KEYS = ("source", *SINGLE_DATASET_KEYS)


def chat_template(
    config: dict[str, Any], model: str, root: Path = Path(".")
) -> dict[str, str] | None:
    """Path and sha256 of a model's configured chat template file (None: the tokenizer's)."""
    path = config["models"][model].get("chat_template")
    if path is None:
        return None
    full = Path(path) if Path(path).is_absolute() else root / path
    try:
        text = full.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"models.{model}.chat_template: cannot read {path} ({exc.strerror})"
        ) from exc
    return {"path": path, "sha256": hashlib.sha256(text).hexdigest()}


def tokenize_spec(
    config: dict[str, Any],
    dataset: str,
    model: str,
    max_length: int,
    overlong: str,
    root: Path = Path("."),
) -> dict[str, Any]:
    """Everything that determines the tokens of ``dataset`` under ``model``'s tokenizer."""
    sources = []
    for comp in components(config, dataset):
        spec = config["datasets"][comp["name"]]
        sources.append({**comp, "spec": {k: spec[k] for k in DATASET_TOKEN_KEYS if k in spec}})
    model_spec = config["models"][model]
    return {
        "dataset": dataset,
        "sources": sources,
        "model": model,
        "tokenizer": {k: model_spec[k] for k in MODEL_TOKEN_KEYS if k in model_spec},
        "chat_template": chat_template(config, model, root),
        "max_length": max_length,
        "overlong": overlong,
        "version": TOKENIZE_VERSION,
    }


def tokenize_key(spec: dict[str, Any]) -> str:
    """Directory name under results/tokenized/ for a tokenize spec."""
    return f"{spec['dataset']}__{spec['model']}__{digest(spec)[:12]}"


def run_tokenize_spec(config: dict[str, Any], run: str, root: Path = Path(".")) -> dict[str, Any]:
    """The tokenize spec of a run's training dataset."""
    r = config["runs"][run]
    return tokenize_spec(config, r["dataset"], r["model"], r["max_length"], r["overlong"], root)


def run_eval_tokenize_spec(
    config: dict[str, Any], run: str, root: Path = Path(".")
) -> dict[str, Any]:
    """The tokenize spec of a run's eval dataset (same tokenizer and length policy)."""
    r = config["runs"][run]
    return tokenize_spec(
        config, r["eval_dataset"], r["model"], r["max_length"], r["overlong"], root
    )


def tokenize_jobs(config: dict[str, Any], root: Path = Path(".")) -> dict[str, dict[str, Any]]:
    """Every tokenized copy the runs need, by key (runs that share one get one entry)."""
    jobs = {}
    for run, r in config["runs"].items():
        specs = [run_tokenize_spec(config, run, root)]
        if "eval_dataset" in r:
            specs.append(run_eval_tokenize_spec(config, run, root))
        for spec in specs:
            jobs[tokenize_key(spec)] = spec
    return jobs


def evaluates_its_start(config: dict[str, Any], run: str) -> bool:
    """Whether a run with ``init_from`` and an eval set scores the model it starts from
    itself (rule evaluate_start): when the run it starts from (or a member of that sweep)
    has another eval set or other eval settings, or none. Otherwise that run's evaluation is
    this run's base."""
    from snaketune.config import init_parents

    r = config["runs"][run]
    if "init_from" not in r or "eval_dataset" not in r:
        return False
    return any(
        config["runs"][p].get("eval_dataset") != r["eval_dataset"]
        or config["runs"][p].get("eval") != r["eval"]
        for p in init_parents(config, run)
    )


def base_evaluations(config: dict[str, Any], root: Path = Path(".")) -> dict[str, dict[str, Any]]:
    """Eval settings of each (base model, eval set), by the eval set's tokenize key.

    The base model is evaluated once per key; runs that share it must share the settings.
    """
    evals: dict[str, dict[str, Any]] = {}
    for run, r in config["runs"].items():
        if "eval_dataset" not in r or "init_from" in r:  # its base: the init run's evaluation
            continue
        key = tokenize_key(run_eval_tokenize_spec(config, run, root))
        first = evals.setdefault(key, {"run": run, **r["eval"]})
        if {k: v for k, v in first.items() if k != "run"} != r["eval"]:
            raise ConfigError(
                f"runs.{run}.eval: differs from runs.{first['run']}.eval, which evaluates the same "
                "model on the same eval set; give both the same eval settings"
            )
    return evals
