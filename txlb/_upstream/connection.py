"""
One keep-alive connection to a backend (:class:`UpstreamConnection`): it writes a request,
reads the response head, and while the response is in flight it is that response and its
body's producer, walking a chunked body's framing so it knows where the message ends while
handing the bytes on untouched.

Its pool (:class:`txlb._upstream.client.UpstreamClient`) hands it each :class:`Attempt`
and takes it back once a response is read to its end; the connection knows the pool only
as a :class:`ConnectionPool`, declared here, below it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from typing import Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IDelayedCall, IPushProducer
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import RequestTransmissionFailed, ResponseFailed, ResponseNeverReceived
from zope.interface import implementer

from txlb._compat import unsent_bytes
from txlb._http.headers import RawHeaders
from txlb._upstream.heads import MAX_HEAD_BYTES, BadResponse, framing, parse_head
from txlb._upstream.interfaces import IRelayOwner, UpstreamResponse
from txlb._upstream.resend import may_send_again

#: A chunk size line: 1-16 hex digits, optional whitespace, optional extensions free of
#: control characters.  Stricter than "int() of what comes before ';'", because the line
#: is passed on to the client raw, and a lenient parser is how two hops come to disagree
#: on where a message ends ("+1", " 1", "1_0", or a bare LF in an extension).
_CHUNK_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\x00-\x08\x0a-\x1f\x7f]*)?")
#: A chunk size with nothing after it (the fast path's check).
_HEX_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
#: Longest chunk size line accepted (extensions included).
MAX_CHUNK_LINE = 4096


class Attempt:
    """One request waiting for a connection and its response head."""

    __slots__ = ("host", "port", "method", "data", "body", "deferred", "connection",
                 "connector", "fresh_only", "written_at")

    def __init__(self, host: str, port: int, method: bytes, data: bytes,
                 body: bytes | None = None) -> None:
        self.host = host
        self.port = port
        self.method = method
        #: the request's head
        self.data = data
        #: its body, written after the head as its own bytes: never joined onto the head
        #: (a copy of a body of megabytes)
        self.body = body
        self.deferred: Deferred[UpstreamResponse] = Deferred(self._cancel)
        self.connection: UpstreamConnection | None = None
        self.connector: Any = None
        #: a pooled connection failed already: the next one must be new
        self.fresh_only = False
        #: when the request's last byte was written to its connection's transport (the
        #: injected clock): where :data:`~txlb._upstream.resend.RESEND_WINDOW` counts from
        self.written_at = 0.0

    def _cancel(self, deferred: Deferred[UpstreamResponse]) -> None:
        if self.connection is not None:
            connection, self.connection = self.connection, None
            connection.abort()
        elif self.connector is not None:
            self.connector.stopConnecting()

    def fail(self, failure: Failure) -> None:
        if not self.deferred.called:
            self.deferred.errback(failure)



class ConnectionPool(TypingProtocol):
    """What a connection needs of its pool (:class:`~txlb._upstream.client.UpstreamClient`)."""

    #: the injected clock's time, for :data:`~txlb._upstream.resend.RESEND_WINDOW`
    now: Callable[[], float]

    def dispatch(self, attempt: Attempt) -> None:
        """Send ``attempt`` on an idle pooled connection, or on a new one."""

    def release(self, connection: UpstreamConnection) -> None:
        """``connection`` read a response to its end and may carry another: keep it."""

    def forget(self, connection: UpstreamConnection) -> None:
        """An idle ``connection`` closed (or misbehaved): out of the pool."""


@implementer(IPushProducer)
class UpstreamConnection(Protocol):
    """
    One keep-alive connection to a backend; while a response is in flight it is also
    that response (:class:`UpstreamResponse`) and its body's producer.

    States: ``new`` (connecting), ``head`` (request sent, reading the head), ``body``,
    ``idle`` (in the pool), ``closed``.
    """

    def __init__(self, client: ConnectionPool, key: tuple[str, int],
                 attempt: Attempt | None) -> None:
        self.client = client
        self.key = key
        self.state = "new"
        self.reused = False
        self._attempt = attempt
        self._buffer = b""
        self._scanned = 0  # how much of the buffer has been searched for the head's end
        self._received = False
        self._owner: IRelayOwner | None = None
        self._raw = False
        self._mode = "none"
        self._remaining = 0
        self._chunk_state = 0  # 0: at a size line, 1: in data, 2: after data (CRLF), 3: trailers
        self._keep_alive = False
        self._paused = False
        self._idle_timer: IDelayedCall | None = None
        # the UpstreamResponse side
        self.code = 0
        self.phrase = b""
        self.headers: RawHeaders = []
        self.length: int | None = None
        self.chunked = False

    # -- connection lifecycle ---------------------------------------------------------------

    def connectionMade(self) -> None:
        assert self.transport is not None
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)  # a token is small and must not wait for Nagle
        attempt, self._attempt = self._attempt, None
        if attempt is not None:
            attempt.connector = None
            if attempt.deferred.called:  # cancelled while connecting
                self.abort()
                return
            self.send(attempt)

    def send(self, attempt: Attempt) -> None:
        assert self.transport is not None
        attempt.connection = self
        self._attempt = attempt
        self.state = "head"
        self._buffer = b""
        self._scanned = 0
        self._received = False
        attempt.written_at = self.client.now()
        self.transport.write(attempt.data)
        if attempt.body:
            self.transport.write(attempt.body)

    def abort(self) -> None:
        self.state = "closed"
        self._owner = None
        if self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        state, self.state = self.state, "closed"
        if self._idle_timer is not None and self._idle_timer.active():
            self._idle_timer.cancel()
        self._idle_timer = None
        if state == "idle":
            self.client.forget(self)
        elif state == "head":
            attempt, self._attempt = self._attempt, None
            if attempt is None or attempt.deferred.called:
                return
            attempt.connection = None
            write_failed = bool(unsent_bytes(self.transport))
            if self.reused and may_send_again(
                    write_failed=write_failed, reused=True, answered=self._received,
                    held=self.client.now() - attempt.written_at):
                # a pooled connection the backend closed as we reused it (or that took
                # only part of the request): not its fault, and it never had the request
                attempt.fresh_only = True
                self.client.dispatch(attempt)
            elif write_failed:
                # part of the request never left: the backend cannot have started on it
                attempt.fail(Failure(RequestTransmissionFailed([reason])))
            else:
                # it had the whole request: it may be generating, so never sent again
                attempt.fail(Failure(ResponseNeverReceived([reason])))
        elif state == "body":
            owner, self._owner = self._owner, None
            if owner is None:
                return
            if self._mode == "close" and reason.check(ConnectionDone):
                owner.body_ended(None)  # delimited by the close: a clean end (not a reset)
            else:
                owner.body_ended(Failure(ResponseFailed([reason])))

    # -- reading ----------------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        state = self.state
        if state == "body":
            if self._owner is None:
                self._buffer += data  # not delivered yet
            elif self._mode == "chunked":
                self._chunked(data)
            elif self._mode == "length":
                self._fixed(data)
            else:
                self._owner.body_chunk(data)
        elif state == "head":
            self._received = True
            self._head(data)
        elif state == "idle":
            # nothing was asked: a confused backend; never reuse this connection
            self.client.forget(self)
            self.abort()

    def _head(self, data: bytes) -> None:
        buffer = self._buffer + data if self._buffer else data
        while True:
            # search only what is new (and the 3 bytes before it): a head trickled in
            # byte by byte must not cost a rescan of the whole buffer per byte
            end = buffer.find(b"\r\n\r\n", max(0, self._scanned - 3))
            if end < 0 or end > MAX_HEAD_BYTES:
                if len(buffer) > MAX_HEAD_BYTES:
                    self._bad_head(BadResponse("response head too large"))
                else:
                    self._buffer = buffer
                    self._scanned = len(buffer)
                return
            self._scanned = 0
            attempt = self._attempt
            assert attempt is not None
            try:
                version, code, phrase, headers = parse_head(buffer[:end])
                mode, length, keep_alive = framing(version, code, attempt.method, headers)
            except BadResponse as error:
                self._bad_head(error)
                return
            buffer = buffer[end + 4:]
            if code < 200:
                if code == 101:
                    self._bad_head(BadResponse("unexpected 101 Switching Protocols"))
                    return
                continue  # 100 Continue, 103 Early Hints: the real head follows
            break
        self.code, self.phrase, self.headers = code, phrase, headers
        self.length = length if mode in ("length", "none") else None
        self.chunked = mode == "chunked"
        self._mode = mode
        self._keep_alive = keep_alive
        self._remaining = length or 0
        self._chunk_state = 0
        self._buffer = buffer
        self.state = "body"
        self._attempt = None
        attempt.connection = None
        attempt.deferred.callback(self)

    def _bad_head(self, error: BadResponse) -> None:
        attempt, self._attempt = self._attempt, None
        self.abort()
        if attempt is not None:
            attempt.connection = None
            attempt.fail(Failure(ResponseFailed([Failure(error)])))

    # -- UpstreamResponse -------------------------------------------------------------------

    def deliver(self, owner: IRelayOwner, raw: bool) -> None:
        self._owner = owner
        self._raw = raw
        owner.body_started(self)
        if self._mode == "none":
            if self._buffer:
                self._keep_alive = False  # bytes after a bodiless response: never reuse
            self._complete()
            return
        pending, self._buffer = self._buffer, b""
        if pending:
            self.dataReceived(pending)

    def discard(self) -> None:
        """Abort: the body of a 502/503 that is retried elsewhere is not worth reading."""
        self.abort()

    # -- body framing -----------------------------------------------------------------------

    def _fixed(self, data: bytes) -> None:
        owner = self._owner
        assert owner is not None
        remaining = self._remaining - len(data)
        if remaining > 0:
            self._remaining = remaining
            owner.body_chunk(data)
            return
        if remaining < 0:
            self._keep_alive = False  # bytes beyond the body: never reuse this connection
            data = data[: self._remaining]
        self._remaining = 0
        owner.body_chunk(data)
        if self._owner is owner:  # still wanted after the write
            self._complete()

    def _chunked(self, data: bytes) -> None:
        """
        Walk the chunk framing of ``data`` (with any held-back partial size line).  Raw
        mode passes the bytes on as they are, holding back only an incomplete size line
        (it might be the last chunk's, which the client's side writes itself); otherwise
        only the chunk payloads go on.
        """
        if self._chunk_state == 3:  # past the last chunk: the trailers are arriving
            self._buffer += data
            self._trailers()
            return
        owner = self._owner
        assert owner is not None
        raw = self._raw
        if raw and not self._buffer and self._chunk_state == 0:
            # The common case, one token per read: exactly one whole chunk ("fa\r\n" +
            # 250 bytes + "\r\n"), checked with a few C calls and handed on as it is.
            end = data.find(b"\r\n", 0, 18)
            if end > 0 and _HEX_SIZE.fullmatch(data, 0, end):
                length = int(data[:end], 16)
                if length and len(data) == end + length + 4 and data.endswith(b"\r\n"):
                    owner.body_chunk(data)
                    return
        buffer = self._buffer + data if self._buffer else data
        self._buffer = b""
        size = len(buffer)
        position = 0  # raw mode hands on buffer[:position] (an incomplete size line waits)
        while position < size:
            state = self._chunk_state
            if state == 1:  # inside a chunk's data
                take = min(self._remaining, size - position)
                if not raw:
                    owner.body_chunk(buffer[position:position + take])
                position += take
                self._remaining -= take
                if not self._remaining:
                    self._chunk_state = 2
            else:  # at a size line, or at the CRLF closing a chunk's data
                if state == 2:
                    if size - position < 2:
                        break  # hold the partial CRLF
                    if buffer[position:position + 2] != b"\r\n":
                        return self._bad_body("missing CRLF after a chunk")
                    position += 2
                    self._chunk_state = 0
                    continue
                end = buffer.find(b"\r\n", position)
                if end < 0 or end - position > MAX_CHUNK_LINE:
                    if size - position > MAX_CHUNK_LINE:
                        return self._bad_body("chunk size line too long")
                    break
                line = _CHUNK_SIZE_LINE.fullmatch(buffer, position, end)
                if line is None:
                    return self._bad_body("bad chunk size line")
                length = int(line.group(1), 16)
                if length == 0:
                    if raw and position:
                        owner.body_chunk(buffer[:position])
                    self._chunk_state = 3
                    self._scanned = 0
                    self._buffer = buffer[end + 2:]
                    self._trailers()
                    return
                position = end + 2
                self._remaining = length
                self._chunk_state = 1
        if raw and position:
            owner.body_chunk(buffer[:position])
        if position < size:
            self._buffer = buffer[position:]

    def _trailers(self) -> None:
        """After the last chunk: skip trailer fields up to the blank line, then done."""
        buffer = self._buffer
        if buffer.startswith(b"\r\n"):
            extra = buffer[2:]
        else:
            end = buffer.find(b"\r\n\r\n", max(0, self._scanned - 3))
            if end < 0 or end > MAX_HEAD_BYTES:
                if len(buffer) > MAX_HEAD_BYTES:
                    self._bad_body("trailers too large")
                self._scanned = len(buffer)
                return  # wait for the rest
            extra = buffer[end + 4:]
        self._buffer = b""
        if extra:
            self._keep_alive = False
        self._complete()

    def _bad_body(self, why: str) -> None:
        owner, self._owner = self._owner, None
        self.abort()
        if owner is not None:
            owner.body_ended(Failure(ResponseFailed([Failure(BadResponse(why))])))

    def _complete(self) -> None:
        """The whole response is read: pool the connection (or close it), then report."""
        if self.state != "body":
            return  # aborted while the last bytes were handed on
        owner, self._owner = self._owner, None
        self._buffer = b""
        if self._keep_alive and self.transport is not None:
            self.client.release(self)
        else:
            self.state = "closed"
            if self.transport is not None:
                self.transport.loseConnection()
        if owner is not None:
            owner.body_ended(None)

    # -- IPushProducer (the body's flow control) -------------------------------------------

    def pauseProducing(self) -> None:
        if self.state == "body" and self.transport is not None:
            self._paused = True
            self.transport.pauseProducing()  # type: ignore[attr-defined]

    def resumeProducing(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resumeProducing()  # type: ignore[attr-defined]

    def stopProducing(self) -> None:
        if self.state == "body":
            self.abort()

    # -- pooling ----------------------------------------------------------------------------

    def idle(self, timer: IDelayedCall) -> None:
        self.state = "idle"
        self.reused = True
        self.resumeProducing()  # a client that was slow must not leave it paused
        self._idle_timer = timer

    def take(self) -> None:
        if self._idle_timer is not None and self._idle_timer.active():
            self._idle_timer.cancel()
        self._idle_timer = None

