"""Validate a snaketune config: the JSON Schema first (snaketune.schema, defaults filled),
then the checks a schema cannot express (keys that depend on each other, runs that start
from others, local paths, DeepSpeed files), every bad entry named at once.

Errors name the key path and the fix, on one line, e.g.::

    runs.demo.method: 'lorra' is not one of ['lora', 'full']
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from snaketune.errors import ConfigError, ConfigProblems
from snaketune.heldout import check_run as check_heldout
from snaketune.packing import check_kernels_installed
from snaketune.schema import (
    WORKFLOW_ROOT,
    check_schema,
    check_sweep_publish,
    load_schema,
    load_yaml,
)
from snaketune.vocabulary import (
    ADAPTER_OPTIONAL,
    FORMAT_FIELDS,
    PAIR_FORMATS,
    SINGLE_DATASET_KEYS,
    components,
)

PRESET_DIR = Path("config/deepspeed")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


class _Collect:
    """Runs checks of independent entries, keeping each one's problem, so that one pass
    names every bad entry (``raise_all`` at the end)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def check(self, func: Any, *args: Any) -> None:
        try:
            func(*args)
        except ConfigProblems as exc:
            self.lines += exc.lines
        except ConfigError as exc:
            self.lines.append(str(exc))

    def raise_all(self) -> None:
        if self.lines:
            raise ConfigProblems(self.lines)


def _check_source(kind: str, name: str, spec: Mapping[str, Any], hub_keys: set[str]) -> None:
    where = f"{kind}.{name}"
    src = spec["source"]
    if src == "hub":
        _require("id" in spec, f"{where}: source hub needs an `id` (e.g. org/name)")
        _require(
            "path" not in spec,
            f"{where}.path: only for source local; remove it or set source: local",
        )
    elif src == "local":
        _require("path" in spec, f"{where}: source local needs a `path`")
        for key in sorted(hub_keys & set(spec)):
            raise ConfigError(f"{where}.{key}: only for source hub; remove it or set source: hub")


def _check_dataset(name: str, spec: Mapping[str, Any], datasets: Mapping[str, Any]) -> None:
    where = f"datasets.{name}"
    if spec["source"] == "mixture":
        _require("mixture" in spec, f"{where}: source mixture needs a `mixture` list of datasets")
        for key in SINGLE_DATASET_KEYS:
            _require(
                key not in spec, f"{where}.{key}: not used by a mixture (its components set it)"
            )
        for i, comp in enumerate(spec["mixture"]):
            other = comp["dataset"]
            _require(
                other in datasets,
                f"{where}.mixture.{i}.dataset: unknown dataset {other!r} "
                f"(defined: {', '.join(sorted(datasets))})",
            )
            _require(
                datasets[other]["source"] != "mixture",
                f"{where}.mixture.{i}.dataset: {other!r} is itself a mixture; list its components",
            )
        kinds = {datasets[c["dataset"]].get("format") in PAIR_FORMATS for c in spec["mixture"]}
        _require(len(kinds) == 1, f"{where}.mixture: mixes preference pairs with other formats; "
                 "a mixture is all preference datasets (method dpo) or none")  # fmt: skip
        return
    _require("mixture" not in spec, f"{where}.mixture: only for source mixture")
    _require("seed" not in spec, f"{where}.seed: only for source mixture")
    _check_source("datasets", name, spec, {"id", "subset", "split", "revision"})
    _require(
        "file_format" not in spec or spec["source"] == "local",
        f"{where}.file_format: only for source local",
    )
    _require(
        "format" in spec,
        f"{where}: missing required key 'format' (one of {sorted(FORMAT_FIELDS)})",
    )
    fields = FORMAT_FIELDS[spec["format"]]
    for key in spec.get("columns", {}):
        _require(
            key in fields,
            f"{where}.columns.{key}: not a field of format {spec['format']!r} "
            f"(fields: {', '.join(fields)})",
        )
    _require(
        spec["format"] != "messages" or "system_prompt" not in spec,
        f"{where}.system_prompt: not used by format messages (put a system turn in the data)",
    )
    for i, flt in enumerate(spec.get("filters", [])):
        listy = isinstance(flt["value"], list)
        _require(
            listy == (flt["op"] in ("in", "not_in")),
            f"{where}.filters.{i}.value: op {flt['op']!r} needs "
            f"{'a list' if not listy else 'a single value'}",
        )


