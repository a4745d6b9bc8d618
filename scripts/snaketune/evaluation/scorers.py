"""The user's own evaluation metrics (``eval.metrics``): the keys GRPO's rewards take,
scoring the evaluate stage's greedy generations.

- ``"<path/to/file.py>:<function>"``: a function of the user's, called as a GRPO reward
  function is (snaketune.evaluation.rewards): keywords ``prompts`` (each example's prompt as
  the model saw it), ``completions`` (the generations), ``answer`` (each reference
  response), ``example_id`` and the source dataset's other columns of each row; it
  returns one number per example (None: no figure for that one);
- ``"model:<run>"``: the raw score of that reward run's final model (the prompt's turns
  and the generation, in the reward model's own chat template);
- the built-in rewards ``correctness`` and ``format``.

Checked where the config is read, before any job (the file is there and imports, the
function takes keyword arguments; the reward run exists and trains a reward model). The
run's evaluate stage scores its own generations and its base model's (the samples.jsonl
beside the base's metrics.json), so each figure has the base's beside it: per example in
samples.jsonl (``scores``), as a mean in metrics.json under its key (and ``base``), in
the headline after the method's and the data's figures. Each file's sha256 is in the
evaluate stage's settings: an edited function reruns the evaluation only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from snaketune.core.errors import ConfigError, UserError

BLOCK = "eval.metrics"


def keys_of(run: Mapping[str, Any]) -> list[str]:
    """A run's metric keys (none without ``eval.metrics``)."""
    return list((run.get("eval") or {}).get("metrics") or [])


def check(
    where: str,
    run: Mapping[str, Any],
    config: Mapping[str, Any],
    writes_text: bool,
    reward_models: Collection[str],
) -> None:
    """One line for the first metric that cannot be used (before any job): ``writes_text``,
    whether the run's model generates; ``reward_models``, the config's runs that train one
    (snaketune.methods.reward_model_runs)."""
    from snaketune.evaluation import model_rewards, rewards

    keys = keys_of(run)
    if not keys:
        return
    if not writes_text:
        raise ConfigError(
            f"{where}.{BLOCK}: a {run['method']} run generates nothing to score; "
            "drop eval.metrics, or put them on a run that generates"
        )
    if "eval_dataset" not in run:
        raise ConfigError(f"{where}.{BLOCK}: nothing is evaluated; set eval_dataset")
    rewards.check(where, keys, BLOCK)
    model_rewards.check(where, keys, config, BLOCK, reward_models)


def spec(
    config: Mapping[str, Any],
    run: str,
    final_model: Callable[[str], str],
    template: Callable[[str], dict[str, str] | None],
) -> dict[str, Any] | None:
    """What the evaluate stage needs to score a run's metrics (None: it has none): the
    keys, each file's sha256 (an edit reruns the evaluation), and for ``model:`` keys
    each reward model's folder, template and max_length with the eval set's sources."""
    from snaketune.evaluation import model_rewards, rewards

    r = config["runs"][run]
    keys = keys_of(r)
    if not keys:
        return None
    out: dict[str, Any] = {"keys": keys, "code_sha256": rewards.digests(keys)}
    names = model_rewards.model_runs(keys)
    if names:
        out["scoring"] = model_rewards.spec(
            config, run, final_model, template, names, "eval_dataset"
        )
    return out


def model_folders(settings: Mapping[str, Any] | None) -> list[str]:
    """The reward models' folders a run's metrics read (the evaluate stage's inputs)."""
    return [m["path"] for m in ((settings or {}).get("scoring") or {}).get("models", {}).values()]


def score(settings: Mapping[str, Any], samples: list[dict[str, Any]]) -> dict[str, list]:
    """Each metric's value per sample (None where the function gave none), by key."""
    import torch

    from snaketune.evaluation import model_rewards, rewards
    from snaketune.evaluation.model import DTYPES, resolve_precision

    keys = settings["keys"]
    ids = [s["example_id"] for s in samples]
    models: dict[str, Any] = {}
    scoring = settings.get("scoring")
    if scoring:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        prompts = model_rewards.prompt_turns(scoring["sources"], ids)
        dtype = DTYPES[resolve_precision("auto")]
        models = {
            k: model_rewards.ModelReward(
                k, scoring["models"][m["run"]], prompts, "raw", 1, dtype, device
            )
            for k in keys
            if (m := rewards.MODEL_KEY.match(k))
        }
    funcs, _ = rewards.functions(dict.fromkeys(keys, 1.0), models)
    inputs = [{"example_id": i} for i in ids]
    rewards.add_columns(inputs, rewards.source_columns(ids) if rewards.user_keys(keys) else {})
    columns = {k: [x.get(k) for x in inputs] for k in inputs[0]} if inputs else {}
    out = {}
    for key, func in zip(keys, funcs, strict=True):
        try:
            out[key] = func(
                prompts=[s["prompt"] for s in samples],
                completions=[s["generation"] for s in samples],
                answer=[s["reference"] for s in samples],
                **columns,
            )
        except rewards.RewardError as exc:
            raise UserError(
                f"{BLOCK}: {exc} (scoring the evaluation's generations); fix the "
                "function and run snakemake again"
            ) from None
    return out


def mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def base_generations(
    base_samples: Path | None, samples: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The base model's samples (its samples.jsonl, where it generated) of the examples in
    ``samples``; none where it has no such file."""
    if base_samples is None or not base_samples.is_file():
        return []
    wanted = {s["example_id"] for s in samples}
    return [
        s
        for line in base_samples.read_text().splitlines()
        if (s := json.loads(line)).get("example_id") in wanted and "generation" in s
    ]


def scorer(
    settings: Mapping[str, Any] | None, base_samples: Path | None
) -> Callable[[list[dict[str, Any]], dict[str, Any]], list[str]] | None:
    """The evaluate stage's ``user_scores``: scores the tuned model's samples (each gets
    ``scores``) and the base model's (``base_samples``, where the base generated), puts
    each metric's mean into the metrics and their ``base``; returns the keys."""
    if not settings:
        return None

    def apply(samples: list[dict[str, Any]], metrics: dict[str, Any]) -> list[str]:
        values = score(settings, samples)
        for i, sample in enumerate(samples):
            sample["scores"] = {k: v[i] for k, v in values.items()}
        metrics.update({k: mean(v) for k, v in values.items()})
        theirs = base_generations(base_samples, samples)
        if theirs and "base" in metrics:
            before = score(settings, theirs)
            metrics["base"].update({k: mean(v) for k, v in before.items()})
        return list(values)

    return apply
