"""Chat templates as tokenize reads them: a conversation rendered with the model's chat
template, with the character spans of its assistant turns (``ChatRenderer``), found from the
template's ``{% generation %}`` marks, from renders of the conversation's prefixes (a
prefix-stable template), or in the one full render (a template that renders earlier turns
unlike the last: Qwen3.5's, Gemma 4's, gpt-oss's, GLM-4.5's).
"""

from __future__ import annotations

import json
import logging
import re

from snaketune.core.errors import DataError

log = logging.getLogger(__name__)


# (role, content), or (role, content, reasoning) for an assistant turn that carries its
# reasoning (a row's ``reasoning_content`` or ``thinking``), or (role, content, reasoning or
# None, calls) for one that calls tools (calls: JSON, snaketune.data.toolcalls)
Turn = tuple[str | None, ...]

# How a template's assistant spans are found (``ChatRenderer.spans_by``), in the words the
# tokenize log and ``snaketune validate`` use.
SPANS_BY = {
    "generation": "the template's {% generation %} marks",
    "prefix": "renders of the conversation's prefixes (the template is prefix-stable)",
    "full": "each assistant message's span in the one full render (the template renders "
    "earlier turns differently from the last one, so prefixes cannot be used)",
}
_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")

# The day a template that prints today's date (gpt-oss's, Llama 3's, SmolLM3's
# ``strftime_now``) renders, unless the model sets ``template_date``: the same rows give the
# same tokens on any day. Llama 3.1's own template falls back to this day without a clock.
TEMPLATE_DATE = "2024-07-26"


def fixed_clock(date: str):
    """A ``strftime_now`` for templates that formats ``date`` (YYYY-MM-DD), not today."""
    import datetime

    day = datetime.datetime.strptime(date, "%Y-%m-%d")
    return day.strftime


def prints_date(template: str) -> bool:
    """Whether a chat template prints today's date (calls ``strftime_now``)."""
    return "strftime_now" in template


def messages_of(turns: list[Turn] | tuple[Turn, ...]) -> list[dict[str, str]]:
    """Turns as the messages a chat template reads; reasoning under both names templates use
    (``reasoning_content``: Qwen, GLM, DeepSeek; ``thinking``: gpt-oss, Gemma), as
    transformers' apply_chat_template aliases it."""
    out = []
    for turn in turns:
        message = {"role": turn[0], "content": turn[1]}
        if len(turn) > 2 and turn[2] is not None:
            message["reasoning_content"] = message["thinking"] = turn[2]
        if len(turn) > 3 and turn[3] is not None:
            message["tool_calls"] = json.loads(turn[3])
        out.append(message)
    return out


# Contents used to check that a template inserts message contents verbatim: padding,
# blank lines, markup and template syntax must all come out unchanged.
_PROBES = ("", " lead and trail \n", "a\n\nb\t", "<think>x</think>y", "{{ x }} {% y %}", "&<>'\"")


def _sentinel(i: int) -> str:
    return f"\ue000{i}\ue001"


