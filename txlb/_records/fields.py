"""
The result log's fields, each declared once, in :data:`FIELDS`.

A row says everything about one field of :class:`~txlb._records.summary.Summary`: its name
(the key of the JSON format, and of the ``--workers`` wire), the lines that carry it, how the
JSON format writes its value and when it leaves it out, where and how the text format writes
it (bare, ``key=value``, a flag, the free text after ``|``; which escaping; when it is
omitted), and the type a worker's message must give it.  The two formatters and the wire
form of a summary are made from the table, so a new field is a new attribute of ``Summary``,
one row here, and the line in :func:`~txlb._records.summary.summarize` that fills it.

The formatters run once per request, in the process that writes the log (the supervisor
formats every worker's lines).  Reading the table on every call would cost about a third
more per line, so :func:`text_formatter` and :func:`json_formatter` turn it, at import time,
into one function each whose body is what a hand-written formatter would be: an f-string per
kind of line, a dict display per kind -- the way ``attrs`` and ``dataclasses`` write
``__init__``.  The generated source is kept on the function (``__source__``) for reading.

Escaping happens in :mod:`txlb._log.escape` only: the rows name its functions.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from txlb._http.apis import CLASSIC_PATHS
from txlb._log.escape import escape, escape_json
from txlb._records.summary import Summary

#: The kinds of line: what :func:`~txlb._records.summary.summarize` found the request was.
COMPLETION, EMBEDDING, ERROR, OTHER = "completion", "embedding", "error", "other"
KINDS = (COMPLETION, EMBEDDING, ERROR, OTHER)
ALL = frozenset(KINDS)

# -- how values are written ------------------------------------------------------------


def stamp(when: float) -> str:
    """The text format's ``MM-DD HH:MM:SS``, in the host's local time zone (``TZ``)."""
    return time.strftime("%m-%d %H:%M:%S", time.localtime(when))


def iso_time(when: float) -> str:
    """
    ``when`` in ISO 8601 with milliseconds and the local zone's offset
    (``2026-11-29T14:22:01.123+01:00``): the JSON format is read by tools that merge logs
    from hosts in different zones and across years, so the line says both.
    """
    moment = datetime.datetime.fromtimestamp(when, datetime.timezone.utc).astimezone()
    return moment.isoformat(timespec="milliseconds")


def flag(value: bool) -> str:
    return "True" if value else "False"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def count(value: int | None) -> str:
    return "-" if value is None else str(value)


def field_or_dash(value: str | None) -> str:
    """A ``key=value`` (or bare) value that may be missing or empty: ``-`` then."""
    return escape(value or "-")


def free_text(value: str) -> str:
    """The text after ``|``: its spaces, ``=`` and ``|`` stay."""
    return escape(value, "text")


def key_list(keys: list[str] | None) -> str:
    """``['a','b']``, each key escaped so that it cannot close the list early; ``-``: none."""
    if keys is None:
        return "-"
    return "[" + ",".join(f"'{escape(key, 'key')}'" for key in keys) + "]"


def rounded(value: float | None) -> float | None:
    """A duration in the JSON format: milliseconds are what anyone reads."""
    return None if value is None else round(value, 3)


def classic_path(path: str) -> bool:
    """
    The two paths a completion line was made for (chat and completions under ``/v1``): its
    line does not name them, so that ``/v1/messages`` or a client missing ``/v1`` shows.
    """
    return path.encode("utf-8", "replace") in CLASSIC_PATHS


# -- the wire's types ------------------------------------------------------------------


@attrs.frozen
class WireType:
    """
    What a worker's message may hold for one field: a value of one of ``classes`` (exactly:
    JSON's ``true`` is no integer) that ``check``, if given, accepts; ``convert``, if given,
    makes what the supervisor keeps of it.  Checked per request for every field, so the
    common case is one set lookup and no call.
    """

    #: for the error that refuses anything else
    name: str
    classes: frozenset[type]
    check: Callable[[Any], bool] | None = None
    convert: Callable[[Any], Any] | None = None

    def optional(self) -> WireType:
        """The same type, or null."""
        check, convert = self.check, self.convert
        return WireType(
            f"{self.name} or null", self.classes | {type(None)},
            None if check is None else (lambda value: value is None or check(value)),
            None if convert is None else (lambda value: None if value is None
                                          else convert(value)))


INT = WireType("an integer", frozenset({int}))
#: a JSON number: ``2.0`` may come back as ``2`` from another encoder; kept as a float
FLOAT = WireType("a number", frozenset({int, float}), convert=float)
STR = WireType("a string", frozenset({str}))
BOOL = WireType("true or false", frozenset({bool}))
STR_LIST = WireType("a list of strings", frozenset({list}),
                    lambda value: all(item.__class__ is str for item in value))
KIND = WireType("one of " + ", ".join(KINDS), frozenset({str}), lambda value: value in ALL)


# -- the table -------------------------------------------------------------------------


@attrs.frozen
class Text:
    """
    How the text line writes a field, on the lines of ``kinds`` (``None``: every kind the
    field is on).

    ``at`` orders the line: its pieces are written by ascending ``at``, whatever the row
    order (the JSON format keeps the row order; the two orders differ, as they always have).
    ``lead`` goes before the value: ``" key="``, ``" "`` for a bare value, ``" | "`` for the
    free text.  ``show`` writes the value (``None``: as ``str`` does); ``omit``, if given,
    leaves the piece out, lead and all, when it says so.
    """

    at: int
    lead: str
    show: Callable[[Any], str] | None = None
    kinds: frozenset[str] | None = None
    omit: Callable[[Any], bool] | None = None


@attrs.frozen
class Field:
    """
    One result-log field.

    ``name`` is its JSON key (and its name on the wire); ``attr`` the attribute of
    :class:`~txlb._records.summary.Summary` it shows (``None``: the same as ``name``).
    ``kinds``: the lines whose JSON form has it.  ``json`` turns the value into JSON's
    (``None``: as it is); ``json_omit`` leaves the key out when it says so.  ``text``: the
    pieces of the text line it makes (none: JSON only).  ``wire``: the type it must have in
    a worker's message.
    """

    name: str
    wire: WireType
    text: tuple[Text, ...] = ()
    kinds: frozenset[str] = ALL
    json: Callable[[Any], Any] | None = None
    json_omit: Callable[[Any], bool] | None = None
    attr: str | None = None

    @property
    def attribute(self) -> str:
        return self.name if self.attr is None else self.attr


_C = frozenset({COMPLETION})
_E = frozenset({EMBEDDING})
_X = frozenset({ERROR})


def _is_ok(outcome: str) -> bool:
    return outcome == "ok"


def _once(tries: int) -> bool:
    return tries <= 1


def _none_yet(count: int) -> bool:
    return count == 0


def _no(value: bool) -> bool:
    return not value


def _unknown(value: object) -> bool:
    return value is None


#: Every field, in the JSON format's order.  ``at`` numbers leave gaps so that a field can
#: go between two others; a field that is written only "when it says something" belongs
#: after ``trunc`` and before the text after ``|`` (``at`` 330-999).
FIELDS: tuple[Field, ...] = (
    Field("time", FLOAT, json=iso_time, text=(Text(0, "", stamp),)),
    Field("orid", STR, text=(Text(10, " orid=", escape),)),
    Field("backend", STR.optional(), text=(Text(20, " ", field_or_dash),)),
    Field("method", STR, text=(Text(30, " ", escape, kinds=frozenset({EMBEDDING, OTHER})),
                               Text(130, " method=", escape, kinds=_X))),
    Field("path", STR, text=(Text(40, " ", escape, kinds=frozenset({EMBEDDING, OTHER})),
                             Text(140, " path=", escape, kinds=_X),
                             Text(200, " path=", escape, kinds=_C, omit=classic_path))),
    Field("status", INT, text=(Text(50, " status="),)),
    Field("kind", KIND),  # the text line's shape says it
    Field("end", STR, attr="outcome", text=(Text(300, " end=", omit=_is_ok),)),
    Field("ttft", FLOAT.optional(), json=rounded,
          text=(Text(180, " ttft=", seconds, kinds=_C),)),
    Field("dur", FLOAT, json=rounded, text=(Text(190, " dur=", seconds),)),
    Field("finish", STR.optional(), kinds=_C, text=(Text(60, " finish=", field_or_dash),)),
    Field("ctok", INT.optional(), kinds=_C, attr="completion_tokens",
          text=(Text(70, " ctok=", count),)),
    Field("max_tokens", INT.optional(), kinds=_C, text=(Text(71, "/", count),)),
    Field("thinking", BOOL, kinds=_C, text=(Text(80, " thinking=", flag),)),
    Field("think", BOOL, kinds=_C, text=(Text(90, " think=", flag),)),
    Field("empty", BOOL, kinds=_C, text=(Text(100, " empty=", flag),)),
    Field("clen", INT, kinds=_C, text=(Text(110, " clen="),)),
    Field("preview", STR, kinds=_C, text=(Text(1000, " | ", free_text),)),
    Field("n", INT.optional(), kinds=_E, attr="count", text=(Text(150, " n=", count),)),
    Field("ptok", INT.optional(), kinds=_C | _E, attr="prompt_tokens",
          text=(Text(160, " ptok=", count, kinds=_E),
                Text(192, " ptok=", count, kinds=_C))),
    Field("cached", INT.optional(), kinds=_C, attr="cached_prompt_tokens",
          text=(Text(194, " cached=", count),)),
    Field("stream", BOOL, kinds=_C),  # JSON only: the text line's ttft/dur say enough
    Field("req_keys", STR_LIST.optional(), kinds=_X,
          text=(Text(120, " req_keys=", key_list),)),
    Field("err_body", STR, kinds=_X, text=(Text(1000, " ERR_BODY | ", free_text),)),
    Field("trunc", BOOL, attr="truncated", json_omit=_no,
          text=(Text(320, " trunc=", flag, omit=_no),)),
    Field("tries", INT, json_omit=_once, text=(Text(310, " tries=", omit=_once),)),
    Field("resumed", INT, attr="resumes", json_omit=_none_yet,
          text=(Text(312, " resumed=", omit=_none_yet),)),
    Field("resumed_on", STR.optional(), attr="resumed_backend", json_omit=_unknown,
          text=(Text(314, " resumed_on=", escape, omit=_unknown),)),
    Field("unresumed", STR.optional(), attr="resume_refused", json_omit=_unknown,
          text=(Text(316, " unresumed=", escape, omit=_unknown),)),
    Field("class", STR.optional(), attr="priority", json_omit=_unknown,
          text=(Text(330, " class=", escape, omit=_unknown),)),
    Field("tenant", STR.optional(), json_omit=_unknown,
          text=(Text(340, " tenant=", escape, omit=_unknown),)),
)


# -- the formatters, made from the table ----------------------------------------------


def _compile(name: str, lines: Iterable[str], namespace: dict[str, Any],
             doc: str) -> Callable[[Summary], str]:
    """Define the function whose body is ``lines``; keep its source for reading."""
    source = f"def {name}(s):\n" + "".join(f"    {line}\n" for line in lines)
    code = compile(source, f"<txlb._records.fields {name}>", "exec")
    exec(code, namespace)  # noqa: S102 -- the source is made from the table above, only
    function: Callable[[Summary], str] = namespace[name]
    function.__doc__ = doc
    function.__module__ = __name__
    function.__source__ = source  # type: ignore[attr-defined]
    return function


def _by_kind(bodies: dict[str, list[str]]) -> list[str]:
    """One branch per kind; a kind no row knows is written as an ``other`` line."""
    lines = ["kind = s.kind"]
    for kind in KINDS:
        if kind != OTHER:
            lines.append(f"if kind == {kind!r}:")
            lines.extend("    " + line for line in bodies[kind])
    lines.extend(bodies[OTHER])
    return lines


def _literal(lead: str) -> str:
    """``lead`` as the literal part of a double-quoted f-string."""
    return (lead.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            .replace("{", "{{").replace("}", "}}"))


def text_formatter(fields: tuple[Field, ...] = FIELDS,
                   doc: str = "A summary's text line.") -> Callable[[Summary], str]:
    """The text format of ``fields``: for each kind, one f-string of its pieces by ``at``."""
    namespace: dict[str, Any] = {}
    bodies = {}
    for kind in KINDS:
        pieces = sorted(
            ((text.at, field, text) for field in fields for text in field.text
             if kind in (field.kinds if text.kinds is None else text.kinds)),
            key=lambda piece: piece[0])
        places = [at for at, _, _ in pieces]
        if len(set(places)) != len(places):
            raise ValueError(f"two fields of a {kind} line share a place (at): {places}")
        parts = []
        for number, (_, field, text) in enumerate(pieces):
            value = f"s.{field.attribute}"
            if text.show is not None:
                namespace[f"show_{kind}_{number}"] = text.show
                value = f"show_{kind}_{number}({value})"
            if text.omit is None:
                parts.append(_literal(text.lead) + "{" + value + "}")
            else:
                namespace[f"omit_{kind}_{number}"] = text.omit
                namespace[f"lead_{kind}_{number}"] = text.lead
                shown = value if text.show else f"str({value})"
                parts.append(f"{{'' if omit_{kind}_{number}(s.{field.attribute}) "
                             f"else lead_{kind}_{number} + {shown}}}")
        bodies[kind] = ['return f"' + "".join(parts) + '"']
    return _compile("format_text", _by_kind(bodies), namespace, doc)


def json_formatter(fields: tuple[Field, ...] = FIELDS,
                   doc: str = "A summary's JSON line.") -> Callable[[Summary], str]:
    """
    The JSON format of ``fields``: for each kind, a dict display of the fields always
    there, then one statement per field after the first one that may be left out (the
    keys keep the row order).
    """
    namespace: dict[str, Any] = {
        "encode": json.JSONEncoder(ensure_ascii=False).encode,  # what json.dumps makes
        "escape_json": escape_json,
    }
    bodies = {}
    for kind in KINDS:
        shown = [field for field in fields if kind in field.kinds]
        display: list[str] = []
        statements: list[str] = []
        for number, field in enumerate(shown):
            value = f"s.{field.attribute}"
            if field.json is not None:
                namespace[f"json_{kind}_{number}"] = field.json
                value = f"json_{kind}_{number}({value})"
            if field.json_omit is None and not statements:
                display.append(f"{field.name!r}: {value}")
                continue
            statement = f"fields[{field.name!r}] = {value}"
            if field.json_omit is not None:
                namespace[f"omit_{kind}_{number}"] = field.json_omit
                statement = (f"if not omit_{kind}_{number}(s.{field.attribute}): "
                             + statement)
            statements.append(statement)
        bodies[kind] = (["fields = {" + ", ".join(display) + "}", *statements,
                         "return escape_json(encode(fields))"])
    return _compile("format_json", _by_kind(bodies), namespace, doc)


# -- the wire --------------------------------------------------------------------------


class BadSummary(ValueError):
    """A worker's message does not hold a summary this code can write."""


