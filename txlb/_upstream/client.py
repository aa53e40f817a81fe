"""
txlb's own HTTP/1.1 client for the hop to the backends.

Why not ``twisted.web.client.Agent``: profiling the relay (docs/performance.md) showed the
two largest costs per streamed token were Agent decoding the backend's chunked framing and
twisted.web re-encoding the very same chunks for the client -- and, per request, Agent's
URI parsing, endpoint, retrying wrapper and parser objects (~300 µs of CPU per request).
This client does what nginx does instead: it writes the request head itself, parses the
response head itself, and for a chunked response only *tracks* the chunk boundaries (so it
knows where the message ends and that the framing is sound) while handing the bytes on
untouched, so the proxy can pass them to an HTTP/1.1 client as they came.

What it keeps from Agent, because the proxy's guarantees depend on it:

* the same failures: ``ConnectionRefusedError`` and friends from connecting, Twisted's
  ``TimeoutError`` for a connect timeout, :class:`RequestTransmissionFailed` for a
  connection lost while part of the request was still unsent (the backend never had it
  whole), :class:`ResponseNeverReceived` (wrapping the connection's loss) for a backend
  that closed or reset after the whole request left, before its response head;
* keep-alive connections, pooled per backend, closed after :data:`IDLE_TIMEOUT` (before
  uvicorn's 5 s) -- and a request that finds its pooled connection already closed by the
  backend is sent again once on a fresh connection, so an idle-timeout race never looks
  like a dead backend; but only as :func:`~txlb._upstream.resend.may_send_again` allows
  (the write failed, or the close came within 50 ms of the request's last byte with no
  byte of response), never a request the backend held and may have started on;
* flow control: the response object is the body's ``IPushProducer``; pausing it pauses
  the socket read, stopping it aborts the connection (how vLLM learns to abort).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from typing import Any
from typing import Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IDelayedCall, IPushProducer
from twisted.internet.protocol import ClientFactory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import RequestTransmissionFailed, ResponseFailed, ResponseNeverReceived
from zope.interface import implementer

from txlb._compat import unsent_bytes
from txlb._config import Config
from txlb._proxy.headers import RawHeaders
from txlb._upstream.resend import may_send_again

log = Logger()

#: Idle keep-alive connections are closed after this long: vLLM (uvicorn) closes its side
#: after 5 s, and a request sent on a connection the backend is closing fails.
IDLE_TIMEOUT = 4.0
#: At most this many idle connections kept per backend (LLM fleets run hundreds of
#: concurrent streams per backend; more than that are closed when they come back).
MAX_IDLE_PER_BACKEND = 256
#: A response head larger than this is refused as a bad response (nginx's default
#: proxy_buffer_size is 4-8 KiB; this is generous).
MAX_HEAD_BYTES = 64 * 1024


#: A chunk size line: 1-16 hex digits, optional whitespace, optional extensions free of
#: control characters.  Stricter than "int() of what comes before ';'", because the line
#: is passed on to the client raw, and a lenient parser is how two hops come to disagree
#: on where a message ends ("+1", " 1", "1_0", or a bare LF in an extension).
_CHUNK_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\x00-\x08\x0a-\x1f\x7f]*)?")
#: A chunk size with nothing after it (the fast path's check).
_HEX_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
#: A header field name (RFC 9110 token).
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: Control characters no response head may carry (HTAB aside); CRLFs are replaced first,
#: so this also finds a bare CR or LF -- which other HTTP parsers take as a line end.
_HEAD_CONTROLS = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
#: Longest chunk size line accepted (extensions included).
MAX_CHUNK_LINE = 4096
#: The largest ``Content-Length`` a backend may send (a signed 64-bit offset, nginx's
#: ``off_t``): a larger one is no length any client could hold, and passing it on would
#: promise the client a body that can never come -- a bad response (502), as nginx says.
MAX_CONTENT_LENGTH = 2**63 - 1


class BadResponse(Exception):
    """The backend's response is not valid HTTP/1.1 (bad status line, header or framing)."""