def resolve_deepspeed(value: str, root: Path) -> Path:
    """Path of a DeepSpeed preset (config/deepspeed/ under the workflow ``root``) or of a
    JSON file (relative to the working directory)."""
    preset = root / PRESET_DIR / f"{value}.json"
    return preset if preset.is_file() else Path(value)


def _check_deepspeed(run: str, value: str, root: Path) -> None:
    presets = sorted(p.stem for p in (root / PRESET_DIR).glob("*.json"))
    path = resolve_deepspeed(value, root)
    where = f"runs.{run}.deepspeed"
    _require(
        path.is_file(),
        f"{where}: {value!r} is neither a preset ({', '.join(presets)}) nor an existing JSON file",
    )
    try:
        ds = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: {path} is not valid JSON ({exc})") from exc
    _require(isinstance(ds, dict), f"{where}: {path} must hold a JSON object")


def _check_grpo(name: str, run: Mapping[str, Any], cfg: Mapping[str, Any]) -> None:
    where = f"runs.{name}"
    if run["method"] != "grpo":
        _require(
            "grpo" not in run, f"{where}.grpo: only for method grpo; remove it or set method: grpo"
        )
        _require(
            "init_from" not in run or run["method"] in ADAPTER_OPTIONAL,
            f"{where}.init_from: only for methods grpo and dpo (an SFT run starts from `model`)",
        )
        return
    grpo = run["grpo"]
    _require(
        run["micro_batch_size"] % grpo["num_generations"] == 0,
        f"{where}.grpo.num_generations: {grpo['num_generations']} does not divide "
        f"micro_batch_size {run['micro_batch_size']} (each device generates whole groups); "
        "make micro_batch_size a multiple of it",
    )
    for part in (c["name"] for c in components(cfg, run["dataset"])):
        fmt = cfg["datasets"][part]["format"]
        _require(
            fmt in ("prompt_response", "alpaca"),
            f"{where}.dataset: {part!r} (format {fmt}) gives no reference answers for the GRPO "
            "rewards; use a prompt_response dataset (columns.response: the answer) or alpaca",
        )


def _check_dpo(name: str, run: Mapping[str, Any], cfg: Mapping[str, Any]) -> None:
    """A dpo block only on a dpo run; a dpo run trains on preference pairs (and evaluates
    on them, or on any held-out set); its loss weights match its losses."""
    where = f"runs.{name}"
    if run["method"] != "dpo":
        _require("dpo" not in run,
                 f"{where}.dpo: only for method dpo; remove it or set method: dpo")  # fmt: skip
    for key in ("dataset", "eval_dataset"):
        if key not in run:
            continue
        for part in (c["name"] for c in components(cfg, run[key])):
            fmt = cfg["datasets"][part]["format"]
            pairs = fmt in PAIR_FORMATS
            if run["method"] == "dpo" and key == "dataset":
                _require(pairs, f"{where}.dataset: {part!r} (format {fmt}) has no pairs to "
                         "tune on; method dpo needs a dataset of format preference (prompt, "
                         "chosen, rejected)")  # fmt: skip
            elif run["method"] != "dpo":
                _require(not pairs, f"{where}.{key}: {part!r} is a preference dataset (pairs), "
                         f"which only method dpo trains and evaluates on; set method: dpo or "
                         "use a dataset of another format")  # fmt: skip
    if run["method"] != "dpo":
        return
    dpo = run["dpo"]
    losses = dpo["loss_type"] if isinstance(dpo["loss_type"], list) else [dpo["loss_type"]]
    weights = dpo.get("loss_weights")
    _require(weights is None or len(weights) == len(losses),
             f"{where}.dpo.loss_weights: {len(weights or [])} weights for {len(losses)} loss "
             "types; give one weight per loss in loss_type")  # fmt: skip
    _require("exo_pair" not in losses or dpo["label_smoothing"] > 0,
             f"{where}.dpo.label_smoothing: loss exo_pair needs label_smoothing > 0 (the EXO "
             "paper uses 1e-3)")  # fmt: skip


def init_parents(config: Mapping[str, Any], name: str) -> list[str]:
    """The runs a run with ``init_from`` may start from: the run it names, or every member
    of the sweep it names (the best one is chosen once the sweep is evaluated)."""
    from snaketune.sweep import sweeps_of

    parent = config["runs"][name]["init_from"]
    return sweeps_of(config["runs"]).get(parent) or [parent]