_WIRE = tuple((field.name, field.attribute, field.wire.classes, field.wire.check,
               field.wire.convert, field.wire) for field in FIELDS)
_WIRE_NAMES = tuple(field.name for field in FIELDS)
_NAMES = frozenset(_WIRE_NAMES)


def wire_writer(fields: tuple[Field, ...] = FIELDS) -> Callable[[Summary], dict[str, Any]]:
    """
    :func:`to_wire` for ``fields``: one dict display of every field, by name, in row order.

    A ``--workers`` worker makes one per request and its supervisor reads one per request,
    in the process every worker's requests go through; like the formatters, both are
    written out from the table once rather than walking it on every call.
    """
    display = ", ".join(f"{field.name!r}: s.{field.attribute}" for field in fields)
    writer: Any = _compile("to_wire", [f"return {{{display}}}"], {},
                           "``summary`` as a JSON object keyed by the fields' names.")
    return writer


def wire_reader(fields: tuple[Field, ...] = FIELDS) -> Callable[[dict[str, Any]], Any]:
    """
    The common case of :func:`from_wire` for ``fields``, given a dict with exactly their
    names: the :class:`~txlb._records.summary.Summary` when every value has its field's
    type, else ``None`` (then :func:`from_wire` walks the table to say which one has not).
    The checks are those :func:`from_wire` makes, one expression per field: a class test
    (``is`` for a type of one class), the type's ``check``, then its ``convert``.
    """
    namespace: dict[str, Any] = {"Summary": Summary}
    lines, tests, arguments = [], [], []
    for number, field in enumerate(fields):
        wire, value = field.wire, f"v{number}"
        lines.append(f"{value} = s[{field.name!r}]")
        if len(wire.classes) == 1:
            (namespace[f"class_{number}"],) = wire.classes
            tests.append(f"{value}.__class__ is class_{number}")
        else:
            namespace[f"classes_{number}"] = wire.classes
            tests.append(f"{value}.__class__ in classes_{number}")
        if wire.check is not None:
            namespace[f"check_{number}"] = wire.check
            tests.append(f"check_{number}({value})")
        if wire.convert is not None:
            namespace[f"convert_{number}"] = wire.convert
            value = f"convert_{number}({value})"
        arguments.append(f"{field.attribute}={value}")
    lines.append("if not (" + " and ".join(tests) + "):")
    lines.append("    return None")
    lines.append("return Summary(" + ", ".join(arguments) + ")")
    reader: Any = _compile("read_wire", lines, namespace,
                           "A worker's summary, or ``None`` if a value is not of its field's type.")
    return reader


