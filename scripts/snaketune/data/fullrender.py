"""Assistant spans of a template that renders earlier turns unlike the last (Qwen3.5's,
Gemma 4's, gpt-oss's, GLM-4.5's): found in the one full render of a conversation, where each
message's text sits (``ChatRenderer.spans_full`` of snaketune.data.chat; each function
takes the renderer).
"""

from __future__ import annotations

import re

from snaketune.data.toolcalls import marked_field

Turn = tuple[str | None, ...]

# Characters put around a message's content to find where the render holds it (private use).
_MARK_OPEN, _MARK_CLOSE = "\ue010", "\ue011"
# A message's own mark beside them (private use too): message j is chr(_TAG + j).
_TAG, _MAX_MARKED = 0xE100, 0x400
_MARKS = re.compile("\ue010[\ue100-\ue4ff]|[\ue100-\ue4ff]\ue011")


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


def spans_full(renderer, turns: tuple[Turn, ...]) -> tuple[str, list[tuple[int, int]]]:
    """Text and assistant spans from the one full render. Each message's place in it is
    where the render changes when that message's text changes; an assistant span starts
    where the generation prompt for it stops matching the render (the markup the model is
    prompted with is not trained, what it writes after is: an opened thought block's end,
    a channel header) and ends with the first special token after the message (its end
    of turn, or the next turn's opening token where a template closes none: GLM)."""
    text = renderer.render(turns)
    regions = _marked_regions(renderer, turns, text) or {}

    def region(j: int) -> tuple[int, int] | None:
        if j not in regions:
            regions[j] = _region(renderer, turns, j, text)
        return regions[j]

    spans = []
    for i, turn in enumerate(turns):
        if turn[0] != "assistant":
            continue
        own = region(i)
        if own is None:  # the render leaves the message out: nothing to learn
            spans.append((len(text), len(text)))
            continue
        start, end = own
        before = next((r[1] for j in range(i - 1, -1, -1) if (r := region(j))), 0)
        prompted = _common_prefix(renderer.render(turns[:i], add_generation_prompt=True), text)
        if before <= prompted <= start:
            start = prompted
        limit = next((r[0] for j in range(i + 1, len(turns)) if (r := region(j))), len(text))
        closed = _end_of_turn(renderer, text, end, limit)
        if len(turn) > 3 and turn[3] is not None:  # a call: through what the template
            # ends it with when it is the last message (Gemma 4's <|tool_response>)
            through = renderer.render(turns[: i + 1]).rstrip("\n")
            if text.startswith(through) and closed < len(through) <= limit:
                closed = len(through)
        if closed == end == len(text) and renderer.stop:  # nothing closes the last turn
            text, closed = text + renderer.stop, len(text) + len(renderer.stop)
            renderer.stopped_rows += 1
        spans.append((start, closed))
    return text, spans


def _marked_regions(renderer, turns: tuple[Turn, ...], text: str) -> dict | None:
    """Every message's region of ``text`` from one render with each message's texts
    between marks of its own: where the template inserts them verbatim (the render less
    the marks is ``text``), a message's region runs from its first mark to its last
    (None: the render leaves it out); None where the template changed them (the regions
    are then found one message at a time, ``_region``)."""
    if len(turns) > _MAX_MARKED:
        return None
    marked = tuple(
        tuple(
            value
            if k == 0 or value is None
            else marked_field(
                turn, k, value, f"{_MARK_OPEN}{chr(_TAG + j)}", f"{chr(_TAG + j)}{_MARK_CLOSE}"
            )
            for k, value in enumerate(turn)
        )
        for j, turn in enumerate(turns)
    )
    render = renderer.render(marked)
    if _MARKS.sub("", render) != text:
        return None
    regions: dict[int, tuple[int, int] | None] = dict.fromkeys(range(len(turns)))
    for k, found in enumerate(_MARKS.finditer(render)):
        mark, at = found.group(), found.start() - 2 * k  # its place in ``text``
        j = ord(mark[1] if mark[0] == _MARK_OPEN else mark[0]) - _TAG
        start, end = regions[j] or (at, at)
        regions[j] = (min(start, at), max(end, at))
    return regions


def _region(renderer, turns: tuple[Turn, ...], j: int, text: str) -> tuple[int, int] | None:
    """[start, end) of ``text`` that holds message ``j`` (its reasoning and content)."""
    turn = turns[j]
    changed = tuple(
        value if k == 0 or value is None else marked_field(turn, k, value, _MARK_OPEN, _MARK_CLOSE)
        for k, value in enumerate(turn)
    )
    other = renderer.render((*turns[:j], changed, *turns[j + 1 :]))
    if other == text:
        return None
    start = _common_prefix(text, other)
    end = len(text) - _common_prefix(text[::-1], other[::-1])
    return start, max(start, end)


def _end_of_turn(renderer, text: str, end: int, limit: int) -> int:
    """``end`` moved past the first special token in ``text[end:limit]`` (unchanged when
    there is none)."""
    piece = text[end:limit]
    if not piece:
        return end
    encoding = renderer.tokenizer.backend_tokenizer.encode(piece, add_special_tokens=False)
    for token, (_, stop) in zip(encoding.ids, encoding.offsets, strict=True):
        if token in renderer._special_ids:
            return end + stop
    return end
