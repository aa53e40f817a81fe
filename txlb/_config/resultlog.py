"""
The ``--log-*`` options: where the result log goes, its form, and what it may keep.

What is private in an answer -- its text, the client's ``user``, an error body -- is kept
only as far as these allow, so their rules are in one place.
"""

from __future__ import annotations

from txlb._config.bounds import MAX_PREVIEW_CHARS
from txlb._config.errors import ConfigError
from txlb._config.values import parse_nonnegative_int


def parse_log_file(option: str, value: object) -> str:
    """A file path, ``-`` (standard output) or ``none``."""
    text = str(value).strip()
    if not text or "\0" in text:
        raise ConfigError(f"--{option}: {value!r} is not a file path, '-' or 'none'")
    return text


def parse_log_format(option: str, value: object) -> str:
    text = str(value).strip().lower()
    if text not in ("text", "json"):
        raise ConfigError(f"--{option}: {value!r} is not 'text' or 'json'")
    return text


def parse_log_content(option: str, value: object) -> int:
    """Characters of the answer kept in the result log: 0 to 1000."""

    number = parse_nonnegative_int(option, value)
    if number > MAX_PREVIEW_CHARS:
        raise ConfigError(f"--{option}: {value!r} is more than {MAX_PREVIEW_CHARS} characters")
    return number


def parse_log_user(option: str, value: object) -> str:
    text = str(value).strip().lower()
    if text not in ("keep", "hash", "drop"):
        raise ConfigError(f"--{option}: {value!r} is not 'keep', 'hash' or 'drop'")
    return text


def parse_log_error_body(option: str, value: object) -> int | None:
    """``keep`` (``None``: all of it, up to the 8 KiB cap), ``none`` (0) or N characters."""
    text = str(value).strip().lower()
    if text == "keep":
        return None
    if text == "none":
        return 0
    try:
        return parse_nonnegative_int(option, value)
    except ConfigError:
        raise ConfigError(f"--{option}: {value!r} is not 'keep', 'none' or a number of "
                          "characters") from None


def parse_secret(option: str, value: object) -> str | None:
    """A key for the ``user`` digest: at least 16 characters (the message never shows it)."""
    if value is None:
        return None
    text = str(value)
    if len(text.strip()) < 16:
        raise ConfigError(f"--{option}: the key must be at least 16 characters")
    return text
