"""The evaluation of a run with tools (snaketune.tools.tooluse): the tool loop on each
held-out prompt, its trajectories in the samples and the report, its figures."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from snaketune.evaluation.rewards import text_of
from snaketune.tools.tooluse import prompt_messages


class ToolLoop:
    """The evaluation's generation for a run with tools (``settings``: eval_settings'
    ``tools``): each held-out prompt as its source row's conversation, rendered with the
    tools; the model's greedy answer parsed with its template (TRL's parser), each call run
    through a tool process (as in training: time limit, output cap, failures as text) and
    its result appended, up to ``max_tool_calls`` rounds. The final assistant text is what
    the evaluation scores; ``finish`` adds each sample's trajectory and the tool figures."""

    def __init__(self, settings: Mapping[str, Any]):
        self.settings = dict(settings)
        self.trajectories: dict[str, list[dict]] = {}
        self.tally = {"calls": 0, "failures": 0, "timeouts": 0, "cut": 0}

    def __call__(self, model, tokenizer, rows, batch_size, max_new_tokens, calls=None):
        from trl.chat_template_utils import add_response_schema

        from snaketune.tools.toolrunner import ToolRunner

        s = self.settings
        runner = ToolRunner(
            s["tools"], s["tool_timeout_s"], s["tool_max_chars"], s.get("environment")
        )
        add_response_schema(tokenizer)
        fixed_day(tokenizer)
        messages = prompt_messages([r["example_id"] for r in rows], s["sources"])
        texts, stopped = [], []
        try:
            for i in range(0, len(rows), batch_size):
                batch = rows[i : i + batch_size]
                said, ended = self._batch(model, tokenizer, runner, batch, messages, max_new_tokens)
                for r, trajectory, end in zip(batch, said, ended, strict=True):
                    self.trajectories[r["example_id"]] = trajectory
                    texts.append(text_of(trajectory))
                    stopped.append(end)
        finally:
            counts = runner.counts
            self.tally.update(timeouts=counts.timeouts, cut=counts.cut)
            runner.close()
        return texts, stopped

    def _batch(self, model, tokenizer, runner, batch, messages, max_new_tokens):
        """One batch's trajectories (the messages after each prompt) and whether each
        ended on a stop token; rows that call go on, the others wait."""
        from trl.chat_template_utils import parse_response

        from snaketune.core.rows import pad_id
        from snaketune.evaluation.generation import greedy, stop_ids_of

        pad, stops = pad_id(tokenizer), stop_ids_of(model, tokenizer)
        convos = [list(messages[r["example_id"]]) for r in batch]
        functions = runner.functions()
        tools = [self._tools(runner, functions, r, c) for r, c in zip(batch, convos, strict=True)]
        said: list[list[dict]] = [[] for _ in batch]
        ended, active = [False] * len(batch), list(range(len(batch)))
        for rounds in range(self.settings["max_tool_calls"] + 1):
            render = {"add_generation_prompt": True, "return_dict": False}
            prompts = [
                tokenizer.apply_chat_template(convos[j], **render, tools=tools[j]) for j in active
            ]
            new = greedy(model, prompts, pad, stops, max_new_tokens, None)
            going = []
            for j, prompt, ids in zip(active, prompts, new.tolist(), strict=True):
                end = next((k + 1 for k, t in enumerate(ids) if t in stops), None)
                ended[j] = end is not None
                message = parse_response(tokenizer, ids[:end], prefix=prompt, tools=tools[j])
                convos[j].append(message)
                said[j].append(message)
                if message.get("tool_calls") and rounds < self.settings["max_tool_calls"]:
                    for call in message["tool_calls"]:
                        result = self._run(tools[j], call)
                        convos[j].append(result)
                        said[j].append(result)
                    going.append(j)
            active = going
            if not active:
                break
        return said, ended

    def _tools(self, runner, functions: list, row: dict, convo: list[dict]) -> list:
        """A row's tools: the run's, and (an environment) a fresh instance's methods, reset
        with the row as training resets it (its prompt, answer and example id); what reset
        returns is added to the user's turn."""
        tools = list(functions)
        if not self.settings.get("environment"):
            return tools
        from snaketune.core.rows import prompt_and_answer

        env = runner.environment_class()()
        answer = prompt_and_answer(row["input_ids"], row["labels"])[1]
        seen = env.reset(prompt=list(convo), answer=answer, example_id=row["example_id"])
        if isinstance(seen, str) and convo:
            convo[-1] = {**convo[-1], "content": convo[-1]["content"] + seen}
        own = inspect.getmembers(type(env), predicate=inspect.isfunction)
        skip = ("reset", "get_reward")
        return tools + [getattr(env, n) for n, _ in own if n not in skip and n[0] != "_"]

    def _run(self, tools: list, call: dict) -> dict:
        """A call's ``tool`` message (its result, or its failure as TRL tells it)."""
        function = call.get("function", {})
        name = function.get("name", "unknown")
        by_name = {t.__name__: t for t in tools}
        self.tally["calls"] += 1
        try:
            if name not in by_name:
                raise ValueError(f"Tool {name} not found.")
            content = str(by_name[name](**(function.get("arguments") or {})))
        except Exception as exc:  # noqa: BLE001 -- told to the model, as in training
            self.tally["failures"] += 1
            content = str({"error": str(exc)})
        return {"role": "tool", "name": name, "content": content}

    def finish(self, samples: list[dict], metrics: dict[str, Any]) -> None:
        """Each sample's trajectory (its messages, and as text for the report) and the tool
        figures over the held-out set (``metrics["tools"]``)."""
        turns = 0
        for sample in samples:
            trajectory = self.trajectories.get(sample["example_id"], [])
            sample["trajectory"] = trajectory
            sample["trajectory_text"] = shown(trajectory)
            turns += sum(m.get("role") == "assistant" for m in trajectory)
        n, t = max(len(samples), 1), self.tally
        metrics["tools"] = {
            "calls_per_sample": t["calls"] / n,
            "failures": t["failures"] / max(t["calls"], 1),
            "timeouts": t["timeouts"],
            "cut": t["cut"],
            "turns_per_sample": turns / n,
        }


def shown(trajectory: list[dict]) -> str:
    """A trajectory as the report shows it: each call as ``-> name(arguments)``, each
    result as ``<- result``, the model's text as it is."""
    import json

    lines = []
    for m in trajectory:
        if m.get("role") == "tool":
            lines.append(f"<- {m.get('content', '')}")
            continue
        if m.get("content"):
            lines.append(str(m["content"]))
        for call in m.get("tool_calls") or []:
            f = call.get("function", {})
            lines.append(f"-> {f.get('name')}({json.dumps(f.get('arguments'), default=str)})")
    return "\n".join(lines)


def fixed_day(tokenizer) -> None:
    """Render the prompts on the day the training rows were rendered on
    (snaketune.data.chat.TEMPLATE_DATE), not today, for a template that prints the date:
    apply_chat_template cannot be handed a clock (it turns a callable into its name), so the
    compiled template's own ``strftime_now`` is set, in this evaluation's process."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from snaketune.data.chat import TEMPLATE_DATE, fixed_clock, prints_date

    template = tokenizer.get_chat_template(None, tools=[{}])
    if prints_date(template):
        _compile_jinja_template(template).globals["strftime_now"] = fixed_clock(TEMPLATE_DATE)
