"""A reward model as a GRPO reward: ``"model:<run>"`` in ``grpo.rewards`` scores each
completion with the final model of that run (a ``method: reward`` run, or the best member
of such a sweep).

Where the config is read (``check``): the run exists, trains a reward model and is not the
GRPO run itself. The workflow makes the reward run's final model an input of the GRPO run's
train job (``trainjob.train_extras``) and puts what scoring needs into the job's spec
(``spec``): the model's folder, the reward run's chat template file (None: its tokenizer's)
and max_length, and the dataset settings the prompts' turns are read with.

In the training job, each rank loads each reward model once (``ModelReward``), before
DeepSpeed starts, in the run's precision on the rank's device. A completion is scored as
the reward model was trained: the prompt's turns, from the example's source row (the
prompt text TRL passes is the policy's rendering, in the policy's template), then the
completion as the assistant turn, rendered with the reward model's own chat template and
tokenizer, cut at its max_length, scored in batches (right-padded, the score read at the
last real token). ``grpo.reward_model_normalization``: ``raw`` (the score as it is) or
``group`` (z-scored within each prompt's group of completions: (score - mean) / (std +
1e-4), as TRL normalises advantages), so a reward model's scale does not outweigh the
other rewards.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from snaketune.core.errors import ConfigError
from snaketune.evaluation.rewards import DATASETS, MODEL_KEY, source_of, source_rows

BATCH = 16  # completions per forward pass of a reward model


def model_runs(rewards: Mapping[str, Any]) -> list[str]:
    """The runs whose reward models a ``grpo.rewards`` block names, in its order."""
    return [m["run"] for key in rewards if (m := MODEL_KEY.match(key))]


def check(
    where: str,
    rewards: Mapping[str, Any],
    config: Mapping[str, Any],
    block: str,
    reward_models: Collection[str],
) -> None:
    """One line for the first ``model:<run>`` key that cannot be scored with: no such run
    (or sweep), a run that trains no reward model (``reward_models``: those that do,
    snaketune.methods.reward_model_runs), the run itself."""
    runs = config["runs"]
    me = where.removeprefix("runs.")
    mine = {me, runs.get(me, {}).get("sweep_of", {}).get("run")}
    for name in model_runs(rewards):
        at = f"{where}.{block}: 'model:{name}'"
        if name in mine:
            raise ConfigError(f"{at} names this run itself; name a reward run (method: reward)")
        member = settings_run(runs, name)
        if member not in runs:
            known = [r for r in runs if r in reward_models]
            raise ConfigError(
                f"{at}: there is no run {name!r}; name a run of method reward ("
                + (", ".join(known) if known else "none in this config")
                + ")"
            )
        if member not in reward_models:
            raise ConfigError(
                f"{at}: run {name!r} is method {runs[member].get('method')}, not a reward "
                "model; name a run of method reward (docs/rewards.md)"
            )


def settings_run(runs: Mapping[str, Any], name: str) -> str:
    """The run whose settings a reward key's run has: itself, or a sweep's first member
    (a sweep's members differ only in what they sweep)."""
    members = [n for n, r in runs.items() if r.get("sweep_of", {}).get("run") == name]
    return members[0] if members else name


def spec(
    config: Mapping[str, Any],
    run: str,
    final_model: Callable[[str], str],
    template: Callable[[str], dict[str, str] | None],
    names: list[str],
    dataset: str = "dataset",
) -> dict[str, Any] | None:
    """What a GRPO run's train job needs to score with its reward models (None: it has
    none): per reward run, its final model's folder (``final_model``), its chat template
    (``template``: path and sha256 of the model's configured file, or None) and
    max_length (a sweep's: its first member's, as every member's); the settings of the
    run's datasets (their prompts' turns). ``names``: the reward runs (a GRPO run's,
    snaketune.methods.reward_runs; a run's metrics'), the prompts of its ``dataset`` key
    (eval_dataset: its evaluation's)."""
    from snaketune.data.formats import components

    r = config["runs"][run]
    if not names:
        return None
    models = {}
    for name in names:
        rm = config["runs"][settings_run(config["runs"], name)]
        models[name] = {
            "path": final_model(name),
            "chat_template": template(rm["model"]),
            "max_length": rm["max_length"],
        }
    sources = {c["name"]: config["datasets"][c["name"]] for c in components(config, r[dataset])}
    return {"models": models, "sources": sources}


def in_spec(block: dict[str, Any], settings: dict[str, Any] | None) -> dict[str, Any]:
    """A method's block as its train job reads it: with what scoring needs (``settings``,
    ``spec``), or without reward models, without their normalisation setting either, so a
    run that has none keeps the params (and the trained outputs) it had before the setting
    existed."""
    if settings:
        return {**block, "reward_models": settings}
    return {k: v for k, v in block.items() if k != "reward_model_normalization"}


# ----------------------------------------------------------------------------- the job


def prompt_turns(
    sources: Mapping[str, Any], example_ids: list[str], datasets: Path = DATASETS
) -> dict[str, tuple]:
    """Each example's prompt as turns (every turn before its last assistant turn: the
    system prompt, the user's; a preference row's prompt), from its row of the downloaded
    dataset, by example id ("<dataset>:<row>[:<copy>]")."""
    from snaketune.data.conversations import Pair, Source, conversations

    turns: dict[tuple[str, int], tuple] = {}
    for name, (order, table) in source_rows(example_ids, datasets).items():
        source = Source(name, datasets / name / "data.parquet", sources[name])
        for row, conv in zip(
            order, conversations(source, table.to_batches()[0], order), strict=True
        ):
            if isinstance(conv, Pair):  # a preference row: the turns before its responses
                turns[(name, row)] = tuple(conv.prompt)
                continue
            last = max(i for i, (role, _) in enumerate(conv) if role == "assistant")
            turns[(name, row)] = tuple(conv[:last])
    return {e: turns[source_of(e)] for e in example_ids}


class ModelReward:
    """A reward function (as TRL calls one) that scores prompt + completion with a reward
    model, loaded once."""

    def __init__(
        self,
        key: str,
        settings: Mapping[str, Any],
        prompts: dict[str, tuple],
        normalization: str,
        group: int,
        dtype,
        device,
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from snaketune.data.chat import ChatRenderer

        path = Path(settings["path"])
        self.__name__ = key
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        template = settings["chat_template"]
        text = Path(template["path"]).read_text() if template else None
        self.renderer = ChatRenderer(self.tokenizer, text)
        self.model = (
            AutoModelForSequenceClassification.from_pretrained(
                path, dtype=dtype, local_files_only=True
            )
            .to(device)
            .eval()
        )
        self.model.requires_grad_(False)
        self.pad = self.model.config.get_text_config().pad_token_id
        self.max_length = int(settings["max_length"])
        self.prompts, self.normalization, self.group = prompts, normalization, group
        self.device, self.torch = device, torch

    def texts(self, example_ids: list[str], completions: list[str]) -> list[str]:
        """Each completion after its prompt's turns, in the reward model's chat template."""
        return [
            self.renderer.render((*self.prompts[e], ("assistant", c)))
            for e, c in zip(example_ids, completions, strict=True)
        ]

    def scores(self, texts: list[str]) -> list[float]:
        """The reward model's score of each text alone (batched, right-padded)."""
        torch = self.torch
        encoded = self.tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        ids = [e.ids[: self.max_length] for e in encoded]
        out: list[float] = []
        for i in range(0, len(ids), BATCH):
            chunk = ids[i : i + BATCH]
            width = max(len(x) for x in chunk)
            input_ids = torch.full((len(chunk), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, x in enumerate(chunk):
                input_ids[j, : len(x)] = torch.as_tensor(x, dtype=torch.long)
                mask[j, : len(x)] = 1
            with torch.inference_mode():
                logits = self.model(
                    input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)
                ).logits
            out += logits[:, 0].float().cpu().tolist()
        return out

    def __call__(self, *, completions: list[str], example_id: list[str], **_) -> list[float]:
        values = self.scores(self.texts(example_id, completions))
        return normalized(values, self.group) if self.normalization == "group" else values


def normalized(values: list[float], group: int) -> list[float]:
    """Each value z-scored within its group of ``group`` consecutive values (a prompt's
    completions): (x - mean) / (std + 1e-4), std the sample standard deviation."""
    out = []
    for i in range(0, len(values), group):
        chunk = values[i : i + group]
        mean = sum(chunk) / len(chunk)
        var = sum((x - mean) ** 2 for x in chunk) / max(1, len(chunk) - 1)
        out += [(x - mean) / (var**0.5 + 1e-4) for x in chunk]
    return out


def scorers(
    block: Mapping[str, Any], example_ids: list[str], dtype, local_rank: int
) -> dict[str, ModelReward]:
    """This rank's reward-model rewards of a rollout method's ``block``, by key (none
    without ``model:`` keys), on its GPU (else the CPU)."""
    import torch

    runs = {k: m["run"] for k in block["rewards"] if (m := MODEL_KEY.match(k))}
    if not runs:
        return {}
    settings = block["reward_models"]
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    prompts = prompt_turns(settings["sources"], example_ids)
    return {
        k: ModelReward(
            k,
            settings["models"][run],
            prompts,
            block["reward_model_normalization"],
            block["num_generations"],
            dtype,
            device,
        )
        for k, run in runs.items()
    }
