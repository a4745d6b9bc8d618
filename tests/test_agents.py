"""GRPO with tools (snaketune.tools.tooluse): a tiny Llama 3.2 (its Hub template) taught
the call format by SFT on tool-call transcripts, then trained with GRPO calling the user's
tools: one that adds, one that raises, one that hangs past its limit, one that prints a
megabyte. The run goes on; each failure is counted; the rewards see whole trajectories; the
tools' results are not trained on; no tool process outlives the run."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT
from families import build

TOOLS_PY = '''\
import json, os, time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def boom() -> str:
    """A tool that fails."""
    raise ValueError("boom")


def hang() -> str:
    """A tool that never answers."""
    time.sleep(600)
    return "late"


def loud() -> str:
    """A tool that prints a megabyte."""
    print("x" * 1_000_000)
    return "y" * 1_000_000


class Ledger:
    """An environment (its state one rollout's): its reset records what it is given."""

    def reset(self, **kwargs):
        with open("resets.jsonl", "a") as f:
            f.write(json.dumps(sorted(kwargs)) + "\\n")
        self.calls = 0

    def get_reward(self) -> float:
        return 0.5


def finished(prompts, completions, answer, **kwargs):
    """1.0 where the trajectory's last assistant text holds the reference answer; each
    trajectory recorded as the reward saw it (seen.jsonl)."""
    with open("seen.jsonl", "a") as f:
        for p, c in zip(prompts, completions):
            f.write(json.dumps({"prompt": p, "completion": c}, default=str) + "\\n")
    said = [[m.get("content") or "" for m in c if m["role"] == "assistant"] for c in completions]
    return [1.0 if s and a in s[-1] else 0.0 for s, a in zip(said, answer)]
'''
# (prompt, tool, arguments, what the tool says, the answer): the transcripts SFT learns
ASKS = [
    ("Use add on 2 and 3.", "add", {"a": 2, "b": 3}, "5", "The answer is 5."),
    ("Use boom.", "boom", {}, "ValueError: boom", "The tool failed."),
    ("Use hang.", "hang", {}, "hang did not finish within 2 s", "The tool failed."),
    ("Use loud.", "loud", {}, "y" * 40, "Done."),
]
ANSWERS = {"add": "5", "boom": "failed", "hang": "failed", "loud": "Done"}


def schemas(path) -> list[dict]:
    """The tools' JSON schemas, as TRL describes them to the model."""
    import importlib.util

    from transformers.utils import get_json_schema

    spec = importlib.util.spec_from_file_location("agent_tools", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [get_json_schema(getattr(module, n)) for n in ("add", "boom", "hang", "loud")]


def transcripts(tools: list[dict], n: int) -> list[dict]:
    """``n`` tool-call transcripts, the asks in turn (rows of unequal lengths)."""
    rows = []
    for i in range(n):
        prompt, name, args, said, answer = ASKS[i % len(ASKS)]
        call = {"type": "function", "function": {"name": name, "arguments": args}}
        rows.append({"messages": [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": said},
            {"role": "assistant", "content": answer},
        ], "tools": json.dumps(tools)})  # fmt: skip
    return rows


def spawned_children(under: Path) -> dict[int, str]:
    """The multiprocessing spawn children (tool processes among them) running in ``under``
    (a rank's working directory, which its tool process keeps), each with its command line:
    those of tests running beside this one (CI runs four groups at once) are not counted."""
    out = subprocess.run(["pgrep", "-f", "multiprocessing.spawn"], capture_output=True, text=True)
    found = {}
    for pid in map(int, out.stdout.split()):
        try:
            if Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(under):
                found[pid] = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # ended meanwhile
    return found


@pytest.mark.slow
def test_grpo_with_tools_after_sft_survives_failing_tools_and_counts_them(tmp_path):
    import yaml
    from conftest import read_jsonl, snakemake

    w = tmp_path / "w"
    (w / "data").mkdir(parents=True)
    (w / "tools.py").write_text(TOOLS_PY)
    tools = schemas(w / "tools.py")
    rows = transcripts(tools, 64)
    corpus = [json.dumps(r) for r in rows[:8]] * 4
    build("llama3", corpus, w / "models/llama")
    (w / "data/calls.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    asks = [{"prompt": p, "response": ANSWERS[t]} for p, t, *_ in ASKS] * 4
    (w / "data/asks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in asks))
    # held-out prompts as the transcripts ask them, with the transcripts' answers as
    # references (not the GRPO rows': the shard job refuses an eval set sharing rows with
    # the training set). The evaluation's tool loop is checked, not what a 180k-weight model
    # makes of new words: with ", please" added it wrote a malformed call for 2 of 3 here,
    # a rounding away from none, and the test needs calls
    held = [(p, said) for p, _, _, _, said in (ASKS[0], ASKS[1], ASKS[3])]
    (w / "data/held.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "response": a}) + "\n" for p, a in held)
    )
    keys = [f"tools.py:{n}" for n in ("add", "boom", "hang", "loud")]
    config = {
        "models": {"llama": {"source": "local", "path": "models/llama"}},
        "datasets": {
            "calls": {"source": "local", "path": "data/calls.jsonl", "format": "messages"},
            "asks": {"source": "local", "path": "data/asks.jsonl", "format": "prompt_response"},
            "held": {"source": "local", "path": "data/held.jsonl", "format": "prompt_response"},
        },
        "runs": {
            "sft": {"model": "llama", "dataset": "calls", "method": "full", "max_length": 2048,
                    "nodes": 1, "gpus_per_node": 1,
                    "micro_batch_size": 4, "max_steps": 120, "learning_rate": 3e-3,
                    "warmup_ratio": 0.0, "save_steps": 120, "packing": False},
            "agent": {"init_from": "sft", "dataset": "asks", "eval_dataset": "held",
                      "method": "grpo", "eval": {"max_new_tokens": 48, "batch_size": 2},
                      "nodes": 2, "gpus_per_node": 1, "micro_batch_size": 4, "max_length": 2048,
                      "max_steps": 2, "learning_rate": 1e-4, "save_steps": 2,
                      "grpo": {"num_generations": 2, "max_completion_length": 256,
                               "temperature": 0.5, "rewards": {"tools.py:finished": 1.0},
                               "tools": keys, "environment": "tools.py:Ledger",
                               "max_tool_calls": 2, "tool_timeout_s": 2,
                               "tool_max_chars": 200}},
        },
    }  # fmt: skip
    (w / "config.yaml").write_text(yaml.safe_dump(config))
    snakemake("--configfile", str(w / "config.yaml"), "--directory", str(w))
    assert not spawned_children(w), "a tool process outlived its rank"

    steps = [m for m in read_jsonl(w / "results/agent/train/metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    total = {k: sum(m[k] for m in steps) for k in ("tool_timeouts", "tool_cut", "tool_calls")}
    assert all(0 <= m["tool_failures"] <= 1 and m["tool_turns"] >= 1 for m in steps), steps
    # the environment: an instance per rollout, reset with the row, its own reward scored
    # (a step whose hung tool ended the process has none: every instance went with it)
    ledger = [m["reward_Ledger_mean"] for m in steps]
    assert 0.5 in ledger and set(ledger) <= {0.5, None}, ledger
    resets = [set(json.loads(line)) for line in (w / "resets.jsonl").read_text().splitlines()]
    assert len(resets) >= 16 and all({"prompt", "answer", "example_id"} <= r for r in resets)
    # what the rewards saw: whole trajectories, each tool's result as the runner gave it
    seen = read_jsonl(w / "seen.jsonl")
    results: dict[str, list[str]] = {}
    asked = {p for p, *_ in ASKS}
    for s in seen:
        assert len(s["prompt"]) == 1 and s["prompt"][0]["role"] == "user"
        assert s["prompt"][0]["content"] in asked  # the source row's prompt, as messages
        assert isinstance(s["completion"], list) and s["completion"][0]["role"] == "assistant"
        calls = {}
        for m in s["completion"]:
            for c in m.get("tool_calls") or []:
                calls[c["function"]["name"]] = c["function"]["arguments"]
            if m["role"] == "tool":
                results.setdefault(m["name"], []).append(m["content"])
    assert {"add", "boom", "hang", "loud"} <= set(results), results.keys()
    assert any(r == "5" for r in results["add"])
    assert all("ValueError: boom" in r for r in results["boom"])
    assert all("did not finish within 2 s" in r for r in results["hang"])
    assert all(len(r) <= 200 for r in results["loud"])
    assert total["tool_timeouts"] >= 1 and total["tool_cut"] >= 1 and total["tool_calls"] > 0
    # the loss's masks: the tools' results untrained, the model's calls trained
    for line in read_jsonl(w / "results/agent/train/trajectories.jsonl"):
        for run in line["runs"]:
            said = [r for rs in results.values() for r in rs if len(r) > 4 and r in run["text"]]
            assert not (said and run["trained"]), run
        if any(m["role"] == "tool" for m in line["completion"]):
            assert any(r["trained"] for r in line["runs"])
            assert any(not r["trained"] for r in line["runs"])
    check_agent_evaluation(w, held)


def check_agent_evaluation(w, held) -> None:
    """The evaluation of the agent and of the model it started from ran the tool loop on
    each held-out prompt: each trajectory's first answer is plain transformers' greedy
    generation from the prompt rendered with the tools, parsed by the template's own
    parser; each tool turn is what the tool gives; the report shows the trajectories."""
    import importlib.util

    import torch
    from conftest import read_jsonl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import add_response_schema, parse_response

    spec = importlib.util.spec_from_file_location("agent_tools_eval", w / "tools.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    functions = [getattr(module, n) for n in ("add", "boom", "hang", "loud")]
    for stage, model_dir in (("eval", "agent/hf"), ("start_eval", "sft/hf")):  # full runs
        metrics = json.loads((w / f"results/agent/{stage}/metrics.json").read_text())
        samples = read_jsonl(w / f"results/agent/{stage}/samples.jsonl")
        assert [s["reference"] for s in samples] == [a for _, a in held]
        assert set(metrics["tools"]) >= {"calls_per_sample", "failures", "turns_per_sample"}
        path = w / "results" / model_dir
        tok = add_response_schema(AutoTokenizer.from_pretrained(path))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for (prompt, _), sample in zip(held, samples, strict=True):
            chat = [{"role": "user", "content": prompt}]
            ids = tok.apply_chat_template(chat, tools=functions, add_generation_prompt=True,
                                          tokenize=True, return_dict=False)  # fmt: skip
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)
            first = parse_response(tok, out[0, len(ids) :].tolist(), prefix=ids, tools=functions)
            trajectory = sample["trajectory"]
            assert trajectory[0].get("tool_calls") == first.get("tool_calls"), (trajectory, first)
            for call, result in zip(first.get("tool_calls") or [], trajectory[1:], strict=False):
                name, args = call["function"]["name"], call["function"]["arguments"]
                if name == "add":
                    assert result["content"] == str(module.add(**args))
                elif name == "boom":
                    assert "boom" in result["content"]
            assert sample["generation"] == next(
                m.get("content") or "" for m in reversed(trajectory) if m["role"] == "assistant"
            )
    assert metrics["tools"]["calls_per_sample"] > 0
    report = (w / "results/summary.html").read_text()  # the report: each run, its samples
    assert "-&gt; add(" in report or "-&gt; boom(" in report


@pytest.mark.parametrize(
    ("source", "key", "line"),
    [
        ("def add(a: int, b: int) -> int:\n    return a + b\n", "t.py:add",
         "cannot be told what it takes"),
        ("x = 1\n", "t.py:add", "has no function add"),
        ("", "nowhere.py:add", "is not a function of yours"),
        ("raise SystemExit(3)\n", "t.py:add", "importing it failed (SystemExit: 3)"),
    ],
)  # fmt: skip
def test_a_tool_that_cannot_be_used_is_one_line_naming_it(source, key, line, tmp_path,
                                                          monkeypatch):  # fmt: skip
    from snaketune.core.errors import ConfigError
    from snaketune.tools import tooluse

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text(source)
    with pytest.raises(ConfigError) as err:
        tooluse.check("runs.agent", {"tools": [key], "rewards": {"correctness": 1.0}})
    assert str(err.value).startswith(f"runs.agent.grpo.tools: {key!r}") and line in str(err.value)


def test_two_tools_of_one_name_and_a_reward_model_beside_tools_are_refused(tmp_path,
                                                                          monkeypatch):  # fmt: skip
    from snaketune.core.errors import ConfigError
    from snaketune.tools import tooluse

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    (tmp_path / "more.py").write_text(TOOLS_PY)
    block = {"tools": ["tools.py:add", "more.py:add"], "rewards": {"correctness": 1.0}}
    with pytest.raises(ConfigError, match="two tools named add; rename one"):
        tooluse.check("runs.agent", block)
    block = {"tools": ["tools.py:add"], "rewards": {"model:rm": 1.0}}
    with pytest.raises(ConfigError, match="a reward model scores text"):
        tooluse.check("runs.agent", block)
    tooluse.check("runs.agent", {"tools": ["tools.py:add", "tools.py:boom"],
                                 "rewards": {"tools.py:finished": 1.0}})  # fmt: skip


def test_a_grpo_run_without_tools_keeps_its_spec_and_a_tool_s_file_is_in_it(tmp_path,
                                                                            monkeypatch):  # fmt: skip
    """The tool keys' defaults leave a GRPO run's train spec as it was (it does not
    retrain after an upgrade); a tool's file is in the spec's code digests."""
    from snaketune.plan import trainjob
    from snaketune.plan.config import validate_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    config = {
        "models": {"m": {"source": "local", "path": "m"}},
        "datasets": {"asks": {"source": "local", "path": "a.jsonl", "format": "prompt_response",
                              "system_prompt": "Be brief."}},
        "runs": {"rl": {"model": "m", "dataset": "asks", "method": "grpo", "nodes": 1,
                        "gpus_per_node": 1, "max_length": 512, "micro_batch_size": 8,
                        "learning_rate": 1e-5, "max_steps": 4}},
    }  # fmt: skip
    run = validate_config(copy.deepcopy(config))["runs"]["rl"]
    spec = json.loads(trainjob.train_spec(run))
    assert not set(spec["grpo"]) & {"tools", "max_tool_calls", "tool_timeout_s"}
    assert "code_sha256" not in spec and "prompt_sources" not in spec
    config["runs"]["rl"]["grpo"] = {"tools": ["tools.py:add"]}
    loaded = validate_config(config)
    sources = trainjob.prompt_sources(loaded, "rl")
    assert sources == {"asks": {"format": "prompt_response", "system_prompt": "Be brief."}}
    assert sources["asks"]["system_prompt"] == "Be brief."
    spec = json.loads(trainjob.train_spec(loaded["runs"]["rl"], prompt_sources=sources))
    assert spec["grpo"]["tools"] == ["tools.py:add"] and spec["prompt_sources"] == sources
    assert "tool tools.py:add" in spec["code_sha256"]


@pytest.mark.parametrize(("family", "parses"), [("llama3", True), ("qwen3.5", True),
                                                ("smollm3", False)])  # fmt: skip
def test_a_model_whose_template_s_calls_cannot_be_parsed_is_named_before_queueing(
    family, parses, tmp_path
):
    from snaketune.tools.tooluse import template_problem

    model_dir = build(family, ["What is 2 plus 3?"] * 4, tmp_path / family)
    problem = template_problem(model_dir)
    assert (problem is None) == parses, problem
    assert template_problem(tmp_path) is None  # no model there yet: the train job checks
    # a model whose template is in its tokenizer_config.json (no chat_template.jinja)
    older = tmp_path / "older"
    older.mkdir()
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (model_dir / "chat_template.jinja").read_text()
    (older / "tokenizer_config.json").write_text(json.dumps(config))
    assert template_problem(older) == problem


def test_the_built_in_rewards_score_a_trajectory_s_last_answer():
    from snaketune.evaluation.rewards import correctness, format_reward

    trajectory = [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                             "function": {"name": "add"}}]},
        {"role": "tool", "name": "add", "content": "42"},
        {"role": "assistant", "content": "It is\n#### 42"},
    ]  # fmt: skip
    assert correctness([trajectory, trajectory[:2]], ["42", "42"]) == [1.0, 0.0]
    assert format_reward([trajectory, "#### 7", trajectory[:1]]) == [1.0, 1.0, 0.0]


# an environment class whose own methods and helper have no docstring or type hints
SHOP_OWN = (
    "class Shop:\n    def _helper(self, x):\n        return x\n\n"
    "    def get_reward(self):\n        return 1.0\n\n"
    "    def reset(self, **kw):\n        pass\n\n"
)


@pytest.mark.parametrize(
    ("source", "line"),
    [
        ("class Shop:\n    def buy(self, item: str) -> str:\n        return item\n",
         "not a class with a reset(self, **kwargs) method"),
        ("class Shop:\n    def reset(self, **kw):\n        pass\n\n"
         "    def buy(self, item):\n        return item\n", "its method buy cannot be told"),
        ("Shop = 3\n", "not a class with a reset"),
        ("raise SystemExit(3)\n", "importing it failed (SystemExit: 3)"),
        (None, "is not a class of yours"),  # no such file
        # its own reset and get_reward, and a private helper, need no schema; a tool after
        # them (in name order) is still checked
        (f"{SHOP_OWN}    def zap(self, x):\n        return x\n", "its method zap cannot be told"),
    ],
)  # fmt: skip
def test_an_environment_that_cannot_be_used_is_one_line_naming_it(source, line, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    from snaketune.core.errors import ConfigError
    from snaketune.tools import tooluse

    monkeypatch.chdir(tmp_path)
    if source is not None:
        (tmp_path / "shop.py").write_text(source)
    block = {"tools": [], "environment": "shop.py:Shop", "rewards": {"correctness": 1.0}}
    with pytest.raises(ConfigError) as err:
        tooluse.check("runs.agent", block)
    assert str(err.value).startswith("runs.agent.grpo.environment: 'shop.py:Shop'")
    assert line in str(err.value)


def test_an_environment_s_own_methods_and_helpers_need_no_schema(tmp_path, monkeypatch):
    from snaketune.tools import tooluse

    monkeypatch.chdir(tmp_path)
    (tmp_path / "shop.py").write_text(SHOP_OWN)
    tooluse.check("runs.agent", {"tools": [], "environment": "shop.py:Shop",
                                 "rewards": {"correctness": 1.0}})  # fmt: skip


def test_a_run_calls_tools_only_with_tools_or_an_environment():
    from snaketune.methods import calls_tools
    from snaketune.tools.tooluse import name_of

    assert not calls_tools({"method": "grpo", "grpo": {"tools": [], "environment": None}})
    assert calls_tools({"method": "grpo", "grpo": {"tools": ["t.py:add"]}})
    assert calls_tools({"method": "grpo", "grpo": {"tools": [], "environment": "e.py:E"}})
    assert not calls_tools({"method": "lora"})
    assert name_of("tools/t.py:add") == "add"


def test_the_agent_demo_s_fixtures_describe_its_calculator_as_trl_will(tmp_path):
    """The transcripts' tools are what TRL tells the model of the demo's calculator (its
    method's schema); about half of them call it; the held-out questions are not trained."""
    import importlib.util

    from transformers.utils import get_json_schema

    from snaketune.app.agentdemo import make_agent_fixtures

    paths = make_agent_fixtures(tmp_path)
    spec = importlib.util.spec_from_file_location(
        "calculator", ROOT / "config/agent_demo/calculator.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    schema = get_json_schema(module.Calculator().add)
    rows = [json.loads(line) for line in (paths["data"] / "transcripts.jsonl").open()]
    assert all(json.loads(r["tools"]) == [schema] for r in rows)
    calls = sum(len(r["messages"]) == 4 for r in rows) / len(rows)
    assert 0.4 < calls < 0.6, calls
    read = {
        n: [json.loads(x) for x in (paths["data"] / f"{n}.jsonl").open()] for n in ("train", "test")
    }
    assert not {r["question"] for r in read["test"]} & {r["question"] for r in read["train"]}
    assert {r["messages"][0]["content"] for r in rows} == {r["question"] for r in read["train"]}
    env = module.Calculator()
    env.reset(prompt=[{"role": "user", "content": "Compute 3 + 4."}])
    assert env.add() == 7


@pytest.mark.extended
@pytest.mark.slow
def test_the_agent_demo_learns_to_call_its_calculator(tmp_path):
    """config/agent_demo.yaml as documented: SFT on the transcripts, GRPO with the
    calculator; the held-out share of right answers of the GRPO model (the evaluation's tool
    loop) is above the SFT model's (its start's evaluation, the same loop), and it calls the
    calculator more."""
    from conftest import snakemake

    snakemake("--configfile", str(ROOT / "config/agent_demo.yaml"), "--directory", str(tmp_path))
    tuned, start = (json.loads((tmp_path / f"results/agent_grpo/{s}/metrics.json").read_text())
                    for s in ("eval", "start_eval"))  # fmt: skip
    assert tuned["tools"]["calls_per_sample"] > start["tools"]["calls_per_sample"]
    # measured (docs/benchmarks.md, "The agent demo"): the SFT model called the calculator
    # for 0.29 of the questions and answered 0.29 right; the GRPO model 1.0 and 0.92
    assert tuned["math_verify"] >= start["math_verify"] + 0.2, (tuned, start)
