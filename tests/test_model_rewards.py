"""A reward model as a GRPO reward ("model:<run>", snaketune.evaluation.model_rewards): the
config's refusals, what the workflow hands the train job (the reward run's final model as
an input, what scoring needs in the spec), the prompts' turns read from the source rows,
the per-group z-score. The reward model's scores in a GRPO job, against plain
transformers, and a GRPO run that logs them on 2 emulated nodes: the reward chain in
tests/test_reward_model.py."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT

from snaketune.core.errors import ConfigError
from snaketune.evaluation import model_rewards
from snaketune.plan import trainjob
from snaketune.plan.config import load_yaml, validate_config


def chain(rewards: dict, **rm) -> dict:
    """config/config.yaml with the GRPO demo's runs and the reward demo's, rl_demo scored
    with ``rewards``."""
    config = load_yaml(ROOT / "config/config.yaml")
    for overlay in ("grpo_demo.yaml", "reward_demo.yaml"):
        more = copy.deepcopy(load_yaml(ROOT / "config" / overlay))
        config["datasets"].update(more.get("datasets", {}))
        config["runs"].update(more["runs"])
    config["runs"]["rl_demo"]["grpo"]["rewards"] = rewards
    config["runs"]["rm_demo"].update(rm)
    return config


@pytest.mark.parametrize(
    "key, message",
    [
        ("model:nope", "'model:nope': there is no run 'nope'; name a run of method reward "
                       "(rm_demo)"),
        ("model:sft_demo", "'model:sft_demo': run 'sft_demo' is method lora, not a reward "
                           "model; name a run of method reward"),
        ("model:rl_demo", "'model:rl_demo' names this run itself; name a reward run"),
        ("model:", "'model:' is not a reward (built-ins: correctness, format; a function of "
                   "yours: '<path/to/file.py>:<function>'; a reward run's model: 'model:<run>')"),
    ],
)  # fmt: skip
def test_a_reward_model_key_that_names_no_reward_model_is_one_line(key, message):
    with pytest.raises(ConfigError) as err:
        validate_config(chain({"correctness": 1.0, key: 1.0}), ROOT)
    line = str(err.value)
    assert "\n" not in line and line.startswith("runs.rl_demo.grpo.rewards: "), line
    assert message in line, line


def test_the_train_job_reads_the_reward_run_s_final_model_and_how_to_score_with_it():
    """The reward run's final model is an input of the GRPO run's train job; its spec says
    where it is, its chat template (the tokenizer's: None), its max_length and the dataset
    settings the prompts' turns are read with. A run without one gets neither."""
    config = validate_config(chain({"correctness": 1.0, "model:rm_demo": 0.5}), ROOT)
    extras = trainjob.train_extras(config, "rl_demo")
    assert extras["reward_models"] == ["results/rm_demo/hf"]
    models = trainjob.reward_models(config, "rl_demo")
    spec = json.loads(trainjob.train_spec(config["runs"]["rl_demo"], **{**extras,
                                                                      "reward_models": models}))  # fmt: skip
    block = spec["grpo"]["reward_models"]
    assert block["models"] == {"rm_demo": {"path": "results/rm_demo/hf", "chat_template": None,
                                           "max_length": 256}}  # fmt: skip
    assert block["sources"] == {"arith": config["datasets"]["arith"]}
    assert spec["grpo"]["reward_model_normalization"] == "raw"
    # a sweep's best member, as the workflow resolves it
    picked = trainjob.train_extras(config, "rl_demo", lambda name: "demo")
    assert picked["reward_models"] == ["results/demo/merged_model"]
    assert "reward_models" not in trainjob.train_extras(config, "sft_demo")
    assert trainjob.reward_models(config, "sft_demo") is None
    # a GRPO run without one: its spec (and so its trained outputs) as before the setting
    plain = validate_config(chain({"correctness": 1.0}), ROOT)
    grpo = json.loads(trainjob.train_spec(plain["runs"]["rl_demo"]))["grpo"]
    assert "reward_models" not in grpo and "reward_model_normalization" not in grpo


def test_a_sweep_of_reward_runs_is_a_reward_model():
    config = chain({"model:rm_demo": 1.0}, sweep={"learning_rate": [1.0e-3, 2.0e-3]})
    validate_config(config, ROOT)  # the sweep's name, its members of method reward


def test_the_prompt_s_turns_come_from_its_source_row(tmp_path):
    """Every turn before the response: the dataset's system prompt and the user's turn, as
    tokenize makes them, by example id (a repeated example's copy suffix read past)."""
    folder = tmp_path / "d"
    folder.mkdir()
    pq.write_table(pa.table({"q": ["one?", "two?", "three?"], "a": ["1", "2", "3"]}),
                   folder / "data.parquet")  # fmt: skip
    sources = {"d": {"format": "prompt_response", "columns": {"prompt": "q", "response": "a"},
                     "system_prompt": "Be brief."}}  # fmt: skip
    turns = model_rewards.prompt_turns(sources, ["d:2", "d:0:1"], tmp_path)
    assert turns == {"d:2": (("system", "Be brief."), ("user", "three?")),
                     "d:0:1": (("system", "Be brief."), ("user", "one?"))}  # fmt: skip


def test_a_preference_row_s_prompt_turns_are_its_prompt(tmp_path):
    """An eval set of pairs scored with a reward model (eval.metrics: model:<run>): each
    example's prompt is the pair's prompt, not its chosen or rejected turn."""
    folder = tmp_path / "p"
    folder.mkdir()
    pq.write_table(pa.table({"prompt": ["one?", "two?"], "chosen": ["1", "2"],
                             "rejected": ["3", "4"]}), folder / "data.parquet")  # fmt: skip
    turns = model_rewards.prompt_turns({"p": {"format": "preference"}}, ["p:1"], tmp_path)
    assert turns == {"p:1": (("user", "two?"),)}


def test_group_normalisation_is_a_z_score_within_each_prompt_s_completions():
    values = [1.0, 2.0, 4.0, 7.0, 3.0, 3.0, 3.0, 3.0, -1.0, 5.0, 0.5, 2.0]
    got = model_rewards.normalized(values, 4)
    for k in range(0, len(values), 4):
        group = np.array(values[k : k + 4])
        want = (group - group.mean()) / (group.std(ddof=1) + 1e-4)
        assert got[k : k + 4] == pytest.approx(want.tolist(), abs=1e-9)
    assert got[4:8] == [0.0] * 4  # equal scores: no signal, not a division by zero
    assert all(math.isfinite(x) for x in got)


def test_the_memory_plan_holds_each_reward_model_whole_on_every_gpu(tmp_path):
    """A GRPO run's plan counts its reward model's weights in the run's precision on each
    GPU (not sharded: each rank loads it whole), and nothing for a run without one."""
    from snaketune.budget.fit import plan_config
    from snaketune.budget.memplan import Shape

    llama_8b = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "vocab_size": 128256, "tie_word_embeddings": False}  # fmt: skip
    folder = tmp_path / "resources/models/tiny"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(llama_8b))
    config = chain({"correctness": 1.0, "model:rm_demo": 0.5})
    config["runs"]["rl_demo"]["precision"] = "bf16"
    plans = {p["run"]: p for p in plan_config(validate_config(config, ROOT), tmp_path, ROOT,
                                              gpu="h100-80gb")}  # fmt: skip
    params = Shape.from_config(llama_8b).params
    assert plans["rl_demo"]["per_gpu_gib"]["reward_models"] == pytest.approx(
        2 * params / 1024**3, abs=0.01)  # fmt: skip
    assert "reward_models" not in plans["sft_demo"]["per_gpu_gib"]
