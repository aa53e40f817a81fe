"""
The main port's ``Site``: twisted.web's HTTP server with the limits a proxy needs.

twisted.web reads a whole request body (into memory, or a temporary file above 100 kB)
before any resource sees it, and its idle timeout restarts on every byte, so on its own it
would buffer any body a client sends and wait forever for headers trickling in one byte a
second (slowloris).  The channel and request here add what nginx calls
``client_header_timeout`` and ``client_max_body_size``:

* :class:`ProxyChannel` gives each request's line and headers ``header_timeout`` seconds
  from their first byte, then answers 408 and closes;
* :class:`LimitedRequest` answers 413 the moment ``Content-Length`` (or a chunked body
  so far) exceeds ``max_body``, without buffering past the limit, and never lets the
  refused request reach the proxy.

Oversized header blocks are refused: a line over 16 KiB with 431 (here), more than 16 KiB or
500 headers in all with 400.

The channel is also strict about framing where twisted.web is lenient, because a proxy that
reads a request's length differently from the client lets the rest of the stream be taken
for a second request nobody checked (request smuggling).  RFC 9112 §6.1-6.3 and RFC 9110
§7.2/§7.6.1, as nginx and HAProxy apply them:

* ``Transfer-Encoding`` must be exactly ``chunked`` (one coding, on HTTP/1.1).  A final
  coding other than chunked (``identity``, ``gzip``, a second header line saying
  ``identity`` after ``chunked``) leaves the length unknowable: 400.  Chunked after another
  coding is well framed but names a coding txlb cannot forward: 501.  On HTTP/1.0: 400.
* ``Content-Length`` with ``Transfer-Encoding``, or twice, is twisted.web's own 400.
* An HTTP/1.1 request without ``Host``, any request with two, or an invalid ``Host``: 400.
* A header line continuing the previous one (obs-fold), a head line ended by a bare LF, or a
  control character in a header value: 400, as llhttp answers on the lean server
  (:mod:`txlb._server.lean`).
* A request target with a byte that is not visible ASCII (twisted.web lets DEL and
  0x80-0xB0 through), or one that is no path, no absolute URL and not exactly ``*``
  (``*?a=b`` is not ``*``): 400.
* A chunked body's trailers are dropped, but a trailer line that is not a field line (a
  bare CR or LF, a control character, obs-fold, a name that is no token) or that says
  ``Content-Length``, ``Transfer-Encoding`` or ``Connection`` is 400, as llhttp refuses
  it: twisted.web reads trailer lines only at CRLF, so a request pipelined behind
  ``X-T: 1\\n\\r\\n`` was taken for a trailer.
* ``Connection`` is a comma-separated token list over every ``Connection`` line:
  ``keep-alive, close`` closes.
* ``CONNECT``: 405 (txlb opens no tunnels; what follows its head is no request); in another
  case (``connect``): 400, as llhttp refuses it.

Every such refusal has the OpenAI-style JSON body of :func:`txlb._http.errors.error_body`, says
``Connection: close``, closes the connection, and never reaches the proxy.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel, datetimeToString
from twisted.web.resource import IResource
from twisted.web.server import Request, Site
from twisted.web.server import version as server_version

from txlb._compat import chunked_trailer, parsed_request_line, unterminated_line
from txlb._config.config import Config
from txlb._http.errors import error_body
from txlb._log.quiet import RepeatSummary
from txlb._server.rules import (
    CHUNKS_TOO_SMALL,
    CONNECT_REFUSED,
    CONNECTION_FIELDS,
    CONNECTION_TRAILER,
    TARGET_REFUSED,
    TOKEN_SEPARATORS,
    VALID_HOST,
    VISIBLE_ASCII,
    ChunkPace,
    codings,
    log_slow_head,
    raw_response,
    transfer_coding_refusal,
    valid_target_form,
)

log = Logger()

#: Control characters a header value may not hold besides NUL, CR and LF (HTAB it may).
_CONTROLS = bytes([*range(0x01, 0x09), *range(0x0B, 0x0D), *range(0x0E, 0x20), 0x7F])

#: RFC 9110 5.6.2's token, the characters of a field name.
_TCHAR = rb"!#$%&'*+.^_`|~0-9A-Za-z-"
#: What a field value may hold, as llhttp reads one: tabs, spaces, visible ASCII and bytes
#: over 0x7F (obs-text) -- no other control character, no bare CR or LF.
_VALUE_CHARS = rb"\t\x20-\x7e\x80-\xff"
#: A whole trailer line, without its CRLF: a field line, as in the head (RFC 9112 7.1.2).
_TRAILER_LINE = re.compile(rb"([%s]+):[%s]*" % (_TCHAR, _VALUE_CHARS))
#: What arrived of a trailer line not ended yet, before its colon and after it: a CR may
#: only be the last byte so far (the CR of its CRLF).
_TRAILER_NAME_PART = re.compile(rb"[%s]*(?::[%s]*)?\r?" % (_TCHAR, _VALUE_CHARS))
_TRAILER_VALUE_PART = re.compile(rb"[%s]*\r?" % _VALUE_CHARS)
#: Trailer fields llhttp refuses, as a second length of a body whose length is known.
_FRAMING_FIELDS = frozenset({b"content-length", b"transfer-encoding"})


# twisted.web private API: the request line being parsed is read through
# txlb._compat.parsed_request_line; ProxyChannel overrides HTTPChannel's private
# _respondToBadRequestAndDisconnect (txlb._compat.BAD_REQUEST_HOOK, whose existence
# tests/unit/test_compat.py checks).


class ProxyChannel(HTTPChannel):
    """
    An HTTP/1.1 channel that gives a request's head a deadline (slowloris defence) and
    refuses any framing a second parser could read differently (smuggling defence).
    """

    header_timeout = 30.0

    def __init__(self) -> None:
        super().__init__()
        self._awaiting_head = True
        self._head_deadline: IDelayedCall | None = None
        self._closing = False
        #: how deep in dataReceived: twisted.web calls it again from within itself when a
        #: request answered during a read lets the next one be parsed
        self._receiving = 0
        self._reset_head()

    def _reset_head(self) -> None:
        """What the framing checks remember of the head (and trailers) being parsed."""
        self._host_lines = 0
        self._transfer_codings: list[bytes] = []
        #: trailer lines already checked; how much of the line not ended yet was, and
        #: whether its colon was among it
        self._trailer_lines = 0
        self._trailer_checked = 0
        self._trailer_value = False

    def connectionMade(self) -> None:
        super().connectionMade()
        # Streamed tokens are small writes: do not let Nagle's algorithm hold them back
        # (nginx's tcp_nodelay, on by default).
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            with contextlib.suppress(OSError):  # not a TCP socket, or already closed
                set_no_delay(True)

    def dataReceived(self, data: bytes) -> None:
        if self._closing:
            return  # refused: whatever follows is never parsed, so never forwarded
        if self._awaiting_head and self._head_deadline is None:
            self._head_deadline = self.callLater(self.header_timeout, self._head_too_slow)
        self._receiving += 1
        try:
            super().dataReceived(data)
        finally:
            self._receiving -= 1
        if self._receiving:
            # called from within itself (a request answered during the read, the next one
            # handed back to be parsed): the line buffer still holds whole lines the outer
            # call has yet to parse, so only the outer call can tell an unended line
            return
        if self._awaiting_head and not self._closing and b"\n" in unterminated_line(self):
            # a line of the head ended by a bare LF: twisted.web would wait for a CRLF that
            # never comes; refused at once, as llhttp (the lean server) refuses it
            self.refuse(400, "a line of the request head ends without CR")

    def rawDataReceived(self, data: bytes) -> None:
        super().rawDataReceived(data)
        if not self._closing:
            self._check_trailers()

    def allContentReceived(self) -> None:
        if not self._check_trailers():
            return  # refused: the request never reaches the resource
        super().allContentReceived()

    def _check_trailers(self) -> bool:
        """
        Refuse a chunked body's trailer section that llhttp, the lean server's parser,
        refuses: a line that is not a field line (a bare CR or LF, NUL or another control
        character, obs-fold, a name that is not a token), ``Content-Length`` or
        ``Transfer-Encoding``, ``Connection``.  twisted.web drops trailers unchecked and
        reads lines only at CRLF: ``X-T: 1\\n\\r\\n`` followed by a pipelined request
        made that request a trailer, where a parser ending lines at LF sees a request.
        Checked as the bytes arrive (each only once) and before the request goes on.
        Returns ``False`` once refused.
        """
        section = chunked_trailer(self)
        if section is None:
            return True
        lines, partial = section
        if len(lines) > self._trailer_lines:
            for line in lines[self._trailer_lines:]:
                field = _TRAILER_LINE.fullmatch(line)
                name = field.group(1).lower() if field is not None else b""
                if field is None or name in _FRAMING_FIELDS:
                    return self.refuse(400, "malformed request body framing")
                if name in CONNECTION_FIELDS:
                    return self.refuse(400, CONNECTION_TRAILER)
            self._trailer_lines = len(lines)
            self._trailer_checked, self._trailer_value = 0, False  # a new line begins
        arrived = partial[self._trailer_checked:]
        part = _TRAILER_VALUE_PART if self._trailer_value else _TRAILER_NAME_PART
        if partial[:1] == b":" or not part.fullmatch(arrived):
            return self.refuse(400, "malformed request body framing")
        if not self._trailer_value and b":" in arrived:
            self._trailer_value = True
            if bytes(partial[:partial.index(b":")]).lower() in _FRAMING_FIELDS:
                # llhttp refuses a second length as soon as its name is read
                return self.refuse(400, "malformed request body framing")
        # a CR last is checked again with what follows it (a CRLF ends the line)
        self._trailer_checked = len(partial) - partial.endswith(b"\r")
        return True

    def lineReceived(self, line: bytes) -> None:
        if self._awaiting_head and line[:1] in (b" ", b"\t") and not self._closing:
            # obs-fold (RFC 9112 5.2): refused, as llhttp refuses it, rather than joined --
            # a continuation a backend could read as a header of its own
            self.refuse(400, "a header line continues the previous one (obs-fold)")
            return
        super().lineReceived(line)

    def headerReceived(self, line: bytes) -> bool:
        """
        Check the headers that decide framing and routing before twisted.web sees them.
        ``line`` is one whole field line (an obs-fold already joined with a space).
        """
        name, colon, value = line.partition(b":")
        if len(value.translate(None, b"\x00\r\n")) != len(value):
            # RFC 9110 5.5; twisted.web 25.5 passes a lone CR or LF through, which a
            # backend's parser may read as the end of the line (request smuggling)
            return self.refuse(400, "a header value has a NUL, CR or LF")
        if len(value.translate(None, _CONTROLS)) != len(value):
            # the other control characters (RFC 9110 5.5: invalid), refused as llhttp --
            # the lean main port's parser, and the engines' own (uvicorn) -- refuses them
            return self.refuse(400, "a header value has a control character")
        lowered = name.lower()  # exact: "Host " (space before the colon) is twisted's 400
        if colon and lowered == b"transfer-encoding":
            return self._transfer_encoding(value)
        if colon and lowered == b"host":
            self._host_lines += 1
            if self._host_lines > 1:
                return self.refuse(400, "the request has more than one Host header")
            if not VALID_HOST.fullmatch(value.strip(b" \t")):
                return self.refuse(400, "the request's Host header is not a valid host")
        ok: bool = super().headerReceived(line)
        return ok

    def _transfer_encoding(self, value: bytes) -> bool:
        """
        Accept exactly one coding, ``chunked``, over all ``Transfer-Encoding`` lines; every
        other value is refused here, where twisted.web would take ``identity`` for "no body"
        and a later ``identity`` line after ``chunked`` for chunked.
        """
        self._transfer_codings += codings(value)
        _, _, version = parsed_request_line(self)
        refusal = transfer_coding_refusal(self._transfer_codings, version == b"HTTP/1.1")
        if refusal is not None:
            return self.refuse(*refusal)
        ok: bool = super().headerReceived(b"Transfer-Encoding: chunked")
        return ok

    def allHeadersReceived(self) -> None:
        self._awaiting_head = False
        self._cancel_deadline()
        missing_host = self._host_lines == 0
        self._reset_head()
        method, target, version = parsed_request_line(self)
        if target is not None and len(target.translate(None, VISIBLE_ASCII)) != 0:
            # twisted.web lets DEL and bytes 0x80-0xB0 through; the backend's parser may not
            self.refuse(400, "the request target has bytes that are not visible ASCII")
            return
        if missing_host and version == b"HTTP/1.1":
            self.refuse(400, "an HTTP/1.1 request must have a Host header")
            return  # nothing more: the refused request never reaches the proxy
        if method == b"CONNECT":
            # a tunnel, asked of a proxy: txlb opens none (nginx: 405), and what follows
            # the head would be the tunnel's bytes, not a request -- nothing more is read
            self.refuse(405, CONNECT_REFUSED)
            return
        if method is not None and method.upper() == b"CONNECT":
            # methods are case-sensitive (RFC 9110 9.1): "connect" is no CONNECT here, but
            # a backend reading it as one would take what follows for a tunnel's bytes;
            # llhttp (the lean server) refuses it as an unknown method
            self.refuse(400, "malformed request line or headers")
            return
        if target is not None and not valid_target_form(target):
            self.refuse(400, TARGET_REFUSED)
            return
        super().allHeadersReceived()

    def checkPersistence(self, request: Any, version: bytes) -> bool:
        """
        Keep the connection open unless the client asked to close it, reading every
        ``Connection`` line as a token list (twisted.web reads only the first line, split
        on spaces, so ``keep-alive,close`` would stay open).  HTTP/1.0 always closes.
        ``Proxy-Connection`` (an old client's word for the same thing, which llhttp reads
        as ``Connection``) closes too, as on the main port.
        """
        headers = request.requestHeaders
        tokens = {token.lower()
                  for name in (b"connection", b"proxy-connection")
                  for value in headers.getRawHeaders(name, [])
                  for token in TOKEN_SEPARATORS.split(value) if token}
        if version == b"HTTP/1.1" and b"close" not in tokens:
            return True
        if version == b"HTTP/1.1":
            request.responseHeaders.setRawHeaders(b"Connection", [b"close"])
        return False

    def requestDone(self, request: Request) -> None:
        # the next request's head gets its own deadline, from its first byte
        self._awaiting_head = True
        super().requestDone(request)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._cancel_deadline()
        super().connectionLost(reason)

    def lineLengthExceeded(self, line: bytes) -> None:
        """A request line or header over 16 KiB: 431, as nginx answers, not a bare close."""
        self.refuse(431, "request header fields too large")

    def _respondToBadRequestAndDisconnect(self) -> None:
        """
        twisted.web's answer to a malformed request line, header, length or chunked body
        (private API, see the top of this module): the same 400, with a JSON body, and
        logged.
        """
        if self._awaiting_head:
            self.refuse(400, "malformed request line or headers")
        else:
            self.refuse(400, "malformed request body framing")

    def refuse(self, status: int, message: str) -> bool:
        """
        Answer ``status`` with a JSON error, close the connection, and make sure the
        request being parsed (if any) never reaches the resource.  Only the first refusal
        of a connection is written: twisted.web may find a second fault in bytes it had
        already read.  Returns ``False``, twisted.web's "stop parsing this header".
        """
        if self._closing:
            return False
        self._closing = True
        self._cancel_deadline()
        request = self.requests[-1] if self.requests else None
        body = error_body(status, message)
        if isinstance(request, LimitedRequest):
            request.refused(status, body)
        if self.transport is not None:
            self.transport.write(raw_response(status, body))
            self.loseConnection()
        return False

    def _cancel_deadline(self) -> None:
        if self._head_deadline is not None and self._head_deadline.active():
            self._head_deadline.cancel()
        self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self.transport is None:
            return
        log_slow_head(log, self.transport.getPeer(),
                      getattr(getattr(self, "site", None), "repeats", None), self.header_timeout)
        self.refuse(408, f"request headers not received within {self.header_timeout:g}s")


class LimitedRequest(Request):
    """A request that refuses a body over its site's ``max_body`` while it arrives."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._body_seen = 0
        #: the pace of a chunked body's chunks (``None``: the body is not chunked)
        self._pace: ChunkPace | None = None
        self._refused = False

    @property
    def _max_body(self) -> int:
        site = getattr(self.channel, "site", None)
        return getattr(site, "max_body", 0) or 0

    def gotLength(self, length: int | None) -> None:
        limit = self._max_body
        if limit and length is not None and length > limit:
            # no "100 Continue" for a body that is refused anyway
            self.requestHeaders.removeHeader(b"expect")
            self._refuse(f"the request body ({length} bytes) is over the limit of "
                         f"{limit} bytes")
            return
        if length is None:  # twisted.web's channel says None only for a chunked body
            self._pace = ChunkPace()
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self._refused:
            return
        self._body_seen += len(data)
        pace = self._pace
        if pace is not None and pace.too_small(self._body_seen):
            self._refuse(CHUNKS_TOO_SMALL, status=400)
            return
        limit = self._max_body
        if limit and self._body_seen > limit:
            self._refuse(f"the request body is over the limit of {limit} bytes")
            return
        super().handleContentChunk(data)

    def process(self) -> None:
        """
        As twisted.web's, except for the ``*`` target (``OPTIONS *``), which twisted.web
        answers itself, unseen by the resource -- so with no result-log line.  Here the
        resource answers it, as on the lean server (:mod:`txlb._server.lean`).
        """
        if self.path != b"*":
            super().process()
            return
        self.site = self.channel.site  # type: ignore[attr-defined]  # a Site's channel
        self.setHeader(b"Date", datetimeToString())
        self.prepath, self.postpath = [], []
        try:
            self.render(self.site.getResourceFor(self))
        except BaseException:
            self.processingFailed(Failure())

    def setHeader(self, name: bytes | str, value: bytes | str) -> None:
        """
        As twisted.web's, except for the ``Server: TwistedWeb/...`` its ``process`` puts
        on every answer: txlb names no software (nginx's ``server_tokens off``), so an
        answer has a ``Server`` header only when the backend sent one.
        """
        if name == b"Server" and value == server_version:
            return
        super().setHeader(name, value)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if self._refused:
            return  # answered already; the proxy never sees it
        super().requestReceived(command, path, version)

    def _refuse(self, message: str, status: int = 413) -> None:
        channel = self.channel
        if isinstance(channel, ProxyChannel):
            channel.refuse(status, message)
        elif channel is not None:
            # in an embedder's own channel: answer the same way, without its framing checks
            body = error_body(status, message)
            self.refused(status, body)
            if channel.transport is not None:
                channel.transport.write(raw_response(status, body))
                channel.loseConnection()

    def refused(self, status: int, body: bytes) -> None:
        """
        Mark this request as answered by the channel (``status`` with ``body``): it never
        reaches the resource, and the site's ``on_refused`` gets it for the result log.
        """
        if self._refused:
            return
        self._refused = True
        # The request line is parsed but not yet given to the request: take it from the
        # channel, so the result log says what was refused ("-" when it did not parse).
        command, path, _ = parsed_request_line(self.channel)
        self.method = command or b"-"
        self.uri = path or b"-"
        site = getattr(self.channel, "site", None)
        if site is not None and getattr(site, "on_refused", None) is not None:
            site.on_refused(self, status, body)


