"""GRPO with tools (``grpo.tools``): the model calls the user's functions during its
rollouts, TRL's GRPOTrainer runs the loop, snaketune.tools.toolrunner runs the calls.

A tool is named as a user's reward is (``"<path/to/file.py>:<function>"``); its name,
signature and docstring are what the model is told (transformers' ``get_json_schema``: the
function needs type hints and a docstring with its arguments). With tools, each rollout
prompt is the conversation its source row makes (the system prompt and the user's turn),
which TRL renders with the tools' block; a completion the model's template parses as calls
(TRL's response schema of the template: Qwen3/Qwen3.5, Llama 3.x, GLM-4.5, gpt-oss, Gemma 4)
gets each call run, its result appended as a ``tool`` turn, and the model continues, up to
``max_tool_calls`` rounds. A call runs in the rank's tool process with a time limit and an
output cap: a tool that raises, hangs or dies is the model's text, never the rank's end.
The tool results' tokens are masked out of the loss (TRL's ``tool_mask``). Rewards get the
whole trajectory (the completion's messages: calls, results, final answer); the built-ins
score its last assistant text. Each step logs calls per completion, the failed share, and
the runner's timeouts, outputs cut and dead processes (``tool_*`` in metrics.jsonl).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from snaketune.core.errors import ConfigError

# runs.<run>.grpo's tool keys (snaketune.methods.grpo adds them to its block)
SCHEMA = """\
  tools:
    description: >-
      Functions of yours the model may call during its rollouts,
      "<path/to/file.py>:<function>" (found as reward functions' files are): each
      with type hints and a docstring naming its arguments (what the model is told).
      Each call runs in a separate process with tool_timeout_s; what it raises is
      the model's text. Rewards see the whole trajectory; tool results are not
      trained on (docs/agents.md).
    type: array
    items:
      type: string
    default: []
  environment:
    description: >-
      EXPERIMENTAL (TRL's environment_factory): "<path/to/file.py>:<Class>", a class
      whose instance holds one rollout's state: reset(**row) starts it (it gets the
      prompt, the answer and the row's other columns; what it returns is added to the
      prompt), its public methods are tools (as `tools` are: type hints, docstring),
      and get_reward(), where it has one, is a reward. Each instance lives in the
      rank's tool process (docs/agents.md).
    type: string
  max_tool_calls:
    description: Rounds of tool calls a completion may make before it must answer.
    type: integer
    minimum: 1
    default: 4
  tool_timeout_s:
    description: Seconds a tool call may run; past it the call is ended and the model told.
    type: number
    exclusiveMinimum: 0
    default: 10
  tool_max_chars:
    description: Characters of a tool's result (and what it prints) the model is shown.
    type: integer
    minimum: 1
    default: 4096
"""
KEYS = ("tools", "environment", "max_tool_calls", "tool_timeout_s", "tool_max_chars")


def uses_tools(block: Mapping[str, Any]) -> bool:
    """Whether a GRPO block gives the model tools (its own, or an environment's)."""
    return bool(block.get("tools") or block.get("environment"))


def in_spec(block: Mapping[str, Any]) -> dict[str, Any]:
    """The block as the train job's spec holds it: without the tool keys when it has no
    tools (a run made before them keeps its settings, and does not retrain)."""
    return dict(block) if uses_tools(block) else {k: v for k, v in block.items() if k not in KEYS}


def name_of(key: str) -> str:
    """A tool's name (its function's)."""
    return key.rsplit(":", 1)[1]


def check(where: str, block: Mapping[str, Any]) -> None:
    """One line for the first tool that cannot be used: not a ``file.py:function`` key, a
    file that is not there or does not import, no such function, two of one name, no schema
    transformers can make of it; a reward model beside tools."""
    from transformers.utils import get_json_schema

    from snaketune.evaluation.rewards import USER_KEY, _load, located

    seen: set[str] = set()
    for key in block.get("tools", []):
        at = f"{where}.grpo.tools: {key!r}"
        if not USER_KEY.match(key) or located(key) is None:
            raise ConfigError(
                f"{at} is not a function of yours: give '<path/to/file.py>:<function>', the "
                "file's path from the directory snakemake runs in (or an absolute one)"
            )
        try:
            func = _load(key)
        except BaseException as exc:  # its module's own failure
            raise ConfigError(f"{at}: importing it failed ({type(exc).__name__}: {exc})") from None
        if not callable(func):
            raise ConfigError(f"{at}: the file has no function {name_of(key)}; fix the name")
        if name_of(key) in seen:
            raise ConfigError(f"{at}: two tools named {name_of(key)}; rename one")
        seen.add(name_of(key))
        try:
            get_json_schema(func)
        except Exception as exc:  # transformers' docstring and type-hint parsing errors
            raise ConfigError(
                f"{at}: the model cannot be told what it takes ({exc}); give it type hints "
                f"and a docstring with an Args: section, as {name_of(key)}{inspect.signature(func)}"
            ) from None
    if block.get("environment"):
        check_environment(where, block["environment"])
    if uses_tools(block) and any(k.startswith("model:") for k in block["rewards"]):
        raise ConfigError(
            f"{where}.grpo.rewards: a reward model scores text, not a tool-calling "
            "trajectory; score it with a function of yours (docs/agents.md)"
        )


def check_environment(where: str, key: str) -> None:
    """One line for an environment that cannot be used: not a ``file.py:Class`` key, a file
    that does not import, no such class, no ``reset``, a method the model cannot be told of."""
    from transformers.utils import get_json_schema

    from snaketune.evaluation.rewards import USER_KEY, _load, located

    at = f"{where}.grpo.environment: {key!r}"
    if not USER_KEY.match(key) or located(key) is None:
        raise ConfigError(f"{at} is not a class of yours: give '<path/to/file.py>:<Class>'")
    try:
        cls = _load(key)
    except BaseException as exc:  # its module's own failure
        raise ConfigError(f"{at}: importing it failed ({type(exc).__name__}: {exc})") from None
    if not inspect.isclass(cls) or not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"{at}: not a class with a reset(self, **kwargs) method (TRL's contract)")
    for name, method in inspect.getmembers(cls, predicate=inspect.isfunction):
        if name.startswith("_") or name in ("reset", "get_reward"):
            continue
        try:
            get_json_schema(method)
        except Exception as exc:  # transformers' docstring and type-hint parsing errors
            raise ConfigError(
                f"{at}: its method {name} cannot be told to the model ({exc}); give it type "
                "hints and a docstring with an Args: section"
            ) from None


def digests(block: Mapping[str, Any]) -> dict[str, str]:
    """sha256 of each tool's file (and the environment's), by ``tool <key>`` (a changed
    tool retrains the run)."""
    from snaketune.evaluation.rewards import located

    out = {}
    for key in [*block.get("tools", []), *filter(None, [block.get("environment")])]:
        path = located(key)
        if path is not None:
            out[f"tool {key}"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def template_problem(model_dir: Path) -> str | None:
    """Why tool calls cannot be parsed from the model's generations (its chat template is
    none TRL knows the call format of), or None; None too when no template is there yet."""
    import json
    from types import SimpleNamespace

    from trl.chat_template_utils import add_response_schema

    text = None
    if (model_dir / "chat_template.jinja").is_file():
        text = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    elif (model_dir / "tokenizer_config.json").is_file():
        text = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if not isinstance(text, str):
        return None
    try:
        add_response_schema(SimpleNamespace(chat_template=text))
    except ValueError:
        return (
            "its chat template is not one whose tool calls TRL can parse (Qwen3, Qwen3.5, "
            "Llama 3.1/3.2, GLM-4.5, gpt-oss, Gemma 4 and others: docs/agents.md)"
        )
    return None


def prompt_messages(example_ids: list[str], sources: Mapping[str, Any]) -> dict[str, list]:
    """Each example's prompt as messages (its source row's turns before the answer), by
    example id; ``sources``: the datasets' specs by name (the spec's ``prompt_sources``)."""
    from snaketune.data.conversations import Source, conversations
    from snaketune.evaluation.rewards import DATASETS, source_of, source_rows

    turns = {}
    for name, (order, table) in source_rows(example_ids).items():
        path = DATASETS / name / "data.parquet"
        source = Source(name, path, dict(sources[name]))
        read = conversations(source, table.to_batches()[0], order)
        for row, convo in zip(order, read, strict=True):
            turns[(name, row)] = [{"role": t[0], "content": t[1]} for t in convo[:-1]]
    return {e: turns[source_of(e)] for e in example_ids}


class Tools:
    """A GRPO run's tools on this rank: the runner, what TRL's trainer and config take, the
    rollout table with conversational prompts, and each step's figures (``figures``)."""

    def __init__(self, run: Mapping[str, Any], block: str, table):
        from snaketune.tools.toolrunner import ToolRunner

        b = run[block]
        self.runner = ToolRunner(
            b["tools"], b["tool_timeout_s"], b["tool_max_chars"], b.get("environment")
        )
        messages = prompt_messages(list(table["example_id"]), run["prompt_sources"])
        prompts = [messages[e] for e in table["example_id"]]
        self.table = table.remove_columns("prompt").add_column("prompt", prompts)
        self.trainer_args = {"tools": self.runner.functions()}
        if b.get("environment"):  # TRL's experimental environment_factory
            self.trainer_args["environment_factory"] = self.runner.environment_class()
        self.config_args = {"max_tool_calling_iterations": b["max_tool_calls"]}
        self._seen = self.runner.counts.__dict__.copy()
        self.turns: list[int] = []  # assistant turns of each completion of the last batch
        self.completions: list = []

    def observe(self, completions: list) -> None:
        """The batch's completions (trajectories) as TRL's rewards get them."""
        self.completions = completions
        self.turns = [sum(m.get("role") == "assistant" for m in c) for c in completions]

    def record(self, trainer, inputs: list[dict], out: dict, path: Path) -> None:
        """Rank 0's first trajectory of a training step, as one line of ``path``: its prompt
        and completion messages, and the completion's text in runs of trained (the model's
        own tokens) and untrained (the tools' results) tokens, as the loss masks them."""
        import json

        if trainer.accelerator.process_index != 0 or not self.completions:
            return
        ids, mask = out["completion_ids"][0], out["completion_mask"][0].bool()
        trained = out["tool_mask"][0] if "tool_mask" in out else mask.int()
        runs: list[list] = []
        for token, keep in zip(ids[mask].tolist(), trained[mask].tolist(), strict=True):
            if runs and runs[-1][1] == bool(keep):
                runs[-1][0].append(token)
            else:
                runs.append([[token], bool(keep)])
        decode = trainer.processing_class.decode
        line = {
            "step": trainer.state.global_step + 1,
            "example_id": inputs[0]["example_id"],
            "prompt": inputs[0]["prompt"],
            "completion": self.completions[0],
            "runs": [{"text": decode(t), "trained": k} for t, k in runs],
        }
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, default=str) + "\n")

    def figures(self, trainer) -> None:
        """This generation batch's runner counts (every rank's, summed) and mean assistant
        turns per completion, into TRL's step metrics (``tools/*``: metrics.jsonl's
        ``tool_*``)."""
        import torch

        now = self.runner.counts.__dict__.copy()
        names = ("timeouts", "died", "cut")
        local = [now[k] - self._seen[k] for k in names] + [sum(self.turns), len(self.turns)]
        self._seen = now
        device = trainer.accelerator.device
        total = trainer.accelerator.gather(torch.tensor(local, device=device)[None]).sum(0)
        mode = "train" if trainer.model.training else "eval"
        for i, k in enumerate(names):
            trainer._metrics[mode][f"tools/{k}"].append(total[i].item())
        trainer._metrics[mode]["tools/turns"].append((total[3] / max(total[4], 1)).item())

    def close(self) -> None:
        """End the rank's tool process."""
        self.runner.close()
