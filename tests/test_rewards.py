"""GRPO's reward functions of the user's own (snaketune.evaluation.rewards): the checks before
anything runs, the wrapper in the training job (one line naming the file, the function and
the completion), the dataset's other columns as keywords, the code's digest in the train
job's spec, each reward's figures in metrics.jsonl and summary.tsv. The GRPO demo's run
(config/grpo_demo.yaml) uses config/rewards/arith.py: tests/test_grpo.py checks its figure
rises there."""

from __future__ import annotations

import copy
import importlib.util
import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT

from snaketune.app.summary import extra_columns
from snaketune.core.errors import ConfigError
from snaketune.evaluation import rewards
from snaketune.evaluation.rewards import correctness
from snaketune.methods.rollouts import reward_quarters, step_fields
from snaketune.plan import trainjob
from snaketune.plan.config import load_yaml, validate_config

DEMO_KEY = "config/rewards/arith.py:sum_from_question"


def chain(rewards_block: dict) -> dict:
    config = load_yaml(ROOT / "config/config.yaml")
    config["runs"].update(copy.deepcopy(load_yaml(ROOT / "config/grpo_demo.yaml")["runs"]))
    config["runs"]["rl_demo"]["grpo"]["rewards"] = rewards_block
    return config


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the reward files are found from the working directory


def write(tmp_path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return name


GOOD = (
    "def short(prompts, completions, **kwargs):\n    return [-len(c) / 10 for c in completions]\n"
)


@pytest.mark.parametrize(
    "key, text, message",
    [
        ("rewards.py:short", None, "'rewards.py:short': rewards.py is not a file (looked in"),
        ("length", None, "'length' is not a reward (built-ins: correctness, format; a function"),
        ("formatt", None, "'formatt' is not a reward; did you mean 'format'? (built-ins:"),
        ("r.py:short", "import not_a_module\n",
         "'r.py:short': importing r.py failed (ModuleNotFoundError: No module named "
         "'not_a_module'); fix the file"),
        ("r.py:short", "def short(:\n", "'r.py:short': importing r.py failed (SyntaxError"),
        ("r.py:shorter", GOOD, "'r.py:shorter': r.py has no function shorter; fix the name"),
        ("r.py:short", "def short(prompts, completions):\n    return []\n",
         "'r.py:short': short(prompts, completions) must take keyword arguments: def "
         "f(prompts, completions, **kwargs)"),
    ],
)  # fmt: skip
def test_a_reward_that_cannot_be_used_is_one_line_before_anything_runs(tmp_path, key, text,
                                                                        message):  # fmt: skip
    if text is not None:
        write(tmp_path, key.split(":")[0], text)
    with pytest.raises(ConfigError) as err:
        validate_config(chain({"correctness": 1.0, key: 0.5}), ROOT)
    line = str(err.value)
    assert "\n" not in line and line.startswith("runs.rl_demo.grpo.rewards: "), line
    assert message in line, line


def test_a_good_function_and_the_demo_s_validate_and_their_code_is_in_the_train_spec(tmp_path):
    write(tmp_path, "mine.py", GOOD)
    config = validate_config(chain({"correctness": 1.0, "mine.py:short": 0.1, DEMO_KEY: 0.5}),
                             ROOT)  # fmt: skip
    run = config["runs"]["rl_demo"]
    spec = json.loads(trainjob.train_spec(run))
    assert set(spec["code_sha256"]) == {"mine.py:short", DEMO_KEY}  # the demo's: from the project
    before = spec["code_sha256"]["mine.py:short"]
    write(tmp_path, "mine.py", GOOD.replace("/ 10", "/ 20"))  # the code changed: the spec too
    assert json.loads(trainjob.train_spec(run))["code_sha256"]["mine.py:short"] != before
    builtin = validate_config(chain({"correctness": 1.0}), ROOT)["runs"]["rl_demo"]
    assert "code_sha256" not in json.loads(trainjob.train_spec(builtin))  # runs as before


def _functions(tmp_path, text: str):
    write(tmp_path, "u.py", text)
    funcs, weights = rewards.functions({"format": 0.2, "u.py:f": 1.0})
    assert [f.__name__ for f in funcs] == ["format", "u.py:f"] and weights == [0.2, 1.0]
    return funcs[1]


def test_the_wrapper_names_the_completion_a_function_raises_on(tmp_path):
    func = _functions(tmp_path, "def f(prompts, completions, **kw):\n"
                                "    return [1.0 / (len(c) - 3) for c in completions]\n")  # fmt: skip
    assert func(prompts=["p"] * 2, completions=["abcde", "ab"]) == [0.5, -1.0]
    with pytest.raises(rewards.RewardError) as err:
        func(prompts=["p"] * 4, completions=["abcde", "ab", "abc", "x"], answer=list("1234"))
    assert str(err.value) == ("reward u.py:f raised ZeroDivisionError: float division by zero "
                              "on completion 2 of this step (4 completions)")  # fmt: skip


@pytest.mark.parametrize(
    "body, message",
    [
        ("return [1.0]", "reward u.py:f returned 1 values for 2 completions"),
        ("return 1.0", "reward u.py:f returned float, not a list of one float per completion"),
        ("return [1.0, float('nan')]",
         "reward u.py:f returned nan for completion 1 (return None for no reward)"),
        ("return [1.0, 'yes']", "reward u.py:f returned 'yes' for completion 1: not a number"),
    ],
)  # fmt: skip
def test_what_a_function_returns_is_checked(tmp_path, body, message):
    func = _functions(tmp_path, f"def f(prompts, completions, **kw):\n    {body}\n")
    with pytest.raises(rewards.RewardError, match="^" + message.replace("(", r"\(")
                       .replace(")", r"\)")):  # fmt: skip
        func(prompts=["p", "q"], completions=["a", "b"])


def test_none_and_numpy_values_pass_as_trl_takes_them(tmp_path):
    func = _functions(tmp_path, "import numpy as np\ndef f(prompts, completions, **kw):\n"
                                "    return [None, np.float32(0.5), True and 1]\n")  # fmt: skip
    assert func(prompts=["p"] * 3, completions=["a", "b", "c"]) == [None, 0.5, 1.0]


def test_the_source_rows_other_columns_reach_the_function(tmp_path):
    """A row's columns from resources/datasets/<name>/data.parquet, by example id (mixture
    copies ":<copy>" too); snaketune's own names are not overwritten."""
    where = tmp_path / "resources/datasets/code"
    where.mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "tests": [["t0"], ["t1a", "t1b"], []],
                             "answer": ["x", "y", "z"], "lang": ["py", "rs", "go"]}),
                   where / "data.parquet")  # fmt: skip
    got = rewards.source_columns(["code:2", "code:1", "code:1:1"])
    assert got == {"code:2": {"prompt": "c", "tests": [], "lang": "go"},
                   "code:1": {"prompt": "b", "tests": ["t1a", "t1b"], "lang": "rs"},
                   "code:1:1": {"prompt": "b", "tests": ["t1a", "t1b"], "lang": "rs"}}  # fmt: skip
    # a step's inputs as TRL holds them: each gets its row's columns, its own keys kept
    inputs = [
        {"example_id": "code:1:1", "prompt": "mine", "answer": "y"},
        {"example_id": "code:2", "prompt": "c", "answer": "z"},
    ]
    rewards.add_columns(inputs, got)
    assert inputs == [{"example_id": "code:1:1", "prompt": "mine", "answer": "y",
                       "tests": ["t1a", "t1b"], "lang": "rs"},
                      {"example_id": "code:2", "prompt": "c", "answer": "z", "tests": [],
                       "lang": "go"}]  # fmt: skip


