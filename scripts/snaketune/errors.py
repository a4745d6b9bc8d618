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
