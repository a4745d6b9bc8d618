"""Secrets stay out of logs: values of environment variables named like a token, key,
secret or password are replaced by ``***`` in every log record.

Names are split at underscores; a part TOKEN, KEY, SECRET, PASSWORD, PASSWD, APIKEY or
CREDENTIALS marks a secret (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, DB_PASSWORD),
TOKENIZERS_PARALLELISM does not. Values shorter than 8 characters are left alone (they
would mask ordinary words and numbers, and are no secret worth the name).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

MARKERS = {"TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "APIKEY", "CREDENTIALS"}
MIN_LENGTH = 8
MASK = "***"


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a secret."""
    return bool(MARKERS & set(name.upper().split("_")))


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values to mask, longest first (so a value containing another is masked whole)."""
    env = os.environ if environ is None else environ
    values = {v for k, v in env.items() if is_secret_name(k) and len(v) >= MIN_LENGTH}
    return sorted(values, key=len, reverse=True)


def redact(text: str, values: list[str]) -> str:
    for value in values:
        text = text.replace(value, MASK)
    return text


class RedactingFilter(logging.Filter):
    """Masks secret values in a record's formatted message (and its traceback text)."""

    def __init__(self, values: list[str] | None = None):
        super().__init__()
        self.values = secret_values() if values is None else values

    def filter(self, record: logging.LogRecord) -> bool:
        if self.values:
            message = record.getMessage()
            clean = redact(message, self.values)
            if clean != message:
                record.msg, record.args = clean, None
            if record.exc_info and not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            if record.exc_text:
                record.exc_text = redact(record.exc_text, self.values)
        return True
