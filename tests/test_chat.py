"""The chat renderer's own rules (snaketune.data.chat), on templates built to hit each, with
a real tokenizer (Qwen3.5's): a verbatim prefix-stable template takes the fast path and it
gives jinja's spans; a template that changes contents, a row with reasoning or tools, a row
a spot check disproves and a row of a shape its probes missed that renders unlike its
prefixes are each rendered by jinja (the last found by the full render, counted); a
template that refuses a probe's roles is probed with the next; the renderer says how it
found each row's spans."""

from __future__ import annotations

import logging

import pytest
from test_fullrender import CHATML

TRIM = CHATML.replace("{{ m.content }}", "{{ m.content | trim }}")
# "@" written out: probes hold none, so only a spot check on a row with one can find it
AT = CHATML.replace("{{ m.content }}", "{{ m.content | replace('@', ' at ') }}")
THOUGHT = CHATML.replace("{{ m.content }}", "{% if m.reasoning_content %}Thought: "
                         "{{ m.reasoning_content }}\n{% endif %}{{ m.content }}")  # fmt: skip
# prefix-stable for the probes' shapes (five messages at most), not for a longer row that
# ends with a user turn: its last message is upper-cased
LONG = CHATML.replace("{{ m.content }}", "{% if loop.last and messages|length > 5 %}"
                      "{{ m.content | upper }}{% else %}{{ m.content }}{% endif %}")  # fmt: skip
NO_SYSTEM = ("{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}"
             "{% endif %}") + CHATML  # fmt: skip
# the last message lower-cased (the probes' contents are upper-case): not prefix-stable
LAST = "{% if loop.last %}{{ m.content | lower }}{% else %}{{ m.content }}{% endif %}"
LAST_LOWER = CHATML.replace("{{ m.content }}", LAST)
# no turn closed, and not prefix-stable: a stop is added after the last turn
OPEN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n" + LAST + "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip

ROWS = (
    (("system", "S"), ("user", "hi"), ("assistant", "yo"), ("user", "and"), ("assistant", "ok")),
    (("user", " lead <|im_end|> {{ x }}"), ("assistant", "a\n\nb ")),
    (("user", "u"), ("assistant", "x"), ("assistant", "y")),
)


@pytest.fixture
def tokenizer(qwen_tokenizer):
    return qwen_tokenizer


def renderer(tokenizer, template):
    from snaketune.data.chat import ChatRenderer

    return ChatRenderer(tokenizer, template=template, stop="<|im_end|>")


def texts(text, spans):
    return [text[a:b] for a, b in spans]


def test_messages_carry_reasoning_and_calls_only_where_a_turn_has_them():
    from snaketune.data.chat import messages_of

    call = '[{"type": "function", "function": {"name": "f", "arguments": {}}}]'
    assert messages_of([("user", "u"), ("assistant", "a", None, None)]) == [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    (message,) = messages_of([("assistant", "", "r", call)])
    assert message["reasoning_content"] == message["thinking"] == "r"
    assert message["tool_calls"][0]["function"]["name"] == "f"


def test_the_special_ids_are_the_tokenizer_s_special_tokens_only(tokenizer):
    made = renderer(tokenizer, CHATML)
    ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>", "<think>", "<tool_call>"])
    assert ids[0] in made._special_ids and ids[1] in made._special_ids
    assert ids[2] not in made._special_ids and ids[3] not in made._special_ids  # added, not special
    assert tokenizer.eos_token_id in made._special_ids  # special by both accounts: kept
    assert made.render_messages([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n"  # no generation prompt unless asked
    )


def test_a_verbatim_template_takes_the_fast_path_and_it_gives_jinja_s_spans(tokenizer):
    made = renderer(tokenizer, CHATML)
    assert made.spans_by == "prefix"
    for row in ROWS:
        text, spans = made.spans(row)
        assert made._layouts[tuple(t[0] for t in row)] is not None, row  # built, not jinja
        assert (text, spans) == made.spans_slow(row)
        assert text == tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in row], chat_template=CHATML, tokenize=False
        )
    text, spans = made.spans(ROWS[0])
    assert texts(text, spans) == ["yo<|im_end|>\n", "ok<|im_end|>\n"]
    assert made.full_rows == 0 and made.describe().count(";") == 0


