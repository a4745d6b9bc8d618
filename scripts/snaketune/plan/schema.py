"""The config's JSON Schema, read our way: YAML that refuses a key given twice, defaults
filled in while validating, numbers and booleans given as strings (``--config``) read as
such, and one line per error naming the key path, what is wrong and what is allowed.

Snakemake's own ``validate()`` is not used for this: its message prints the whole
failing schema; ours names the key path, the allowed values and the closest known key.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from snaketune.core.errors import ConfigError, ConfigProblems
from snaketune.core.io import yaml_safe_loader

SCHEMA_PATH = Path("workflow/schemas/config.schema.yaml")
SCALARS = ("integer", "number", "boolean")
# The workflow directory this library belongs to (scripts/snaketune/ -> the repository):
# where the schema and config/deepspeed/ are found when no other root is given.
WORKFLOW_ROOT = Path(__file__).resolve().parents[3]


class Quoted(str):
    """A number written in quotes in a config file (``epochs: "6"``): a string the schema
    does not read as a number, as it reads a number Snakemake's ``--config`` passes as text
    or PyYAML's ``1e-4`` (YAML 1.1 reads an exponent without a dot as a string)."""


# written back as the text it is (snaketune calibrate writes a config the user gave)
yaml.SafeDumper.add_representer(Quoted, yaml.representer.SafeRepresenter.represent_str)


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class _UniqueKeyLoader(yaml_safe_loader()):
    """A safe loader that refuses a key given twice in one mapping (plain YAML keeps the
    last one silently, so a second `runs: {demo: ...}` would replace the first), and marks a
    quoted number (Quoted)."""

    def construct_scalar(self, node):
        value = super().construct_scalar(node)
        if node.style in ("'", '"') and _number(value):
            return Quoted(value)
        return value

    def construct_mapping(self, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                mark = key_node.start_mark
                raise ConfigError(
                    f"{mark.name} line {mark.line + 1}: {key!r} is given twice "
                    "in the same mapping; names must be unique (rename or merge one of them)"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> Any:
    """Read a YAML file; a syntax error or a duplicated key becomes a one-line ConfigError."""
    try:
        with open(path, encoding="utf-8") as fh:
            return yaml.load(fh, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: file not found") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(
            f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})"
        ) from exc


def _coerce(value: str, kind: str) -> Any:
    """A string as the schema's scalar type, or the string itself when it is not one.

    Snakemake's ``--config runs={demo: {nodes: 4}}`` passes nested values as strings; a
    number quoted in a config file stays a string (Quoted), to be named.
    """
    if isinstance(value, Quoted):
        return value
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            return float(value)
        if kind == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
    except ValueError:
        pass
    return value