class ChatRenderer:
    """Render conversations with a tokenizer's chat template and find the assistant spans.

    The spans come from the template's ``{% generation %}`` marks where it has them, from
    renders of the conversation's prefixes where it is prefix-stable, else from the one
    full render (``SPANS_BY``; ``spans_by`` says which, probed once per template).

    Rendering every row through jinja costs more than encoding it. For a prefix-stable
    template that inserts message contents verbatim between fixed pieces of markup, the
    renderer derives those pieces once per conversation shape (its sequence of roles),
    from a render with placeholder contents, checks them against real renders of probe
    contents, and then builds each row by concatenation. Templates that transform contents
    (trim, escape) fail the check and every row is rendered by jinja.
    """

    def __init__(
        self,
        tokenizer,
        template: str | None = None,
        stop: str | None = None,
        date: str = TEMPLATE_DATE,
    ):
        """``stop``: the model's stop token (its generation config's first), labelled after
        a conversation's last assistant turn where the template closes that turn with no
        special token (GLM-4.5's), so the model learns to stop. ``date``: the day a template
        that prints today's date renders (YYYY-MM-DD; ``TEMPLATE_DATE``)."""
        from transformers.utils.chat_template_utils import _compile_jinja_template

        template = template or tokenizer.chat_template
        if not template:
            raise DataError(
                "the tokenizer has no chat template; "
                "set `chat_template:` (a Jinja file) on the model"
            )
        if isinstance(template, dict):  # named templates: use the default one
            template = template.get("default") or next(iter(template.values()))
        self.template = template
        self._compiled = _compile_jinja_template(template)
        # Template.render() copies the environment's globals into a new context on every
        # call; merge them once and hand jinja a ready context (what render() does next).
        # ``strftime_now`` given as a variable shadows the environment's global of that name
        self.date = date
        self._variables = {**tokenizer.special_tokens_map, "strftime_now": fixed_clock(date)}
        self._base = {**self._compiled.globals, **self._variables}
        self._layouts: dict[tuple[str, ...], tuple | None] = {}
        self.tokenizer = tokenizer
        self.stop = stop
        self.stopped_rows = 0  # rows whose last turn was closed with ``stop``
        decoder = getattr(tokenizer, "added_tokens_decoder", {})
        self._special_ids = set(tokenizer.all_special_ids) | {
            i for i, token in decoder.items() if getattr(token, "special", False)
        }
        self.full_rows = 0  # rows of a prefix-stable template found by the full render
        self.tools: list[dict] | None = None  # the tools of the row being rendered
        self._renders_calls: bool | None = None  # probed on the first row with calls
        self.spans_by = self._spans_by()

    def render(
        self, turns: list[Turn] | tuple[Turn, ...], add_generation_prompt: bool = False
    ) -> str:
        """The template's text for ``turns`` (what apply_chat_template(tokenize=False) gives)."""
        return self.render_messages(messages_of(turns), add_generation_prompt)

    def render_messages(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` as given (a content may be a list of parts)."""
        context = {
            **self._base,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        if self.tools:  # the row's tools, while its spans are found (``spans``)
            context["tools"] = self.tools
        ctx = self._compiled.new_context(context, shared=True)
        return self._compiled.environment.concat(self._compiled.root_render_func(ctx))

    def spans_slow(self, turns: tuple[Turn, ...]) -> tuple[str, list[tuple[int, int]]]:
        """Text and assistant spans, by rendering every prefix through jinja."""
        text = self.render(turns)
        spans = []
        for i, turn in enumerate(turns):
            if turn[0] != "assistant":
                continue
            gen = self.render(turns[:i], add_generation_prompt=True)
            through = self.render(turns[: i + 1]) if i + 1 < len(turns) else text
            if not (text.startswith(gen) and text.startswith(through) and len(gen) <= len(through)):
                raise DataError(
                    "the chat template renders a conversation differently from its prefixes, "
                    "so prompt tokens cannot be masked; use another template (`chat_template:`)"
                )
            spans.append((len(gen), len(through)))
        return text, spans

    def _pieces(self, roles: tuple[str, ...], gen: bool) -> list[str] | None:
        turns = [(r, _sentinel(i)) for i, r in enumerate(roles)]
        text = self.render(turns, add_generation_prompt=gen)
        pieces = []
        for i in range(len(roles)):
            head, sep, text = text.partition(_sentinel(i))
            if not sep or _sentinel(i) in text:
                return None
            pieces.append(head)
        return [*pieces, text]

    def _layout(self, roles: tuple[str, ...]) -> tuple | None:
        """Markup pieces of ``roles`` and of each assistant turn's prefixes, or None."""
        if roles in self._layouts:
            return self._layouts[roles]
        full = self._pieces(roles, gen=False)
        marks = []  # per assistant turn: (markup before its content, markup through its end)
        for i, role in enumerate(roles):
            if role == "assistant" and full is not None:
                gen = self._pieces(roles[:i], gen=True)
                through = self._pieces(roles[: i + 1], gen=False)
                if gen is None or through is None:
                    full = None
                    break
                marks.append((len("".join(gen)), len("".join(through)), i))
        layout = None if full is None else (full, marks)
        if layout is not None:
            for k, probe in enumerate(_PROBES):
                turns = tuple((r, f"{probe}{k}{j}") for j, r in enumerate(roles))
                try:
                    slow = self.spans_slow(turns)
                except DataError:  # this shape renders unlike its prefixes: no fast path
                    slow = None
                if self._spans_fast(turns, layout) != slow:
                    layout = None
                    break
        self._layouts[roles] = layout
        return layout

    @staticmethod
    def _spans_fast(turns: tuple[Turn, ...], layout: tuple) -> tuple[str, list[tuple[int, int]]]:
        full, marks = layout
        parts = [full[0]]
        lengths = [0]
        for turn, piece in zip(turns, full[1:], strict=True):
            content = turn[1]
            parts.append(content)
            parts.append(piece)
            lengths.append(lengths[-1] + len(content))
        spans = [(gen + lengths[i], through + lengths[i + 1]) for gen, through, i in marks]
        return "".join(parts), spans

    def spans(self, turns: tuple[Turn, ...]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans [start, end) of its assistant turns
        (with the conversation's tools where it has them: snaketune.data.toolcalls)."""
        if any(len(t) > 3 and t[3] is not None for t in turns) and not self.renders_calls():
            raise DataError(
                f"{self.tokenizer.name_or_path}: the chat template prints nothing for an "
                "assistant turn's tool_calls, so its calls would not be trained; use a "
                "template that renders tool calls (`chat_template:`)"
            )
        self.tools = getattr(turns, "tools", None)
        try:
            return self._spans(turns)
        finally:
            self.tools = None

    def _spans(self, turns: tuple[Turn, ...]) -> tuple[str, list[tuple[int, int]]]:
        if self.spans_by == "generation":
            return self.spans_marked(turns)
        if self.spans_by == "full":
            return self.spans_full(turns)
        layout = None if _reasons(turns) else self._layout(tuple(t[0] for t in turns))
        if layout is not None:
            return self._spans_fast(turns, layout)
        try:
            return self.spans_slow(turns)
        except DataError:  # this row renders unlike its prefixes (its reasoning, say)
            self.full_rows += 1
            return self.spans_full(turns)

    def renders_calls(self) -> bool:
        """Whether the template prints an assistant turn's tool calls (probed once)."""
        if self._renders_calls is None:
            call = '[{"type": "function", "function": {"name": "probe_fn", "arguments": {}}}]'
            turns = (("user", "U"), ("assistant", "", None, call))
            try:
                self._renders_calls = "probe_fn" in self.render(turns)
            except Exception:  # noqa: BLE001 -- jinja raises what the template's code raises
                self._renders_calls = False
        return self._renders_calls

    def check(self, turns: tuple[Turn, ...]) -> None:
        """Compare the fast path with jinja on one real conversation (a spot check per batch)."""
        if self.spans_by != "prefix" or _reasons(turns):
            return
        roles = tuple(t[0] for t in turns)
        layout = self._layout(roles)
        if layout is not None and self._spans_fast(turns, layout) != self.spans_slow(turns):
            self._layouts[roles] = None
            log.warning(
                "chat template is not verbatim for this data; rendering every row with jinja"
            )

    # ------------------------------------------------------------ templates not prefix-stable

    def _spans_by(self) -> str:
        """How this template's assistant spans are found (a key of SPANS_BY)."""
        if _GENERATION_MARK.search(self.template):
            return "generation"
        for probe in _PROBE_CONVERSATIONS:
            try:
                self.spans_slow(probe)
            except DataError:
                return "full"
            except Exception:  # noqa: BLE001 -- a template that refuses the probe's roles
                continue
        return "prefix"

    def describe(self) -> str:
        """How the spans are found, in words, for the tokenize log and ``snaketune validate``."""
        line = f"assistant tokens found by {SPANS_BY[self.spans_by]}"
        if self.full_rows:
            line += (
                f"; {self.full_rows} rows rendered unlike their prefixes, found by the full render"
            )
        if self.stopped_rows:
            line += (
                f"; the template closes a last assistant turn with no special token: "
                f"{self.stop} (the model's stop token) added after it in "
                f"{self.stopped_rows} rows"
            )
        return line

    def spans_marked(self, turns: tuple[Turn, ...]) -> tuple[str, list[tuple[int, int]]]:
        """Text and spans from the template's ``{% generation %}`` marks (transformers'
        assistant mask), one span per assistant turn. Rendered by the step of transformers'
        render_jinja_template that tracks the marks, on this renderer's compiled template
        with its variables (render_jinja_template itself turns a callable ``strftime_now``
        into its name)."""
        from transformers.utils.chat_template_utils import _render_with_assistant_indices

        text, indices = _render_with_assistant_indices(
            self._compiled, messages_of(turns), self.tools, None, False, **self._variables
        )
        spans = [tuple(span) for span in indices]
        if len(spans) != sum(t[0] == "assistant" for t in turns):
            raise DataError(
                "the chat template's {% generation %} marks do not wrap each assistant turn "
                f"once ({len(spans)} marked spans); mark each assistant message, or remove "
                "the marks to let the assistant turns be found in the render"
            )
        return text, spans

    def spans_full(self, turns: tuple[Turn, ...]) -> tuple[str, list[tuple[int, int]]]:
        """Text and assistant spans from the one full render (snaketune.data.fullrender)."""
        from snaketune.data.fullrender import spans_full

        return spans_full(self, turns)


def _reasons(turns: tuple[Turn, ...]) -> bool:
    """Whether a turn carries more than its text (reasoning, tool calls): the fast path
    builds rows from contents alone."""
    return any(len(t) > 2 and any(v is not None for v in t[2:]) for t in turns) or bool(
        getattr(turns, "tools", None)
    )


# Conversations the template is probed with: two exchanges with a system turn, without and
# with reasoning on the assistant turns.
_PROBE_CONVERSATIONS = (
    (("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2"), ("assistant", "A2")),
    (("user", "U1"), ("assistant", "A1", "R1"), ("user", "U2"), ("assistant", "A2", "R2")),
)
