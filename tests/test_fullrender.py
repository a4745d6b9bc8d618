"""snaketune.data.fullrender's pieces (quick): the common prefix its binary search finds,
against a plain character-by-character count over strings with long shared starts. The
spans of every family's template are test_templates.py's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snaketune.data import fullrender

TEXT = st.text(alphabet="ab", max_size=40)


def plain_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(TEXT, TEXT, TEXT)
def test_the_common_prefix_is_the_plain_count(shared, a, b):
    x, y = shared + a, shared + b
    assert fullrender._common_prefix(x, y) == plain_prefix(x, y)


def test_the_common_prefix_at_its_edges():
    for a, b, n in [("", "", 0), ("", "x", 0), ("abc", "abc", 3), ("abc", "abd", 2),
                    ("abc", "xbc", 0), ("ab", "abc", 2), ("a" * 99 + "b", "a" * 99 + "c", 99)]:  # fmt: skip
        assert fullrender._common_prefix(a, b) == n == fullrender._common_prefix(b, a)


# Templates built to hit each rule of spans_full, rendered by the product's ChatRenderer with
# a real tokenizer (Qwen3.5's, whose <|im_start|> and <|im_end|> are special tokens).
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
# the message count first: the prompt for a turn differs from the full render from char 1
COUNTED = "[{{ messages|length }}]" + CHATML
# no turn closed: a turn ends at the next one's opening token; the last, with none, at stop
OPEN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
# what the model writes before its reasoning ("Thought: ") is trained, the prompt is not
THOUGHT = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}"
           "Thought: {{ m.reasoning_content }}\nAnswer: {% endif %}{{ m.content }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
# earlier assistant turns left out, every content trimmed (not verbatim: one message at a time)
LAST_ONLY = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>"
             "{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip

TURNS = (("user", "hi", None, None), ("assistant", "yo", None, None),
         ("user", "and", None, None), ("assistant", "ok", None, None))  # fmt: skip


@pytest.fixture
def tokenizer(qwen_tokenizer):
    return qwen_tokenizer


def spans_of(tokenizer, template, turns=TURNS):
    from snaketune.data.chat import ChatRenderer

    renderer = ChatRenderer(tokenizer, template=template, stop="<|im_end|>")
    text, spans = renderer.spans_full(turns)
    return text, [text[a:b] for a, b in spans], renderer.stopped_rows


@pytest.mark.parametrize("template", [CHATML, COUNTED])
def test_each_assistant_turn_is_its_text_through_its_end_of_turn(tokenizer, template):
    text, spans, stopped = spans_of(tokenizer, template)
    assert spans == ["yo<|im_end|>", "ok<|im_end|>"] and stopped == 0
    assert text.endswith("<|im_start|>assistant\nok<|im_end|>\n")


def test_a_template_that_closes_no_turn_ends_each_at_the_next_and_the_last_at_stop(tokenizer):
    text, spans, stopped = spans_of(tokenizer, OPEN)
    assert spans == ["yo<|im_start|>", "ok<|im_end|>"] and stopped == 1
    assert text.endswith("assistant\nok<|im_end|>")  # the stop added to the text


def test_the_stop_added_to_a_long_text_ends_the_last_span_at_the_text_s_end(tokenizer):
    """The stop token added where nothing closes the last turn: the span's end is the new
    text's end (a slice would clip one past it), on a text past 256 characters too (no
    identity of small integers to lean on)."""
    from snaketune.data.chat import ChatRenderer

    long = (("user", "x" * 300, None, None), ("assistant", "yo", None, None))
    for turns in (TURNS, long):
        renderer = ChatRenderer(tokenizer, template=OPEN, stop="<|im_end|>")
        text, spans = renderer.spans_full(turns)
        assert spans[-1][1] == len(text)
        assert text[spans[-1][0] : spans[-1][1]] == turns[-1][1] + "<|im_end|>"
        assert renderer.stopped_rows == 1


# no special token at all: each turn ends with its text, and the stop is added only where
# the text itself ends (here it ends with a newline: none is added)
PLAIN = ("{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}### assistant: {% endif %}")  # fmt: skip


def test_a_template_without_special_tokens_ends_each_turn_with_its_text(tokenizer):
    text, spans, stopped = spans_of(tokenizer, PLAIN)
    assert spans == ["yo", "ok"] and stopped == 0 and text.endswith("ok\n")


def test_what_the_model_writes_before_its_reasoning_is_trained(tokenizer):
    turns = (("user", "hi", None, None), ("assistant", "yo", "think", None))
    _, spans, _ = spans_of(tokenizer, THOUGHT, turns)
    assert spans == ["Thought: think\nAnswer: yo<|im_end|>"]


def test_a_turn_the_render_leaves_out_is_empty_and_a_changed_text_is_found_alone(tokenizer):
    """An earlier assistant turn the template drops: an empty span at the text's end; the
    contents trimmed (the marks' render is not the render: each message found by changing
    it alone, _region)."""
    from snaketune.data import fullrender

    turns = (("user", " hi ", None, None), ("assistant", " yo ", None, None),
             ("user", "and", None, None), ("assistant", " ok ", None, None))  # fmt: skip
    text, spans, _ = spans_of(tokenizer, LAST_ONLY, turns)
    assert "yo" not in text and spans == ["", "ok<|im_end|>"]
    from snaketune.data.chat import ChatRenderer

    renderer = ChatRenderer(tokenizer, template=LAST_ONLY)
    assert fullrender._marked_regions(renderer, turns, text) is None
    assert fullrender._region(renderer, turns, 1, text) is None
    start, end = fullrender._region(renderer, turns, 3, text)
    assert text[start:end] == "ok"


class Plain:
    """A renderer of each message's text after its role, as it is."""

    def render(self, turns, add_generation_prompt=False):
        return "".join(f"<{t[0]}>{t[1]}" for t in turns) + (
            "<assistant>" if add_generation_prompt else ""
        )


