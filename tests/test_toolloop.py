"""The evaluation's tool loop (snaketune.tools.toolloop) in this process, with a scripted
model: the real family tokenizers and templates (Qwen3.5's XML calls, Llama 3's JSON ones
and its printed date), TRL's parser, the user's tools in the runner's process. What each
held-out prompt's trajectory holds, when the loop stops (no call, the rounds spent, a
generation cut by its token limit), a call to a tool that is not there, batches split
across rows, and the figures and the report's text of each trajectory. And the rank's side
of GRPO with tools (snaketune.tools.tooluse.Tools) with a stand-in trainer."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from families import build
from test_toolrunner import TOOLS  # the user's tools file: add, and failing ones

QUESTIONS = ["What is 2 plus 3?", "Use nope.", "Say hi.", "Loop forever."]


def call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}  # fmt: skip


def said(text: str) -> dict:
    return {"role": "assistant", "content": text}


# what the model says to each question, round by round (the last repeats)
SCRIPT = {
    "What is 2 plus 3?": [call("add", a=2, b=3), said("The answer is 5.")],
    "Use nope.": [call("nope", x=1), said("Sorry.")],
    "Say hi.": [said("hi " * 300)],  # past max_new_tokens: cut, no stop token
    "Loop forever.": [call("add", a=1, b=1)],
}


class Scripted:
    """A model whose greedy generation is SCRIPT's next message for the question in each
    prompt, rendered by the model's own template (its tokens up to its stop token). Each
    prompt it was given is kept."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, model_dir, tools):
        from transformers import GenerationConfig

        self.tokenizer, self.tools = tokenizer, tools
        self.generation_config = GenerationConfig.from_pretrained(model_dir)
        self.rounds: dict[str, int] = {}
        self.prompts: list[str] = []

    def completion(self, question: str, message: dict) -> list[int]:
        tok, convo = self.tokenizer, [{"role": "user", "content": question}]
        prompt = tok.apply_chat_template(convo, tools=self.tools, add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
        whole = tok.apply_chat_template([*convo, message], tools=self.tools, tokenize=False)
        assert whole.startswith(prompt)
        ids = tok(whole[len(prompt) :], add_special_tokens=False)["input_ids"]
        stops = self.generation_config.eos_token_id
        end = next(k + 1 for k, t in enumerate(ids) if t in stops)
        return ids[:end]

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **_):
        rows = []
        for ids, mask in zip(input_ids, attention_mask, strict=True):
            prompt = self.tokenizer.decode(ids[mask.bool()])
            self.prompts.append(prompt)
            (question,) = [q for q in SCRIPT if q in prompt]
            k = self.rounds.get(question, 0)
            self.rounds[question] = k + 1
            script = SCRIPT[question]
            rows.append(self.completion(question, script[min(k, len(script) - 1)])[:max_new_tokens])
        width = max(map(len, rows))
        new = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


