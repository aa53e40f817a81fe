"""
In-memory doubles for the proxy's two sides.

Client side: a real ``Site`` channel over a ``StringTransport`` (:class:`ClientConnection`),
so disconnects and backpressure go through twisted.web's own code.  Upstream side: a fake
``IAgent`` (:class:`FakeUpstream`) whose responses the test drives chunk by chunk, with a
body transport that records pause/resume/stop -- the signals the proxy must send upstream.
"""

from __future__ import annotations

from typing import Any

import attrs
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IConsumer, IPushProducer
from twisted.internet.protocol import Protocol
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IAgent, IBodyProducer, IResponse
from twisted.web.server import Site
from zope.interface import implementer

from txlb._records.observer import IRequestObserver


@implementer(IConsumer)
class _Collector:
    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        pass

    def unregisterProducer(self) -> None:
        pass


@implementer(IPushProducer)
class FakeBodyTransport:
    """The upstream connection as the body protocol sees it: records flow control."""

    def __init__(self) -> None:
        self.paused = False
        self.stopped = False
        self.pauses = 0

    def pauseProducing(self) -> None:
        self.paused = True
        self.pauses += 1

    def resumeProducing(self) -> None:
        self.paused = False

    def stopProducing(self) -> None:
        self.stopped = True


@implementer(IResponse)
class FakeResponse:
    """An upstream response whose body the test feeds with :meth:`send` and :meth:`end`."""

    version = (b"HTTP", 1, 1)
    previousResponse = None
    request = None

    def __init__(
        self, code: int = 200, headers: list[tuple[bytes, bytes]] | None = None,
        length: int | object = UNKNOWN_LENGTH, phrase: bytes = b"OK",
    ) -> None:
        self.code = code
        self.phrase = phrase
        self.headers = Headers()
        for name, value in headers or []:
            self.headers.addRawHeader(name, value)
        self.length = length
        self.protocol: Protocol | None = None
        self.transport = FakeBodyTransport()

    def deliverBody(self, protocol: Protocol) -> None:
        self.protocol = protocol
        protocol.makeConnection(self.transport)  # type: ignore[arg-type]

    def send(self, data: bytes) -> None:
        assert self.protocol is not None
        self.protocol.dataReceived(data)

    def end(self, reason: Failure | None = None) -> None:
        if self.protocol is None:
            return  # nobody asked for the body (treq skips reading an empty one)
        self.protocol.connectionLost(reason or Failure(ResponseDone()))

    def setPreviousResponse(self, response: IResponse) -> None:
        pass


@attrs.define
class UpstreamCall:
    """One request the proxy sent upstream, and the Deferred the test answers it with."""

    method: bytes
    uri: bytes
    headers: Headers
    body: bytes | None
    deferred: Deferred[IResponse]
    cancelled: bool = False

    def respond(self, response: FakeResponse) -> FakeResponse:
        self.deferred.callback(response)
        return response

    def fail(self, error: BaseException) -> None:
        self.deferred.errback(Failure(error))

    def header(self, name: bytes) -> list[bytes]:
        return self.headers.getRawHeaders(name) or []


@implementer(IAgent)
class FakeUpstream:
    """An IAgent that records each request and lets the test decide what happens."""

    def __init__(self) -> None:
        self.calls: list[UpstreamCall] = []

    def request(
        self, method: bytes, uri: bytes, headers: Headers | None = None,
        bodyProducer: IBodyProducer | None = None,
    ) -> Deferred[IResponse]:
        body = None
        if bodyProducer is not None:
            collector = _Collector()
            bodyProducer.startProducing(collector)
            body = collector.data

        def cancel(d: Deferred[IResponse]) -> None:
            call.cancelled = True

        deferred: Deferred[IResponse] = Deferred(cancel)
        call = UpstreamCall(method, uri, headers or Headers(), body, deferred)
        self.calls.append(call)
        return deferred

    @property
    def last(self) -> UpstreamCall:
        return self.calls[-1]


class ClientConnection:
    """A client connected to a Site in memory, speaking raw HTTP/1.1."""

    def __init__(self, site: Site, peer: str = "10.1.2.3") -> None:
        self.transport = StringTransport(peerAddress=IPv4Address("TCP", peer, 40000))
        self.channel = site.buildProtocol(IPv4Address("TCP", peer, 40000))
        assert self.channel is not None
        self.channel.makeConnection(self.transport)

    def send(self, raw: bytes) -> None:
        self.channel.dataReceived(raw)

    def request(
        self, method: bytes = b"GET", path: bytes = b"/", headers: list[tuple[bytes, bytes]]
        | None = None, body: bytes = b"",
    ) -> None:
        lines = [method + b" " + path + b" HTTP/1.1", b"Host: lb.example"]
        for name, value in headers or []:
            lines.append(name + b": " + value)
        if body or method in (b"POST", b"PUT"):
            lines.append(b"Content-Length: " + str(len(body)).encode())
        self.send(b"\r\n".join(lines) + b"\r\n\r\n" + body)

    def disconnect(self) -> None:
        from twisted.internet.error import ConnectionDone

        self.channel.connectionLost(Failure(ConnectionDone("client went away")))

    def response(self) -> ParsedResponse:
        return parse_response(self.transport.value())


@attrs.define
class ParsedResponse:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    complete: bool

    def header(self, name: bytes) -> list[bytes]:
        return [v for n, v in self.headers if n.lower() == name.lower()]


def parse_response(raw: bytes) -> ParsedResponse:
    """Parse one HTTP/1.1 response, decoding chunked bodies; ``complete`` if it ended."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = [tuple(line.split(b": ", 1)) for line in lines[1:]]
    parsed = [(n, v) for n, v in headers]  # type: ignore[misc]
    names = {n.lower(): v for n, v in parsed}
    if names.get(b"transfer-encoding") == b"chunked":
        body = b""
        while True:
            size_line, sep, after = rest.partition(b"\r\n")
            if not sep:
                return ParsedResponse(status, parsed, body, False)
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                return ParsedResponse(status, parsed, body, True)
            if len(after) < size + 2:
                return ParsedResponse(status, parsed, body + after[:size], False)
            body += after[:size]
            rest = after[size + 2 :]
    if b"content-length" in names:
        length = int(names[b"content-length"])
        return ParsedResponse(status, parsed, rest[:length], len(rest) >= length)
    return ParsedResponse(status, parsed, rest, False)


@implementer(IRequestObserver)
class ObserverTap:
    """
    A request observer in front of another: a test hears each event first (``ended``,
    ``answered``: callables to call with the event's arguments), then the balancer's own
    observer gets it as usual -- so the books are still kept.
    """

    def __init__(self, inner: Any, *, ended: Any = None, answered: Any = None) -> None:
        self._inner = inner
        self._ended = ended
        self._answered = answered

    def ended(self, record: Any) -> None:
        if self._ended is not None:
            self._ended(record)
        self._inner.ended(record)

    def answered(self, backend: Any, status: int, client: str | None) -> None:
        if self._answered is not None:
            self._answered(backend, status, client)
        self._inner.answered(backend, status, client)

    def suspect(self, backend: Any) -> None:
        self._inner.suspect(backend)

    def retried(self) -> None:
        self._inner.retried()

    def waited(self, seconds: float) -> None:
        self._inner.waited(seconds)

    def down(self, backend: Any, reason: str) -> None:
        self._inner.down(backend, reason)


def keep_records(lb: Any) -> list[Any]:
    """The records of every request ``lb``'s proxy finishes from now on, in order."""
    records: list[Any] = []
    context = lb.proxy.context
    context.observer = ObserverTap(context.observer, ended=records.append)
    return records
