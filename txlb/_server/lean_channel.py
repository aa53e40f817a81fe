"""
One client connection of the lean main-port server (:mod:`txlb._server.lean`): the bytes
read handed to llhttp (through ``httptools``), the requests parsed answered in order, and
every refusal written.

llhttp is strict where a second parser could read a request differently (``Content-Length``
with ``Transfer-Encoding``, a repeated ``Content-Length``, a bad chunk size, a bare CR or LF,
a NUL, a space before a colon, obs-fold: 400); what it leaves to its caller is checked
exactly as :class:`~txlb._server.site.ProxyChannel` checks it.  The checks of each part of
a head as llhttp hands it over are :mod:`txlb._server.lean_head`'s; the channel checks what
only the reads as a whole show:

* ``--header-timeout``: a request's line and headers get that long from their first byte
  (slowloris; the empty lines llhttp skips before a request line count), then 408; a head
  still incomplete after some 128 KiB on the wire: 431;
* a request line with more than one space between its parts: 400 (llhttp lets it through);
* ``--max-body``: 413 the moment a body so far exceeds it, without buffering past it and
  with no ``100 Continue`` for a refused body; a chunked body's framing (size lines,
  extensions, trailers) may be at most its payload plus 16 KiB before it is 400 (httptools
  buffers a trailer whole); a body is held as one buffer of its payload
  (:meth:`~txlb._server.lean_head.RequestHead.add_body`), and a chunked body of chunks too
  small to be worth their parse is 400 (:class:`~txlb._server.rules.ChunkPace`);
* a connection idle for 60 s (nothing received, no answer under way) is closed, as
  twisted.web closes it.

Every refusal is :func:`txlb._server.rules.raw_response` (JSON body, ``Connection: close``),
is reported to the site's ``on_refused`` for the result log, closes the connection, and
nothing after it is parsed.  Pipelined requests are answered in order, one at a time; a read
is parsed no further than a request waiting behind the one being answered (the rest is held
as bytes) and reading pauses meanwhile.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from email.utils import formatdate
from io import BytesIO
from typing import Any
from typing import Protocol as TypingProtocol

from httptools import (
    HttpParserCallbackError,
    HttpParserError,
    HttpParserUpgrade,
    HttpRequestParser,
)
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.resource import IResource
from twisted.web.server import NOT_DONE_YET

from txlb._http.errors import error_body
from txlb._log.quiet import RepeatSummary
from txlb._server.lean_head import (
    MALFORMED_HEAD,
    Refused,
    RequestHead,
    malformed_refusal,
    parsed_method,
    request_line_so_far,
)
from txlb._server.lean_request import LeanRequest, ProducerRelay
from txlb._server.rules import (
    CHUNKS_TOO_SMALL,
    MAX_HEAD_BYTES,
    MAX_LINE,
    log_slow_head,
    raw_response,
)

log = Logger(namespace="txlb._server.site")

#: Bytes a head may take on the wire while incomplete before it is refused even though no
#: single span was seen whole yet (httptools buffers a header until it ends): bounds the
#: memory one slow or hostile client can hold, whatever its reads look like.
_HEAD_BUFFER_LIMIT = 4 * MAX_HEAD_BYTES + 65536

#: Bytes of a chunked body's framing (chunk-size lines, extensions, trailers) beyond its
#: payload: a body's framing may be at most its payload and this much more.  llhttp reads
#: extensions without buffering, but httptools buffers a trailer until its line ends, and
#: nothing else bounds them after the head (twisted.web refuses a chunk-size line over
#: 1 KiB and trailers over 64 KiB).  Counted over the whole body, not per read: a read with
#: one byte of data in it must not excuse 60 KiB of extensions.
_FRAMING_LIMIT = MAX_HEAD_BYTES

#: A read is parsed this much at a time once a request in it is complete (_feed_bounded).
_FEED_SLICE = 4096

#: Complete requests that may wait behind the one being answered before reading pauses.
_PIPELINE_DEPTH = 1

#: A connection on which nothing arrives for this long while no answer is being written is
#: closed (twisted.web's idle timeout, which ``lb.site()`` keeps).
IDLE_TIMEOUT = 60.0


class _Stop(Exception):
    """Raised from a parser callback to stop parsing: nothing after this request is read."""


class _Refusal:
    """A refusal waiting for its turn behind the requests pipelined before it."""

    __slots__ = ("status", "body", "request")

    def __init__(self, status: int, body: bytes, request: LeanRequest) -> None:
        self.status = status
        self.body = body
        self.request = request


class DateCache:
    """The ``Date`` header's value, formatted once a second rather than per request."""

    def __init__(self, clock: IReactorTime | None) -> None:
        self._seconds = clock.seconds if clock is not None else time.time
        self._at = -1
        self._value = b""

    def now(self) -> bytes:
        second = int(self._seconds())
        if second != self._at:
            self._at = second
            self._value = formatdate(second, usegmt=True).encode("ascii")
        return self._value