def test_a_template_that_changes_contents_is_rendered_by_jinja(tokenizer):
    made = renderer(tokenizer, TRIM)
    row = (("user", " hi "), ("assistant", " yo "))
    text, spans = made.spans(row)
    assert made._layouts[("user", "assistant")] is None
    assert texts(text, spans) == ["yo<|im_end|>\n"] and "<|im_start|>user\nhi<|im_end|>" in text


def test_a_turn_with_reasoning_or_a_row_with_tools_is_rendered_by_jinja(tokenizer):
    from snaketune.data.chat import _reasons

    made = renderer(tokenizer, THOUGHT)
    assert made.spans_by == "prefix"
    plain = (("user", "hi"), ("assistant", "yo"))
    made.spans(plain)  # the shape's fast path made first
    text, spans = made.spans((("user", "hi"), ("assistant", "yo", "think")))
    assert texts(text, spans) == ["Thought: think\nyo<|im_end|>\n"]

    class WithTools(tuple):
        tools = [{"type": "function", "function": {"name": "f"}}]

    assert _reasons((("user", "hi"), ("assistant", "yo", None, None))) is False
    assert _reasons((("user", "hi"), ("assistant", "yo", "r"))) is True
    assert _reasons(WithTools(plain)) is True


def test_a_row_its_probes_missed_that_renders_unlike_its_prefixes_is_found_in_the_full_render(
    tokenizer,
):
    made = renderer(tokenizer, LONG)
    assert made.spans_by == "prefix"
    row = tuple((("user", "assistant")[j % 2], f"m{j}") for j in range(7))
    text, spans = made.spans(row)
    assert text.endswith("<|im_start|>user\nM6<|im_end|>\n")
    assert texts(text, spans) == ["m1<|im_end|>", "m3<|im_end|>", "m5<|im_end|>"]
    assert made.full_rows == 1
    assert "; 1 rows rendered unlike their prefixes, found by the full render" in made.describe()
    made.spans(row)
    assert made.full_rows == 2


def test_the_spot_check_drops_a_fast_path_a_row_disproves(tokenizer, caplog):
    made = renderer(tokenizer, AT)
    roles = ("user", "assistant")
    with caplog.at_level(logging.WARNING, logger="snaketune.data.chat"):
        made.check((("user", "a"), ("assistant", "b")))
        assert made._layouts[roles] is not None and not caplog.records  # agreed: kept
        made.check((("user", "a@b"), ("assistant", "c")))
    assert made._layouts[roles] is None
    assert [r.getMessage() for r in caplog.records] == [
        "chat template is not verbatim for this data; rendering every row with jinja"
    ]
    text, spans = made.spans((("user", "x@y"), ("assistant", "z@")))
    assert "x at y" in text and texts(text, spans) == ["z at <|im_end|>\n"]
    full = renderer(tokenizer, LAST_LOWER)
    assert full.spans_by == "full"
    full.check((("user", "a"), ("assistant", "b")))
    reasoned = renderer(tokenizer, THOUGHT)
    reasoned.check((("user", "a"), ("assistant", "b", "r")))
    assert full._layouts == {} and reasoned._layouts == {}  # neither checked on the fast path


def test_a_template_that_refuses_a_probe_s_roles_is_probed_with_the_next(tokenizer):
    assert renderer(tokenizer, NO_SYSTEM).spans_by == "prefix"
    refusing_full = NO_SYSTEM.replace(CHATML, LAST_LOWER)
    assert renderer(tokenizer, refusing_full).spans_by == "full"


def test_the_renderer_says_how_it_found_the_spans(tokenizer):
    from snaketune.data.chat import SPANS_BY

    made = renderer(tokenizer, OPEN)
    assert made.describe() == f"assistant tokens found by {SPANS_BY['full']}"
    made.spans((("user", "hi"), ("assistant", "yo")))
    assert made.describe() == (
        f"assistant tokens found by {SPANS_BY['full']}; the template closes a last assistant "
        "turn with no special token: <|im_end|> (the model's stop token) added after it in 1 rows"
    )


