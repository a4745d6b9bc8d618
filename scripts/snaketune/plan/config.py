"""Validate a snaketune config: the JSON Schema first (snaketune.plan.schema, defaults filled),
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

from snaketune.core.errors import Collect, ConfigError, require
from snaketune.core.heldout import check_run as check_heldout
from snaketune.data import sequence
from snaketune.data.formats import FORMAT_FIELDS, SINGLE_DATASET_KEYS, components, has_pictures
from snaketune.data.kernels import check_kernels_installed
from snaketune.data.kinds import kind_named, mixes_kinds, own_fields, unread
from snaketune.evaluation import scorers
from snaketune.methods import compose_schema, method_of, methods, reward_model_runs
from snaketune.plan.clean import check as clean_problems
from snaketune.plan.references import check_references
from snaketune.plan.runspec import RunSpec
from snaketune.plan.schema import (
    WORKFLOW_ROOT,
    check_sweep_publish,
    load_schema,
    load_yaml,
    schema_problems,
)

PRESET_DIR = Path("config/deepspeed")


def _check_source(kind: str, name: str, spec: Mapping[str, Any], hub_keys: set[str]) -> None:
    where = f"{kind}.{name}"
    src = spec["source"]
    if src == "hub":
        require("id" in spec, f"{where}: source hub needs an `id` (e.g. org/name)")
        require(
            "path" not in spec,
            f"{where}.path: only for source local; remove it or set source: local",
        )
    elif src == "local":
        require("path" in spec, f"{where}: source local needs a `path`")
        for key in sorted(hub_keys & set(spec)):
            raise ConfigError(f"{where}.{key}: only for source hub; remove it or set source: hub")


def _check_dataset(name: str, spec: Mapping[str, Any], datasets: Mapping[str, Any]) -> None:
    where = f"datasets.{name}"
    if spec["source"] == "mixture":
        require("mixture" in spec, f"{where}: source mixture needs a `mixture` list of datasets")
        for key in SINGLE_DATASET_KEYS:
            require(
                key not in spec, f"{where}.{key}: not used by a mixture (its components set it)"
            )
        for i, comp in enumerate(spec["mixture"]):
            other = comp["dataset"]
            require(
                other in datasets,
                f"{where}.mixture.{i}.dataset: unknown dataset {other!r} "
                f"(defined: {', '.join(sorted(datasets))})",
            )
            require(
                datasets[other].get("source") != "mixture",
                f"{where}.mixture.{i}.dataset: {other!r} is itself a mixture; list its components",
            )
        mixed = mixes_kinds([datasets[c["dataset"]].get("format") for c in spec["mixture"]])
        require(mixed is None, f"{where}.mixture: {mixed}")
        return
    require("mixture" not in spec, f"{where}.mixture: only for source mixture")
    require("seed" not in spec, f"{where}.seed: only for source mixture")
    _check_source("datasets", name, spec, {"id", "files", "subset", "split", "revision"})
    for key in ("subset", "split"):
        require(
            not ("files" in spec and key in spec),
            f"{where}.{key}: not used with `files` (the files chosen are the rows); remove one",
        )
    require(
        "file_format" not in spec or spec["source"] == "local",
        f"{where}.file_format: only for source local",
    )
    require(
        "format" in spec,
        f"{where}: missing required key 'format' (one of {sorted(FORMAT_FIELDS)})",
    )
    fields = [*FORMAT_FIELDS[spec["format"]], *own_fields(spec["format"])]
    for key in spec.get("columns", {}):
        require(
            key in fields,
            f"{where}.columns.{key}: not a field of format {spec['format']!r} "
            f"(fields: {', '.join(fields)})",
        )
    require(
        spec["format"] != "messages" or "system_prompt" not in spec,
        f"{where}.system_prompt: not used by format messages (put a system turn in the data)",
    )
    require(
        spec["format"] != "text" or "system_prompt" not in spec,
        f"{where}.system_prompt: not used by format text (documents have no turns); remove it",
    )
    for i, flt in enumerate(spec.get("filters", [])):
        listy = isinstance(flt["value"], list)
        require(
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
    require(
        path.is_file(),
        f"{where}: {value!r} is neither a preset ({', '.join(presets)}) nor an existing JSON file",
    )
    try:
        ds = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: {path} is not valid JSON ({exc})") from exc
    require(isinstance(ds, dict), f"{where}: {path} must hold a JSON object")


def _named(names: list[str]) -> str:
    return f"method {names[0]}" if len(names) == 1 else f"methods {', '.join(names)}"


def _check_method(name: str, run: Mapping[str, Any], cfg: Mapping[str, Any]) -> None:
    """What the run's method allows (its own block and no other method's, a `lora` block
    where it can train an adapter, init_from where it starts from runs, the data kind it
    trains on), then the method's own checks."""
    where, method, every = f"runs.{name}", method_of(run), methods()
    split = sequence.check_run(where, run, method.splits_sequences)
    require(split is None, split or "")
    for block in {m.block for m in every.values() if m.block and m.block != method.block}:
        owners = [n for n, m in every.items() if m.block == block]
        require(
            block not in run,
            f"{where}.{block}: only for {_named(owners)}; remove it or set method: {owners[0]}",
        )
    adapters = [n for n, m in every.items() if m.adapter == "lora"]
    require(
        method.adapter != "full" or "lora" not in run,
        f"{where}.lora: only for method {adapters[0]} (or "
        f"{', '.join(n for n, m in every.items() if m.adapter == 'optional')}); remove it "
        f"or set method: {adapters[0]}",
    )
    require(
        method.adapter_of(run) == "lora" or run["export"]["merged"],
        f"{where}.export.merged: false keeps a LoRA run's adapter as its model; this run "
        "trains every weight (its converted model is the model): remove the key",
    )
    starters = [n for n, m in every.items() if m.starts_from_runs]
    require(
        "init_from" not in run or method.starts_from_runs,
        f"{where}.init_from: only for {_named(starters)} (a run of method "
        f"{run['method']} starts from `model`)",
    )
    kind = kind_named(method.trains_on)
    for key in ("dataset", "eval_dataset"):
        allowed = kind.formats if key == "dataset" else kind.evaluates_on
        for part in (c["name"] for c in components(cfg, run[key])) if key in run else ():
            fmt = cfg["datasets"][part]["format"]
            readers = [n for n, m in every.items() if fmt in kind_named(m.trains_on).formats]
            require(
                allowed is None or fmt in allowed,
                unread(f"{where}.{key}", part, fmt, run["method"], kind, readers),
            )
            pictures = [n for n in readers if every[n].takes_pictures]
            require(
                method.takes_pictures or not has_pictures(cfg, part),
                f"{where}.{key}: {part!r} holds pictures (columns.images), which method "
                f"{run['method']} does not train on; set method: {' or '.join(pictures)}",
            )
    method.check(where, run, cfg)
    scorers.check(where, run, cfg, method.writes_text, reward_model_runs(cfg["runs"]))


