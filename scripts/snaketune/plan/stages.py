"""What each stage needs from a validated config: the keys, paths and arguments the rules'
input functions return (workflow/rules/common.smk only looks them up here).

Shards are keyed by their tokenized input and layout (``shard_job``: a sweep's members
with the same one share one shard job); a run's model is its base or the final model of
the run (or sweep's best member) it starts from. A tokenized copy is keyed by everything
that determines its tokens: the dataset entry (and each mixture component's), the model's
tokenizer source, the chat template's content, max_length and the overlong policy. Runs
that differ only in training keys share one copy; a change to any of those makes a new
one, and the old one stays for runs that still use it. Changes to the bytes of a local
file behind the same config are caught by Snakemake's rerun triggers (the download rule's
input changes).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from snaketune.core.errors import ConfigError
from snaketune.core.io import digest
from snaketune.data.formats import SINGLE_DATASET_KEYS, components
from snaketune.data.tokenization import TOKENIZE_VERSION
from snaketune.evaluation.settings import eval_args, shared_eval
from snaketune.methods import calls_tools, method_of
from snaketune.plan.clean import clean_spec, removed_path
from snaketune.plan.runspec import RunSpec

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
    spec = {
        "dataset": dataset,
        "sources": sources,
        "model": model,
        "tokenizer": {k: model_spec[k] for k in MODEL_TOKEN_KEYS if k in model_spec},
        "chat_template": chat_template(config, model, root),
        "max_length": max_length,
        "overlong": overlong,
        "version": TOKENIZE_VERSION,
    }
    if "template_date" in model_spec:  # unset: chat.TEMPLATE_DATE (the key as before)
        spec["template_date"] = model_spec["template_date"]
    if (cleaned := clean_spec(config, dataset)) is not None:  # the cleaned rows' tokens
        spec["clean"] = cleaned
    parts = parts_of(config, dataset, Path("results/tokenized") / tokenize_key(spec))
    if parts > 1:  # one part: the spec (and its job's params) as before parts existed
        spec["parts"] = parts
    return spec


def tokenize_key(spec: dict[str, Any]) -> str:
    """Directory name under results/tokenized/ for a tokenize spec (its parts left out: a
    set made in another number of parts stays in its directory, its part files named by
    their number)."""
    keyed = {k: v for k, v in spec.items() if k != "parts"}
    return f"{spec['dataset']}__{spec['model']}__{digest(keyed)[:12]}"


def parts_of(config: dict[str, Any], dataset: str, directory: Path) -> int:
    """How many tokenize jobs make ``dataset``'s tokenized set (``datasets.<d>.parts``):
    the number given, or for ``auto`` the parts of the set already made in ``directory``
    (the same N on a rerun), else one per GiB of its sources' files (snaketune.core.parts)."""
    from snaketune.core.parts import auto_parts, finished_parts

    setting = config["datasets"][dataset].get("parts", "auto")
    if setting != "auto":
        return int(setting)
    made = finished_parts(directory)
    return made if made is not None else auto_parts(sources_bytes(config, dataset))


def sources_bytes(config: dict[str, Any], dataset: str) -> int | None:
    """The bytes of a dataset's source files (a mixture's components'): a local file or
    directory, a Hub dataset's download; None where one is not there yet."""
    total = 0
    for comp in components(config, dataset):
        spec = config["datasets"][comp["name"]]
        if "files" in spec:  # a Hub dataset's chosen files
            chosen = chosen_bytes(comp["name"], spec)
            if chosen is None:
                return None
            total += int(chosen * comp["weight"])
            continue
        where = Path(spec["path"]) if spec["source"] == "local" else Path("resources/datasets")
        if spec["source"] != "local":
            where = where / comp["name"] / "data.parquet"
        if not where.exists():
            return None
        files = [where] if where.is_file() else [f for f in where.rglob("*") if f.is_file()]
        total += int(sum(f.stat().st_size for f in files) * comp["weight"])
    return total


def chosen_bytes(name: str, spec: dict[str, Any]) -> int | None:
    """The bytes of the files a Hub dataset's ``files`` choose: as its download recorded them
    (for these globs), else as the Hub lists them where it answers (offline or unreachable:
    None), so its parts are counted alike before and after the download."""
    from huggingface_hub import HfApi, constants

    from snaketune.core.hubfiles import chosen
    from snaketune.data.sources import hub_reachable

    provenance = Path("resources/datasets") / name / "provenance.json"
    if provenance.is_file():
        record = json.loads(provenance.read_text(encoding="utf-8"))
        if record.get("spec", {}).get("files") == spec["files"] and record.get("files"):
            return sum(record["files"].values())
    if constants.HF_HUB_OFFLINE or not hub_reachable(constants.ENDPOINT):
        return None
    try:
        commit = HfApi().dataset_info(spec["id"], revision=spec.get("revision", "main")).sha
        return sum(chosen(name, spec["id"], commit, spec["files"]).values())
    except Exception:  # noqa: BLE001 -- gated, no such repo, no file matched: the download says
        return None


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