class IRelayOwner(TypingProtocol):
    """What a response body is reported to: the exchange that owns the client request."""

    def body_started(self, producer: IPushProducer) -> None:
        """The body began; ``producer`` pauses/resumes/stops the upstream read."""

    def body_chunk(self, data: bytes) -> None:
        """One upstream read of body bytes, to be written to the client now."""

    def body_ended(self, failure: Failure | None) -> None:
        """The body ended: cleanly (``None``) or not (the failure)."""


class UpstreamResponse(TypingProtocol):
    """A response head from a backend, with a way to receive (or refuse) its body."""

    code: int
    phrase: bytes
    #: every header as received, names lowercased, in order (hop-by-hop ones included)
    headers: RawHeaders
    #: the body's length when the backend said it (Content-Length), else ``None``
    length: int | None
    #: the body arrives in chunked framing; ``deliver(owner, raw=True)`` passes it as is
    chunked: bool

    def deliver(self, owner: IRelayOwner, raw: bool) -> None:
        """
        Stream the body to ``owner``.  With ``raw`` a chunked body is handed on with its
        framing (minus the last chunk and trailers, which the client's side writes
        itself); otherwise only the payload bytes.
        """

    def discard(self) -> None:
        """The body is not wanted (the request goes to another backend): drop it."""


class Upstream(TypingProtocol):
    """How the proxy sends a request to a backend."""

    def send(self, host: str, port: int, method: bytes, target: bytes,
             headers: RawHeaders, body: bytes | None) -> Deferred[UpstreamResponse]:
        """
        Send ``method target`` with ``headers`` (end-to-end ones: ``Host`` and
        ``Content-Length`` are the client's to write) and ``body`` (``None``: no body and
        no ``Content-Length``).  Cancelling the Deferred aborts the attempt.
        """

    def close_idle(self) -> Deferred[None]:
        """Close every idle pooled connection (at shutdown)."""


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