class ProxySite(Site):
    """
    The main port's Site.

    No twisted.web access log: formatting a Common Log Format line per request costs the
    proxy throughput, and txlb's own result log is the one operators read.
    """

    protocol = ProxyChannel  # type: ignore[assignment]
    requestFactory = LimitedRequest
    noisy = False  # "Starting factory <ProxySite object at 0x...>" says nothing to operators

    def __init__(self, resource: IResource, max_body: int = 0, header_timeout: float = 30.0,
                 on_refused: Any = None, repeats: RepeatSummary | None = None,
                 **kwargs: Any) -> None:
        # A proxy forwards a form body as it came and never reads request.args: parsing
        # every POST's Content-Type (twisted.web does it through the email package) cost
        # a sixth of the CPU of a small request.
        kwargs.setdefault("parsePOSTFormSubmission", False)
        super().__init__(resource, **kwargs)
        self.max_body = max_body
        self.header_timeout = header_timeout
        self.on_refused = on_refused
        self.repeats = repeats

    def reconfigure(self, config: Config) -> None:
        """``config``'s ``--max-body`` and ``--header-timeout``, from the next request on."""
        self.max_body = config.max_body
        self.header_timeout = config.header_timeout

    def buildProtocol(self, addr: Any) -> Any:
        channel = super().buildProtocol(addr)
        if channel is not None:
            channel.header_timeout = self.header_timeout
        return channel

    def log(self, request: Any) -> None:
        pass