def test_a_template_that_fails_on_calls_renders_none_and_marks_must_wrap_each_turn(tokenizer):
    """A template whose code raises on a call's turn prints no calls (a row with calls is
    refused); ``{% generation %}`` marks around the last assistant turn alone are refused
    (one marked span for two turns), around each turn they are the spans."""
    from snaketune.core.errors import DataError

    raising = CHATML.replace("{{ m.content }}", "{{ m.content }}{% if m.tool_calls %}"
                             "{{ raise_exception('no calls') }}{% endif %}")  # fmt: skip
    assert renderer(tokenizer, raising).renders_calls() is False
    assert renderer(tokenizer, CHATML).renders_calls() is False  # prints none
    printing = CHATML.replace("{{ m.content }}", "{{ m.content }}{% for c in m.tool_calls "
                              "or [] %}{{ c.function.name }}{% endfor %}")  # fmt: skip
    assert renderer(tokenizer, printing).renders_calls() is True
    marked = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' "
              "%}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{% else %}"
              "{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}")  # fmt: skip
    last = marked.replace("m.role == 'assistant'", "m.role == 'assistant' and loop.last")
    row = (("user", "hi"), ("assistant", "yo"), ("user", "and"), ("assistant", "ok"))
    made = renderer(tokenizer, marked)
    assert made.spans_by == "generation"
    text, spans = made.spans(row)
    assert texts(text, spans) == ["yo<|im_end|>", "ok<|im_end|>"]
    with pytest.raises(DataError, match=r"do not wrap each assistant turn once \(1 marked spans\)"):
        renderer(tokenizer, last).spans(row)
    long = row * 150  # 300 assistant turns: counts past the integers Python keeps one of
    assert len(made.spans(long)[1]) == 300


def test_named_templates_use_the_default_one_and_the_first_without(tokenizer):
    from snaketune.data.chat import ChatRenderer

    named = {"tool_use": LAST_LOWER, "default": CHATML}
    assert ChatRenderer(tokenizer, template=named).template == CHATML
    assert ChatRenderer(tokenizer, template={"rag": TRIM, "x": CHATML}).template == TRIM


def test_the_fast_path_takes_roles_built_at_run_time_and_an_empty_turn(tokenizer):
    """Roles read from a dataset are strings built at run time, not the code's literals;
    an assistant turn with no text under a template that closes no turn renders as its
    prompt: an empty span, not a template refused."""
    made = renderer(tokenizer, CHATML)
    row = tuple(("".join(list(role)), text) for role, text in ROWS[0])
    assert made.spans(row) == made.spans_slow(ROWS[0])
    assert made._layouts[tuple(t[0] for t in row)] is not None
    stable_open = CHATML.replace("<|im_end|>\n", "")
    text, spans = renderer(tokenizer, stable_open).spans_slow(
        (("user", "hi"), ("assistant", ""), ("user", "x"), ("assistant", "y"))
    )
    assert texts(text, spans) == ["", "y"]


def test_the_spot_check_drops_a_fast_path_whichever_way_the_texts_differ(tokenizer):
    """The row's text written out is jinja's by equality: a render that sorts after the
    fast path's ("z" for "@") is a difference too."""
    made = renderer(
        tokenizer, CHATML.replace("{{ m.content }}", "{{ m.content | replace('@', 'zz') }}")
    )
    made.check((("user", "a@b"), ("assistant", "c")))
    assert made._layouts[("user", "assistant")] is None


def test_generation_marks_around_more_than_the_assistant_turns_are_refused(tokenizer):
    from snaketune.core.errors import DataError

    every = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% generation %}{{ m.content }}"
             "<|im_end|>{% endgeneration %}\n{% endfor %}")  # fmt: skip
    with pytest.raises(DataError, match=r"\(4 marked spans\)"):
        renderer(tokenizer, every).spans(
            (("user", "hi"), ("assistant", "yo"), ("user", "and"), ("assistant", "ok"))
        )
