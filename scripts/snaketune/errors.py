"""Errors meant for users: one readable line naming the problem and the fix.

Entry scripts catch :class:`UserError` and print its message without a traceback;
every other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input (config, data, paths): the message is shown as is, on one line."""


class ConfigError(UserError):
    """The config does not validate; the message starts with the key path."""


class DataError(UserError):
    """A dataset, model or tokenizer cannot be used as configured."""


class ConfigProblems(ConfigError):
    """Several problems found at once (every missing path, every bad entry): one line each."""

    def __init__(self, lines: list[str]):
        self.lines = list(lines)
        super().__init__("; ".join(self.lines))


def error_lines(error: UserError) -> list[str]:
    """The lines to show for ``error``: each of several problems, or its one line."""
    return list(getattr(error, "lines", None) or [str(error)])