def own_start(run: dict[str, Any]) -> bool:
    """Whether a run's start is scored as the run is and by no other run: its method says so
    (a reward model's new head), or it calls tools (its start is evaluated with them)."""
    return method_of(run).evaluates_start or calls_tools(run)


def evaluates_its_start(config: dict[str, Any], run: str) -> bool:
    """Whether a run with an eval set scores the model it starts from itself (rule
    evaluate_start): where its method says so (a reward model's new head); with
    ``init_from``, when the run it starts from (or a member of that sweep) has another eval
    set or other settings, or none. Otherwise that run's evaluation is this run's base."""
    from snaketune.plan.sweep import init_parents

    r = config["runs"][run]
    if "eval_dataset" in r and own_start(r):  # a reward model's new head, an agent's tools
        return True
    if "init_from" not in r or "eval_dataset" not in r:
        return False
    return any(
        config["runs"][p].get("eval_dataset") != r["eval_dataset"]
        or shared_eval(config["runs"][p]) != shared_eval(r)
        for p in init_parents(config, run)
    )


def run_eval_args(run: dict[str, Any], metrics: dict[str, Any] | None = None) -> str:
    """evaluate.py options of a run's evaluation: its method (its config name) and the
    method's own settings, and ``metrics``, the user's (snaketune.evaluation.scorers.spec)."""
    return eval_args(run["eval"], run["method"], method_of(run).eval_settings(run), metrics)


def base_evaluations(config: dict[str, Any], root: Path = Path(".")) -> dict[str, dict[str, Any]]:
    """Eval settings of each (base model, eval set), by the eval set's tokenize key.

    The base model is evaluated once per key; runs that share it must share the settings.
    """
    evals: dict[str, dict[str, Any]] = {}
    for run, r in config["runs"].items():
        # its base: the init run's evaluation, or its own start's (rule evaluate_start)
        if "eval_dataset" not in r or "init_from" in r or own_start(r):
            continue
        key = tokenize_key(run_eval_tokenize_spec(config, run, root))
        first = evals.setdefault(key, {"run": run, **shared_eval(r)})
        if {k: v for k, v in first.items() if k != "run"} != shared_eval(r):
            raise ConfigError(
                f"runs.{run}.eval: differs from runs.{first['run']}.eval, which evaluates the same "
                "model on the same eval set; give both the same eval settings"
            )
    return evals


# ----------------------------------------------------------------------------- common


def as_json(value: Any) -> str:
    """A config value as compact JSON for a script's --spec argument."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def download_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A dataset's entry as its download reads it (its parts are its tokenization's, its
    stated size the plan's)."""
    return {k: v for k, v in spec.items() if k not in ("parts", "size")}


def local_source(spec: dict[str, Any]) -> dict[str, str]:
    """A local model's or dataset's path as an input (so a rule can make it), none for the
    Hub."""
    return {"source": spec["path"]} if spec["source"] == "local" else {}


# ----------------------------------------------------------------------------- data


def tokenize_inputs(spec: dict[str, Any]) -> dict[str, Any]:
    """Downloaded sources, model directory and chat template of a tokenized copy."""
    inputs: dict[str, Any] = {
        "data": [f"resources/datasets/{s['name']}/data.parquet" for s in spec["sources"]],
        "model": f"resources/models/{spec['model']}",
    }
    if spec["chat_template"]:
        inputs["template"] = spec["chat_template"]["path"]
    inputs |= {"removed": removed_path(spec["clean"])} if "clean" in spec else {}
    return inputs


def tokenized(config: dict[str, Any], run: str, eval_set: bool = False) -> str:
    """The tokenized copy a run trains on (or, ``eval_set``, evaluates on)."""
    spec = (run_eval_tokenize_spec if eval_set else run_tokenize_spec)(config, run)
    return tokenized_set(spec)


def tokenized_set(spec: dict[str, Any]) -> str:
    """The path a tokenize spec's set is read by: its one file, or the index of its parts
    (snaketune.core.parts)."""
    from snaketune.core.parts import INDEX

    name = INDEX if spec.get("parts", 1) > 1 else "data.parquet"
    return f"results/tokenized/{tokenize_key(spec)}/{name}"


def tokenized_set_exists(spec: dict[str, Any]) -> bool:
    """Whether a tokenize spec's set is made, in its number of parts."""
    from snaketune.core.parts import exists, files

    return exists(tokenized_set(spec)) and (
        spec.get("parts", 1) == 1 or len(files(tokenized_set(spec))) == spec["parts"]
    )


def part_paths(spec: dict[str, Any]) -> list[str]:
    """The part files of a tokenize spec's set in parts."""
    from snaketune.core.parts import part_files

    return [f"results/tokenized/{tokenize_key(spec)}/{f}" for f in part_files(spec["parts"])]