class ChannelSite(TypingProtocol):
    """
    What a channel reads of its site (:class:`txlb._server.lean.LeanSite`), per connection
    and per request, so that a reload retunes it in place.  Declared here, below the site,
    which builds the channels.
    """

    #: what renders each request (the proxy resource)
    resource: IResource
    max_body: int
    header_timeout: float
    #: told ``(request, status, body)`` of each refusal, for the result log
    on_refused: Any
    repeats: RepeatSummary | None
    clock: IReactorTime
    date: DateCache


class LeanChannel(Protocol):
    """One client connection of the main port (see the module docstring)."""

    #: a TCP (or TLS, or UNIX) transport: a producer and a consumer as well
    transport: Any

    def __init__(self, site: ChannelSite) -> None:
        self.site = site
        self.factory = site
        self.header_timeout = site.header_timeout
        self._parser = HttpRequestParser(self)
        self._head: RequestHead | None = None
        #: parsed requests (and at most one refusal, last) waiting for their turn
        self._queue: deque[LeanRequest | _Refusal] = deque()
        #: the request being answered
        self._current: LeanRequest | None = None
        #: what the transport pauses while the client's socket is full: the answer's producer
        self._relay = ProducerRelay()
        self._deadline: IDelayedCall | None = None
        #: refused, or past a request after which nothing is read: input is dropped
        self._closing = False
        self._advancing = False
        self._reading_paused = False
        self._head_buffered = 0
        #: bytes read into a chunked body since llhttp last reached a chunk or its data
        #: the part of a read not parsed yet: it follows a request waiting for its turn
        self._held = b""
        self._continue_sent = False
        #: the start of a request line not yet ended by CRLF (see _check_request_line)
        self._line: bytes | None = None
        #: a request asking to switch protocols whose body is still being read
        self._upgrading: RequestHead | None = None
        self._idle_timer: IDelayedCall | None = None
        self._last_active = 0.0

    # -- the connection -------------------------------------------------------------------

    def connectionMade(self) -> None:
        transport = self.transport
        assert transport is not None
        # Streamed tokens are small writes: Nagle's algorithm must not hold them back
        # (nginx's tcp_nodelay, on by default).
        set_no_delay = getattr(transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            with contextlib.suppress(OSError):  # not a TCP socket, or already closed
                set_no_delay(True)
        # the transport tells the relay when the client's socket is full; it passes it
        # on to the producer of the answer being written (the exchange)
        transport.registerProducer(self._relay, True)
        clock = self.site.clock
        self._last_active = clock.seconds()
        self._idle_timer = clock.callLater(IDLE_TIMEOUT, self._idle_check)

    def _idle_check(self) -> None:
        """
        Close a connection idle for ``IDLE_TIMEOUT``: nothing received, no answer being
        written.  One timer per connection, re-armed for what is left rather than moved on
        every read (a held stream is not idle: its timer just waits again).
        """
        self._idle_timer = None
        if self._closing or self.transport is None:
            return
        clock = self.site.clock
        quiet = clock.seconds() - self._last_active
        if self._current is None and not self._queue and quiet >= IDLE_TIMEOUT:
            self._closing = True
            self.loseConnection()
            return
        wait = IDLE_TIMEOUT - quiet if quiet < IDLE_TIMEOUT else IDLE_TIMEOUT
        self._idle_timer = clock.callLater(wait, self._idle_check)

    def dataReceived(self, data: bytes) -> None:
        if self._closing:
            return  # refused or closing: whatever follows is never parsed, so never forwarded
        self._last_active = self.site.clock.seconds()
        if self._held:
            # bytes of an earlier read wait unparsed: this one comes after them
            self._held += data
            self._pause_reading()
            return
        self._receive(data)
        self._advance()

    def _receive(self, data: bytes) -> None:
        """Parse ``data`` (a read, or the bytes held back from one), without answering."""
        if self._upgrading is None and (self._line is not None or self._head is None):
            data = self._check_request_line(data)
            if not data:
                return
        # a chunked body under way: what of this read is not its payload is its framing
        before = self._head
        payload = before.body_size if before is not None and before.pace is not None else -1
        try:
            if len(data) <= _FEED_SLICE:
                self._feed(data)  # the usual read: one call less
            else:
                self._feed_bounded(data)
        finally:
            head = self._head
            if head is not None and head.request is None and not self._closing:
                # a head is under way: its deadline runs from its first byte, and its
                # bytes on the wire are bounded even before httptools hands a span over
                if self._deadline is None:
                    self._deadline = self.site.clock.callLater(self.header_timeout,
                                                               self._head_too_slow)
                self._head_buffered += len(data)
                if self._head_buffered > _HEAD_BUFFER_LIMIT:
                    self.refuse(431, "request header fields too large")
            elif head is before and payload >= 0 and head is not None and not self._closing:
                # a chunked body: its framing bytes are bounded too (_FRAMING_LIMIT)
                # what of the read was parsed (a part held back behind a waiting request
                # is counted when it is parsed) and was not payload
                head.framing += len(data) - len(self._held) - (head.body_size - payload)
                if head.framing > _FRAMING_LIMIT + head.body_size:
                    self.refuse(400, "malformed request body framing")
            elif (head is None and self._deadline is None and self._upgrading is None
                  and self._current is None and not self._queue and not self._closing
                  and not data.strip(b"\r\n")):
                # llhttp skips empty lines before a request line without starting a
                # message: they start the head's deadline, as on twisted.web, or a CRLF
                # now and then would hold the connection with no deadline at all
                self._deadline = self.site.clock.callLater(self.header_timeout,
                                                           self._head_too_slow)

    def _feed_bounded(self, data: bytes) -> None:
        """
        ``data`` to llhttp, but no further than a request waiting for its turn: the rest
        of the read is held back, unparsed, until the requests before it are answered (as
        twisted.web holds it).  Parsed whole, one 64 KiB read of small pipelined requests
        behind a stream was some 2,400 requests, megabytes held per connection.
        """
        self._feed(data[:_FEED_SLICE])
        if self._closing:
            return  # refused, or a request after which nothing is read
        if not self._queue:  # the usual read: no request ended in its start (a body)
            self._feed(data[_FEED_SLICE:])
            return
        position = _FEED_SLICE
        while position < len(data) and not self._closing:
            if self._queue:
                self._held = data[position:]
                return
            self._feed(data[position:position + _FEED_SLICE])
            position += _FEED_SLICE

    def _check_request_line(self, data: bytes) -> bytes:
        """
        The request line that starts this read, checked for what llhttp lets through and
        twisted.web does not: more than one space between its three parts.  Only a line at
        the start of a read is seen whole here (a pipelined one is not: txlb writes every
        request line upstream itself, so the spaces never reach a backend either way).
        Returns what to feed llhttp; ``b""`` once refused.
        """
        self._line, well_formed = request_line_so_far(self._line, data)
        if not well_formed:
            self.refuse(400, MALFORMED_HEAD)
            return b""
        return data

    def _feed(self, data: bytes) -> None:
        parser = self._parser
        while True:
            if self._upgrading is not None:
                data = self._upgrade_body(data)
                if not data or self._closing:
                    return
            try:
                parser.feed_data(data)
                return
            except HttpParserUpgrade as upgrade:
                # llhttp stops after the head of a request asking to switch protocols
                # (``Upgrade``, CONNECT) and leaves its body unread.  txlb does not switch
                # (``Upgrade`` is hop-by-hop): the body is read here, by its
                # Content-Length, and parsing goes on after it, as twisted.web does
                offset = upgrade.args[0] if upgrade.args else len(data)
                data = data[offset:]
                if self._closing or not (data or self._upgrading is not None):
                    return
            except HttpParserCallbackError as error:
                cause = error.__context__
                if isinstance(cause, Refused):
                    self.refuse(cause.status, cause.message)
                    return
                if isinstance(cause, _Stop):
                    return
                if cause is not None:
                    raise cause from None
                raise
            except HttpParserError as error:
                head = self._head
                self.refuse(*malformed_refusal(str(error), self.site.max_body,
                                               head is not None and head.request is not None))
                return

    def _upgrade_body(self, data: bytes) -> bytes:
        """The body of a request llhttp left unread (see :meth:`_feed`); what follows it."""
        head = self._upgrading
        assert head is not None
        rest = head.add_counted_body(data)
        if rest is None:
            return b""
        self._upgrading = None
        try:
            self._complete(head)
        except _Stop:
            return b""
        return rest

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._closing = True
        self._cancel_deadline()
        idle, self._idle_timer = self._idle_timer, None
        if idle is not None and idle.active():
            idle.cancel()
        self._relay.producer = None
        current, self._current = self._current, None
        self._queue.clear()
        self._held = b""
        self._head = None
        if current is not None:
            current.connectionLost(reason)

    def loseConnection(self) -> None:
        """Close once what is written has gone (the transport's producer unregistered first,
        so a paused one cannot hold the close back)."""
        transport = self.transport
        if transport is not None:
            transport.unregisterProducer()
            transport.loseConnection()

    # -- llhttp's callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._head = RequestHead()
        self._head_buffered = 0
        self._continue_sent = False

    def on_url(self, url: bytes) -> None:
        head = self._head
        assert head is not None
        head.url += url
        if len(head.url) > MAX_LINE - 24:  # near the limit: the exact count (rare)
            head.check_line_length(self._parser)

    def on_header(self, name: bytes, value: bytes) -> None:
        head = self._head
        assert head is not None
        if head.request is not None:
            head.add_trailer(name)
        else:
            head.add_field(name, value, self._parser)

    def on_headers_complete(self) -> None:
        head = self._head
        assert head is not None
        self._cancel_deadline()
        self._head_buffered = 0
        head.start_request(self, self._parser, self.site.max_body)
        if head.expect is not None and head.wants_continue():
            self._maybe_continue()

    # No on_chunk_header / on_chunk_complete: httptools calls only the callbacks a protocol
    # has, and each is a Python call per chunk.  The framing is bounded per read, in
    # _receive, by what of the read was not payload.

    def on_body(self, data: bytes) -> None:
        head = self._head
        assert head is not None
        head.add_body(data)
        pace = head.pace
        if pace is not None and pace.too_small(head.body_size):
            raise Refused(400, CHUNKS_TOO_SMALL)
        limit = self.site.max_body
        if limit and head.body_size > limit:
            raise Refused(413, f"the request body is over the limit of {limit} bytes")

    def on_message_complete(self) -> None:
        head, self._head = self._head, None
        assert head is not None and head.request is not None
        if head.upgrade and head.content_length:
            self._upgrading = head  # its body comes after the upgrade pause (see _feed)
            return
        self._complete(head)

    def _complete(self, head: RequestHead) -> None:
        """``head``'s request is whole: in line for its answer."""
        request = head.request
        assert request is not None
        request.content = BytesIO(head.take_body())
        self._queue.append(request)
        if not request.persistent:
            self._closing = True  # the answer closes the connection: nothing more is read
            raise _Stop()

    # -- answering, in order --------------------------------------------------------------

    def _advance(self) -> None:
        """Answer the next request in line, if none is being answered."""
        if self._advancing:
            return
        self._advancing = True
        try:
            queue = self._queue
            while True:
                while self._current is None and queue and self.transport is not None:
                    item = queue.popleft()
                    if isinstance(item, _Refusal):
                        self._write_refusal(item)
                        return
                    self._current = item
                    self._dispatch(item)
                if (self._current is None and not queue and self._held
                        and not self._closing and self.transport is not None):
                    held, self._held = self._held, b""  # what a read held back: parsed now
                    self._receive(held)
                    continue
                break
            if self._current is None and not queue:
                self._resume_reading()
                self._maybe_continue()
            elif (len(queue) >= _PIPELINE_DEPTH or self._held) and not self._closing:
                self._pause_reading()
        finally:
            self._advancing = False

    def _dispatch(self, request: LeanRequest) -> None:
        headers = request.responseHeaders
        # no Server: txlb names no software (nginx's server_tokens off); a backend's own
        # Server header is passed on with the rest of its head
        headers.setRawHeaders(b"Date", [self.site.date.now()])
        # the "*" target ("OPTIONS *") too: the resource answers it, and logs it
        try:
            result = self.site.resource.render(request)
        except Exception:
            log.failure("rendering {uri!r} failed", uri=request.uri)
            if request.startedWriting and not request.finished:
                # part of an answer is out: only a cut connection says it is not whole
                self._closing = True
                self.transport.abortConnection()
                return
            if not request.finished:
                request.setResponseCode(500)
                body = error_body(500, "internal error in the balancer")
                request.responseHeaders = Headers({b"Content-Type": [b"application/json"],
                                                   b"Content-Length": [b"%d" % len(body)]})
                request.write(body)
                request.finish()
            return
        if result is not NOT_DONE_YET and isinstance(result, bytes) and not request.finished:
            request.write(result)
            request.finish()

    def request_done(self, request: LeanRequest) -> None:
        """``request`` has its whole answer: close, or go on with the next one."""
        if request is not self._current:
            return
        self._current = None
        self._relay.producer = None
        self._last_active = self.site.clock.seconds()  # idle from the answer's end
        if not request.persistent:
            self._closing = True
            self.loseConnection()
            return
        self._advance()

    def register_request_producer(self, producer: Any) -> None:
        """The answer's producer, paused while the client's socket is full."""
        self._relay.producer = producer

    def _maybe_continue(self) -> None:
        """``100 Continue`` for a body that is wanted, once the answers before it are out."""
        head = self._head or self._upgrading
        if (head is None or head.request is None or self._continue_sent or self._closing
                or self._current is not None or self._queue or self.transport is None):
            return
        if not head.wants_continue():
            return
        self._continue_sent = True
        self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pauseProducing()

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self._closing:
            self._reading_paused = False
            self.transport.resumeProducing()

    # -- refusals -------------------------------------------------------------------------

    def refuse(self, status: int, message: str) -> None:
        """
        Answer ``status`` with a JSON error and close, after the answers to the requests
        pipelined before this one; nothing after it is parsed, and the request being parsed
        (if any) never reaches the proxy.  Only a connection's first refusal counts.
        """
        if self._closing:
            return
        self._closing = True
        self._cancel_deadline()
        head = self._head
        request = head.request if head is not None else None
        if request is None:
            # llhttp names a method (DELETE, its zero) even before it read one: only a
            # request line read as far as its target has a method to log
            parsed = head is not None and bool(head.url)
            method = parsed_method(self._parser) if parsed else b"-"
            url = head.url if head is not None and head.url else b"-"
            request = LeanRequest(None, method, url, b"HTTP/1.1", Headers())
            if head is not None:
                for name, value in head.headers:
                    request.requestHeaders.addRawHeader(name, value)
        request.channel = None  # it never reaches the resource
        self._head = None
        self._queue.append(_Refusal(status, error_body(status, message), request))
        if not self._advancing:
            self._advance()

    def _write_refusal(self, refusal: _Refusal) -> None:
        self._closing = True
        on_refused = self.site.on_refused
        if on_refused is not None:
            try:
                on_refused(refusal.request, refusal.status, refusal.body)
            except Exception:
                log.failure("logging a refused request")
        transport = self.transport
        if transport is not None:
            transport.write(raw_response(refusal.status, refusal.body))
            self.loseConnection()

    def _cancel_deadline(self) -> None:
        deadline, self._deadline = self._deadline, None
        if deadline is not None and deadline.active():
            deadline.cancel()

    def _head_too_slow(self) -> None:
        self._deadline = None
        if self.transport is None or self._closing:
            return
        log_slow_head(log, self.transport.getPeer(), self.site.repeats, self.header_timeout)
        self.refuse(408, f"request headers not received within {self.header_timeout:g}s")
        self._advance()