def _resolve_init(config: dict[str, Any]) -> None:
    """Fill `model` of each run with `init_from` from the run (or sweep) it starts from,
    following chains; refuse an unknown run, a chain that loops, and a sweep whose members
    would hand on different base models or model kinds."""
    from snaketune.sweep import sweeps_of

    runs, sweeps = config["runs"], sweeps_of(config["runs"])
    for name, run in runs.items():
        where = f"runs.{name}"
        if "init_from" not in run:
            _require("model" in run, f"{where}: missing required key 'model'")
            continue
        _require("model" not in run,
                 f"{where}: give one of `model` and `init_from`, not both (init_from's model "
                 "is the base)")  # fmt: skip
        chain, current = [name], run
        while "init_from" in current:
            parent = current["init_from"]
            _require(
                parent in runs or parent in sweeps,
                f"{where}.init_from: unknown run or sweep {parent!r} (defined: "
                f"{', '.join(sorted([*runs, *sweeps]))})",
            )
            _require(
                parent not in chain,
                f"{where}.init_from: the runs start from each other in a loop "
                f"({' -> '.join([*chain, parent])}); one of them must start from a `model`",
            )
            chain.append(parent)
            members = [runs[m] for m in sweeps.get(parent, [parent])]
            for key, what in (("model", "base model"), ("method", "method")):
                values = {str(m.get(key)) for m in members if "init_from" not in m}
                _require(
                    len(values) <= 1,
                    f"{where}.init_from: the members of sweep {parent!r} differ in their {what} "
                    f"({', '.join(sorted(values))}); start from one member, or sweep a key "
                    "that keeps it",
                )
            current = members[0]
        run["model"] = current.get("model")  # the chain's first run's (none: refused there)


def _check_run(name: str, run: Mapping[str, Any], cfg: Mapping[str, Any], root: Path) -> None:
    where = f"runs.{name}"
    for key, section in (
        ("model", "models"),
        ("dataset", "datasets"),
        ("eval_dataset", "datasets"),
    ):
        if key in run:
            _require(
                run[key] in cfg[section],
                f"{where}.{key}: unknown {section[:-1]} {run[key]!r} "
                f"(defined: {', '.join(sorted(cfg[section]))})",
            )
    _require(
        ("epochs" in run) != ("max_steps" in run),
        f"{where}: give exactly one of `epochs` and `max_steps`",
    )
    _require(
        run.get("eval_dataset") != run["dataset"],
        f"{where}.eval_dataset: must differ from the training dataset {run['dataset']!r} "
        "(evaluate on held-out data)",
    )
    _check_quantize(name, run, root)
    problem = check_heldout(where, run)
    _require(problem is None, problem or "")
    _require(
        run["method"] == "lora" or run["method"] in ADAPTER_OPTIONAL or "lora" not in run,
        f"{where}.lora: only for method lora (or grpo, dpo); remove it or set method: lora",
    )
    _check_grpo(name, run, cfg)
    _check_dpo(name, run, cfg)
    lm_eval = run.get("eval", {}).get("lm_eval")
    if lm_eval and "include_path" in lm_eval:
        from snaketune.lmeval import resolve_include_path

        found = resolve_include_path(lm_eval["include_path"], root)
        _require(
            found is not None,
            f"{where}.eval.lm_eval.include_path: {lm_eval['include_path']} is not a directory "
            f"(looked in {Path.cwd()} and {root}); point it at your task YAMLs",
        )
        lm_eval["include_path"] = str(found)
    targets = (run.get("lora") or {}).get("target_modules")
    _require(
        not (isinstance(targets, list) and "lm_head" in targets),
        f"{where}.lora.target_modules: lm_head cannot take a LoRA adapter (TRL computes the "
        "loss from its weight, so the adapter would never train); move it to "
        "lora.modules_to_save to train it in full",
    )
    _check_deepspeed(name, run["deepspeed"], root)
    check_kernels_installed(where, run)


