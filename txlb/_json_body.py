"""
A body read as a JSON object, the one way txlb reads one: orjson, with Python's ``json``
for what orjson refuses or reads differently.

Routing reads request bodies with it (:mod:`txlb._scheduling.work`) and the result log reads
requests and answers with it (:mod:`txlb._records`), so that a body parses to the same
object whichever of them reads it.  It sits at the bottom of the package, importing nothing
of txlb, so that both can import it without either importing the other.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["parse_json_object", "stdlib_loads"]


def parse_json_object(body: bytes) -> dict[str, Any] | None:
    """
    ``body`` as a JSON object, or ``None`` if it is not one -- nor one nested too deep for
    Python's recursive parser (RecursionError, not ValueError: a client or a backend
    choosing the depth must not get past this).

    Parsed by orjson (C, several times faster than the standard library on the bodies
    txlb reads); what orjson refuses is read by Python's ``json`` as it always was
    (:func:`stdlib_loads`), so every body gets the outcome it had.
    """
    if not body or body.lstrip()[:1] != b"{":
        return None
    if _LONG_DIGITS in body.translate(_DIGITS):
        # orjson reads an integer past 64 bits as a float: json keeps it whole (the
        # alias rewriting writes the body again, an orid is the user's number)
        return _stdlib_object(body)
    try:
        value = orjson.loads(body)
    except ValueError:  # orjson.JSONDecodeError
        return _stdlib_object(body)
    return value if value.__class__ is dict else None


#: every digit as ``0``, anything else as ``x``: a run of 19 zeros is an integer that may
#: not fit in 64 bits (found at C speed, about a nanosecond a byte)
_DIGITS = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x78 for byte in range(256))
_LONG_DIGITS = b"0" * 19


def _stdlib_object(body: bytes) -> dict[str, Any] | None:
    value = stdlib_loads(body)
    return value if value.__class__ is dict else None


def stdlib_loads(body: bytes) -> object:
    """
    ``body`` read by Python's ``json``, or ``None``: for what orjson refuses and ``json``
    reads -- ``NaN`` and ``Infinity``, lone surrogates escaped in a string, nesting past
    orjson's 1,024 levels -- and integers past 64 bits, which orjson reads as floats; so
    that orjson changes no outcome.  (A stream's events are parsed by orjson alone: the
    numbers a summary reads of them are counts, and a count past 64 bits is none either
    way.)
    """
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None
