"""
The fake upstream's interface (:class:`tests.helpers.FakeUpstream`) played over txlb's own
production upstream client (:class:`txlb._upstream.client.UpstreamClient`).

The proxy suites were written against a fake ``IAgent``, which left the client the proxy
really uses tested by its own module only.  :class:`WireUpstream` lets the same tests drive
the real client: the balancer runs on a ``MemoryReactorClock`` with no ``agent=``; each
connection the client opens is accepted over a ``StringTransport``; each request written on
one (a fresh connection or a pooled one) becomes an :class:`WireCall`; and the test's
``FakeResponse`` is turned into bytes on that connection -- a status line and headers,
``Content-Length`` when it gave a length and chunked framing when it did not, each
``send`` one chunk, ``end()`` the last chunk, ``end(failure)`` the connection lost.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import error as neterror
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.web.client import (
    RequestTransmissionFailed,
    ResponseDone,
    ResponseFailed,
    ResponseNeverReceived,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH

from .helpers import FakeResponse

#: Request headers the client writes itself (framing and the authority): an Agent writes
#: its own too, so :class:`FakeUpstream` never records them; neither does this.
_OWN_HEADERS = frozenset({b"host", b"content-length"})


class _BodyTransportView:
    """``FakeResponse.transport`` as the tests read it, over the real socket's state."""

    def __init__(self, transport: StringTransport) -> None:
        self._transport = transport
        self.pauses = 0

    @property
    def paused(self) -> bool:
        return self._transport.producerState == "paused"

    @property
    def stopped(self) -> bool:
        return bool(self._transport.disconnecting)


class WireTransport(StringTransport):
    """A ``StringTransport`` that counts pauses (flow control the client passes on)."""

    def __init__(self) -> None:
        super().__init__(peerAddress=None)
        self.pauses = 0

    def pauseProducing(self) -> None:
        self.pauses += 1
        super().pauseProducing()


class _Connection:
    def __init__(self, protocol: Any, factory: Any, transport: WireTransport, key: bytes):
        self.protocol = protocol
        self.factory = factory
        self.transport = transport
        self.key = key
        self.read = 0  # how much of what the client wrote was parsed into calls


class _WireBody:
    """Stands in for the body protocol a FakeResponse feeds: bytes onto the connection."""

    def __init__(self, connection: _Connection, chunked: bool) -> None:
        self.connection = connection
        self.chunked = chunked

    def dataReceived(self, data: bytes) -> None:
        if self.chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data) if data else b""
        if data:
            self.connection.protocol.dataReceived(data)

    def connectionLost(self, reason: Failure) -> None:
        if reason.check(ResponseDone):
            if self.chunked:
                self.connection.protocol.dataReceived(b"0\r\n\r\n")
            return
        inner = reason.value.reasons[0] if isinstance(reason.value, ResponseFailed) else reason
        self.connection.transport.loseConnection()
        self.connection.protocol.connectionLost(inner)


class WireCall:
    """One request the client wrote, as :class:`tests.helpers.UpstreamCall` shows it."""

    def __init__(self, connection: _Connection, method: bytes, target: bytes,
                 headers: Headers, body: bytes | None) -> None:
        self.connection = connection
        self.method = method
        self.uri = b"http://" + connection.key + target
        self.headers = headers
        self.body = body
        self.answered = False

    @property
    def cancelled(self) -> bool:
        return not self.answered and bool(self.connection.transport.disconnected)

    def header(self, name: bytes) -> list[bytes]:
        return list(self.headers.getRawHeaders(name) or [])

    def respond(self, response: FakeResponse) -> FakeResponse:
        self.answered = True
        names = {name.lower() for name, _ in response.headers.getAllRawHeaders()}
        lines = [b"HTTP/1.1 %d %s" % (response.code, response.phrase)]
        for name, values in response.headers.getAllRawHeaders():
            lines += [name + b": " + value for value in values]
        chunked = response.length is UNKNOWN_LENGTH
        if chunked and b"transfer-encoding" not in names:
            lines.append(b"Transfer-Encoding: chunked")
        elif not chunked and b"content-length" not in names:
            lines.append(b"Content-Length: %d" % int(response.length))  # type: ignore[call-overload]
        response.transport = _BodyTransportView(self.connection.transport)  # type: ignore[assignment]
        response.protocol = _WireBody(self.connection, chunked)  # type: ignore[assignment]
        self.connection.protocol.dataReceived(b"\r\n".join(lines) + b"\r\n\r\n")
        return response

    def fail(self, error: BaseException) -> None:
        self.answered = True
        connection = self.connection
        if isinstance(error, neterror.ConnectError):
            # refused (or unreachable) before any byte: the connect itself failed
            connection.protocol.state = "closed"
            connection.transport.loseConnection()
            connection.factory.clientConnectionFailed(None, Failure(error))
        elif isinstance(error, ResponseNeverReceived):
            connection.transport.loseConnection()
            connection.protocol.connectionLost(error.reasons[0])
        elif isinstance(error, RequestTransmissionFailed):
            # lost with part of the request still unsent: what a socket transport's
            # write buffer shows then (txlb._compat.unsent_bytes reads it)
            transport: Any = connection.transport
            transport.dataBuffer, transport.offset, transport._tempDataBuffer = b"x", 0, []
            connection.transport.loseConnection()
            connection.protocol.connectionLost(error.reasons[0])
        else:  # a response that is not HTTP
            connection.protocol.dataReceived(b"HTTP/1.1 XYZ bad status line\r\n\r\n")


class WireUpstream:
    """:class:`tests.helpers.FakeUpstream`'s ``calls`` and ``last``, over the real client."""

    def __init__(self, reactor: MemoryReactorClock) -> None:
        self.reactor = reactor
        self._connected = 0
        self._connections: list[_Connection] = []
        self._calls: list[WireCall] = []
        recorded = reactor.connectTCP

        def connect_at_once(*args: Any, **kwargs: Any) -> Any:
            # The fake records a request the moment the proxy sends it; so does this: the
            # connection is accepted as it is asked for, and the request written on it.
            connector = recorded(*args, **kwargs)
            self._collect()
            return connector

        reactor.connectTCP = connect_at_once  # type: ignore[method-assign]

    @property
    def calls(self) -> list[WireCall]:
        self._collect()
        return self._calls

    @property
    def last(self) -> WireCall:
        return self.calls[-1]

    def _collect(self) -> None:
        clients = self.reactor.tcpClients
        while self._connected < len(clients):
            host, port, factory, _, _ = clients[self._connected]
            self._connected += 1
            protocol = factory.buildProtocol(None)
            assert protocol is not None
            transport = WireTransport()
            connection = _Connection(protocol, factory, transport,
                                     f"{host}:{port}".encode())
            self._connections.append(connection)
            protocol.makeConnection(transport)
        for connection in self._connections:
            written = connection.transport.value()
            while connection.read < len(written):
                call = self._parse(connection, written[connection.read:])
                if call is None:
                    break
                self._calls.append(call)

    @staticmethod
    def _parse(connection: _Connection, data: bytes) -> WireCall | None:
        head, separator, rest = data.partition(b"\r\n\r\n")
        if not separator:
            return None
        lines = head.split(b"\r\n")
        method, target, _ = lines[0].split(b" ", 2)
        headers = Headers()
        length: int | None = None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            value = value.strip()
            if name.lower() == b"content-length":
                length = int(value)
            if name.lower() not in _OWN_HEADERS:
                headers.addRawHeader(name, value)
        body = None if length is None else rest[:length]
        connection.read += len(head) + 4 + (length or 0)
        return WireCall(connection, method, target, headers, body)
