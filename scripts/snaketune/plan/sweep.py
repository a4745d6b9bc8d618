"""Sweeps: one run with ``sweep`` becomes a run per combination of the swept values.

    runs:
      demo:
        ...
        sweep: {learning_rate: [0.003, 0.006], lora.r: [4, 8]}
        sweep_select: {metric: exact_match, mode: max}

expands, before anything else is validated, into the members ``demo-learning_rate_0p003-r_4``,
``demo-learning_rate_0p003-r_8``, ``demo-learning_rate_0p006-r_4`` and
``demo-learning_rate_0p006-r_8``: runs of their own (results/<member>/, every stage), which
share the download, tokenize and shard jobs wherever their inputs are the same (those are
keyed by their settings, not by run). Each member carries ``sweep_of`` (the sweep's name,
its values, the selection rule, and the sweep's ``publish`` settings: its best member is
what is published) for the report, the selection and the runs that start from the sweep.

Member names: the run's name, then for each swept key in the order given ``-<key>_<value>``;
the key is its last path component (the whole path with ``.`` as ``_`` when two swept paths
end alike); a number is written in its shortest form with ``.`` as ``p`` (0.0003 -> 0p0003,
2e-05 -> 2e-05), a boolean as true/false, a string with every character outside letters,
digits and ``_`` as ``_``, a list as its items joined by ``_``. A name longer than 64
characters keeps its first 55 and adds ``-`` and 8 hex digits of its SHA-1.

``results/<run>/best.json`` names the member with the best ``sweep_select.metric`` (any
figure of the members' eval metrics.json: exact_match, math_verify, chrf, loss,
perplexity, stop_rate, preference_accuracy and the other figures, a key of eval.metrics,
an lm-eval column ``lm_eval:<task>:<metric,filter>``; or ``train_loss``, the last training
loss), with its values and metrics. The default with an eval set, ``auto``, is the first
figure of the members' headline (snaketune.evaluation.figures): their method's own (DPO's
preference_accuracy), else their data's: exact_match where the eval references hold
``####`` answers (GSM8K-style), the held-out loss for free text (chat data). Members tied
on the metric are named in best.json (``tied``) and the tie is broken by the held-out loss
(else the training loss), then by name.

A run may start from another run's model, or from a sweep's best member (``init_from``):
``resolve_init`` follows such chains to their base model, ``init_parents`` names the runs a
run may start from.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import itertools
import re
from collections.abc import Mapping
from typing import Any

from snaketune.core.errors import ConfigError, require
from snaketune.evaluation.figures import DESCRIBED
from snaketune.plan.runspec import merged

MAX_NAME = 64
# the figures an evaluation reports: its one description of them (snaketune.evaluation.figures)
EVAL_FIGURES = tuple(DESCRIBED)
# the best held-out figure each member saw while training (eval_steps; snaketune.core.heldout)
HELDOUT_FIGURES = ("heldout_loss_best", "heldout_exact_match_best")
LOWER_IS_BETTER = (
    *(key for key, figure in DESCRIBED.items() if not figure.higher_is_better),
    "train_loss",
    "heldout_loss_best",
)
AUTO = "auto"  # the first figure of the members' headline (snaketune.evaluation.figures)


def _run_schema(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    return schema["properties"]["runs"]["additionalProperties"]


def _resolve(node: Mapping[str, Any], schema: Mapping[str, Any]) -> Mapping[str, Any]:
    ref = node.get("$ref")
    if ref and ref.startswith("#/$defs/"):
        return schema["$defs"][ref.removeprefix("#/$defs/")]
    return node


def check_path(path: str, schema: Mapping[str, Any], where: str) -> None:
    """A run key path (``lora.r``) the run schema has; else one line with the closest."""
    node = _run_schema(schema)
    done: list[str] = []
    for part in path.split("."):
        props = _resolve(node, schema).get("properties", {})
        if part not in props or part in ("sweep", "sweep_select", "sweep_of"):
            keys = [k for k in props if k not in ("sweep", "sweep_select", "sweep_of")]
            close = difflib.get_close_matches(part, keys, n=1)
            hint = (
                f"did you mean {'.'.join([*done, close[0]])}?"
                if close
                else (f"keys there: {', '.join(sorted(keys))}")
            )
            raise ConfigError(f"{where}.sweep: a run has no key {path!r}; {hint}")
        done.append(part)
        node = _resolve(props[part], schema)


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value).replace(".", "p")
    if isinstance(value, list | tuple):
        return "_".join(_value_text(v) for v in value)
    if isinstance(value, dict):
        return "_".join(f"{k}_{_value_text(v)}" for k, v in sorted(value.items()))
    return re.sub(r"[^A-Za-z0-9_]", "_", str(value))


def member_name(run: str, values: list[tuple[str, Any]]) -> str:
    """The member's name (the rule is in the module's docstring)."""
    lasts = [p.rsplit(".", 1)[-1] for p, _ in values]
    keys = [
        p.replace(".", "_") if lasts.count(last) > 1 else last
        for (p, _), last in zip(values, lasts, strict=True)
    ]
    name = run + "".join(f"-{k}_{_value_text(v)}" for k, (_, v) in zip(keys, values, strict=True))
    if len(name) > MAX_NAME:
        name = f"{name[:55]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


def _set(run: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for p in parents:
        run = run.setdefault(p, {})
    run[last] = copy.deepcopy(value)


def check_metric(metric: str, run: Mapping[str, Any], where: str) -> None:
    """A selection metric the members will have; else one line naming what they have."""
    if metric in ("train_loss", AUTO):
        return
    if metric in HELDOUT_FIGURES:
        if not run.get("eval_steps"):
            raise ConfigError(
                f"{where}.sweep_select.metric: {metric!r} is the best held-out figure seen "
                "while training: set eval_steps (and eval_dataset)"
            )
        return
    if "eval_dataset" not in run:
        raise ConfigError(
            f"{where}.sweep_select.metric: {metric!r} needs an evaluation (set eval_dataset), "
            "or select on train_loss"
        )
    if metric in EVAL_FIGURES or metric in ((run.get("eval") or {}).get("metrics") or ()):
        return
    tasks = ((run.get("eval") or {}).get("lm_eval") or {}).get("tasks") or []
    if metric.startswith("lm_eval:") and metric.split(":")[1] in tasks:
        return
    raise ConfigError(
        f"{where}.sweep_select.metric: {metric!r} is not a figure of the evaluation; use one "
        f"of {', '.join((*EVAL_FIGURES, 'train_loss', *HELDOUT_FIGURES))}, a key of "
        "eval.metrics or lm_eval:<task>:<metric,filter> of a task in eval.lm_eval.tasks"
    )


def _check_sweep(
    where: str, run: Mapping[str, Any], schema: Mapping[str, Any], limit: int
) -> dict[str, str]:
    """A sweep's keys, values and member count (one line, ConfigError, for the first
    problem); its selection rule, defaults filled."""
    sweep = run["sweep"]
    if not isinstance(sweep, dict) or not sweep:
        raise ConfigError(
            f"{where}.sweep: give key paths with lists of values, e.g. "
            "{learning_rate: [1.0e-4, 3.0e-4], lora.r: [8, 16]}"
        )
    for path, values in sweep.items():
        check_path(str(path), schema, where)
        if not isinstance(values, list) or not values:
            raise ConfigError(
                f"{where}.sweep.{path}: give a non-empty list of values (got {values!r})"
            )
    count = 1
    for values in sweep.values():
        count *= len(values)
    if count > limit:
        raise ConfigError(
            f"{where}.sweep: {' x '.join(str(len(v)) for v in sweep.values())} = {count} "
            f"members, more than max_sweep_runs ({limit}); sweep fewer values or raise "
            "max_sweep_runs"
        )
    select = dict(run.get("sweep_select") or {})
    select.setdefault("metric", AUTO if "eval_dataset" in run else "train_loss")
    if select["metric"] != AUTO:
        select.setdefault("mode", "min" if select["metric"] in LOWER_IS_BETTER else "max")
    check_metric(select["metric"], run, where)
    return select


def expand_sweeps(config: dict[str, Any], schema: Mapping[str, Any]) -> dict[str, list[str]]:
    """Replace every run with ``sweep`` by its members, in place; {sweep: [members]}.

    One line (ConfigError) for: a sweep that is not a mapping of key paths to non-empty
    lists, a key path a run does not have (with the closest), more members than
    ``max_sweep_runs`` (default 64), a member whose name another run has. A value the schema
    refuses is caught by the schema check that follows, naming the member.
    """
    runs = config.get("runs")
    if not isinstance(runs, dict) or not any(
        isinstance(r, dict) and "sweep" in r for r in runs.values()
    ):
        return {}
    limit = config.get("max_sweep_runs", 64)
    expanded: dict[str, Any] = {}
    sweeps: dict[str, list[str]] = {}
    for name, run in runs.items():
        if not isinstance(run, dict) or "sweep" not in run:
            expanded[name] = run
            continue
        where = f"runs.{name}"
        sweep = run["sweep"]
        select = _check_sweep(where, run, schema, limit)
        # `publish` is the sweep's: its best member is published (results/<run>/publish.json)
        base = {k: v for k, v in run.items() if k not in ("sweep", "sweep_select", "publish")}
        members = []
        for combo in itertools.product(*sweep.values()):
            values = list(zip(sweep, combo, strict=True))
            member = member_name(name, values)
            if member in runs or member in expanded:
                raise ConfigError(
                    f"{where}.sweep: member {member} has the name of another "
                    "run; rename one of them"
                )
            spec = copy.deepcopy(base)
            for path, value in values:
                _set(spec, path, value)
            spec["sweep_of"] = {"run": name, "values": dict(values), "select": select}
            if "publish" in run:
                spec["sweep_of"]["publish"] = copy.deepcopy(run["publish"])
            expanded[member] = spec
            members.append(member)
        sweeps[name] = members
    config["runs"] = expanded
    return sweeps


def sweeps_of(runs: Mapping[str, Any]) -> dict[str, list[str]]:
    """{sweep: [members]} of expanded runs."""
    out: dict[str, list[str]] = {}
    for name, run in runs.items():
        if "sweep_of" in run:
            out.setdefault(run["sweep_of"]["run"], []).append(name)
    return out


def init_parents(config: Mapping[str, Any], name: str) -> list[str]:
    """The runs a run with ``init_from`` may start from: the run it names, or every member
    of the sweep it names (the best one is chosen once the sweep is evaluated)."""
    parent = config["runs"][name]["init_from"]
    return sweeps_of(config["runs"]).get(parent) or [parent]


def resolve_init(
    config: dict[str, Any], skip: set[str] = frozenset()
) -> tuple[list[str], set[str]]:
    """Fill `model` of each run with `init_from` from the run (or sweep) it starts from,
    following chains. Returns a line per run refused (an unknown run, a chain that loops, a
    sweep whose members would hand on different base models or model kinds) and the runs
    left without a model: those refused, those in ``skip`` (refused already) and those
    that start from one of them."""
    runs, sweeps = config["runs"], sweeps_of(config["runs"])
    lines, unresolved = [], set(skip)
    for name, run in runs.items():
        if name in skip:
            continue
        try:
            chain = _chain(name, runs, sweeps)
        except ConfigError as exc:  # its own link or one further up (named once)
            lines += [str(exc)] if str(exc) not in lines else []
            unresolved.add(name)
            continue
        if any(m in skip for parent in chain[1:] for m in sweeps.get(parent, [parent])):
            unresolved.add(name)  # its line names the run it starts from
            continue
        first = chain[-1]
        run["model"] = runs[sweeps.get(first, [first])[0]].get("model")
    return lines, unresolved


def _chain(name: str, runs: Mapping[str, Any], sweeps: Mapping[str, list[str]]) -> list[str]:
    """``name`` and the runs (or sweeps) it starts from, in order, to the one with a model."""
    where, run = f"runs.{name}", runs[name]
    if "init_from" not in run:
        require("model" in run, f"{where}: missing required key 'model'")
        return [name]
    require(
        "model" not in run,
        f"{where}: give one of `model` and `init_from`, not both (init_from's model is the base)",
    )
    chain, current = [name], run
    while "init_from" in current:
        where, parent = f"runs.{chain[-1]}", current["init_from"]
        require(
            parent in runs or parent in sweeps,
            f"{where}.init_from: unknown run or sweep {parent!r} (defined: "
            f"{', '.join(sorted([*runs, *sweeps]))})",
        )
        if parent in chain:  # one line per loop, from its first run in the config
            loop = chain[chain.index(parent) :]
            order = list(runs)
            first = min(loop, key=lambda n: order.index(n) if n in order else len(order))
            loop = loop[loop.index(first) :] + loop[: loop.index(first)]
            raise ConfigError(
                f"runs.{first}.init_from: the runs start from each other in a loop "
                f"({' -> '.join([*loop, first])}); one of them must start from a `model`"
            )
        chain.append(parent)
        members = [runs[m] for m in sweeps.get(parent, [parent])]
        for key, what in (("model", "base model"), ("method", "method")):
            values = {str(m.get(key)) for m in members if "init_from" not in m}
            require(
                len(values) <= 1,
                f"{where}.init_from: the members of sweep {parent!r} differ in their {what} "
                f"({', '.join(sorted(values))}); start from one member, or sweep a key "
                "that keeps it",
            )
        kept = [m for m in sweeps.get(parent, [parent]) if not merged(runs[m])]
        require(
            not kept,
            f"{where}.init_from: {parent!r} keeps no merged model "
            "(export.merged: false): a run starts from a whole model; set export.merged: "
            f"true on {kept[0] if kept else parent!r}",
        )
        current = members[0]
    return chain