def test_the_marked_regions_are_where_each_message_sits_up_to_the_mark_count():
    """One render with every message's text between marks of its own: each region where a
    plain search finds the message (unique texts); ``_MAX_MARKED`` messages at most (one
    more: None, found one at a time)."""
    from snaketune.data import fullrender

    turns = tuple((("user", "assistant")[j % 2], f"m{j}.", None, None) for j in range(6))
    text = Plain().render(turns)
    regions = fullrender._marked_regions(Plain(), turns, text)
    for j, turn in enumerate(turns):
        at = text.index(turn[1])
        assert regions[j] == (at, at + len(turn[1])), j
    many = tuple(("user", "x", None, None) for _ in range(fullrender._MAX_MARKED))
    text = Plain().render(many)
    regions = fullrender._marked_regions(Plain(), many, text)
    assert len(regions) == len(many) and regions[len(many) - 1] == (len(text) - 1, len(text))
    more = (*many, ("user", "x", None, None))
    assert fullrender._marked_regions(Plain(), more, Plain().render(more)) is None


# the last message rendered unlike an earlier one (upper-cased): the prompt for a turn
# leaves the render inside the previous message's text, which is not the turn's to train
LAST_UPPER = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if loop.last %}"
              "{{ m.content | upper }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
# the last message closed unlike an earlier one ("!" after it): the prompt leaves the render
# right at the previous message's end, and all after it is the turn's (the rule's edge)
LAST_BANG = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
             "{% if loop.last %}!{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
# a generation prompt that writes the first letter of the answer for the model: past the
# message's start, so the message's whole text is trained
PREFILL = CHATML.replace(
    "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\ny{% endif %}"
)
FOUR = (("user", "Hi", None, None), ("assistant", "yo", None, None),
        ("user", "And", None, None), ("assistant", "ok", None, None))  # fmt: skip


def test_a_prompt_that_leaves_the_render_before_the_turn_s_place_is_not_trained(tokenizer):
    """The prompt for a turn leaves the full render inside the previous message (upper-cased
    there, first message and a later one): the span starts where the message does; at the
    previous message's very end: from there; past the message's start: the message's text."""
    text, spans, _ = spans_of(tokenizer, LAST_UPPER, FOUR)
    assert spans == ["yo<|im_end|>", "OK<|im_end|>"], spans
    _, spans, _ = spans_of(tokenizer, LAST_BANG, FOUR)
    assert spans == ["<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>",
                     "<|im_end|>\n<|im_start|>assistant\nok!<|im_end|>"], spans  # fmt: skip
    _, spans, _ = spans_of(tokenizer, PREFILL, FOUR)
    assert spans == ["yo<|im_end|>", "ok<|im_end|>"], spans


def test_a_turn_s_end_is_looked_for_before_the_next_message_only(tokenizer):
    """No special token between the messages (PLAIN): a special token inside the next
    message's text is its own, not the turn's end (the next message of the second turn, the
    fourth message, not the message at twice its index)."""
    turns = (("user", "hi", None, None), ("assistant", "yo", None, None),
             ("user", "a<|im_end|>b", None, None), ("assistant", "go", None, None),
             ("user", "c<|im_end|>", None, None), ("assistant", "ok", None, None))  # fmt: skip
    _, spans, _ = spans_of(tokenizer, PLAIN, turns)
    assert spans == ["yo", "go", "ok"], spans


