"""snaketune.data.fullrender's pieces (quick): the common prefix its binary search finds,
against a plain character-by-character count over strings with long shared starts. The
spans of every family's template are test_templates.py's."""

from __future__ import annotations

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
