"""
The lean server's framing checks of one request's head, and what they remember of it.

llhttp (through ``httptools``) is strict where a second parser could read a request
differently (``Content-Length`` with ``Transfer-Encoding``, a repeated ``Content-Length``, a
bad chunk size, a bare CR or LF, a NUL, a space before a colon, obs-fold: 400), and leaves
the rest to its caller.  :class:`RequestHead` checks that rest as llhttp hands each part of
the head over, exactly as :class:`~txlb._server.site.ProxyChannel` does on twisted.web (the
rules themselves are :mod:`txlb._server.rules`, shared by both):

* a request line or header line over 16 KiB: 431; a head over 16 KiB or 500 headers in all: 400;
* ``Host`` and ``Expect`` read without the whitespace after them (llhttp strips only the
  whitespace before a value);
* ``Transfer-Encoding`` exactly ``chunked`` on HTTP/1.1 (else 400, or 501 for a coding
  before ``chunked``); ``Host`` required on HTTP/1.1, once, and valid; the target visible
  ASCII; HTTP/1.0 and 1.1 only;
* ``CONNECT`` refused with 405, as :class:`~txlb._server.site.ProxyChannel` refuses it;
* ``--max-body``: 413 at once for a ``Content-Length`` over it;
* ``Connection`` read as a token list over every line (``keep-alive, close`` closes);
  HTTP/1.0 closes;
* a chunked body's trailers are dropped, but one that says how the connection is used is 400.

A check that fails raises :class:`Refused` from within llhttp's callback, which stops the
parser; the channel (:mod:`txlb._server.lean`) answers it.  The checks that bound a read
as a whole (the head's deadline, its bytes on the wire, a chunked body's framing) and the
body's own limits are the channel's, which sees each read.
"""

from __future__ import annotations

from io import BytesIO

from httptools import HttpRequestParser
from twisted.web.http_headers import Headers

from txlb._server.lean_request import LeanRequest, RequestChannel
from txlb._server.rules import (
    CONNECT_REFUSED,
    CONNECTION_FIELDS,
    CONNECTION_TRAILER,
    LENGTH_UNKNOWABLE,
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    MAX_LINE,
    TARGET_REFUSED,
    TOKEN_SEPARATORS,
    VALID_HOST,
    VISIBLE_ASCII,
    ChunkPace,
    codings,
    transfer_coding_refusal,
    valid_target_form,
)

#: The refusal of a head llhttp reads but txlb may not forward (and of a head too large).
MALFORMED_HEAD = "malformed request line or headers"


