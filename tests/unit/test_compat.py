"""
The private Twisted state txlb reads (:mod:`txlb._compat`), checked on real sockets, so a
Twisted release that changes it fails here rather than silently changing what txlb does.
"""

from __future__ import annotations

import errno
import socket
from typing import Any

from twisted.internet import defer, reactor, task, tcp
from twisted.internet.endpoints import serverFromString
from twisted.internet.epollreactor import EPollReactor
from twisted.internet.protocol import ClientFactory, Factory, Protocol, connectionDone
from twisted.internet.testing import StringTransport
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool, readBody
from twisted.web.http import HTTPChannel
from twisted.web.http_headers import Headers

from txlb._compat import (
    BAD_REQUEST_HOOK,
    CONNECTOR_MAKE_TRANSPORT,
    EPOLL_REACTOR_INTERNALS,
    POOL_FACTORY_ATTRIBUTE,
    HTTP11ClientFactory,
    adopt_listening_port,
    chunked_trailer,
    parsed_request_line,
    port_logger,
    response_connection_headers,
    set_port_logger,
    tcp_endpoint_address,
    unsent_bytes,
    unterminated_line,
    write_buffer_empty,
    write_disconnected,
)
from txlb._log.quiet import QuietConnectionPool

PAYLOAD = 16 * 1024 * 1024  # more than loopback's socket buffers take


class _Stalled(Protocol):
    """A server that reads nothing until told to reset."""

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.pauseProducing()  # type: ignore[attr-defined]


class _Writer(Protocol):
    def __init__(self) -> None:
        self.made: defer.Deferred[None] = defer.Deferred()
        self.lost: defer.Deferred[int | None] = defer.Deferred()

    def connectionMade(self) -> None:
        self.made.callback(None)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost.callback(unsent_bytes(self.transport))


