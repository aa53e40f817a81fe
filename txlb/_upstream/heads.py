"""
The bytes of the hop to a backend, written and read: a request head as txlb sends it, and
a response head held to HTTP/1.1 as strictly as a second parser could read it.

:mod:`txlb._upstream.client`'s connections and :mod:`txlb._upstream.agent` (an embedder's
Agent) both need to know when a backend's answer is no valid HTTP -- a head with a control
character, a bad status line, two lengths -- because a lenient read of it is how two hops
come to disagree on where a message ends.  Those rules are pure functions of bytes, here,
apart from the connections that apply them.
"""

from __future__ import annotations

import re

from txlb._http.headers import RawHeaders

#: A response head larger than this is refused as a bad response (nginx's default
#: proxy_buffer_size is 4-8 KiB; this is generous).
MAX_HEAD_BYTES = 64 * 1024
#: A header field name (RFC 9110 token).
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: Control characters no response head may carry (HTAB aside); CRLFs are replaced first,
#: so this also finds a bare CR or LF -- which other HTTP parsers take as a line end.
_HEAD_CONTROLS = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
#: The largest ``Content-Length`` a backend may send (a signed 64-bit offset, nginx's
#: ``off_t``): a larger one is no length any client could hold, and passing it on would
#: promise the client a body that can never come -- a bad response (502), as nginx says.
MAX_CONTENT_LENGTH = 2**63 - 1


class BadResponse(Exception):
    """The backend's response is not valid HTTP/1.1 (bad status line, header or framing)."""


_TITLE_CASE: dict[bytes, bytes] = {}


def _title(name: bytes) -> bytes:
    """``x-forwarded-for`` -> ``X-Forwarded-For``, as Agent (and most clients) send them."""
    cased = _TITLE_CASE.get(name)
    if cased is None:
        cased = b"-".join(part[:1].upper() + part[1:] for part in name.split(b"-"))
        if len(_TITLE_CASE) < 4096:
            _TITLE_CASE[name] = cased
    return cased


def request_head(method: bytes, target: bytes, host_header: bytes, headers: RawHeaders,
                 body: bytes | None) -> bytes:
    """The bytes of an HTTP/1.1 request head."""
    parts = [method, b" ", target, b" HTTP/1.1\r\nHost: ", host_header, b"\r\n"]
    for name, value in headers:
        parts += (_title(name), b": ", value, b"\r\n")
    if body is not None:
        parts.append(b"Content-Length: %d\r\n" % len(body))
    parts.append(b"\r\n")
    return b"".join(parts)


def parse_head(head: bytes) -> tuple[bytes, int, bytes, RawHeaders]:
    """
    Split a response head (without its final blank line) into version, status code,
    reason phrase and headers.  Strict where leniency would let a confused backend smuggle
    a second response (RFC 9112: no obs-fold, no space before the colon).
    """
    if _HEAD_CONTROLS.search(head.replace(b"\r\n", b"\t")):
        raise BadResponse("control character (or bare CR/LF) in the response head")
    lines = head.split(b"\r\n")
    status = lines[0].split(b" ", 2)
    version = status[0]
    if len(status) < 2 or version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise BadResponse(f"bad status line {lines[0][:80]!r}")
    code_bytes = status[1]
    if len(code_bytes) != 3 or not code_bytes.isdigit() or code_bytes[0] == 48:
        raise BadResponse(f"bad status code {code_bytes[:10]!r}")
    headers: RawHeaders = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            # also refuses obs-fold (a line starting with whitespace) and a space before
            # the colon, both ways to smuggle a header past one parser and not another
            raise BadResponse(f"bad header line {line[:80]!r}")
        headers.append((name.lower(), value.strip(b" \t")))
    return version, int(code_bytes), status[2] if len(status) == 3 else b"", headers


def parse_content_length(values: list[bytes]) -> int | None:
    """
    A response's ``Content-Length`` from its values (``None``: it sent none): ASCII digits
    up to :data:`MAX_CONTENT_LENGTH`, the same number on every line.  Anything else makes
    the response's end unknowable: :class:`BadResponse`.
    """
    length: int | None = None
    for value in values:
        if not value.isdigit():
            raise BadResponse(f"bad Content-Length {value[:20]!r}")
        number = int(value)
        if number > MAX_CONTENT_LENGTH:
            raise BadResponse(f"Content-Length {value[:24]!r} is over 2**63-1")
        if length is not None and number != length:
            raise BadResponse("conflicting Content-Length headers")
        length = number
    return length


def framing(version: bytes, code: int, method: bytes,
             headers: RawHeaders) -> tuple[str, int | None, bool]:
    """
    How the body is delimited -- ``"none"``, ``"length"``, ``"chunked"`` or ``"close"``
    -- its length when known, and whether the connection may carry another request.
    """
    lengths: list[bytes] = []
    transfer_coding = b""
    keep_alive = version == b"HTTP/1.1"
    if code < 100:
        raise BadResponse(f"bad status code {code}")
    for name, value in headers:
        if name == b"content-length":
            lengths.append(value)
        elif name == b"transfer-encoding":
            transfer_coding = value.rsplit(b",", 1)[-1].strip().lower()
        elif name == b"connection" and b"close" in value.lower():
            keep_alive = False
    content_length = parse_content_length(lengths) if lengths else None
    if method == b"HEAD" or code in (204, 304) or code < 200:
        return "none", content_length, keep_alive
    if transfer_coding:
        # RFC 9112 6.1/6.3: Transfer-Encoding wins over Content-Length, but a message with
        # both may be a smuggling attempt (so the connection is not reused); from an
        # HTTP/1.0 server, or with anything but chunked last, the body runs until close
        if transfer_coding == b"chunked" and version == b"HTTP/1.1":
            return "chunked", None, keep_alive and content_length is None
        return "close", None, False
    if content_length is not None:
        return ("none" if content_length == 0 else "length"), content_length, keep_alive
    return "close", None, False

