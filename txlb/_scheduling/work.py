"""
How much of a request body routing reads, and the work it may spend on it: a per-request
:class:`WorkBudget`, and :func:`read_json`, the one reading of a body that routing, the
token estimate and the result log share.

A body of up to :attr:`WorkBudget.json_bytes` is parsed whole (orjson, the stdlib's ``json``
for what orjson refuses), as it always was.  A larger one is not: building Python objects for
every message, part and tool of a 4 MB body costs tens of milliseconds of the one reactor
thread, for nothing routing uses.  Its top level is split into its keys by msgspec, which
skips over the values at C speed (about half a millisecond a megabyte) without building
them; the small values (``model``, ``stream``, ``max_tokens``, ``user`` ...) are parsed
exactly as a small body's are, and the large ones (``messages``, ``tools``, ``prompt`` ...)
only as far as :attr:`WorkBudget.json_bytes` reaches in document order: the first
:data:`~txlb._scheduling.prefix.MAX_ITEMS` items of a list, the rest of it skipped unbuilt.
That is all the routing key (which renders at most 64 KiB of the prompt's beginning) and the
token estimate (made from the body's size) read, so an ordinary long prompt routes as it
did; only the work a hostile one can cause is bounded.

The body forwarded is the body received, byte for byte (an alias's rewrite of ``model``
aside: see :meth:`BodyReading.with_model`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import attrs
import msgspec

from txlb._json_body import parse_json_object

#: Bytes of request body parsed whole; over it, what routing reads is parsed and the rest
#: skipped.  256 KiB holds a 60k-token prompt, and the routing key renders at most 64 KiB.
JSON_BYTES = 256 * 1024
#: Pieces the routing key's renderer may look at per request (each string, part, media
#: item or piece of JSON syntax is one, whatever it renders): at ~1 µs of Python each, a
#: body of 100,000 empty parts must not cost a tenth of a second.  64 KiB of the densest
#: ordinary rendering (a tools schema: short names, one piece per brace) takes ~25,000.
STEPS = 32_768
#: Items of one list read at most (the renderer looks at no more).
MAX_ITEMS = 4096
#: How deep a large value is followed (the renderer follows no deeper).
MAX_DEPTH = 16


@attrs.define
class WorkBudget:
    """
    What one request's routing may spend on its body: the bytes parsed into Python objects
    (:func:`read_json`) and the pieces its routing key renders (:meth:`draw`).  Made once per
    request and carried on its :class:`~txlb._scheduling.request.RoutingRequest`, so every
    step that reads the body draws from the same account.
    """

    #: a body up to this many bytes is parsed whole; a larger one this far
    json_bytes: int = JSON_BYTES
    #: steps left for the routing key's rendering (and whatever reads the prompt next)
    steps: int = STEPS

    def draw(self, wanted: int) -> int:
        """Take up to ``wanted`` steps; the number granted (0 once spent)."""
        granted = max(0, min(wanted, self.steps))
        self.steps -= granted
        return granted


@attrs.frozen
class BodyReading:
    """A request body as read for routing: the JSON object, and whether it is all of it."""

    #: the body as a JSON object (``None`` when it is not one); for a large body its small
    #: values exactly and its large ones cut (:func:`read_json`)
    json: dict[str, Any] | None
    #: the top level's values, unparsed, when the body was too large to parse whole
    raw: dict[str, msgspec.Raw] | None = None

    @property
    def partial(self) -> bool:
        """Whether :attr:`json` is a bounded reading of a large body."""
        return self.raw is not None

    def with_model(self, model: str, body: bytes) -> bytes:
        """
        ``body`` with its ``model`` replaced: a body parsed whole is written again as it
        always was (``json.dumps``); a large one has its top level written again around
        the other values' bytes, copied as they came.
        """
        if self.raw is None:
            assert self.json is not None
            return json.dumps(dict(self.json, model=model)).encode("utf-8")
        raw = dict(self.raw)
        raw["model"] = msgspec.Raw(msgspec.json.encode(model))
        return msgspec.json.encode(raw)


#: A top-level value this small is read before any large one.
SMALL_VALUE = 4096
#: The large values the routing key renders, in its order (:func:`~txlb._scheduling.prefix.render`).
_RENDERED = {key: rank for rank, key in enumerate(
    ("tools", "chat_template_kwargs", "system", "messages", "prompt", "instructions",
     "input"))}

_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_FIELDS = _TOP
#: The first MAX_ITEMS items of an array, each unparsed; the rest skipped (an array-like
#: struct ignores trailing items, and an absent one is the empty default).
_Prefix = msgspec.defstruct(
    "_Prefix", [(f"i{k}", msgspec.Raw, msgspec.Raw(b"")) for k in range(MAX_ITEMS)],
    array_like=True)
_ITEMS = msgspec.json.Decoder(_Prefix)
_NOT_READ = object()
_STRING = msgspec.json.Decoder(str)
#: a body that is a JSON object, whatever whitespace comes first (matched, never copied)
_OBJECT_START = re.compile(rb"[ \t\r\n]*\{")


def read_json(body: bytes, budget: WorkBudget) -> BodyReading:
    """
    ``body`` as a JSON object, reading no more than ``budget`` allows (module docstring).
    A large body msgspec refuses -- ``NaN``, a lone surrogate, nesting past its limit -- is
    read as no JSON object (routed by load alone) rather than parsed whole.
    """
    if len(body) <= budget.json_bytes:
        return BodyReading(parse_json_object(body))
    if _OBJECT_START.match(body) is None:
        return BodyReading(None)
    try:
        top = _TOP.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return BodyReading(None)
    room = [budget.json_bytes]
    values: dict[str, object] = {}
    # the small values first, then the large ones in the order the routing key renders
    # them (tools before messages, wherever the client put them), then the rest
    order = sorted(top, key=lambda key: (len(top[key]) > SMALL_VALUE,
                                         _RENDERED.get(key, len(_RENDERED))))
    for key in order:
        values[key] = _bounded(top[key], room, 0)
    found = {key: values[key] for key in top if values[key] is not _NOT_READ}
    return BodyReading(found, top)


def _exact(raw: msgspec.Raw) -> object:
    """A value small enough to parse, parsed as a small body's would be."""
    data = bytes(raw)
    found = parse_json_object(b'{"v":' + data + b"}")
    return _NOT_READ if found is None else found.get("v", _NOT_READ)


