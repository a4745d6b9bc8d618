"""GRPO's rewards: the built-ins and the user's own functions (``grpo.rewards``).

A reward is named by its key in ``grpo.rewards`` (its value the weight):

- ``correctness``: 1.0 when the completion's final answer (its ``####`` line, else its last
  number) equals the reference's, as math-verify judges it;
- ``format``: 1.0 when the completion ends with a ``#### <number>`` line;
- ``"<path/to/file.py>:<function>"``: a function of the user's, in a file found from the
  directory the workflow runs in, else from the workflow's own directory (an absolute path
  as it is). It is called as TRL calls reward
  functions: keyword arguments ``prompts``, ``completions`` (strings), ``completion_ids``,
  ``answer`` (the reference answer), the source dataset's other columns of each
  completion's row, ``trainer_state`` and TRL's logging hooks; it returns one float (or
  None: no reward for that completion) per completion;
- ``"model:<run>"``: the score of that run's reward model (snaketune.evaluation.model_rewards).

``check`` runs where the config is read (``snaketune validate``, every dry run, before any
job): the file exists and imports, the function exists and takes keyword arguments
(``**kwargs``). In the training job ``functions`` wraps each: an exception inside it, a
wrong count or a value that is not a finite number fails the step with one line naming the
file, the function and the completion's index (a batch that raises is scored again one
completion at a time to find it). ``digests`` gives each file's sha256: the train job's
spec carries it, so a changed function retrains the run (and starts its checkpoints over),
and provenance records it.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from snaketune.core.errors import ConfigError
from snaketune.evaluation.answers import final_answer, math_verify_match, parse_answer

_FORMAT = re.compile(r"(?:^|\n)####[ \t]*-?[\d,]*\.?\d+[ \t]*$")
USER_KEY = re.compile(r"^(?P<path>[^:]+\.py):(?P<function>[A-Za-z_][A-Za-z0-9_]*)$")
MODEL_KEY = re.compile(r"^model:(?P<run>[^:/\s]+)$")  # a reward run's model: model_rewards
PROJECT = Path(__file__).resolve().parents[3]  # the workflow's directory (scripts/..)
# keywords TRL and snaketune pass besides the dataset's columns (a column of these names is
# not passed under it)
PASSED = (
    "prompts",
    "completions",
    "completion_ids",
    "answer",
    "example_id",
    "prompt_ids",
    "step",
    "micro",
    "trainer_state",
    "log_extra",
    "log_metric",
)


class RewardError(RuntimeError):
    """A user's reward function failed on a step: the one line says where."""


def text_of(completion: Any) -> str:
    """A completion's final text: the last assistant message's of a trajectory (a list of
    messages: GRPO with tools), or the completion itself (plain text)."""
    if isinstance(completion, str):
        return completion
    said = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    return said[-1] if said else ""


def correctness(completions: list, answer: list[str], **_) -> list[float]:
    """1.0 where the completion's final answer equals the reference answer (math-verify)."""
    out = []
    for completion, reference in zip(completions, answer, strict=True):
        want = parse_answer(reference) or final_answer(reference)
        out.append(1.0 if math_verify_match(want, final_answer(text_of(completion))) else 0.0)
    return out


def format_reward(completions: list, **_) -> list[float]:
    """1.0 where the completion ends with a "#### <number>" line."""
    return [1.0 if _FORMAT.search(text_of(c).strip()) else 0.0 for c in completions]


BUILTIN: dict[str, Callable[..., list[float]]] = {
    "correctness": correctness,
    "format": format_reward,
}


def user_keys(rewards: Mapping[str, Any]) -> list[str]:
    """The keys that name a user's function (not a built-in, not a reward model)."""
    return [k for k in rewards if k not in BUILTIN and not MODEL_KEY.match(k)]


def located(key: str) -> Path | None:
    """The file a user key names: from the working directory, else from the project's
    directory (its own examples, config/rewards/); None when neither holds it."""
    match = USER_KEY.match(key)
    if match is None:
        return None
    for path in (Path(match["path"]), PROJECT / match["path"]):
        if path.is_file():
            return path.resolve()
    return None


def _load(key: str) -> Callable[..., Any]:
    """The function a user key names (its file imported once per process)."""
    match = USER_KEY.match(key)
    path = located(key)
    assert match and path, key
    name = "snaketune_reward_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return getattr(module, match["function"], None)


def check(where: str, rewards: Mapping[str, Any], block: str = "grpo.rewards") -> None:
    """One line for the first reward key that cannot be used: not a built-in nor a
    ``file.py:function`` key, a file that is not there or does not import, a function that
    is not there or does not take keyword arguments."""
    for key in user_keys(rewards):  # reward models: model_rewards.check (the config's runs)
        at = f"{where}.{block}: {key!r}"
        match = USER_KEY.match(key)
        if not match:
            close = difflib.get_close_matches(key, BUILTIN, n=1)
            raise ConfigError(
                f"{at} is not a reward"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + " (built-ins: correctness, format; a function of yours: "
                "'<path/to/file.py>:<function>'; a reward run's model: 'model:<run>')"
            )
        path = located(key)
        if path is None:
            raise ConfigError(
                f"{at}: {match['path']} is not a file (looked in {Path.cwd()} and {PROJECT}); "
                "give the file's path from the directory snakemake runs in, or an absolute one"
            )
        try:
            func = _load(key)
        except BaseException as exc:  # SyntaxError, ImportError, SystemExit from its code
            raise ConfigError(
                f"{at}: importing {match['path']} failed ({type(exc).__name__}: {exc}); fix "
                "the file"
            ) from None
        if not callable(func):
            raise ConfigError(
                f"{at}: {match['path']} has no function {match['function']}; fix the name"
            )
        params = inspect.signature(func).parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in params) or any(
            p.kind is p.POSITIONAL_ONLY for p in params
        ):
            raise ConfigError(
                f"{at}: {match['function']}{inspect.signature(func)} must take keyword "
                "arguments: def f(prompts, completions, **kwargs) (TRL passes the dataset's "
                "other columns as keywords)"
            )