class Refused(Exception):
    """
    Raised from a parser callback to stop parsing: the request is refused with ``status``
    and ``message``, which the channel answers once llhttp has stopped.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message


def request_line_so_far(before: bytes | None, data: bytes) -> tuple[bytes | None, bool]:
    """
    The request line that starts a read (``before``: what came of it in the reads before),
    checked for what llhttp lets through and twisted.web does not: more than one space
    between its three parts.  Only a line at the start of a read is seen whole here (a
    pipelined one is not: txlb writes every request line upstream itself, so the spaces
    never reach a backend either way).  Returns what to keep of the line while it is not
    whole (``None``: it is whole, or past the limit, which is llhttp's to refuse, as 431)
    and whether it is well formed so far.
    """
    line = (before or b"") + data
    start = len(line) - len(line.lstrip(b"\r\n"))
    end = line.find(b"\r\n", start)
    if end < 0:
        return (line if len(line) <= MAX_LINE else None), True
    parts = line[start:end].split(b" ")
    return None, len(parts) == 3 and all(parts)


def malformed_refusal(reason: str, max_body: int, in_body: bool) -> tuple[int, str]:
    """
    The refusal of bytes llhttp refused for ``reason``: 400 -- or 413 for a length no limit
    could allow.  ``in_body``: the head was whole, so the fault is the body's framing.
    """
    lowered = reason.lower()
    if max_body and "overflow" in lowered:
        return 413, f"the request body is over the limit of {max_body} bytes"
    if "transfer-encoding" in lowered and "content-length" not in lowered:
        # the words ProxyChannel's own check uses for the same refusal
        return 400, LENGTH_UNKNOWABLE
    if in_body:
        return 400, "malformed request body framing"
    return 400, MALFORMED_HEAD


def parsed_method(parser: HttpRequestParser) -> bytes:
    """The method llhttp has read so far, or ``b"-"`` while it has read none."""
    try:
        method = parser.get_method()
    except Exception:  # not parsed yet
        return b"-"
    return method if isinstance(method, bytes) and method else b"-"


class RequestHead:
    """What the framing checks remember of the request being parsed, and the checks."""

    __slots__ = ("url", "headers", "size", "count", "host_lines", "codings",
                 "content_length", "connection", "expect", "body", "body_size",
                 "framing", "pace", "request", "version", "upgrade")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.size = 0
        self.count = 0
        self.host_lines = 0
        self.codings: list[bytes] = []
        self.content_length: int | None = None
        self.connection: list[bytes] = []
        self.expect: bytes | None = None
        #: the body as it arrives: its first span alone, then (from a second span on) the
        #: whole body so far in one buffer (see :meth:`add_body`)
        self.body: bytes | BytesIO = b""
        self.body_size = 0
        #: a chunked body's bytes on the wire that were not payload, so far
        self.framing = 0
        #: the pace of a chunked body's chunks (``None``: the body is not chunked)
        self.pace: ChunkPace | None = None
        #: set when the head is complete
        self.request: LeanRequest | None = None
        self.version = b""
        #: llhttp saw a request asking to switch protocols, and does not read its body
        self.upgrade = False

    # -- the head, as llhttp hands it over ------------------------------------------------

    def check_line_length(self, parser: HttpRequestParser) -> None:
        """
        The request line's length so far, as twisted.web limits it: method, target and
        `` HTTP/1.1``, with their spaces (the channel asks only once the target alone
        comes near the limit).
        """
        if len(parsed_method(parser)) + len(self.url) + 10 > MAX_LINE:
            raise Refused(431, "request header fields too large")

    def add_trailer(self, name: bytes) -> None:
        """
        A chunked body's trailer: dropped, as twisted.web drops them (the channel bounds
        their bytes); llhttp refuses a malformed one, or Content-Length and
        Transfer-Encoding, and closes after the answer when one says Connection: close --
        refused instead, as lb.site() refuses it, rather than taking the next request for
        a fault.
        """
        if name.lower() in CONNECTION_FIELDS:
            raise Refused(400, CONNECTION_TRAILER)

    def add_field(self, name: bytes, value: bytes, parser: HttpRequestParser) -> None:
        """One header line of the head."""
        line = len(name) + len(value) + 2
        if line > MAX_LINE:
            raise Refused(431, "request header fields too large")
        if not self.size:  # the request line counts towards the head's size, as twisted's
            self.size = len(self.url) + 16
        self.size += line
        self.count += 1
        if self.size > MAX_HEAD_BYTES or self.count > MAX_HEADERS:
            raise Refused(400, MALFORMED_HEAD)
        lowered = name.lower()
        if lowered == b"host":
            # RFC 9110 5.5: the whitespace around a value is not part of it (llhttp strips
            # the leading whitespace only): "Host: x " is x, as on twisted.web
            value = value.rstrip(b" \t")
            self.host_lines += 1
            if self.host_lines > 1:
                raise Refused(400, "the request has more than one Host header")
            if not VALID_HOST.fullmatch(value):
                raise Refused(400, "the request's Host header is not a valid host")
        elif lowered == b"transfer-encoding":
            # exactly one coding, chunked, over all lines, on HTTP/1.1 (as ProxyChannel)
            self.codings += codings(value)
            refusal = transfer_coding_refusal(self.codings,
                                              parser.get_http_version() == "1.1")
            if refusal is not None:
                raise Refused(*refusal)
            value = b"chunked"
        elif lowered == b"content-length":
            try:
                self.content_length = int(value)  # llhttp let only digits through, once
            except ValueError:
                raise Refused(400, MALFORMED_HEAD) from None
        elif lowered == b"connection" or lowered == b"proxy-connection":
            # llhttp reads Proxy-Connection as Connection: a close in it ends the connection
            # after this answer (and nothing after it is parsed), on both servers
            self.connection.append(value)
        elif lowered == b"expect" and self.expect is None:
            self.expect = value.rstrip(b" \t")
        self.headers.append((name, value))

    def start_request(self, channel: RequestChannel, parser: HttpRequestParser,
                      max_body: int) -> LeanRequest:
        """
        The head is complete: its checks as a whole, and the request it makes (kept as
        :attr:`request` before the checks that refuse it, so the result log names it).
        """
        version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise Refused(400, MALFORMED_HEAD)
        target = self.url
        if len(target.translate(None, VISIBLE_ASCII)) != 0:
            raise Refused(400, "the request target has bytes that are not visible ASCII")
        self.version = clientproto = b"HTTP/1.1" if version == "1.1" else b"HTTP/1.0"
        headers = Headers()
        add = headers.addRawHeader
        for name, value in self.headers:
            add(name, value)
        request = self.request = LeanRequest(channel, parser.get_method(), target,
                                             clientproto, headers)
        if self.host_lines == 0 and version == "1.1":
            raise Refused(400, "an HTTP/1.1 request must have a Host header")
        if request.method == b"CONNECT":
            # as ProxyChannel: no tunnel, and nothing after the head is read (llhttp would
            # hand it over as the tunnel's bytes)
            raise Refused(405, CONNECT_REFUSED)
        if not valid_target_form(target):
            # llhttp takes "*?a=b" (and "**") for a target: it is not "*" (RFC 9112 3.2.4)
            raise Refused(400, TARGET_REFUSED)
        chunked = bool(self.codings)
        if chunked:
            self.pace = ChunkPace()
        if parser.should_upgrade():
            self.upgrade = True
            if chunked:
                # llhttp leaves the body unread, and its chunks are not worth a second
                # parser here: refused, where twisted.web would read and forward it
                raise Refused(400, "a request asking to switch protocols may not have a "
                                   "chunked body")
        length = self.content_length
        if max_body and length is not None and length > max_body:
            # no "100 Continue" for a body that is refused anyway
            raise Refused(413, f"the request body ({length} bytes) is over the limit of "
                               f"{max_body} bytes")
        tokens = {token.lower() for value in self.connection
                  for token in TOKEN_SEPARATORS.split(value) if token}
        if version == "1.1" and b"close" not in tokens:
            request.persistent = True
        else:
            request.persistent = False
            if version == "1.1":
                request.responseHeaders.setRawHeaders(b"Connection", [b"close"])
        return request

    def wants_continue(self) -> bool:
        """Whether the client waits for ``100 Continue`` before it sends the body."""
        return (self.expect is not None and self.expect.lower() == b"100-continue"
                and self.version == b"HTTP/1.1"
                and bool(self.codings or self.content_length))

    # -- the body -------------------------------------------------------------------------

    def add_body(self, data: bytes) -> None:
        """
        ``data`` after the body so far.  The body is held as its bytes and no more: one
        span as it came, and from a second span on one ``BytesIO`` that each span is
        copied into.  A list of spans cost a bytes object and a list slot per span --
        some 40 bytes for each 2-byte chunk of a chunked body, ~20 times its payload --
        and a join of millions of them when it ended.
        """
        self.body_size += len(data)
        body = self.body
        if isinstance(body, bytes):
            if not body:
                self.body = data
                return
            self.body = body = BytesIO(body)
            body.seek(0, 2)
        body.write(data)

    def add_counted_body(self, data: bytes) -> bytes | None:
        """
        Of ``data``, the part of a body llhttp left unread (a request asking to switch
        protocols), by its ``Content-Length``: what follows the body once it is whole,
        ``None`` while more of it is wanted.
        """
        length = self.content_length
        assert length is not None
        wanted = length - self.body_size
        if wanted > 0 and data:
            taken = data[:wanted]
            self.add_body(taken)
            data = data[len(taken):]
        return None if self.body_size < length else data

    def take_body(self) -> bytes:
        """
        The whole body, given up by the head: ``BytesIO.getvalue`` hands over its buffer
        without a copy, so a body is copied once in all between the read and the request.
        """
        body, self.body = self.body, b""
        return body if isinstance(body, bytes) else body.getvalue()
