"""Errors meant for users: one readable line naming the problem and the fix.

Entry scripts catch :class:`UserError` and print its message without a traceback;
every other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from typing import Any


class UserError(Exception):
    """Bad input (config, data, paths): the message is shown as is, on one line."""


class ConfigError(UserError):
    """The config does not validate; the message starts with the key path."""


class DataError(UserError):
    """A dataset, model or tokenizer cannot be used as configured."""


class ConfigProblems(ConfigError):
    """Several problems found at once (every missing path, every bad entry): one line each;
    ``other``: problems outside the config (a working directory that takes no file, a
    dataset's rows), shown as "error:" rather than "config error:"."""

    def __init__(self, lines: list[str], other: list[str] | None = None):
        self.lines, self.other = list(lines), list(other or [])
        super().__init__("; ".join(self.lines + self.other))


def require(cond: bool, message: str) -> None:
    """A check: ``message`` as a ConfigError where ``cond`` does not hold."""
    if not cond:
        raise ConfigError(message)


class Collect:
    """Runs checks of independent entries, keeping each one's problem, so that one pass
    names every bad entry (``raise_all`` at the end)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def check(self, func: Any, *args: Any) -> None:
        try:
            func(*args)
        except ConfigProblems as exc:
            self.lines += exc.lines
        except ConfigError as exc:
            self.lines.append(str(exc))

    def raise_all(self) -> None:
        if self.lines:
            raise ConfigProblems(self.lines)


def error_lines(error: UserError) -> list[str]:
    """The lines to show for ``error``: each of several problems, or its one line."""
    return [line for _, line in labelled(error)]


def labelled(error: UserError) -> list[tuple[str, str]]:
    """("config error" or "error", line) for each problem of ``error``."""
    if isinstance(error, ConfigProblems):
        return [("config error", x) for x in error.lines] + [("error", x) for x in error.other]
    return [("config error" if isinstance(error, ConfigError) else "error", str(error))]


def print_error(exc: UserError) -> None:
    """``exc`` as its lines on stderr, each "error: ...", secret values masked."""
    from snaketune.core.redact import redact, secret_values

    for line in error_lines(exc):
        print(f"error: {redact(line, secret_values())}", file=sys.stderr, flush=True)