@pytest.mark.parametrize("family", ["qwen3.5", "llama3"])
def test_the_tool_loop_runs_each_prompt_s_calls_until_it_answers(family, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from snaketune.evaluation.rewards import _load
    from snaketune.tools.toolloop import ToolLoop

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.py").write_text(TOOLS)
    data = tmp_path / "resources/datasets/calc"
    data.mkdir(parents=True)
    pq.write_table(pa.table({"question": ["unused", *QUESTIONS],
                             "answer": ["0", "5", "-", "hi", "2"]}), data / "data.parquet")  # fmt: skip
    model_dir = build(family, QUESTIONS * 2, tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = Scripted(tokenizer, model_dir, [_load("tools.py:add")])
    settings = {
        "tools": ["tools.py:add"], "tool_timeout_s": 10, "tool_max_chars": 100,
        "max_tool_calls": 3,  # odd: 3 + 1 rounds, not 3 | 1
        "sources": {"calc": {"format": "prompt_response",
                             "columns": {"prompt": "question", "response": "answer"}}},
    }  # fmt: skip
    rows = [{"example_id": f"calc:{i + 1}", "input_ids": [], "labels": []} for i in range(4)]
    loop = ToolLoop(settings)
    texts, stopped = loop(model, tokenizer, rows, batch_size=3, max_new_tokens=120)

    assert texts[0] == "The answer is 5." and texts[1] == "Sorry."
    assert texts[2].startswith("hi hi") and texts[3] == ""  # cut; a call past the rounds
    assert stopped == [True, True, False, True]
    add, answer = loop.trajectories["calc:1"][:2], loop.trajectories["calc:1"][2]
    assert add[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert add[1] == {"role": "tool", "name": "add", "content": "5"}
    assert answer["role"] == "assistant" and not answer.get("tool_calls")
    nope = loop.trajectories["calc:2"][1]
    assert nope == {"role": "tool", "name": "nope", "content": "{'error': 'Tool nope not found.'}"}
    assert len(loop.trajectories["calc:3"]) == 1
    # rounds 0 to 2 run their call, round 3's call is said but not run
    looping = loop.trajectories["calc:4"]
    assert [m["role"] for m in looping] == ["assistant", "tool"] * 3 + ["assistant"]
    assert [m["content"] for m in looping if m["role"] == "tool"] == ["2", "2", "2"]
    assert model.rounds == {"What is 2 plus 3?": 2, "Use nope.": 2, "Say hi.": 1,
                            "Loop forever.": 4}  # fmt: skip
    # the second round's prompt holds the first's call and its result
    second = [p for p in model.prompts if "What is 2 plus 3?" in p][1]
    assert second.count("add") >= 2 and "5" in second.split("What is 2 plus 3?")[1]
    if family == "llama3":  # its template prints the day: the training rows' day, not today
        assert all("26 Jul 2024" in p for p in model.prompts), model.prompts[0][:300]

    samples = [{"example_id": r["example_id"]} for r in rows]
    metrics: dict = {}
    loop.finish(samples, metrics)
    assert metrics["tools"] == {"calls_per_sample": 5 / 4, "failures": 1 / 5, "timeouts": 0,
                                "cut": 0, "turns_per_sample": (2 + 2 + 1 + 4) / 4}  # fmt: skip
    assert samples[0]["trajectory"] == loop.trajectories["calc:1"]
    assert samples[0]["trajectory_text"] == '-> add({"a": 2, "b": 3})\n<- 5\nThe answer is 5.'


def test_a_trajectory_is_shown_call_by_call_and_figures_of_no_samples_are_zero():
    from snaketune.tools.toolloop import ToolLoop, shown

    trajectory = [
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
            {"function": {"name": "now", "arguments": None}}]},
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "tool", "name": "now"},
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": "3"},
    ]  # fmt: skip
    assert shown(trajectory) == 'Let me add.\n-> add({"a": 1, "b": 2})\n-> now(null)\n<- 3\n<- \n3'
    assert shown([]) == ""
    loop = ToolLoop({})
    metrics: dict = {}
    loop.finish([], metrics)
    assert metrics["tools"] == {"calls_per_sample": 0.0, "failures": 0.0, "timeouts": 0,
                                "cut": 0, "turns_per_sample": 0.0}  # fmt: skip
    loop.tally.update(calls=3, failures=3, timeouts=1, cut=2)
    loop.trajectories = {"a": trajectory}
    samples = [{"example_id": "a"}, {"example_id": "b"}]
    loop.finish(samples, metrics)
    assert metrics["tools"] == {"calls_per_sample": 1.5, "failures": 1.0, "timeouts": 1,
                                "cut": 2, "turns_per_sample": 1.5}  # fmt: skip
    assert samples[1]["trajectory"] == [] and samples[1]["trajectory_text"] == ""
    one: dict = {}
    loop.tally.update(calls=1, failures=1)
    loop.finish([{"example_id": "a"}], one)  # one prompt, one call: shares of one
    assert (one["tools"]["calls_per_sample"], one["tools"]["failures"]) == (1.0, 1.0)


ROOM = '''
class Room:
    def reset(self, **kwargs):
        return None

    def look(self) -> str:
        """Looks around."""
        return "a door"
'''


