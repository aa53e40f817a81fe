"""
The hop to the backends through txlb's own client (:mod:`txlb._upstream.client`): what the
proxy promises about it (docs/reliability.md, "Upstream connections") -- the documented
limits to the byte and the second, keep-alive reuse and closing idle connections, the
idle-close race, the Host header, and the words an operator reads.  (The client's protocol
itself is tests.unit.test_upstream.)

Written for the survivors of the full mutation run of ``_upstream/client``
(``bench/results/mutation-full/_upstream-client.json``).  The limits are written out here
(4 s, 256, 50 ms, 64 KiB, 4 KiB), not imported: a test that reads the constant it checks
moves with it.
"""

from __future__ import annotations

from typing import Any, cast

from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IPushProducer
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseFailed, ResponseNeverReceived

from txlb._http.words import describe_failure
from txlb._upstream.client import UpstreamClient
from txlb._upstream.connection import UpstreamConnection

from .test_upstream import SSE_HEAD, Owner

HOST, PORT = "127.0.0.1", 8002
EMPTY_200 = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


class NoDelayTransport(StringTransport):
    """A StringTransport that records ``setTcpNoDelay``, as a TCP transport has it."""

    def __init__(self) -> None:
        super().__init__()
        self.no_delay: list[bool] = []

    def setTcpNoDelay(self, enabled: bool) -> None:
        self.no_delay.append(enabled)


class _ClientTestCase(SynchronousTestCase):
    """The client on a MemoryReactorClock; the test plays the backend."""

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.client = UpstreamClient(self.reactor, connect_timeout=5)

    def send(self) -> list[Any]:
        result: list[Any] = []
        self.client.send(HOST, PORT, b"POST", b"/v1/completions", [], b"{}").addBoth(
            result.append)
        return result

    def connect(self, index: int = -1, transport: StringTransport | None = None
                ) -> tuple[UpstreamConnection, StringTransport]:
        factory = self.reactor.tcpClients[index][2]
        connection: Any = factory.buildProtocol(None)
        transport = transport if transport is not None else StringTransport()
        connection.makeConnection(transport)
        return connection, transport

    def answer(self, wire: bytes, raw: bool = True
               ) -> tuple[UpstreamConnection, StringTransport, Owner]:
        """A request on a new connection, answered with ``wire`` (the head in it)."""
        result = self.send()
        connection, transport = self.connect()
        connection.dataReceived(wire)
        owner = Owner()
        result[0].deliver(owner, raw=raw)
        return connection, transport, owner

    def pooled(self) -> tuple[UpstreamConnection, StringTransport]:
        """A connection whose response was read to its end: back in the pool."""
        connection, transport, owner = self.answer(EMPTY_200)
        self.assertEqual(owner.ended, [None])
        self.assertEqual(self.client.idle_count(HOST, PORT), 1)
        return connection, transport

    def assertPooled(self, transport: StringTransport) -> None:
        self.assertEqual(self.client.idle_count(HOST, PORT), 1)
        self.assertFalse(transport.disconnecting)

    def assertNotReused(self, transport: StringTransport) -> None:
        self.assertEqual(self.client.idle_count(HOST, PORT), 0)
        self.assertTrue(transport.disconnecting or transport.disconnected)


