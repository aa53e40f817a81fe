"""
The request object of the main port's lean server (:mod:`txlb._server.lean`): the small
part of twisted.web's ``Request`` the proxy renders against, and nothing more.

twisted.web's ``Request`` does much a proxy never uses (sessions, cookies, form parsing,
``getResourceFor``'s path walk, an access log line, a temporary file for bodies) and its
response head costs several Python calls per header.  :class:`LeanRequest` keeps what
:mod:`txlb._proxy` reads -- ``method``, ``uri``, ``prepath``, ``clientproto``,
``requestHeaders``/``responseHeaders`` (twisted's ``Headers``, so header rules and their
sanitising stay twisted's), ``content``, ``getHeader``, ``getClientAddress``, ``isSecure``,
``setResponseCode``, ``setHeader``, ``write``, ``finish``, ``notifyFinish``, the producer
methods, ``startedWriting``, ``chunked`` and ``channel`` -- with twisted.web's semantics for
each (``write`` after ``finish`` raises, ``finish`` after the connection was lost raises,
a disconnected client's writes are dropped, HEAD and 204/304 answers carry no body, an
HTTP/1.1 answer without ``Content-Length`` is chunked), and writes the head together with
the first body bytes in one ``transport.write``.  :class:`ProducerRelay` passes the
client's flow control on to the producer of the answer being written.
"""

from __future__ import annotations

import io
from typing import Any, Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import ISSLTransport
from twisted.python.failure import Failure
from twisted.web.http import NO_BODY_CODES, RESPONSES
from twisted.web.http_headers import Headers


class RequestChannel(Protocol):
    """
    What a request needs of the connection it came on
    (:class:`txlb._server.lean_channel.LeanChannel`): its transport to write the answer to,
    and word of the answer's end and producer.
    Declared here, below the channel, which builds requests and so knows them.
    """

    #: a TCP (or TLS, or UNIX) transport: a consumer, with ``getPeer`` and ``getHost``
    transport: Any

    def request_done(self, request: LeanRequest) -> None:
        """``request`` has its whole answer."""

    def register_request_producer(self, producer: Any) -> None:
        """The answer's producer (``None``: none), paused while the client's socket is full."""

    def loseConnection(self) -> None:
        """Close once what is written has gone."""