class UnsentBytesTests(TestCase):
    timeout = 30

    def test_not_a_socket_transport(self) -> None:
        self.assertIsNone(unsent_bytes(StringTransport()))
        self.assertIsNone(unsent_bytes(object()))

    @defer.inlineCallbacks
    def test_counts_what_the_kernel_has_not_taken_even_after_a_reset(self) -> Any:
        servers: list[_Stalled] = []

        def build() -> _Stalled:
            servers.append(_Stalled())
            return servers[-1]

        port = reactor.listenTCP(0, Factory.forProtocol(build), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        writer = _Writer()
        factory = ClientFactory.forProtocol(lambda: writer)
        reactor.connectTCP("127.0.0.1", port.getHost().port, factory)
        yield writer.made
        assert writer.transport is not None
        self.assertEqual(unsent_bytes(writer.transport), 0)
        writer.transport.write(b"x" * PAYLOAD)
        pending = unsent_bytes(writer.transport)
        assert pending is not None
        self.assertGreater(pending, 0)
        self.assertLessEqual(pending, PAYLOAD)
        while not servers:  # the server side accepts in a later reactor turn
            yield task.deferLater(reactor, 0, lambda: None)
        servers[0].transport.abortConnection()  # type: ignore[union-attr]
        left = yield writer.lost
        self.assertIsNotNone(left)
        self.assertGreater(left, 0)


@defer.inlineCallbacks
def _turns_until(condition: Any, turns: int = 200) -> Any:
    """Let the global reactor run until ``condition()`` holds, at most ``turns`` turns."""
    for _ in range(turns):
        if condition():
            return True
        yield task.deferLater(reactor, 0, lambda: None)
    return bool(condition())


class _Fixed(Protocol):
    """A backend answering any request with one fixed response."""

    RESPONSE = (b"HTTP/1.1 200 OK\r\nConnection: x-hop\r\nX-Hop: 1\r\n"
                b"Content-Length: 2\r\n\r\nok")

    def dataReceived(self, data: bytes) -> None:
        if b"\r\n\r\n" in data:
            assert self.transport is not None
            self.transport.write(self.RESPONSE)


class WriteStateTests(TestCase):
    """``write_buffer_empty`` and ``write_disconnected`` on a real TCP transport."""

    timeout = 30

    @defer.inlineCallbacks
    def test_buffer_and_half_close(self) -> Any:
        servers: list[_Stalled] = []

        def build() -> _Stalled:
            servers.append(_Stalled())
            return servers[-1]

        port = reactor.listenTCP(0, Factory.forProtocol(build), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        writer = _Writer()
        reactor.connectTCP("127.0.0.1", port.getHost().port,
                           ClientFactory.forProtocol(lambda: writer))
        yield writer.made
        conn: Any = writer.transport
        self.addCleanup(lambda: writer.lost)  # trial waits for it: no connection outlives us
        self.addCleanup(conn.abortConnection)
        self.assertTrue(write_buffer_empty(conn))
        self.assertFalse(write_disconnected(conn))
        conn.write(b"x" * PAYLOAD)
        self.assertFalse(write_buffer_empty(conn))
        yield _turns_until(lambda: bool(servers))
        server: Any = servers[0].transport
        self.addCleanup(server.abortConnection)
        server.resumeProducing()
        drained = yield _turns_until(lambda: write_buffer_empty(conn), turns=5000)
        self.assertTrue(drained)
        conn.loseWriteConnection()
        closed = yield _turns_until(lambda: write_disconnected(conn))
        self.assertTrue(closed)


class ReactorInternalsTests(TestCase):
    def test_epoll_reactor_has_what_txlb_epoll_uses(self) -> None:
        epoll = EPollReactor()
        self.addCleanup(epoll._poller.close)
        self.addCleanup(epoll.removeAll)
        for name in EPOLL_REACTOR_INTERNALS:
            self.assertTrue(hasattr(epoll, name), name)
        self.assertTrue(callable(epoll._doReadOrWrite))
        self.assertTrue(callable(epoll._disconnectSelectable))
        self.assertIsInstance(epoll._selectables, dict)

    def test_connector_makes_its_transport_in_the_overridden_method(self) -> None:
        self.assertTrue(callable(getattr(tcp.Connector, CONNECTOR_MAKE_TRANSPORT)))


class _Hooked(HTTPChannel):
    bad: int = 0

    def _respondToBadRequestAndDisconnect(self) -> None:
        self.bad += 1
        super()._respondToBadRequestAndDisconnect()


class ChannelTests(TestCase):
    def channel(self) -> tuple[_Hooked, StringTransport]:
        channel = _Hooked()
        transport = StringTransport()
        channel.makeConnection(transport)
        self.addCleanup(channel.connectionLost, Failure(ConnectionError()))
        return channel, transport

    def test_request_line_being_parsed(self) -> None:
        channel, _ = self.channel()
        self.assertEqual(parsed_request_line(channel), (None, None, None))
        channel.dataReceived(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        self.assertEqual(parsed_request_line(channel),
                         (b"POST", b"/v1/completions", b"HTTP/1.1"))

    def test_unterminated_line_is_what_the_line_receiver_buffers(self) -> None:
        channel, _ = self.channel()
        self.assertEqual(unterminated_line(channel), b"")
        channel.dataReceived(b"GET / HTTP/1.1\r\nHost: x\nX-A")
        self.assertEqual(unterminated_line(channel), b"Host: x\nX-A")

    def test_chunked_trailer_is_what_the_decoder_read_past_the_last_chunk(self) -> None:
        channel, _ = self.channel()
        self.assertIsNone(chunked_trailer(channel))
        channel.dataReceived(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                             b"\r\n\r\n5\r\nhello\r\n")
        self.assertIsNone(chunked_trailer(channel))  # chunks still to come
        channel.dataReceived(b"0\r\nX-A: 1\r\nX-B: 2\r\nX-")
        section = chunked_trailer(channel)
        assert section is not None
        lines, unended = section
        self.assertEqual(([bytes(line) for line in lines], bytes(unended)),
                         ([b"X-A: 1", b"X-B: 2"], b"X-"))
        channel.dataReceived(b"C: 3\n")  # a bare LF ends no line for twisted.web
        section = chunked_trailer(channel)
        assert section is not None
        self.assertEqual((len(section[0]), bytes(section[1])), (2, b"X-C: 3\n"))

    def test_chunked_trailer_is_still_read_when_the_body_ends(self) -> None:
        """allContentReceived sees the whole section, before the decoder is dropped."""
        seen: list[Any] = []

        class _Ending(_Hooked):
            def allContentReceived(self) -> None:
                section = chunked_trailer(self)
                seen.append(section and ([bytes(line) for line in section[0]],
                                         bytes(section[1])))
                super().allContentReceived()

        channel = _Ending()
        transport = StringTransport()
        channel.makeConnection(transport)
        self.addCleanup(channel.connectionLost, Failure(ConnectionError()))
        channel.dataReceived(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                             b"\r\n\r\n0\r\nX-A: 1\r\n\r\n")
        self.assertEqual(seen, [([b"X-A: 1"], b"")])
        self.assertIsNone(chunked_trailer(channel))  # the next request has no decoder yet

    def test_chunked_trailer_is_none_for_a_content_length_body(self) -> None:
        channel, _ = self.channel()
        channel.dataReceived(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nab")
        self.assertIsNone(chunked_trailer(channel))

    def test_bad_request_hook_is_what_a_malformed_request_calls(self) -> None:
        self.assertEqual(BAD_REQUEST_HOOK, _Hooked._respondToBadRequestAndDisconnect.__name__)
        self.assertTrue(callable(getattr(HTTPChannel, BAD_REQUEST_HOOK)))
        channel, transport = self.channel()
        channel.dataReceived(b"GET / HTTP/1.1\r\nno colon here\r\n\r\n")
        self.assertEqual(channel.bad, 1)
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 400 "))


class ClientPoolTests(TestCase):
    def test_pool_builds_connections_from_its_factory_attribute(self) -> None:
        self.assertIs(getattr(HTTPConnectionPool, POOL_FACTORY_ATTRIBUTE), HTTP11ClientFactory)
        quiet = getattr(QuietConnectionPool, POOL_FACTORY_ATTRIBUTE)
        self.assertTrue(issubclass(quiet, HTTP11ClientFactory))
        self.assertFalse(quiet.noisy)

    @defer.inlineCallbacks
    def test_connection_headers_of_an_agent_response(self) -> Any:
        port = reactor.listenTCP(0, Factory.forProtocol(_Fixed), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)
        url = f"http://127.0.0.1:{port.getHost().port}/".encode()
        response = yield Agent(reactor, pool=pool).request(b"GET", url)
        headers = response_connection_headers(response)
        yield readBody(response)
        self.assertIsInstance(headers, Headers)
        assert isinstance(headers, Headers)
        self.assertEqual(headers.getRawHeaders(b"connection"), [b"x-hop"])
        self.assertIsNone(response.headers.getRawHeaders(b"connection"))
        self.assertIsNone(response_connection_headers(object()))


class _AcceptFails:
    """A listening socket whose accept fails as when the kernel is out of buffers."""

    def __init__(self, real: socket.socket) -> None:
        self.real = real

    def accept(self) -> Any:
        raise OSError(errno.ENOBUFS, "No buffer space available")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class ListeningPortTests(TestCase):
    timeout = 30

    def test_port_logs_accept_errors_through_its_logger(self) -> None:
        port: Any = reactor.listenTCP(0, Factory.forProtocol(Protocol), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        original = port_logger(port)
        self.assertIsInstance(original, Logger)
        events: list[dict[str, Any]] = []
        set_port_logger(port, Logger(namespace=original.namespace, observer=events.append))
        real, port.socket = port.socket, _AcceptFails(port.socket)
        try:
            port.doRead()
        finally:
            port.socket = real
        self.assertEqual(len(events), 1)
        self.assertEqual(events[0].get("acceptError"), "ENOBUFS")
        self.assertIsNone(port_logger(object()))

    def test_tcp_endpoint_address(self) -> None:
        endpoint = serverFromString(reactor, "tcp:8123:interface=127.0.0.1:backlog=7")
        self.assertEqual(tcp_endpoint_address(endpoint), (8123, "127.0.0.1", 7))
        endpoint = serverFromString(reactor, "tcp6:8124")
        self.assertEqual(tcp_endpoint_address(endpoint), (8124, "::", 50))

    @defer.inlineCallbacks
    def test_adopted_listening_socket_serves(self) -> Any:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.addCleanup(sock.close)
        sock.bind(("127.0.0.1", 0))
        sock.listen(5)
        sock.setblocking(False)
        accepted: list[Protocol] = []

        def build() -> Protocol:
            accepted.append(Protocol())
            return accepted[-1]

        port = adopt_listening_port(tcp.Port, reactor, sock.fileno(), socket.AF_INET,
                                    Factory.forProtocol(build))
        self.assertFalse(port.connected)
        port.startListening()
        self.addCleanup(port.stopListening)
        writer = _Writer()
        reactor.connectTCP("127.0.0.1", sock.getsockname()[1],
                           ClientFactory.forProtocol(lambda: writer))
        yield writer.made
        self.addCleanup(writer.transport.abortConnection)  # type: ignore[union-attr]
        served = yield _turns_until(lambda: bool(accepted))
        self.assertTrue(served)
        for protocol in accepted:
            self.addCleanup(protocol.transport.abortConnection)  # type: ignore[union-attr]


class QuietClientServiceTests(TestCase):
    def test_a_retry_is_not_logged(self) -> None:
        from twisted.application.internet import ClientService
        from twisted.internet.endpoints import TCP4ClientEndpoint
        from twisted.internet.task import Clock
        from twisted.internet.testing import MemoryReactorClock
        from twisted.logger import globalLogPublisher

        from txlb._compat import quiet_client_service

        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        for service_class, logged in ((ClientService, True),
                                      (quiet_client_service(ClientService), False)):
            del events[:]
            memory, clock = MemoryReactorClock(), Clock()
            endpoint = TCP4ClientEndpoint(memory, "127.0.0.1", 1)
            service = service_class(endpoint, Factory.forProtocol(Protocol), clock=clock)
            service.startService()
            memory.tcpClients[0][2].clientConnectionFailed(None, Failure(Exception("no")))
            retries = [e for e in events if "Scheduling retry" in e.get("log_format", "")]
            self.assertEqual(bool(retries), logged)
            service.stopService()


class TlsNegotiationTests(TestCase):
    def test_alpn_on_the_shared_context_is_seen_where_twisted_does_it(self) -> None:
        """
        Twisted 25.5's TLS factory sets ALPN on the shared context per connection (its
        ``_applyProtocolNegotiation``); later ones do not have the method.  The answer
        follows the method, and the main port names ALPN protocols only without it.
        """
        from twisted.internet.interfaces import IProtocolNegotiationFactory
        from twisted.protocols.tls import TLSMemoryBIOFactory

        from txlb._compat import alpn_mutates_shared_context
        from txlb._server.lean import LeanSite

        per_connection = hasattr(TLSMemoryBIOFactory, "_applyProtocolNegotiation")
        self.assertEqual(alpn_mutates_shared_context(), per_connection)
        self.assertEqual(IProtocolNegotiationFactory.implementedBy(LeanSite),
                         not per_connection)