def _with_defaults(cls: type) -> type:
    """A validator class that also fills `default` values into the instance and reads
    numbers and booleans given as strings (from the command line)."""
    validate_properties = cls.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if not isinstance(sub, dict):
                    continue
                if "default" in sub:
                    instance.setdefault(name, copy.deepcopy(sub["default"]))
                if isinstance(instance.get(name), str) and sub.get("type") in SCALARS:
                    instance[name] = _coerce(instance[name], sub["type"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(cls, {"properties": set_defaults})


Validator = _with_defaults(jsonschema.Draft202012Validator)


def key_path(parts: Any) -> str:
    return ".".join(str(p) for p in parts) or "(top level)"


def _allowed_keys(schema: Mapping[str, Any]) -> list[str]:
    return sorted(schema.get("properties", {}))


def format_error(error: jsonschema.ValidationError) -> str:
    """One line: key path, what is wrong, what is allowed."""
    path = key_path(error.absolute_path)
    if "propertyNames" in error.absolute_schema_path:
        return (
            f"{path}: name {error.instance!r} is not a safe identifier "
            "(use letters, digits, '_' and '-', starting with a letter, at most 64 characters)"
        )
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        return unknown_keys(error)[0]
    if error.validator == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        return f"{path}: missing required key {missing!r}"
    if error.validator == "type" and isinstance(error.instance, Quoted):
        return (
            f"{path}: {str(error.instance)!r} is in quotes, so text, not a number; "
            f"write it without them ({error.absolute_path[-1]}: {error.instance})"
        )
    if error.validator in ("oneOf", "anyOf"):
        return (
            f"{path}: {error.instance!r} is not valid here ({error.schema.get('description', '')})"
        )
    return f"{path}: {error.message}"


def unknown_keys(error: jsonschema.ValidationError) -> list[str]:
    """A line per unknown key of an additionalProperties error, each with the closest
    allowed key."""
    path = key_path(error.absolute_path)
    allowed = _allowed_keys(error.schema)
    lines = []
    for key in sorted(k for k in error.instance if k not in allowed) or ["?"]:
        hint = difflib.get_close_matches(key, allowed, n=1)
        did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
        prefix = f"{path}.{key}" if error.absolute_path else key
        lines.append(f"{prefix}: unknown key{did_you_mean} (allowed: {', '.join(allowed)})")
    return lines


def _rank(error: jsonschema.ValidationError) -> tuple:
    """Shallowest first; at equal depth an unknown key first (a typo also explains the
    required key it leaves missing), then document order."""
    return (
        len(error.absolute_path),
        error.validator != "additionalProperties",
        [str(p) for p in error.absolute_path],
    )


def first_error(errors: Iterator[jsonschema.ValidationError]) -> jsonschema.ValidationError | None:
    """The error to report of one value: the first by ``_rank``."""
    errors = list(errors)
    return min(errors, key=_rank) if errors else None


def every_error(errors: Iterator[jsonschema.ValidationError]) -> list[jsonschema.ValidationError]:
    """One error per key path (the first by ``_rank``), in document order; a missing key is
    left out where an unknown key at the same place explains it (a typo)."""
    by_path: dict[tuple, list[jsonschema.ValidationError]] = {}
    for error in errors:
        by_path.setdefault(tuple(str(p) for p in error.absolute_path), []).append(error)
    return sorted((min(group, key=_rank) for group in by_path.values()), key=_rank)


def schema_problems(config: dict[str, Any], schema: Mapping[str, Any]) -> list[tuple[tuple, str]]:
    """Validate against the JSON Schema, filling defaults in place where the values hold:
    (key path, line) for every problem."""
    if not isinstance(config, dict):
        return [((), "config: the top level must be a mapping with models, datasets and runs")]
    found = []
    for error in every_error(Validator(schema).iter_errors(config)):
        unknown = error.validator == "additionalProperties" and isinstance(error.instance, dict)
        for line in unknown_keys(error) if unknown else [format_error(error)]:
            found.append((tuple(error.absolute_path), line))
    return found


def check_schema(config: dict[str, Any], schema: Mapping[str, Any]) -> None:
    """Validate against the JSON Schema and fill defaults in place; every problem at once
    (ConfigProblems, a line each)."""
    found = schema_problems(config, schema)
    if len(found) == 1:
        raise ConfigError(found[0][1])
    if found:
        raise ConfigProblems([line for _, line in found])


def load_schema(root: str | Path) -> Any:
    """The config's JSON Schema under the workflow directory ``root``."""
    path = Path(root) / SCHEMA_PATH
    if not path.is_file():
        raise ConfigError(
            f"{path}: file not found; give the workflow directory (the one holding "
            f"workflow/schemas/), e.g. --root {WORKFLOW_ROOT}"
        )
    return load_yaml(path)


def top_default(key: str, root: str | Path = WORKFLOW_ROOT) -> Any:
    """The schema's default of a top-level key (for a command run outside the workflow,
    e.g. scripts/train.py by hand: the code never restates a default)."""
    return load_schema(root)["properties"][key]["default"]


def run_default(key: str, root: str | Path = WORKFLOW_ROOT) -> Any:
    """The schema's default of a run's key (for a command run by hand)."""
    run = load_schema(root)["properties"]["runs"]["additionalProperties"]
    return run["properties"][key]["default"]


def check_config_files(paths: list[str | Path], schema: Mapping[str, Any]) -> list[str]:
    """Re-read the config files Snakemake loaded, to catch what its loader lets through: a
    key given twice (raised), and a line per number in quotes where the schema takes a
    number (Snakemake's loader gives it as the text ``--config`` gives, which it reads)."""
    quoted = []
    for path in paths:
        if Path(path).suffix in (".yaml", ".yml"):
            content = load_yaml(path)  # one file of maybe several: only its quoted numbers
            quoted += [
                format_error(e)
                for e in Validator(schema).iter_errors(content)
                if e.validator == "type" and isinstance(e.instance, Quoted)
            ]
    return quoted


def check_sweep_publish(config: dict[str, Any], schema: Mapping[str, Any]) -> None:
    """A sweep's `publish` (kept in its members' sweep_of: the best member is published)
    against the run schema's `publish`, defaults filled."""
    sub = schema["properties"]["runs"]["additionalProperties"]["properties"]["publish"]
    for run in config["runs"].values():
        settings = (run.get("sweep_of") or {}).get("publish")
        if settings is None:
            continue
        error = first_error(Validator(sub).iter_errors(settings))
        if error is not None:
            where = key_path(["runs", run["sweep_of"]["run"], "publish", *error.absolute_path])
            raise ConfigError(f"{where}: {error.message}")