to_wire = wire_writer()
_read_wire = wire_reader()


def from_wire(message: object) -> Summary:
    """
    The :class:`~txlb._records.summary.Summary` a worker sent (:func:`to_wire`).

    A worker runs the same code, so anything else is a bug or a process that is not a
    worker: it is refused whole, with :class:`BadSummary` naming what is wrong, rather than
    written as a line with the wrong shape (or failing later, in a formatter).
    """
    if not isinstance(message, dict):
        raise BadSummary(f"a summary is a JSON object, not {_json_type(message)}")
    if message.keys() != _NAMES:
        missing = sorted(_NAMES - message.keys())
        unknown = sorted(str(name) for name in message.keys() - _NAMES)
        raise BadSummary("a summary's fields do not match: "
                         f"missing {missing or 'none'}, unknown {unknown or 'none'}")
    summary: Summary | None = _read_wire(message)
    if summary is not None:
        return summary
    for name, _, classes, check, _, wire in _WIRE:  # which value is wrong, for the error
        value = message[name]
        if value.__class__ not in classes or (check is not None and not check(value)):
            raise BadSummary(f"summary field {name!r} must be {wire.name}, "
                             f"not {_json_type(value)}")
    raise AssertionError("read_wire refused a summary every field's type accepts")


def _json_type(value: object) -> str:
    names = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number",
             str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)
