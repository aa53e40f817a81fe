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

import functools
import json
import re
from typing import Literal

#: What a value is: a ``key=value`` field (or the bare method or path), a request key in
#: ``req_keys=[...]``, or free text after ``|``.
Kind = Literal["field", "key", "text"]

_CONTROLS = "".join(map(chr, range(0x20))) + "\x7f"
_SPECIALS = {"field": _CONTROLS + "\\ =|", "key": _CONTROLS + "\\ =|',[]",
             "text": _CONTROLS + "\\"}
#: Finds whether a value needs the ASCII pass at all (most need none) ...
_ASCII = {kind: re.compile("[" + re.escape(chars) + "]") for kind, chars in _SPECIALS.items()}
#: ... which is one str.translate: no Python call per character, however many there are.
_ASCII_FORMS = {
    kind: {ord(char): "\\n" if char == "\n" else "\\\\" if char == "\\"
           else f"\\x{ord(char):02x}" for char in chars}
    for kind, chars in _SPECIALS.items()
}
#: Free text often has newlines and backslashes (JSON error bodies): those two are done
#: with str.replace, and only text with other controls is translated.
_RARE_CONTROLS = re.compile("[" + re.escape(_CONTROLS.replace("\n", "")) + "]")
_RARE_FORMS = {code: form for code, form in _ASCII_FORMS["text"].items()
               if chr(code) not in "\n\\"}
#: ``…`` takes three bytes, in UTF-8 and in the JSON line.
ELLIPSIS = "…"
#: The most bytes one character can take once escaped: a JSON surrogate pair.
_WIDEST = 12
#: Characters per step when looking for where to cut a long value.
_STEP = 64


def _json_width(code: int) -> int:
    return 2 if chr(code) in '"\\\n\r\t\b\f' else 6 if code < 0x20 or code == 0x7F else 1


#: Bytes an ASCII character takes once escaped, the more of the two formats.
_ASCII_WIDTHS = {
    kind: [max(len(forms.get(code, "x")), _json_width(code)) for code in range(0x80)]
    for kind, forms in _ASCII_FORMS.items()
}


@functools.cache
def _unprintable() -> re.Pattern[str]:
    """
    Every non-ASCII character Python does not call printable in the Basic Multilingual
    Plane, and everything above it (whose few unprintable characters the escape function
    picks out).  Built on first use (about 10 ms), so that text with, say, one U+2028 among
    Chinese characters calls back for the one character only.
    """
    ranges = []
    start = None
    for code in range(0x80, 0x10000):
        unprintable = not chr(code).isprintable()
        if unprintable and start is None:
            start = code
        elif not unprintable and start is not None:
            ranges.append((start, code - 1))
            start = None
    if start is not None:
        ranges.append((start, 0xFFFF))
    members = "".join(f"\\u{low:04x}-\\u{high:04x}" for low, high in ranges)
    return re.compile(f"[{members}\\U00010000-\\U0010ffff]")


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
    if kind == "text":
        if "\\" in text or "\n" in text:
            text = text.replace("\\", "\\\\").replace("\n", "\\n")
        if _RARE_CONTROLS.search(text):
            text = text.translate(_RARE_FORMS)
    elif _ASCII[kind].search(text):
        text = text.translate(_ASCII_FORMS[kind])
    # after the ASCII pass only non-ASCII characters can be unprintable; most text has
    # none, and isprintable() says so at C speed
    if not text.isprintable():
        text = _unprintable().sub(_unicode_escape, text)
    return text


def escape_json(line: str) -> str:
    """A ``json.dumps(..., ensure_ascii=False)`` line with no unsafe character left raw."""
    if line.isprintable():
        return line
    # json.dumps escapes the C0 controls itself; DEL and non-ASCII characters are left
    return _unprintable().sub(_json_escape, line.replace("\x7f", "\\u007f"))


def _cost(text: str, kind: Kind) -> int:
    """Bytes ``text`` takes once escaped: the more of the text format and JSON."""
    as_json = escape_json(json.dumps(text, ensure_ascii=False))
    return max(len(escape(text, kind).encode()), len(as_json.encode()) - 2)


def _width(char: str, widths: list[int]) -> int:
    """Bytes one character takes once escaped, the more of the two formats."""
    code = ord(char)
    if code < 0x80:
        return widths[code]
    if char.isprintable():
        return 2 if code < 0x800 else 3 if code < 0x10000 else 4
    return 6 if code < 0x10000 else _WIDEST


def clip(text: str, limit: int, kind: Kind = "field") -> str:
    """
    ``text``, cut (and marked with ``…``) so that it takes at most ``limit`` bytes once
    escaped in either format.  The cut is on the raw value, so both formats show the same
    value and an escape sequence is never cut in two.

    The cut is found in one pass: for a long limit :data:`_STEP` characters at a time
    (escaped at C speed), then character by character, so the work is linear in what is
    kept whatever the characters (a search re-escaping prefixes cost a hostile value
    milliseconds).  Costs are added per piece, which can only overestimate.
    """
    if len(text) * _WIDEST <= limit:
        return text
    if len(text) <= limit and _cost(text, kind) <= limit:
        return text
    room = limit - len(ELLIPSIS.encode())
    kept = used = 0
    if limit > 4 * _STEP:
        while kept < len(text):
            cost = _cost(text[kept:kept + _STEP], kind)
            if used + cost > room:
                break
            used += cost
            kept += _STEP
    widths = _ASCII_WIDTHS[kind]
    for char in text[kept:kept + room + 1]:
        used += _width(char, widths)
        if used > room:
            break
        kept += 1
    return text[:kept] + ELLIPSIS
