"""
The framing rules both main-port servers apply, one copy for both.

twisted.web's channel (:mod:`txlb._server.site`, what ``lb.site()`` serves) and the lean
llhttp server (:mod:`txlb._server.lean`, what ``twistd llmlb`` serves) must refuse the same
requests with the same status and words: a request one server forwards and the other
refuses is a difference an attacker can look for, and an operator cannot explain.  So the
limits, the patterns a head is held to, the refusal messages, the pace a chunked body's
chunks must keep and the bytes of a refusal on the wire live here, below both servers.
"""

from __future__ import annotations

import re
from typing import Any

from twisted.logger import Logger, LogLevel

from txlb._log.quiet import RepeatSummary

#: The reason phrase of each status a refusal may have.
_REASONS = {
    400: b"Bad Request",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    431: b"Request Header Fields Too Large",
    501: b"Not Implemented",
}

#: RFC 3986 ``host [ ":" port ]``: an IP literal in brackets, or a reg-name / IPv4 address
#: (unreserved, pct-encoded and sub-delims characters); anything else in ``Host`` is 400.
VALID_HOST = re.compile(
    rb"(?:\[[A-Za-z0-9:._~%!$&'()*+,;=-]*\]|[A-Za-z0-9._~%!$&'()*+,;=-]*)(?::[0-9]*)?")

#: What a request target may hold (RFC 9112 §3.2: URI characters, all visible ASCII).
VISIBLE_ASCII = bytes(range(0x21, 0x7F))

#: Trailer fields that would change the connection once the body is read: llhttp closes
#: after a trailer saying ``close``, twisted.web drops it.  Refused on both servers.
CONNECTION_FIELDS = frozenset({b"connection", b"proxy-connection"})
CONNECTION_TRAILER = "a trailer may not say how the connection is used (Connection)"

#: RFC 9112 3.2: absolute-form's scheme and ``://``.
_ABSOLUTE_FORM = re.compile(rb"[A-Za-z][A-Za-z0-9+.-]*://")
#: The refusal of a target that is no path, no absolute URL and not exactly ``*``.
TARGET_REFUSED = "the request target must be a path, an absolute URL or exactly *"


def valid_target_form(target: bytes) -> bool:
    """
    Whether ``target`` is in origin-form (``/...``), absolute-form (``http://...``) or
    asterisk-form -- which is ``*`` alone (RFC 9112 3.2.4): ``*?a=b`` is no form at all,
    and must not be taken for ``*``.  (Authority-form is CONNECT's, refused before.)
    """
    return target[:1] == b"/" or target == b"*" or _ABSOLUTE_FORM.match(target) is not None


#: ``Connection`` tokens are comma-separated (RFC 9110 §7.6.1); whitespace separates too,
#: as twisted.web reads it, so that every spelling that could mean "close" closes.
TOKEN_SEPARATORS = re.compile(rb"[\s,]+")

#: What a 405 from the main port's servers allows (RFC 9110 15.5.6: a 405 says): every
#: standard method but ``CONNECT``, which asks a proxy for a tunnel txlb never opens.
ALLOWED_METHODS = b"GET, HEAD, POST, PUT, DELETE, OPTIONS, TRACE, PATCH"


def raw_response(status: int, body: bytes) -> bytes:
    """A refusal's whole answer on the wire: ``status``, ``body`` as JSON, and a close."""
    allow = b"Allow: %s\r\n" % ALLOWED_METHODS if status == 405 else b""
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"%sConnection: close\r\n\r\n" % (status, _REASONS[status], len(body), allow)
            ) + body


def codings(value: bytes) -> list[bytes]:
    """A ``Transfer-Encoding`` value as lowercase codings (empty list elements dropped)."""
    return [c for c in (part.strip(b" \t").lower() for part in value.split(b",")) if c]