def _framing(version: bytes, code: int, method: bytes,
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


def has_spoken(transport: Any) -> bool:
    """
    Whether an idle connection's backend closed it, or sent something, that the reactor has
    not read yet: a peek at its socket (one system call, nothing taken).  A backend's idle
    close that reaches txlb in the same turn as a new request is otherwise found only once
    the request is written -- and if txlb is slow to read it, later than the resend window
    (:mod:`txlb._upstream.resend`) allows, so the client would get a 502 for a request no
    backend ever saw.  txlb reaches backends over plain TCP (``connectTCP``); a transport
    without a socket (in tests) is taken as it is.  Over TLS the raw socket would show
    records the TLS layer has not read (a session ticket) and waste a good connection.
    """
    peek = getattr(getattr(transport, "socket", None), "recv", None)
    if peek is None:
        return False
    try:
        peek(1, _PEEK)
    except BlockingIOError:
        return False  # nothing waiting: the connection is as it was left
    except OSError:
        return True
    return True  # the end of the stream, or bytes nobody asked for


_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT


class _Attempt:
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


class _ConnectFactory(ClientFactory):
    """Builds the connection for one attempt and reports a failure to connect."""

    noisy = False  # one per upstream connection: not worth two log lines each

    def __init__(self, client: UpstreamClient, attempt: _Attempt) -> None:
        self.client = client
        self.attempt = attempt

    def buildProtocol(self, addr: object) -> UpstreamConnection:
        return UpstreamConnection(self.client, (self.attempt.host, self.attempt.port),
                                  self.attempt)

    def clientConnectionFailed(self, connector: object, reason: Failure) -> None:
        self.attempt.fail(reason)


@implementer(IPushProducer)
class UpstreamConnection(Protocol):
    """
    One keep-alive connection to a backend; while a response is in flight it is also
    that response (:class:`UpstreamResponse`) and its body's producer.

    States: ``new`` (connecting), ``head`` (request sent, reading the head), ``body``,
    ``idle`` (in the pool), ``closed``.
    """

    def __init__(self, client: UpstreamClient, key: tuple[str, int],
                 attempt: _Attempt | None) -> None:
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

    def send(self, attempt: _Attempt) -> None:
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
                mode, length, keep_alive = _framing(version, code, attempt.method, headers)
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


class UpstreamClient:
    """
    Sends proxied requests on pooled keep-alive connections (see the module docstring).

    ``reactor`` needs ``connectTCP`` and ``callLater``.
    """

    def __init__(self, reactor: Any, connect_timeout: float,
                 idle_timeout: float = IDLE_TIMEOUT,
                 max_idle: int = MAX_IDLE_PER_BACKEND) -> None:
        self._reactor = reactor
        self.now: Callable[[], float] = reactor.seconds
        self._connect_timeout = connect_timeout
        self._idle_timeout = idle_timeout
        self._max_idle = max_idle
        self._idle: dict[tuple[str, int], list[UpstreamConnection]] = {}
        self._host_headers: dict[tuple[str, int], bytes] = {}

    def reconfigure(self, config: Config) -> None:
        """``config``'s ``--connect-timeout``, for the connections opened from now on."""
        self._connect_timeout = config.connect_timeout

    def send(self, host: str, port: int, method: bytes, target: bytes,
             headers: RawHeaders, body: bytes | None) -> Deferred[UpstreamResponse]:
        key = (host, port)
        host_header = self._host_headers.get(key)
        if host_header is None:
            name = f"[{host}]" if ":" in host else host
            authority = name if port == 80 else f"{name}:{port}"
            try:
                host_header = authority.encode("idna")
            except UnicodeError:  # not a valid IDNA name (a label over 63 characters)
                host_header = authority.encode("ascii", "replace")
            self._host_headers[key] = host_header
        attempt = _Attempt(host, port, method,
                           request_head(method, target, host_header, headers, body), body)
        self.dispatch(attempt)
        deferred: Deferred[Any] = attempt.deferred
        return deferred

    def dispatch(self, attempt: _Attempt) -> None:
        """Send on an idle pooled connection, or connect a new one."""
        key = (attempt.host, attempt.port)
        if not attempt.fresh_only:
            idle = self._idle.get(key)
            while idle:
                connection = idle.pop()
                connection.take()
                transport: Any = connection.transport
                if (connection.state == "idle" and transport is not None
                        and not transport.disconnecting):
                    if not has_spoken(transport):
                        connection.send(attempt)
                        return
                    connection.state = "closed"  # closed (or babbling) while it sat idle
                    transport.loseConnection()
        factory = _ConnectFactory(self, attempt)
        attempt.connector = self._reactor.connectTCP(attempt.host, attempt.port, factory,
                                                     timeout=self._connect_timeout)

    def release(self, connection: UpstreamConnection) -> None:
        """A response was read to its end on a reusable connection: keep it for later."""
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) >= self._max_idle:
            connection.state = "closed"
            if connection.transport is not None:
                connection.transport.loseConnection()
            return
        connection.idle(self._reactor.callLater(self._idle_timeout, self._expire, connection))
        idle.append(connection)

    def _expire(self, connection: UpstreamConnection) -> None:
        """Idle too long: out of the pool at once (not when the close completes), closed."""
        self.forget(connection)
        connection.state = "closed"
        if connection.transport is not None:
            connection.transport.loseConnection()

    def forget(self, connection: UpstreamConnection) -> None:
        """An idle connection closed (or misbehaved): it leaves the pool."""
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)
        connection.take()

    def close_idle(self) -> Deferred[None]:
        for idle in self._idle.values():
            for connection in idle:
                connection.take()
                connection.state = "closed"
                if connection.transport is not None:
                    connection.transport.loseConnection()
        self._idle.clear()
        done: Deferred[None] = Deferred()
        done.callback(None)
        return done

    def idle_count(self, host: str, port: int) -> int:
        """Idle pooled connections to one backend (for tests and status)."""
        return len(self._idle.get((host, port), ()))

