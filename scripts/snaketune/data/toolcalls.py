"""Tool calls in chat rows: the Hub's function-calling layout of a ``messages`` dataset.

- an assistant turn may hold ``tool_calls``: ``[{"type": "function", "function": {"name",
  "arguments"}}]`` (``arguments`` an object, or a JSON string of one; a call without the
  ``function`` wrapper is read too), with or without text content;
- a ``tool`` turn holds a tool's result (its content), after the assistant turn that called
  it (or after another tool turn);
- the row's tools (column ``tools``, a field of the messages format: a list of JSON schemas,
  or a JSON string of one) are what the model's chat template renders for it.

As turns: an assistant turn with calls is ``("assistant", content, reasoning or None,
calls)``, ``calls`` the calls as canonical JSON (snaketune.data.chat renders them as the
template's ``tool_calls``); a tool turn is ``("tool", result)``. A conversation with tools
is a ``Tooled`` tuple (its ``tools`` beside its turns). The assistant turns, their calls
included, are trained; the tool results, like the user's turns, are prompt.

Each row is checked (one line naming the dataset, the row and the field): arguments that
are not a JSON object, a call with no name, a call to a tool the row does not declare (when
it declares any), a tool turn with no call before it, tools that are not a list of schemas.
"""

from __future__ import annotations

import json
from typing import Any

from snaketune.core.errors import DataError

ROLES = ("system", "user", "assistant", "tool")


class Tooled(tuple):
    """A conversation's turns (a tuple, as every row's) and the tools its template renders."""

    tools: list[dict] | None

    def __new__(cls, turns, tools=None):
        made = super().__new__(cls, turns)
        made.tools = tools
        return made


def tools_of(value: Any, where: str) -> list[dict] | None:
    """A row's ``tools`` value as a list of schemas (None: the row declares none)."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: column 'tools' is not JSON ({exc.msg})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"{where}: column 'tools' must be a list of function schemas")
    for schema in value:  # no parameters, read from parquet as null (the download stage)
        inner = schema.get("function", schema)
        params = inner.get("parameters") if isinstance(inner, dict) else None
        if isinstance(params, dict) and "properties" in params and params["properties"] is None:
            params["properties"] = {}
    return value


def tool_name(schema: dict) -> str | None:
    """A tool schema's function name (``{"type": "function", "function": {"name"}}`` or
    ``{"name"}``)."""
    inner = schema.get("function", schema)
    return inner.get("name") if isinstance(inner, dict) else None


def calls_of(message: dict, where: str) -> str | None:
    """An assistant message's tool calls as canonical JSON (None: it calls none)."""
    raw = message.get("tool_calls")
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise DataError(f"{where}: tool_calls must be a list of calls (got {raw!r:.60})")
    calls = []
    for k, call in enumerate(raw):
        inner = call.get("function", call) if isinstance(call, dict) else None
        name = inner.get("name") if isinstance(inner, dict) else None
        if not isinstance(name, str) or not name:
            raise DataError(f"{where} call {k}: a call needs a function name (got {call!r:.60})")
        arguments = inner.get("arguments") or {}  # null: a call of no arguments (parquet)
        if isinstance(arguments, dict):  # an Arrow struct: the keys other calls have, as null
            arguments = {key: v for key, v in arguments.items() if v is not None}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where} call {k} ({name}): arguments are not JSON ({exc.msg}): "
                    f"{arguments!r:.60}"
                ) from None
        if not isinstance(arguments, dict):
            raise DataError(f"{where} call {k} ({name}): arguments must be a JSON object")
        calls.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    return json.dumps(calls, ensure_ascii=False, sort_keys=True)


def check_calls(turns: tuple, tools: list[dict] | None, where: str) -> None:
    """A tool turn only after a call (or another tool turn); every call to a declared tool
    where the row declares tools."""
    declared = {tool_name(t) for t in tools or ()}
    for j, turn in enumerate(turns):
        if turn[0] == "tool" and (
            j == 0 or not (turns[j - 1][0] == "tool" or called(turns[j - 1]))
        ):
            raise DataError(
                f"{where} turn {j}: a tool turn with no call before it (a tool's result follows "
                "the assistant turn whose tool_calls asked for it)"
            )
        for call in json.loads(turn[3]) if called(turn) else ():
            name = call["function"]["name"]
            if tools and name not in declared:
                raise DataError(
                    f"{where} turn {j}: a call to tool {name!r}, which the row's tools do not "
                    f"declare (declared: {', '.join(sorted(filter(None, declared)))})"
                )


def called(turn: tuple) -> bool:
    """Whether ``turn`` is an assistant turn with tool calls."""
    return len(turn) > 3 and turn[3] is not None


def any_calls(turns: tuple) -> bool:
    return any(called(t) or t[0] == "tool" for t in turns)


def marked_field(turn: tuple, k: int, value: str, before: str, after: str) -> str:
    """Turn field ``k``'s ``value`` changed where the render shows it (how
    snaketune.data.chat finds a message in a render): a text between marks; tool calls
    (field 3) with one more argument, named by the marks, after the last call's own (the end
    of what the model writes; a function's name is not changed: some templates print it
    again in the tool's result, Gemma 4's). A calling turn's empty text is left as it is
    (Gemma 4 prints a calling turn's text after the tools' results)."""
    if k == 1 and value == "" and called(turn):
        return value
    if k != 3:
        return f"{before}{value}{after}"
    calls = json.loads(value)
    calls[-1]["function"]["arguments"][f"{before}{after}"] = ""
    return json.dumps(calls, ensure_ascii=False)