class KeepAliveTests(_ClientTestCase):
    """Answers the full run of ``_upstream/client``: the pool of idle connections."""

    def test_an_idle_connection_lives_4_seconds(self) -> None:
        """Closed at 4 s idle: after 3.5 s it is still there, at 4 s txlb has closed it
        (before uvicorn's own 5 s)."""
        _, transport = self.pooled()
        self.reactor.advance(3.5)
        self.assertPooled(transport)
        self.reactor.advance(0.5)
        self.assertNotReused(transport)

    def test_256_idle_connections_are_kept_per_backend_and_the_next_is_closed(self) -> None:
        results = [self.send() for _ in range(257)]
        transports = []
        for index, result in enumerate(results):
            connection, transport = self.connect(index)
            connection.dataReceived(b"HTTP/1.1 204 No Content\r\n\r\n")
            result[0].deliver(Owner(), raw=False)
            transports.append(transport)
        self.assertEqual(self.client.idle_count(HOST, PORT), 256)
        self.assertEqual([t.disconnecting for t in transports], [False] * 256 + [True])

    def test_a_late_pause_does_not_stop_a_pooled_connection_reading(self) -> None:
        """The response is over and its connection pooled: a pause from whoever had its
        body must not leave the socket unread for the next request."""
        connection, transport, owner = self.answer(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        self.assertEqual(owner.ended, [None])
        owner.producer.pauseProducing()
        self.assertEqual(transport.producerState, "producing")
        result = self.send()
        connection.dataReceived(EMPTY_200)
        self.assertEqual(result[0].code, 200)

    def test_nagle_is_off_on_a_backend_connection(self) -> None:
        """A token is a few bytes: the request and each read must not wait for Nagle."""
        self.send()
        _, transport = self.connect(transport=NoDelayTransport())
        assert isinstance(transport, NoDelayTransport)
        self.assertEqual(transport.no_delay, [True])

    def test_a_backend_connection_logs_nothing_when_it_starts_or_stops(self) -> None:
        """One factory per upstream connection: Twisted's "Starting factory" and
        "Stopping factory" lines would be two log lines per request."""
        events: list[dict[str, Any]] = []
        observer = cast(ILogObserver, events.append)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        self.send()
        factory = self.reactor.tcpClients[-1][2]
        factory.doStart()  # what a real connector does around a connection
        connection, _ = self.connect()
        connection.dataReceived(EMPTY_200)
        factory.doStop()
        self.assertEqual([e for e in events if e.get("factory") is factory], [])

    def test_the_body_producer_is_an_ipushproducer(self) -> None:
        """IRelayOwner.body_started gets an IPushProducer: an owner may adapt it, as the
        Agent path adapts its transport."""
        _, _, owner = self.answer(SSE_HEAD)
        self.assertIs(IPushProducer(owner.producer), owner.producer)


class IdleCloseRaceTests(_ClientTestCase):
    """Answers the full run of ``_upstream/client``: a reused connection the backend closes."""

    def test_the_window_counts_from_the_write_at_any_clock_time(self) -> None:
        self.reactor.advance(10_000)
        connection, _ = self.pooled()
        second = self.send()
        self.reactor.advance(0.04)
        connection.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(second, [])
        self.assertEqual(len(self.reactor.tcpClients), 2)  # sent again, on a new one
        fresh, _ = self.connect()
        fresh.dataReceived(EMPTY_200)
        self.assertEqual(second[0].code, 200)

    def test_closed_60_ms_after_the_write_is_a_failure_not_a_resend(self) -> None:
        """Past the 50 ms window the backend may have started on it: never a duplicate."""
        connection, _ = self.pooled()
        second = self.send()
        self.reactor.advance(0.06)
        connection.connectionLost(Failure(ConnectionDone()))
        self.assertIsInstance(second[0].value, ResponseNeverReceived)
        self.assertEqual(len(self.reactor.tcpClients), 1)

    def test_the_resend_goes_on_a_new_connection_not_another_pooled_one(self) -> None:
        """The backend closing idle connections has likely closed its other idle ones
        too: the one resend is on a new connection."""
        first, second = self.send(), self.send()
        pair = [self.connect(0), self.connect(1)]
        for (connection, _), result in zip(pair, (first, second), strict=True):
            connection.dataReceived(EMPTY_200)
            result[0].deliver(Owner(), raw=False)
        self.assertEqual(self.client.idle_count(HOST, PORT), 2)
        for _, transport in pair:
            transport.clear()
        third = self.send()
        used, other = pair if pair[0][1].value() else pair[::-1]
        self.assertEqual(other[1].value(), b"")
        used[0].connectionLost(Failure(ConnectionDone()))
        self.assertEqual(len(self.reactor.tcpClients), 3)
        self.assertEqual(other[1].value(), b"")  # the other pooled one is left alone
        self.assertEqual(self.client.idle_count(HOST, PORT), 1)
        fresh, _ = self.connect()
        fresh.dataReceived(EMPTY_200)
        self.assertEqual(third[0].code, 200)


class LimitTests(_ClientTestCase):
    """Answers the full run of ``_upstream/client``: the documented size limits, to the
    byte (a head of 64 KiB, a chunk size line of 4 KiB) and however the reads fall."""

    @staticmethod
    def head(size: int) -> bytes:
        """A 200 head of exactly ``size`` bytes before its blank line."""
        start = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nX-Pad: "
        return start + b"p" * (size - len(start)) + b"\r\n\r\n"

    def test_a_head_of_64_kib_is_accepted(self) -> None:
        result = self.send()
        connection, _ = self.connect()
        connection.dataReceived(self.head(64 * 1024))
        self.assertEqual(result[0].code, 200)

    def test_a_head_one_byte_over_64_kib_is_refused(self) -> None:
        result = self.send()
        connection, transport = self.connect()
        connection.dataReceived(self.head(64 * 1024 + 1))
        self.assertIsInstance(result[0].value, ResponseFailed)
        self.assertIn("response head too large", describe_failure(result[0]))
        self.assertTrue(transport.disconnected)

    def test_a_head_under_the_limit_is_accepted_when_64_kib_came_before_its_end(self) -> None:
        """64 KiB read, the head's blank line not yet whole: that is not too large."""
        wire = self.head(64 * 1024 - 3)
        result = self.send()
        connection, _ = self.connect()
        connection.dataReceived(wire[:64 * 1024])
        self.assertEqual(result, [])
        connection.dataReceived(wire[64 * 1024:])
        self.assertEqual(result[0].code, 200)

    def test_a_chunk_size_line_of_4_kib_is_accepted(self) -> None:
        line = b"1;" + b"x" * (4096 - 2)
        connection, _, owner = self.answer(SSE_HEAD)
        connection.dataReceived(line + b"\r\na\r\n0\r\n\r\n")
        self.assertEqual((owner.data, owner.ended), (line + b"\r\na\r\n", [None]))

    def test_a_chunk_size_line_one_byte_over_4_kib_is_refused(self) -> None:
        line = b"1;" + b"x" * (4097 - 2)
        connection, transport, owner = self.answer(SSE_HEAD)
        connection.dataReceived(line + b"\r\na\r\n0\r\n\r\n")
        self.assertEqual(owner.data, b"")
        self.assertEqual(len(owner.ended), 1)
        failure = owner.ended[0]
        assert failure is not None
        self.assertEqual(describe_failure(failure), "chunk size line too long")
        self.assertNotReused(transport)


class FramingTests(_ClientTestCase):
    """Answers the full run of ``_upstream/client``: where a response ends, and a
    connection reused only when its response was read exactly to its end."""

    def test_a_body_is_not_over_with_one_byte_to_come(self) -> None:
        connection, transport, owner = self.answer(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhell")
        self.assertEqual((owner.data, owner.ended), (b"hell", []))
        self.assertEqual(self.client.idle_count(HOST, PORT), 0)
        connection.dataReceived(b"o")
        self.assertEqual((owner.data, owner.ended), (b"hello", [None]))
        self.assertPooled(transport)

    def test_one_byte_after_the_trailers_stops_reuse(self) -> None:
        connection, transport, owner = self.answer(SSE_HEAD)
        connection.dataReceived(b"2\r\nhi\r\n0\r\nx-checksum: 1\r\n\r\nH")
        self.assertEqual((owner.data, owner.ended), (b"2\r\nhi\r\n", [None]))
        self.assertNotReused(transport)


class ErrorWordsTests(_ClientTestCase):
    """
    Answers the full run of ``_upstream/client``: what the result log's ``error=`` (and
    the log) say about a bad head.  They quote the offending bytes -- the status line, not
    another line of the head -- cut short, so a 64 KiB line of garbage is not a 64 KiB log
    line.
    """

    def words(self, head: bytes) -> str:
        result = self.send()
        connection, transport = self.connect()
        connection.dataReceived(head)
        self.assertIsInstance(result[0].value, ResponseFailed)
        self.assertTrue(transport.disconnected)
        return describe_failure(result[0])

    def test_a_bad_status_line_is_quoted_to_80_bytes(self) -> None:
        status = b"ICY 200 " + b"x" * 100
        self.assertEqual(self.words(status + b"\r\nServer: y\r\n\r\n"),
                         f"bad status line {status[:80]!r}")

    def test_a_bad_status_code_is_quoted_to_10_bytes(self) -> None:
        self.assertEqual(self.words(b"HTTP/1.1 2000000000000000 OK\r\n\r\n"),
                         f"bad status code {b'2000000000'!r}")

    def test_a_bad_content_length_is_quoted_to_20_bytes(self) -> None:
        value = b"1" * 10 + b"x" * 20
        self.assertEqual(self.words(b"HTTP/1.1 200 OK\r\nContent-Length: " + value
                                    + b"\r\n\r\n"),
                         f"bad Content-Length {value[:20]!r}")

    def test_a_bad_header_line_is_quoted_to_80_bytes(self) -> None:
        line = b"X Model: " + b"m" * 100
        self.assertEqual(self.words(b"HTTP/1.1 200 OK\r\n" + line + b"\r\n\r\n"),
                         f"bad header line {line[:80]!r}")


class CloseIdleAndHostHeaderTests(SynchronousTestCase):
    def test_close_idle_closes_every_pooled_connection(self) -> None:
        reactor = MemoryReactorClock()
        client = UpstreamClient(reactor, connect_timeout=5)
        transports = []
        for port in (8002, 8003):
            result: list[Any] = []
            client.send("127.0.0.1", port, b"GET", b"/", [], None).addBoth(result.append)
            _, _, factory, _, _ = reactor.tcpClients[-1]
            protocol = factory.buildProtocol(None)
            transport = StringTransport()
            protocol.makeConnection(transport)
            protocol.dataReceived(b"HTTP/1.1 204 No Content\r\n\r\n")
            result[0].deliver(Owner(), raw=False)
            transports.append(transport)
        self.assertEqual(client.idle_count("127.0.0.1", 8002), 1)
        client.close_idle()
        self.assertTrue(all(t.disconnecting for t in transports))
        self.assertEqual(client.idle_count("127.0.0.1", 8003), 0)

    def test_a_host_that_is_no_valid_idna_name_still_gets_a_host_header(self) -> None:
        reactor = MemoryReactorClock()
        client = UpstreamClient(reactor, connect_timeout=5)
        host = "a" * 64 + ".example"  # a label over 63 characters: not IDNA
        client.send(host, 8002, b"GET", b"/", [], None)
        _, _, factory, _, _ = reactor.tcpClients[-1]
        protocol = factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        self.assertIn(b"\r\nHost: " + host.encode() + b":8002\r\n", transport.value())