class LeanRequest:
    """One request on a lean channel, from its parsed head to its answer's last byte."""

    __slots__ = ("channel", "method", "uri", "path", "clientproto", "requestHeaders",
                 "responseHeaders", "content", "prepath", "code", "code_message",
                 "startedWriting", "chunked", "finished", "persistent", "producer",
                 "defaultContentType", "_disconnected", "_notifications", "_no_body",
                 "__weakref__")

    def __init__(self, channel: RequestChannel | None, method: bytes, uri: bytes,
                 clientproto: bytes, headers: Headers) -> None:
        self.channel: RequestChannel | None = channel
        self.method = method
        self.uri = uri
        self.path = uri.partition(b"?")[0]
        self.clientproto = clientproto
        self.requestHeaders = headers
        self.responseHeaders = Headers()
        self.content: io.BytesIO | None = None
        #: the proxy is the whole main port: nothing of the path is a mount point
        self.prepath: list[bytes] = []
        self.code = 200
        self.code_message = b"OK"
        self.startedWriting = False
        self.chunked = False
        self.finished = False
        #: whether the connection stays open after this answer (the channel decides)
        self.persistent = True
        self.producer: Any = None
        #: twisted.web's: a ``Content-Type`` for answers that set none (``None``: none)
        self.defaultContentType: bytes | None = None
        self._disconnected = False
        self._notifications: list[Deferred[None]] = []
        self._no_body = False

    # -- what the proxy reads -------------------------------------------------------------

    def getHeader(self, name: bytes) -> bytes | None:
        """The last value of request header ``name``, as twisted.web's ``getHeader``."""
        values = self.requestHeaders.getRawHeaders(name)
        return values[-1] if values else None

    def getClientAddress(self) -> Any:
        channel = self.channel
        return None if channel is None or channel.transport is None else channel.transport.getPeer()

    def getHost(self) -> Any:
        channel = self.channel
        return None if channel is None or channel.transport is None else channel.transport.getHost()

    def isSecure(self) -> bool:
        channel = self.channel
        return (channel is not None and channel.transport is not None
                and ISSLTransport(channel.transport, None) is not None)

    # -- the answer -----------------------------------------------------------------------

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        self.code = code
        self.code_message = message if message is not None else RESPONSES.get(
            code, b"Unknown Status")

    def setHeader(self, name: bytes | str, value: bytes | str) -> None:
        self.responseHeaders.setRawHeaders(name, [value])

    def write(self, data: bytes) -> None:
        """
        Body bytes; the first call sends the head with them, in one write.  As twisted.web:
        after :meth:`finish` it raises; to a client that left it does nothing.
        """
        if self.finished:
            raise RuntimeError("LeanRequest.write called on a request after "
                               "LeanRequest.finish was called.")
        if self._disconnected or self.channel is None:
            return
        transport = self.channel.transport
        if not self.startedWriting:
            transport.write(self._head(data))
            return
        if self._no_body or not data:
            return
        if self.chunked:
            transport.writeSequence((b"%x\r\n" % len(data), data, b"\r\n"))
        else:
            transport.write(data)

    def write_framed(self, data: bytes) -> None:
        """
        Body bytes already in chunked framing (the backend's, passed through): written as
        they are.  The last chunk is still written by :meth:`finish`, so a cut stream stays
        a cut one.  The seam :func:`txlb._proxy.incoming.framed_writer` hands out.
        """
        if not self._disconnected and self.channel is not None and data:
            self.channel.transport.write(data)

    def _head(self, data: bytes) -> bytes:
        """The response head (status line, headers), followed by ``data`` as the body."""
        self.startedWriting = True
        headers = self.responseHeaders
        code = self.code
        self._no_body = no_body = self.method == b"HEAD" or code in NO_BODY_CODES
        if (self.clientproto == b"HTTP/1.1" and not no_body
                and not headers.hasHeader(b"content-length")):
            headers.setRawHeaders(b"Transfer-Encoding", [b"chunked"])
            self.chunked = True
        if self.defaultContentType is not None and not headers.hasHeader(b"content-type"):
            headers.setRawHeaders(b"Content-Type", [self.defaultContentType])
        parts = [b"%s %d %s\r\n" % (self.clientproto, code, self.code_message)]
        for name, values in headers.getAllRawHeaders():
            for value in values:
                parts.append(b"%s: %s\r\n" % (name, value))
        parts.append(b"\r\n")
        if data and not no_body:
            parts.append(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)
        return b"".join(parts)

    def finish(self) -> None:
        """The answer is complete: the last chunk, then the channel takes the next request."""
        if self._disconnected:
            raise RuntimeError("LeanRequest.finish called on a request after its "
                               "connection was lost; use notifyFinish to keep track of this.")
        if self.finished:
            return
        channel = self.channel
        assert channel is not None
        if not self.startedWriting:
            head = self._head(b"")
            channel.transport.write(head + b"0\r\n\r\n" if self.chunked else head)
        elif self.chunked:
            channel.transport.write(b"0\r\n\r\n")
        self.finished = True
        self.channel = None
        if self.content is not None:
            self.content.close()
            self.content = None
        channel.request_done(self)
        notifications, self._notifications = self._notifications, []
        for waiting in notifications:
            waiting.callback(None)

    def notifyFinish(self) -> Deferred[None]:
        """Fires when the answer is finished, or errs when the client left first."""
        waiting: Deferred[None] = Deferred()
        self._notifications.append(waiting)
        return waiting

    def connectionLost(self, reason: Failure) -> None:
        """The client left before the answer was finished (called by the channel)."""
        self._disconnected = True
        self.channel = None
        if self.content is not None:
            self.content.close()
            self.content = None
        notifications, self._notifications = self._notifications, []
        for waiting in notifications:
            waiting.errback(reason)

    # -- flow control ---------------------------------------------------------------------

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        if self.producer is not None:
            raise ValueError(f"registering producer {producer} before previous one "
                             f"({self.producer}) was unregistered")
        self.producer = producer
        if self.channel is not None:
            self.channel.register_request_producer(producer)

    def unregisterProducer(self) -> None:
        if self.channel is not None:
            self.channel.register_request_producer(None)
        self.producer = None

    def loseConnection(self) -> None:
        if self.channel is not None:
            self.channel.loseConnection()


class ProducerRelay:
    """
    The producer a channel registers with its transport, once per connection: the client's
    socket is full, or has room, and the producer of the answer being written (the
    exchange, through :meth:`LeanRequest.registerProducer`) hears it; between answers
    nobody does.
    """

    __slots__ = ("producer",)

    def __init__(self) -> None:
        #: the answer's producer (``None``: no answer is being written, or it has none)
        self.producer: Any = None

    def pauseProducing(self) -> None:
        if self.producer is not None:
            self.producer.pauseProducing()

    def resumeProducing(self) -> None:
        if self.producer is not None:
            self.producer.resumeProducing()

    def stopProducing(self) -> None:
        if self.producer is not None:
            self.producer.stopProducing()
