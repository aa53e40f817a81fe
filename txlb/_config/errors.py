"""
:class:`ConfigError` and the "did you mean" hint every refusal of a misspelt name carries.

The bottom of the config package: every parser raises these, and so do the policies that
declare options of their own, so they live where all of them can import them without
importing each other.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """
    A bad option value, unreadable config file or malformed backend.

    The message is complete on its own (it names the option and the value), so callers can
    print it as the single line that explains why start-up stopped -- one line even when a
    value or an underlying error message holds a newline.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))


def closest_name(word: str, known: Iterable[str]) -> str | None:
    """
    The known name a mistyped ``word`` most likely meant, or ``None`` when none is close.
    Case, dashes and underscores do not count against a match: ``maxconns``,
    ``max-conns`` and ``MAX_CONNS`` all find ``max_conns``.
    """
    def plain(name: str) -> str:
        return name.lower().replace("-", "").replace("_", "")

    names = {plain(name): name for name in known}
    close = difflib.get_close_matches(plain(word), list(names), n=1, cutoff=0.75)
    return names[close[0]] if close else None


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``" (did you mean 'max_conns'?)"``, or nothing when no known name is close."""
    name = closest_name(word, known)
    return f" (did you mean {name!r}?)" if name else ""