def test_a_ranks_tools_give_trl_its_arguments_and_record_each_steps_figures(tmp_path,
                                                                           monkeypatch):  # fmt: skip
    """The rank's side of GRPO with tools (snaketune.tools.tooluse.Tools) with a stand-in
    trainer: the rollout table's prompts made the source rows' conversations, TRL's trainer
    and config arguments (the environment's factory only with one), the first trajectory's
    runs of trained and untrained tokens as the loss masks them (rank 0 only), and the
    runner's counts of this batch, summed, with the mean assistant turns."""
    import json
    from collections import defaultdict
    from types import SimpleNamespace

    from snaketune.tools.tooluse import Tools

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.py").write_text(TOOLS)
    (tmp_path / "room.py").write_text(ROOM)
    data = tmp_path / "resources/datasets/calc"
    data.mkdir(parents=True)
    pq.write_table(pa.table({"question": ["What is 1 plus 1?", "What is 2 plus 3?"],
                             "answer": ["2", "5"]}), data / "data.parquet")  # fmt: skip
    block = {"tools": ["tools.py:add"], "tool_timeout_s": 5, "tool_max_chars": 50,
             "max_tool_calls": 3}  # fmt: skip
    sources = {"calc": {"format": "prompt_response", "system_prompt": "Be brief.",
                        "columns": {"prompt": "question", "response": "answer"}}}  # fmt: skip
    from datasets import Dataset

    table = Dataset.from_dict({"example_id": ["calc:1", "calc:0:1"], "prompt": [[1, 2], [3]]})
    tools = Tools({"grpo": block, "prompt_sources": sources}, "grpo", table)
    try:
        assert tools.table.column_names == ["example_id", "prompt"]
        assert list(tools.table["prompt"]) == [
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 3?"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 plus 1?"}],
        ]  # fmt: skip
        assert [f.__name__ for f in tools.trainer_args["tools"]] == ["add"]
        assert "environment_factory" not in tools.trainer_args
        assert tools.config_args == {"max_tool_calling_iterations": 3}

        metrics = defaultdict(lambda: defaultdict(list))
        trainer = SimpleNamespace(
            accelerator=SimpleNamespace(process_index=0, device="cpu", gather=lambda t: t * 2),
            model=SimpleNamespace(training=True), _metrics=metrics,
            state=SimpleNamespace(global_step=5),
            processing_class=SimpleNamespace(decode=lambda ids: ",".join(map(str, ids))),
        )  # fmt: skip
        path = tmp_path / "trajectories.jsonl"
        # two completions: the first is recorded
        out = {"completion_ids": torch.tensor([[5, 6, 7, 8, 9, 0], [1, 1, 1, 1, 1, 1]]),
               "completion_mask": torch.tensor([[1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]]),
               "tool_mask": torch.tensor([[1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]])}  # fmt: skip
        inputs = [{"example_id": "calc:1", "prompt": "p"}, {"example_id": "calc:0", "prompt": "q"}]
        tools.record(trainer, inputs, out, path)
        assert not path.exists()  # no completions seen yet
        trajectories = [[{"role": "assistant"}, {"role": "tool"}, {"role": "assistant"}],
                        [{"role": "assistant"}]]  # fmt: skip
        tools.observe(trajectories)
        assert tools.turns == [2, 1]
        tools.record(trainer, inputs, out, path)
        (line,) = [json.loads(x) for x in path.read_text().splitlines()]
        assert line == {"step": 6, "example_id": "calc:1", "prompt": "p",
                        "completion": trajectories[0],
                        "runs": [{"text": "5,6", "trained": True}, {"text": "7,8", "trained": False},
                                 {"text": "9", "trained": True}]}  # fmt: skip
        del out["tool_mask"]  # no tool turn in the batch: the completion mask alone
        tools.record(trainer, inputs, out, path)
        last = json.loads(path.read_text().splitlines()[-1])
        assert last["runs"] == [{"text": "5,6,7,8,9", "trained": True}]
        trainer.accelerator.process_index = 1
        tools.record(trainer, inputs, out, path)
        assert len(path.read_text().splitlines()) == 2  # rank 0's only

        tools.runner.counts.timeouts, tools.runner.counts.cut = 1, 2
        tools.figures(trainer)
        got = {k: v for k, v in metrics["train"].items()}
        assert got == {"tools/timeouts": [2], "tools/died": [0], "tools/cut": [4],
                       "tools/turns": [1.5]}  # fmt: skip
        tools.runner.counts.timeouts = 4  # 3 more since: a difference, not 4 ^ 1 or 4 >> 1
        tools.observe([trajectories[0]])  # one completion of 2 turns
        tools.figures(trainer)
        assert (
            metrics["train"]["tools/timeouts"][-1] == 6
            and metrics["train"]["tools/turns"][-1] == 2.0
        )
        one_rank = SimpleNamespace(**{**vars(trainer), "accelerator": SimpleNamespace(
            process_index=0, device="cpu", gather=lambda t: t)})  # fmt: skip
        tools.observe([trajectories[0]])  # one completion on one rank: its 2 turns, not 1
        tools.figures(one_rank)
        assert metrics["train"]["tools/turns"][-1] == 2.0
        # roles as a parsed generation makes them (strings built at run time)
        tools.observe([[{"role": "".join(["assis", "tant"])}, {"role": "".join(["to", "ol"])}]])
        assert tools.turns == [1]
        tools.observe([])
        trainer.model.training = False
        tools.figures(trainer)  # nothing new since: zeros, and no completions no turns
        assert {k: v for k, v in metrics["eval"].items()} == {
            "tools/timeouts": [0], "tools/died": [0], "tools/cut": [0], "tools/turns": [0.0]}  # fmt: skip
    finally:
        tools.close()
    with_room = Tools({"grpo": {**block, "environment": "room.py:Room"},
                       "prompt_sources": sources}, "grpo", table)  # fmt: skip
    try:
        factory = with_room.trainer_args["environment_factory"]
        assert factory.__name__ == "Room" and hasattr(factory(), "look")
    finally:
        with_room.close()