#: The head limits both main-port servers apply (twisted.web's own, which ProxyChannel
#: keeps; :mod:`txlb._server.lean` checks them itself, as llhttp has none): one line, the
#: whole head, and the number of header lines.
MAX_LINE = 16384
MAX_HEAD_BYTES = 16384
MAX_HEADERS = 500

#: A chunked body is refused when any run of this many spans of data (a chunk, or the part
#: of a chunk one read holds) and one more ...
CHUNK_ALLOWANCE = 1024
#: ... averages fewer payload bytes than this: its framing costs more to parse than its
#: payload is worth (``2\r\nab\r\n``, 7 bytes on the wire for 2 of body, is a Python
#: call per chunk on either server).  Real clients send chunks of kilobytes; a client's
#: generator yielding a line at a time is far above it.
MIN_AVERAGE_CHUNK = 16
CHUNKS_TOO_SMALL = (f"the request body's chunks are too small (an average under "
                    f"{MIN_AVERAGE_CHUNK} bytes over {CHUNK_ALLOWANCE} chunks)")


class ChunkPace:
    """
    How fast a chunked body's payload comes per span, judged one window of spans at a
    time: a running average over the whole body would let one large chunk buy the right
    to send tens of thousands of tiny ones after it.
    """

    __slots__ = ("spans", "mark")

    def __init__(self) -> None:
        #: spans in the current window
        self.spans = 0
        #: the payload the body had when the window began
        self.mark = 0

    def too_small(self, payload: int) -> bool:
        """One more span, the body now ``payload`` bytes in all: refuse it?"""
        self.spans += 1
        if self.spans <= CHUNK_ALLOWANCE:
            return False
        if payload - self.mark < CHUNK_ALLOWANCE * MIN_AVERAGE_CHUNK:
            return True
        self.spans, self.mark = 0, payload
        return False


#: The refusal of ``CONNECT`` on both servers.
CONNECT_REFUSED = "CONNECT is not supported: txlb is a reverse proxy and opens no tunnels"


def log_slow_head(logger: Logger, address: Any, repeats: RepeatSummary | None,
                  timeout: float) -> None:
    """
    Say that the client at ``address`` sent no whole request head within ``timeout`` -- as a
    per-kind summary when the site has one: a client opening connections it never
    completes must not cost a log line per connection.  Both servers refuse such a head
    with 408 the same way.
    """
    message = "client {peer} sent no complete request head within {timeout:g}s"
    host, port = getattr(address, "host", None), getattr(address, "port", None)
    # host:port ([v6]:port), not the IPv4Address(type='TCP', ...) repr
    peer = (str(address) if host is None else
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if repeats is None:
        logger.info(message, peer=peer, timeout=timeout)
    else:
        repeats.emit(("slow-head",), logger, LogLevel.info, message, peer=peer,
                     timeout=timeout)


#: The refusal of a final transfer coding that is not ``chunked``, or of ``chunked`` twice.
LENGTH_UNKNOWABLE = ("the request's final transfer coding must be chunked (and only once), "
                     "or its length cannot be known")


def transfer_coding_refusal(found: list[bytes], http_11: bool) -> tuple[int, str] | None:
    """
    The refusal (status, message) of a request whose ``Transfer-Encoding`` lines so far say
    the codings ``found``, or ``None`` when they are exactly one ``chunked`` on HTTP/1.1.
    Any other final coding (``identity``, ``gzip``, ``identity`` after ``chunked``) leaves
    the length unknowable: 400; ``chunked`` after another coding is well framed but names a
    coding txlb cannot forward: 501; any coding on HTTP/1.0: 400.
    """
    if not http_11:
        return 400, "Transfer-Encoding is not allowed in an HTTP/1.0 request"
    if found == [b"chunked"]:
        return None
    if not found or found[-1] != b"chunked" or b"chunked" in found[:-1]:
        return 400, LENGTH_UNKNOWABLE
    return 501, "transfer codings other than chunked are not supported"
