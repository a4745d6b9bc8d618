"""Answers checked the same way wherever they are scored (the evaluate stage, GRPO's
rewards): GSM8K-style exact match of the number after ``####``, and math-verify on a
generation's final answer (its ``####`` line, else its last ``\\boxed{}``, else its last
number), so ``$1,000``, ``1,000.00``, ``\\boxed{1000}`` and ``1000 dollars`` all match 1000.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def normalise_number(text: str) -> str:
    """'1,234.00' -> '1234', '$5' -> '5', '-3.50' -> '-3.5'."""
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if re.fullmatch(r"-?\d+\.\d+", text):
        text = text.rstrip("0").rstrip(".")
    return text


def parse_answer(text: str) -> str | None:
    """The number after the last ``####`` (None when there is none)."""
    if "####" not in text:
        return None
    match = _NUMBER.search(text.rsplit("####", 1)[1])
    return normalise_number(match.group(0)) if match else None


_LAST_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def last_boxed(text: str) -> str | None:
    """The last ``\\boxed{...}`` of ``text`` (braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start : j + 1]
    return None


def final_answer(text: str) -> str | None:
    """A generation's final answer: the rest of its last ``####`` line, else its last
    ``\\boxed{}``, else its last number (None: none of them)."""
    if "####" in text:
        line = text.rsplit("####", 1)[1].strip().splitlines()
        return line[0].strip() if line and line[0].strip() else None
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _LAST_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def math_verify_match(reference: str | None, answer: str | None) -> bool:
    """math-verify's ``verify(gold, answer)`` (gold first). Its timeouts use signal.alarm, so
    this runs in the main thread."""
    if not reference or not answer:
        return False
    from math_verify import parse, verify

    gold, got = parse(reference), parse(answer.replace("\\$", "$"))  # LaTeX-escaped dollars
    return bool(gold) and bool(got) and bool(verify(gold, got))