# a call's turn as Gemma 4 writes it: the call closed by a special token (<|vision_end|>
# stands for <tool_call|>), the tool's answer opened by another (<|vision_start|> for
# <|tool_response>), which the call's turn ends with when it is the last message: the model
# writes it, so it is trained. UNCLOSED closes the call only where a message follows;
# OTHER ends it with another token when it is the last
CALL = ("{% for m in messages %}{% if m.role == 'tool' %}<|vision_start|>{{ m.content }}"
        "<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in "
        "m.tool_calls or [] %}[{{ c.function.name }}{% for k, v in c.function.arguments.items() "
        "%} {{ k }}={{ v }}{% endfor %}]{% endfor %}{% if m.tool_calls %}CLOSE{% if loop.last "
        "%}LAST{% endif %}{% else %}<|im_end|>\n{% endif %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
CALL_OPENS = CALL.replace("CLOSE", "<|vision_end|>").replace("LAST", "<|vision_start|>")
CALL_UNCLOSED = CALL.replace("CLOSE{% if loop.last %}LAST{% endif %}",
                             "{% if not loop.last %}<|vision_end|>{% endif %}")  # fmt: skip
CALL_OTHER = CALL.replace("CLOSE", "<|vision_end|>").replace("LAST", "<|im_end|>")


def test_a_call_s_turn_is_trained_through_what_the_template_ends_it_with_when_last(tokenizer):
    """Gemma 4's rule, the call the fourth message (its turn's index not doubled by a
    shift): the response opener is the call's when the call as the last message ends with
    it; not where the template ends it with something else or closes it only when a
    message follows."""
    import json

    call = json.dumps([{"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}])
    turns = (("user", "hi", None, None), ("assistant", "yo", None, None),
             ("user", "add", None, None), ("assistant", "", None, call),
             ("tool", "5", None, None), ("assistant", "ok", None, None))  # fmt: skip
    _, spans, _ = spans_of(tokenizer, CALL_OPENS, turns)
    assert spans == ["yo<|im_end|>", "[add a=2]<|vision_end|><|vision_start|>", "ok<|im_end|>"]
    for template in (CALL_UNCLOSED, CALL_OTHER):
        _, spans, _ = spans_of(tokenizer, template, turns)
        assert spans == ["yo<|im_end|>", "[add a=2]<|vision_end|>", "ok<|im_end|>"], spans


def test_a_tokenizer_that_adds_a_bos_token_still_ends_each_turn_at_its_end_of_turn(tmp_path):
    """A tokenizer that adds a BOS token to what it encodes (Llama 3's and Gemma's do): the
    end of a turn is looked for in the text alone, not at a BOS the text does not hold."""
    from families import build
    from tokenizers import processors
    from transformers import AutoTokenizer

    from snaketune.data.chat import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(build("qwen3.5", ["hi yo and ok"] * 4, tmp_path))
    bos = (tokenizer.bos_token, tokenizer.bos_token_id)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos[0]} $A", special_tokens=[bos]
    )
    assert tokenizer("x").input_ids[0] == bos[1]  # it adds one
    renderer = ChatRenderer(tokenizer, template=CHATML, stop="<|im_end|>")
    text, spans = renderer.spans_full(TURNS)
    assert [text[a:b] for a, b in spans] == ["yo<|im_end|>", "ok<|im_end|>"]


# a message the template leaves out ("note") right before a turn whose prompt leaves the
# render before the turn's text (the thought's label): the previous message that holds a
# place is looked for one by one back to the first, and none is the text's start
NOTE_DROPPED = THOUGHT.replace(
    "{% for m in messages %}", "{% for m in messages %}{% if m.role != 'note' %}"
).replace("<|im_end|>\n{% endfor %}", "<|im_end|>\n{% endif %}{% endfor %}")


@pytest.mark.parametrize("first", [(), (("user", "hi", None, None),)], ids=["alone", "after-user"])
def test_a_left_out_message_before_a_turn_leaves_the_turn_its_label(tokenizer, first):
    turns = (*first, ("note", "x", None, None), ("assistant", "yo", "think", None))
    text, spans, _ = spans_of(tokenizer, NOTE_DROPPED, turns)
    assert "x" not in text.replace("Answer", "")
    assert spans == ["Thought: think\nAnswer: yo<|im_end|>"], spans


def test_a_prompt_leaving_the_render_inside_a_message_before_a_left_out_one_is_not_trained(
    tokenizer,
):
    """The prompt leaves the render inside the user's text (upper-cased in a render of an
    odd count), with a left-out message between it and the turn: the user's text is not
    the turn's, which starts with its own text (the label is the prompt's, left out)."""
    odd = NOTE_DROPPED.replace(
        "{{ m.content }}", "{{ m.content | upper if messages|length is odd else m.content }}"
    )
    turns = (("user", "Hi", None, None), ("note", "x", None, None),
             ("assistant", "yo", "think", None))  # fmt: skip
    text, spans, _ = spans_of(tokenizer, odd, turns)
    assert "HI" in text and spans == ["think\nAnswer: YO<|im_end|>"], spans