def parts_notes(jobs: dict[str, dict[str, Any]]) -> list[str]:
    """A line for each tokenized set already made in another number of parts than its
    dataset now asks for (it is made again; the old files stay)."""
    from snaketune.core.parts import finished_parts

    out = []
    for key, spec in jobs.items():
        made, now = finished_parts(Path("results/tokenized") / key), spec.get("parts", 1)
        if made is not None and made != now and not tokenized_set_exists(spec):
            out.append(
                f"datasets.{spec['dataset']}: tokenized in {made} part(s) before, {now} now: "
                f"results/tokenized/{key} is tokenized again in {now}"
            )
    return out


def shard_job(config: dict[str, Any], run: str) -> dict[str, Any]:
    """Everything rule shard_dataset's output depends on, for ``run``: its inputs (the
    tokenized copy, the base model's directory for its tokenizer and packing support, the
    eval set so an overlap is refused before training) and its arguments. The layout is
    named: Snakemake compares a rule's params as values without their names, so nodes 2 /
    accumulation 1 and nodes 1 / accumulation 2 would otherwise look the same."""
    r = config["runs"][run]
    # examples per micro batch: a method may make several rows of one (GRPO: a prompt's
    # num_generations completions)
    micro = r["micro_batch_size"] // method_of(r).rows_per_example(r)
    inputs = {"tokenized": tokenized(config, run), "model": f"resources/models/{r['model']}"}
    if "eval_dataset" in r:
        inputs["eval"] = tokenized(config, run, eval_set=True)
    return {
        "inputs": inputs,
        "layout": (
            f"--nodes {r['nodes']} --gpus-per-node {r['gpus_per_node']}"
            f" --micro-batch-size {micro}"
            f" --gradient-accumulation-steps {r['gradient_accumulation_steps']}"
            f" --seed {r['seed']}"
            # only where set: a run without it keeps its params (no rerun of its shards)
            + (f" --sequence-parallel {sp}" if (sp := r.get("sequence_parallel", 1)) > 1 else "")
        ),
        "packing": ("--packing" if RunSpec.of(r).balances_tokens else "--no-packing")
        # packing: auto pads a model that cannot be packed (its train job says so): no refusal
        + (" --pads-unpackable" if r["packing"] == "auto" else ""),
        "attention": r["attn_implementation"],
    }


def shards_of(config: dict[str, Any], sweeps: dict[str, list[str]], run: str) -> str:
    """The shards a run trains on: its own, or, for a sweep's member, those of the first
    member with the same shard job (a sweep over the learning rate or the LoRA rank shards
    once)."""
    r = config["runs"][run]
    if "sweep_of" in r:
        mine = shard_job(config, run)
        for member in sweeps[r["sweep_of"]["run"]]:
            if shard_job(config, member) == mine:
                return f"results/{member}/shards"
    return f"results/{run}/shards"


# ----------------------------------------------------------------------------- train


def flag_of(inputs: Any, key: str) -> str:
    """``--<key> <path>`` for an optional input a rule may have (its script's flag), or ""."""
    # a rule's input is a list of paths with names: `in` alone would look among the paths
    return f"--{key} {inputs[key]}" if key in inputs.keys() else ""  # noqa: SIM118


# ----------------------------------------------------------------------------- export


def export_kind(run: dict[str, Any]) -> str:
    """Where convert_checkpoint writes a run: hf/ (full) or lora_adapters/ (LoRA)."""
    return "lora_adapters" if RunSpec.of(run).trains_lora else "hf"


def check_export(config: dict[str, Any], run: str, export: str) -> dict:
    """No extra inputs for convert_checkpoint; refuses the export directory of the other
    method (ValueError: Snakemake names the target)."""
    kind = export_kind(config["runs"][run])
    if export != kind:
        raise ValueError(f"results/{run}/{export}: run {run} makes results/{run}/{kind}")
    return {}


def final_model(config: dict[str, Any], run: str) -> str:
    """The model a run ends with: the merged model (LoRA) or the converted one (full)."""
    return f"results/{run}/{RunSpec.of(config['runs'][run]).final_model}"


# ----------------------------------------------------------------------------- evaluate


def base_metrics(config: dict[str, Any], run: str, start: Callable[[], str]) -> str:
    """What a run's evaluation is compared with: its base model's evaluation; or (init_from)
    the evaluation of the run it started from (``start()``: its name, a sweep's best member
    once chosen), or, where that run was scored on another eval set or otherwise, the
    starting model's own evaluation (rule evaluate_start; a reward model's, always)."""
    if evaluates_its_start(config, run):
        return f"results/{run}/start_eval/metrics.json"
    if "init_from" not in config["runs"][run]:
        return f"results/base_eval/{tokenize_key(run_eval_tokenize_spec(config, run))}/metrics.json"
    return f"results/{start()}/eval/metrics.json"