def digests(rewards: Mapping[str, Any]) -> dict[str, str]:
    """sha256 of each user reward's file, by key (empty for built-ins only)."""
    out = {}
    for key in user_keys(rewards):
        path = located(key)
        if path is not None:
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def report(ckpt_dir: Path, exc: RewardError, step: int) -> None:
    """The launcher's one line for a failed reward (checkpoints/health/fatal.json, which it
    reads when the workers fail: snaketune.train.launch.explain_failure)."""
    import json
    import os

    where = ckpt_dir / "health"
    where.mkdir(parents=True, exist_ok=True)
    line = (
        f"{exc} (step {step + 1}); fix the function (docs/rewards.md) and run snakemake "
        "again (a changed reward file trains the run from the start)"
    )
    tmp = where / f".fatal-{os.getpid()}"
    tmp.write_text(json.dumps({"line": line, "step": step, "messages": [str(exc)]}))
    tmp.replace(where / "fatal.json")


def _checked(key: str, out: Any, count: int) -> list[float | None]:
    """The user's output as TRL takes it, or a RewardError naming what is wrong."""
    try:
        values = list(out)
    except TypeError:
        raise RewardError(
            f"reward {key} returned {type(out).__name__}, not a list of one float per completion"
        ) from None
    if len(values) != count:
        raise RewardError(f"reward {key} returned {len(values)} values for {count} completions")
    for i, value in enumerate(values):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            try:
                value = float(value)  # numpy and torch scalars
            except (TypeError, ValueError):
                raise RewardError(
                    f"reward {key} returned {value!r} for completion {i}: not a number "
                    "(return None for no reward)"
                ) from None
        if not math.isfinite(value):
            raise RewardError(
                f"reward {key} returned {value} for completion {i} (return None for no reward)"
            )
        values[i] = float(value)
    return values


def _user(key: str) -> Callable[..., list[float | None]]:
    func = _load(key)

    def named(*, prompts, completions, **kwargs):
        try:
            out = func(prompts=prompts, completions=completions, **kwargs)
        except Exception as exc:
            index = _first_failing(func, prompts, completions, kwargs)
            where = f"completion {index}" if index is not None else "a batch"
            raise RewardError(
                f"reward {key} raised {type(exc).__name__}: {exc} on {where} of this step "
                f"({len(completions)} completions)"
            ) from exc
        return _checked(key, out, len(completions))

    named.__name__ = key
    return named


def _first_failing(func, prompts, completions, kwargs) -> int | None:
    """The index of the first completion the function raises on alone."""
    for i in range(len(completions)):
        one = {
            k: (v[i : i + 1] if isinstance(v, list) and len(v) == len(completions) else v)
            for k, v in kwargs.items()
        }
        try:
            func(prompts=prompts[i : i + 1], completions=completions[i : i + 1], **one)
        except Exception:
            return i
    return None


def functions(
    weights: Mapping[str, float],
    models: Mapping[str, Callable] | None = None,
) -> tuple[list[Callable], list[float]]:
    """The run's reward functions (named by their keys, for TRL's logs) and weights;
    ``models``: the reward models' scorers by key (model_rewards.scorers)."""
    funcs, values = [], []
    for name, weight in weights.items():
        if name in (models or {}):
            named = models[name]
        elif name in BUILTIN:
            func = BUILTIN[name]

            def named(*args, _func=func, **kwargs):
                return _func(*args, **kwargs)

            named.__name__ = name
        else:
            named = _user(name)
        funcs.append(named)
        values.append(float(weight))
    return funcs, values


DATASETS = Path("resources/datasets")  # what the download stage wrote: <name>/data.parquet


def source_of(example_id: str) -> tuple[str, int]:
    """The source dataset and row of an example id ("<dataset>:<row>[:<copy>]")."""
    name, row = example_id.split(":")[:2]
    return name, int(row)


def source_rows(example_ids: list[str], datasets_dir: Path = DATASETS):
    """The source rows ``example_ids`` name, read once per dataset: by dataset, its row
    numbers (sorted) and the table of those rows in that order (one chunk)."""
    import pyarrow.parquet as pq

    wanted: dict[str, set[int]] = {}
    for e in example_ids:
        name, row = source_of(e)
        wanted.setdefault(name, set()).add(row)
    out = {}
    for name, numbers in wanted.items():
        order = sorted(numbers)
        table = pq.read_table(datasets_dir / name / "data.parquet").take(order)
        out[name] = (order, table.combine_chunks())
    return out


def add_columns(inputs: list[dict[str, Any]], columns: dict[str, dict[str, Any]]) -> None:
    """Each of a step's inputs gets its source row's other columns (``columns``, by example
    id: source_columns), the keywords TRL passes to a user's reward function; a key the
    input has already (the prompt, the answer) is kept."""
    for x in inputs if columns else ():
        x.update({k: v for k, v in columns[x["example_id"]].items() if k not in x})


def source_columns(example_ids: list[str], datasets_dir: Path = DATASETS):
    """Each example's row of its source dataset, by example id: the columns a user's
    reward function gets as keywords (those named like snaketune's own, ``PASSED``, left
    out)."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for name, (order, table) in source_rows(example_ids, datasets_dir).items():
        for n, values in zip(order, table.to_pylist(), strict=True):
            rows[(name, n)] = {k: v for k, v in values.items() if k not in PASSED}
    return {e: rows[source_of(e)] for e in example_ids}