def _check_run(name: str, run: Mapping[str, Any], cfg: Mapping[str, Any], root: Path) -> None:
    where = f"runs.{name}"
    require(
        ("epochs" in run) != ("max_steps" in run),
        f"{where}: give exactly one of `epochs` and `max_steps`",
    )
    require(
        run.get("eval_dataset") != run["dataset"],
        f"{where}.eval_dataset: must differ from the training dataset {run['dataset']!r} "
        "(evaluate on held-out data)",
    )
    _check_quantize(name, run, root)
    problem = check_heldout(where, run)
    require(problem is None, problem or "")
    _check_method(name, run, cfg)
    lm_eval = run.get("eval", {}).get("lm_eval")
    if lm_eval and "include_path" in lm_eval:
        from snaketune.evaluation.lmeval import resolve_include_path

        found = resolve_include_path(lm_eval["include_path"], root)
        require(
            found is not None,
            f"{where}.eval.lm_eval.include_path: {lm_eval['include_path']} is not a directory "
            f"(looked in {Path.cwd()} and {root}); point it at your task YAMLs",
        )
        lm_eval["include_path"] = str(found)
    targets = (run.get("lora") or {}).get("target_modules")
    require(
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
    from snaketune.core.qlora import missing_bitsandbytes

    where = f"runs.{name}.lora.quantize"
    if not RunSpec.of(run).quantized:
        return
    require(
        method_of(run).adapter != "full",
        f"{where}: a 4-bit base is frozen, so only an adapter can train on it; a full "
        "fine-tune needs the weights in full precision (set method: lora, or drop quantize)",
    )
    _check_deepspeed(name, run["deepspeed"], root)
    ds = json.loads(resolve_deepspeed(run["deepspeed"], root).read_text(encoding="utf-8"))
    zero = ds.get("zero_optimization") or {}
    offloaded = [
        k
        for k in ("offload_optimizer", "offload_param")
        if (zero.get(k) or {}).get("device", "none") != "none"
    ]
    require(
        not offloaded,
        f"{where}: 4bit with DeepSpeed offload ({run['deepspeed']}: "
        f"{', '.join(offloaded)}) is not supported; a 4-bit base needs none: use deepspeed: "
        "zero2, or zero3 to shard the 4-bit base too",
    )
    missing = missing_bitsandbytes()
    require(missing is None, f"{where}: {missing}")


def _check_model(name: str, spec: Mapping[str, Any]) -> None:
    _check_source("models", name, spec, {"id", "revision"})
    template = spec.get("chat_template")
    require(
        template is None or Path(template).is_file(),
        f"models.{name}.chat_template: file {template!r} not found "
        "(relative paths start from the working directory)",
    )


def validate_config(config: dict[str, Any], root: str | Path = WORKFLOW_ROOT) -> dict[str, Any]:
    """Validate ``config`` in place (filling defaults) and return it.

    ``root``: the workflow directory (config/deepspeed/). Raises ConfigError naming every
    problem at once (a line each): the schema's, then the cross-key checks of every model,
    dataset and run it let through (an entry it refused, or a run using one, is not checked
    further: its own line names it)."""
    from snaketune.plan.sweep import expand_sweeps, resolve_init

    root = Path(root)
    schema = compose_schema(load_schema(root))  # each method's keys put in
    expand_sweeps(config, schema)  # a run with `sweep` becomes its members
    problems = schema_problems(config, schema)
    found = Collect()
    found.lines += [line for _, line in problems]
    if not isinstance(config, dict) or not all(
        isinstance(config.get(k), dict) for k in ("models", "datasets", "runs")
    ):
        found.raise_all()
    bad = {path[:2] for path, _ in problems if len(path) >= 2}
    # every run's unknown names, a refused run's too (its init_from: resolve_init says a
    # usable run's), in this one pass
    unknown = set()
    for name, run in config["runs"].items():
        if isinstance(run, dict):
            lines = check_references(name, run, config)
            if ("runs", name) not in bad:
                lines = [line for line in lines if ".init_from: " not in line]
            found.lines += lines
            unknown |= {("runs", name)} if lines else set()
    found.check(check_sweep_publish, config, schema)
    for name, spec in config["models"].items():
        if ("models", name) not in bad:
            found.check(_check_model, name, spec)
    for name, spec in config["datasets"].items():
        if ("datasets", name) not in bad:
            found.check(_check_dataset, name, spec, config["datasets"])
            found.lines += clean_problems(config, f"datasets.{name}", name, spec)
    bad |= {("datasets", d) for d in _mixtures_of(config, bad)}
    init_lines, unresolved = resolve_init(config, {n for kind, n in bad if kind == "runs"})
    found.lines += init_lines
    bad |= {("runs", n) for n in unresolved} | unknown
    good = {n: r for n, r in config["runs"].items() if _usable(n, r, bad, config)}
    for run in good.values():
        method = method_of(run)
        if not method.packs or has_pictures(config, run["dataset"]):
            run["packing"] = False  # e.g. DPO's padded pairs, GRPO's rollouts, pictures
        if method.block and method.block not in run:
            run[method.block] = {}  # a method block left out: its defaults
    _fill_defaults(config, schema, found)
    for name, run in good.items():
        found.check(_check_run, name, run, config, root)
        if method_of(run).adapter == "lora" and "lora" not in run:
            run["lora"] = {}  # where the method always trains an adapter: the LoRA defaults
    _fill_defaults(config, schema, found)
    found.raise_all()
    return config


def _fill_defaults(config: dict[str, Any], schema: Mapping[str, Any], found: Collect) -> None:
    """The schema again, filling the defaults of blocks just put in (a problem it names
    again is not repeated)."""
    found.lines += [line for _, line in schema_problems(config, schema) if line not in found.lines]


def _mixtures_of(config: Mapping[str, Any], bad: set[tuple]) -> list[str]:
    """The mixtures that take a component the schema refused."""
    return [
        name
        for name, spec in config["datasets"].items()
        if isinstance(spec, dict)
        and any(("datasets", c.get("dataset")) in bad for c in spec.get("mixture") or ())
    ]


def _usable(name: str, run: Any, bad: set[tuple], config: Mapping[str, Any]) -> bool:
    """A run the cross-key checks can read: the schema let it and what it uses through."""
    if ("runs", name) in bad or not isinstance(run, dict):
        return False
    uses = [("models", run.get("model"))]
    uses += [("datasets", run[k]) for k in ("dataset", "eval_dataset") if k in run]
    return not any(u in bad for u in uses)


def check_local_sources(config: Mapping[str, Any], producible: set[str]) -> None:
    """Local model and dataset paths exist (or a rule makes them: ``producible``, paths as
    written in the workflow), and a local model directory holds a config.json. Every
    problem at once (ConfigProblems).

    Run where the jobs will run (the working directory); relative paths start there.
    """
    made = {str(Path(p)) for p in producible}
    found = Collect()
    for kind in ("models", "datasets"):
        for name, spec in (config.get(kind) or {}).items():
            if (
                not isinstance(spec, dict)
                or spec.get("source") != "local"
                or not isinstance(spec.get("path"), str)
            ):
                continue  # (the schema's line names it)
            if str(Path(spec["path"])) in made:
                continue
            found.check(_check_local_path, kind, name, Path(spec["path"]))
    found.raise_all()


def _check_local_path(kind: str, name: str, path: Path) -> None:
    where = f"{kind}.{name}.path"
    require(
        path.exists(),
        f"{where}: {path} does not exist (relative paths start from {Path.cwd()}); fix the path",
    )
    if kind == "models":
        require(
            (path / "config.json").is_file(),
            f"{where}: {path} has no config.json; point it at a Hugging Face model "
            "directory (config.json, tokenizer files, weights)",
        )
    elif path.is_file():
        require(
            path.stat().st_size > 0,
            f"{where}: {path} is empty (0 bytes); give a file with at least one row",
        )


def load_config(path: str | Path, root: str | Path = WORKFLOW_ROOT) -> dict[str, Any]:
    """Read and validate a config file."""
    return validate_config(load_yaml(path), root)