def _exact_items(items: list[bytes]) -> list[object]:
    """Array items that fit, parsed in one call (as a small body's items would be)."""
    if not items:
        return []
    found = parse_json_object(b'{"v":[' + b",".join(items) + b"]}")
    value = None if found is None else found.get("v")
    return value if isinstance(value, list) else []


def _bounded(raw: msgspec.Raw, room: list[int], depth: int) -> object:
    """
    ``raw`` parsed within ``room[0]`` bytes (spent as it goes): whole if it fits, else an
    array as its first items, an object with every key and its values cut the same way.
    """
    size = len(raw)
    if size <= room[0] or size <= 64:
        room[0] -= size
        return _exact(raw)
    if depth >= MAX_DEPTH:
        return _NOT_READ
    first = bytes(memoryview(raw)[:1])
    if first == b"[":
        out: list[object] = []
        small: list[bytes] = []  # a run of items that fit, parsed in one go
        for item in msgspec.structs.astuple(_ITEMS.decode(raw)):
            if not item or room[0] <= 0:
                break
            size = len(item) + 1  # and its comma
            if size <= room[0]:
                room[0] -= size
                small.append(bytes(item))
                continue
            out.extend(_exact_items(small))
            small = []
            value = _bounded(item, room, depth + 1)
            if value is not _NOT_READ:
                out.append(value)
        out.extend(_exact_items(small))
        return out
    if first == b"{":
        fields: Mapping[str, msgspec.Raw] = _FIELDS.decode(raw)
        room[0] -= 2 * len(fields)
        read: dict[str, object] = {}
        for key, item in fields.items():
            value = _bounded(item, room, depth + 1) if room[0] > 0 else _NOT_READ
            if value is not _NOT_READ:
                read[key] = value
        return read
    if first == b'"':
        return _string_prefix(raw, room)
    return _exact(raw)  # a number or literal too long to fit: parsed whole, at C speed


def _string_prefix(raw: msgspec.Raw, room: list[int]) -> object:
    """
    A string too long for ``room``: its first ``room[0]`` bytes, as a string.  Parsed whole,
    a 60 MiB prompt was copied three times over (and held as a string as long as the
    request) for a routing key that renders its first 64 KiB.  The cut backs off until the
    prefix is a string (not inside an escape, a surrogate pair or a UTF-8 sequence).
    """
    limit, room[0] = max(room[0], 0), 0
    view = memoryview(raw)
    for cut in range(min(limit, len(view) - 1), max(limit - 16, 1), -1):
        try:
            return _STRING.decode(bytes(view[:cut]) + b'"')
        except msgspec.DecodeError:
            continue
    return _NOT_READ
