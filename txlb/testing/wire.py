"""
What the simulated vLLM puts on the wire and keeps of what it receives: its paths and
content types, vLLM's compact JSON and error bodies, the ``/sim/bytes`` stream, and the
:class:`ReceivedRequest` record a test checks what a proxy forwarded with.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

import attrs

CONTROL_PATHS = (b"/health", b"/v1/models", b"/metrics")
CHAT_PATH = b"/v1/chat/completions"
COMPLETIONS_PATH = b"/v1/completions"
BYTES_PATH = b"/sim/bytes"
TOKENIZE_PATH = b"/tokenize"

JSON = b"application/json"
SSE = b"text/event-stream; charset=utf-8"
PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"

PATTERN = bytes(range(256))


def filler_bytes(n: int, offset: int = 0) -> bytes:
    """
    The bytes ``/sim/bytes`` sends at positions ``offset`` to ``offset + n``.

    The stream is ``bytes(range(256))`` repeated rather than a constant byte, so a test
    that compares what it received with ``filler_bytes(n)`` also catches data that was
    reordered, duplicated or dropped on the way, not just a wrong length.
    """
    if n <= 0:
        return b""
    start = offset % len(PATTERN)
    repeats = (start + n) // len(PATTERN) + 1
    return (PATTERN * repeats)[start : start + n]


def dumps(obj: object) -> bytes:
    """Compact JSON, as vLLM (pydantic) writes it, so byte-level tests see realistic data."""
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def error_type(code: int) -> str:
    """vLLM-style error type names: ``BadRequestError``, ``NotFoundError``, ..."""
    try:
        phrase = HTTPStatus(code).phrase
    except ValueError:
        return "SimulatedError"
    name = "".join(word.capitalize() for word in phrase.replace("-", " ").split())
    return name if name.endswith("Error") else name + "Error"


def error_body(code: int, message: str) -> bytes:
    """The error object vLLM's OpenAI server answers with."""
    return dumps(
        {
            "object": "error",
            "message": message,
            "type": error_type(code),
            "param": None,
            "code": code,
        }
    )


@attrs.frozen
class ReceivedRequest:
    """
    One HTTP request as the simulator saw it, so tests can check what a proxy forwarded.

    :ivar method: e.g. ``b"POST"``.
    :ivar path: the full request target including the query string, e.g.
        ``b"/sim/bytes?n=10"``.
    :ivar headers: every header line as ``(name, value)``; repeated headers are kept, in
        the order received within each name.  Names are as Twisted canonicalises them
        (``b"X-Forwarded-For"``), values are untouched.
    :ivar body: the request body.
    """

    method: bytes
    path: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes | str) -> list[bytes]:
        """All values of header ``name`` (case-insensitive), in order; empty if absent."""
        wanted = (name.encode("ascii") if isinstance(name, str) else name).lower()
        return [value for key, value in self.headers if key.lower() == wanted]

    def json(self) -> Any:
        """The body parsed as JSON (raises ``ValueError`` if it is not)."""
        return json.loads(self.body)