def _check_quantize(name: str, run: Mapping[str, Any], root: Path) -> None:
    """A 4-bit base (lora.quantize): a LoRA update, DeepSpeed without offload (tested: ZeRO
    1-3; a 4-bit base needs no offload, and DeepSpeed would page its packed weights), and
    bitsandbytes installed."""
    from snaketune.qlora import missing_bitsandbytes

    where = f"runs.{name}.lora.quantize"
    if (run.get("lora") or {}).get("quantize", "none") == "none":
        return
    _require(
        run["method"] != "full",
        f"{where}: a 4-bit base is frozen, so only an adapter can train on it; a full "
        "fine-tune needs the weights in full precision (set method: lora, or drop quantize)",
    )
    _check_deepspeed(name, run["deepspeed"], root)
    ds = json.loads(resolve_deepspeed(run["deepspeed"], root).read_text(encoding="utf-8"))
    zero = ds.get("zero_optimization") or {}
    offloaded = [k for k in ("offload_optimizer", "offload_param")
                 if (zero.get(k) or {}).get("device", "none") != "none"]  # fmt: skip
    _require(
        not offloaded,
        f"{where}: 4bit with DeepSpeed offload ({run['deepspeed']}: "
        f"{', '.join(offloaded)}) is not supported; a 4-bit base needs none: use deepspeed: "
        "zero2, or zero3 to shard the 4-bit base too",
    )
    missing = missing_bitsandbytes()
    _require(missing is None, f"{where}: {missing}")


def _check_model(name: str, spec: Mapping[str, Any]) -> None:
    _check_source("models", name, spec, {"id", "revision"})
    template = spec.get("chat_template")
    _require(
        template is None or Path(template).is_file(),
        f"models.{name}.chat_template: file {template!r} not found "
        "(relative paths start from the working directory)",
    )


def validate_config(config: dict[str, Any], root: str | Path = WORKFLOW_ROOT) -> dict[str, Any]:
    """Validate ``config`` in place (filling defaults) and return it.

    ``root`` is the workflow directory (where config/deepspeed/ lives). Raises ConfigError
    with a one-line message: the schema's first problem, or else every bad model, dataset
    and run at once (ConfigProblems, a line each).
    """
    from snaketune.sweep import expand_sweeps

    root = Path(root)
    schema = load_schema(root)
    expand_sweeps(config, schema)  # a run with `sweep` becomes its members
    check_schema(config, schema)
    check_sweep_publish(config, schema)
    found = _Collect()
    for name, spec in config["models"].items():
        found.check(_check_model, name, spec)
    for name, spec in config["datasets"].items():
        found.check(_check_dataset, name, spec, config["datasets"])
    found.raise_all()
    _resolve_init(config)
    for run in config["runs"].values():
        if run["method"] == "dpo":
            run["packing"] = False  # TRL's DPO batches are padded (snaketune.methods.dpo)
        if run["method"] == "grpo":
            run["packing"] = False  # GRPO plans prompts; its rollouts are padded batches
            if "grpo" not in run:
                run["grpo"] = {}
                check_schema(config, schema)  # fills the GRPO defaults
        if run["method"] == "dpo" and "dpo" not in run:
            run["dpo"] = {}
            check_schema(config, schema)  # fills the DPO defaults
    for name, run in config["runs"].items():
        found.check(_check_run, name, run, config, root)
        if run["method"] == "lora" and "lora" not in run:
            run["lora"] = {}
            check_schema(config, schema)  # fills the LoRA defaults
    found.raise_all()
    return config


def check_local_sources(config: Mapping[str, Any], producible: set[str]) -> None:
    """Local model and dataset paths exist (or a rule makes them: ``producible``, paths as
    written in the workflow), and a local model directory holds a config.json. Every
    problem at once (ConfigProblems).

    Run where the jobs will run (the working directory); relative paths start there.
    """
    made = {str(Path(p)) for p in producible}
    found = _Collect()
    for kind in ("models", "datasets"):
        for name, spec in config[kind].items():
            if spec["source"] != "local" or str(Path(spec["path"])) in made:
                continue
            found.check(_check_local_path, kind, name, Path(spec["path"]))
    found.raise_all()


def _check_local_path(kind: str, name: str, path: Path) -> None:
    where = f"{kind}.{name}.path"
    _require(
        path.exists(),
        f"{where}: {path} does not exist (relative paths start from {Path.cwd()}); fix the path",
    )
    if kind == "models":
        _require(
            (path / "config.json").is_file(),
            f"{where}: {path} has no config.json; point it at a Hugging Face model "
            "directory (config.json, tokenizer files, weights)",
        )
    elif path.is_file():
        _require(
            path.stat().st_size > 0,
            f"{where}: {path} is empty (0 bytes); give a file with at least one row",
        )


def load_config(path: str | Path, root: str | Path = WORKFLOW_ROOT) -> dict[str, Any]:
    """Read and validate a config file."""
    return validate_config(load_yaml(path), root)