def test_the_demo_s_function_agrees_with_correctness_on_the_demo_s_questions():
    """config/rewards/arith.py computes the sum from the question's text (no reference
    answer): on the demo's prompts it scores as the built-in correctness does, which is why
    the demo's total reward is unchanged by it."""
    from snaketune.app.fixtures import make_arith

    path = ROOT / "config/rewards/arith.py"
    spec = importlib.util.spec_from_file_location("arith_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = make_arith(40, 0, seed=3)["train"]
    completions = []
    for i, row in enumerate(rows):  # right, off by one, no number, a "####" line, prose
        n = int(row["answer"].split()[-1])
        completions.append([f"#### {n}", f"#### {n + 1}", "I do not know", f"{n}",
                            f"It is {n - 1}.\n#### {n}"][i % 5])  # fmt: skip
    mine = module.sum_from_question(prompts=[""] * len(rows), completions=completions,
                                    question=[r["question"] for r in rows])  # fmt: skip
    assert mine == correctness(completions, [r["answer"] for r in rows])
    assert 0 < sum(mine) < len(rows)


def test_each_reward_is_named_by_its_key_in_metrics_and_summary():
    key = "rewards/code.py:passes"
    logs = {"loss": 0.1, "reward": 1.0, f"rewards/{key}/mean": 0.25, f"rewards/{key}/std": 0.5,
            "rewards/format/mean": 1.0}  # fmt: skip
    fields = step_fields(logs)
    assert fields[f"reward_{key}_mean"] == 0.25 and fields[f"reward_{key}_std"] == 0.5
    assert fields["reward_format_mean"] == 1.0
    metrics = [{"step": s, "reward": s / 8, f"reward_{key}_mean": s / 16} for s in range(1, 9)]
    quarters = reward_quarters(metrics)
    assert quarters[f"reward_first_quarter:{key}"] == pytest.approx((1 + 2) / 2 / 16, abs=1e-4)
    assert quarters[f"reward_last_quarter:{key}"] == pytest.approx((7 + 8) / 2 / 16, abs=1e-4)
    assert extra_columns([quarters]) == [f"reward_first_quarter:{key}",
                                         f"reward_last_quarter:{key}"]  # fmt: skip
    assert not math.isnan(quarters["reward_last_quarter"])
