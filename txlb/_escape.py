"""
How text a client or a backend chose is written into a result-log line.

Such text must never end a line early, drive the terminal of someone running ``tail -f``,
or read as a field the line does not have.  One rule says which characters are unsafe --
ASCII controls, DEL, and every non-ASCII character Python does not call printable (C1
controls such as NEL, the line and paragraph separators U+2028/U+2029, other spacing and
format characters, lone surrogates) -- and both formats write those escaped:

* text format: ``\\n`` for a newline, ``\\\\`` for a backslash, ``\\xHH`` for the other ASCII
  characters, ``\\uHHHH`` / ``\\UHHHHHHHH`` for the rest.  In ``key=value`` fields (and the
  bare method and path) space, ``=`` and ``|`` are escaped too; in request keys also ``'``,
  ``,``, ``[`` and ``]``; in the free text after ``|`` spaces, ``=`` and ``|`` stay.
* JSON: what ``json.dumps`` leaves raw of those characters becomes ``\\uHHHH`` (a
  surrogate pair above U+FFFF), which any JSON parser reads back as the same text.

:func:`clip` cuts a value so that it fits a byte budget once escaped in either format,
which is how each field, and so the whole line, is bounded.
"""

from __future__ import annotations

import json
import re
from typing import Literal

#: What a value is: a ``key=value`` field (or the bare method or path), a request key in
#: ``req_keys=[...]``, or free text after ``|``.
Kind = Literal["field", "key", "text"]

_ASCII = {
    "field": re.compile(r"[\x00-\x20\x7f\\=|]"),
    "key": re.compile(r"[\x00-\x20\x7f\\=|',\[\]]"),
    "text": re.compile(r"[\x00-\x1f\x7f\\]"),
}
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
#: In a JSON line everything ASCII is already safe except DEL (json.dumps escapes C0).
_JSON_UNSAFE = re.compile(r"[^\x00-\x7e]")
#: ``…`` takes three bytes, in UTF-8 and in the JSON line.
ELLIPSIS = "…"


def _ascii_escape(match: re.Match[str]) -> str:
    char = match.group()
    if char == "\n":
        return "\\n"
    if char == "\\":
        return "\\\\"
    return f"\\x{ord(char):02x}"


def _unicode_escape(match: re.Match[str]) -> str:
    char = match.group()
    if char.isprintable():
        return char
    code = ord(char)
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _json_escape(match: re.Match[str]) -> str:
    char = match.group()
    if char.isprintable():
        return char
    code = ord(char)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def escape(text: str, kind: Kind = "field") -> str:
    """``text`` for the text format: nothing in it can end the line, act, or split a field."""
    text = _ASCII[kind].sub(_ascii_escape, text)
    # after the ASCII pass only non-ASCII characters can be unprintable; most text has
    # none, and isprintable() says so at C speed
    if not text.isprintable():
        text = _NON_ASCII.sub(_unicode_escape, text)
    return text


def escape_json(line: str) -> str:
    """A ``json.dumps(..., ensure_ascii=False)`` line with no unsafe character left raw."""
    if line.isprintable():
        return line
    return _JSON_UNSAFE.sub(_json_escape, line)


def _cost(text: str, kind: Kind) -> int:
    """Bytes ``text`` takes once escaped: the more of the text format and JSON."""
    as_json = escape_json(json.dumps(text, ensure_ascii=False))
    return max(len(escape(text, kind).encode()), len(as_json.encode()) - 2)


def clip(text: str, limit: int, kind: Kind = "field") -> str:
    """
    ``text``, cut (and marked with ``…``) so that it takes at most ``limit`` bytes once
    escaped in either format.  The cut is on the raw value, so both formats show the same
    value and an escape sequence is never cut in two.
    """
    if len(text) * 12 <= limit:  # 12 bytes: the widest escape (a JSON surrogate pair)
        return text
    if len(text) <= limit and _cost(text, kind) <= limit:
        return text
    text = text[:limit]  # every character takes at least one byte
    room = limit - len(ELLIPSIS.encode())
    low, high = 0, len(text)  # the longest prefix that fits with the mark: binary search
    while low < high:
        middle = (low + high + 1) // 2
        if _cost(text[:middle], kind) <= room:
            low = middle
        else:
            high = middle - 1
    return text[:low] + ELLIPSIS