DESK = '''
class Desk:
    """One held-out prompt's desk."""

    def __init__(self):
        self.seen = {}

    def reset(self, **kwargs):
        self.seen = kwargs
        return " (desk " + kwargs["example_id"] + ")"

    def look(self) -> str:
        """Looks at the desk."""
        return "answer " + ",".join(map(str, self.seen["answer"]))

    def _private(self) -> str:
        return "never a tool"

    def get_reward(self) -> float:
        return 1.0
'''


def test_the_tool_loop_with_an_environment_resets_one_per_prompt_and_offers_its_methods(
    tmp_path, monkeypatch
):
    """An environment in the evaluation: each prompt's own instance, reset as training
    resets it (the prompt's messages, the row's answer tokens, its example id), what reset
    returns added to the user's turn, its public methods (not reset, get_reward or a
    private one) the model's tools beside the run's."""
    from transformers import AutoTokenizer

    from snaketune.evaluation.rewards import _load
    from snaketune.tools.toolloop import ToolLoop

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.py").write_text(TOOLS)
    (tmp_path / "desk.py").write_text(DESK)
    data = tmp_path / "resources/datasets/calc"
    data.mkdir(parents=True)
    pq.write_table(pa.table({"question": ["Look around."], "answer": ["-"]}), data / "data.parquet")
    model_dir = build("qwen3.5", ["Look around."] * 4, tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    monkeypatch.setitem(SCRIPT, "Look around.", [call("look"), said("Done.")])
    model = Scripted(tokenizer, model_dir, [_load("tools.py:add")])
    settings = {"tools": ["tools.py:add"], "environment": "desk.py:Desk", "tool_timeout_s": 10,
                "tool_max_chars": 100, "max_tool_calls": 2,
                "sources": {"calc": {"format": "prompt_response", "system_prompt": "Be brief.",
                                     "columns": {"prompt": "question", "response": "answer"}}}}  # fmt: skip
    rows = [{"example_id": "calc:0", "input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}]
    loop = ToolLoop(settings)
    texts, _ = loop(model, tokenizer, rows, batch_size=4, max_new_tokens=120)
    assert texts == ["Done."]
    assert loop.trajectories["calc:0"][1] == {"role": "tool", "name": "look",
                                              "content": "answer 7,8"}  # fmt: skip
    assert all("Look around. (desk calc:0)" in p for p in model.prompts)
    assert "_private" not in model.prompts[0] and '"look"' in model.prompts[0]
    assert "get_reward" not in model.prompts[0] and '"add"' in model.prompts[0]
    # a reset that returns nothing (TRL's contract allows it): the user's turn as it was
    quiet = DESK.replace('return " (desk " + kwargs["example_id"] + ")"', "return None")
    (tmp_path / "quiet.py").write_text(quiet)
    model = Scripted(tokenizer, model_dir, [_load("tools.py:add")])
    loop = ToolLoop({**settings, "environment": "quiet.py:Desk"})
    texts, _ = loop(model, tokenizer, rows, batch_size=4, max_new_tokens=120)
    assert texts == ["Done."] and "(desk" not in model.prompts[0]
    assert "Look around." in model.prompts[0]
