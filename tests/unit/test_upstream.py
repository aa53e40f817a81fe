"""
txlb's own upstream HTTP/1.1 client (:mod:`txlb._upstream.client`), in memory.

The client connects through a ``MemoryReactorClock``; each test plays the backend by
feeding bytes to the connection and reading what was written on its ``StringTransport``.
The second half runs the whole proxy path in memory (client ``Site`` -> exchange -> this
client -> backend bytes) to pin what the pass-through promises the client.
"""

from __future__ import annotations

import socket
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.error import ConnectionDone, ConnectionLost, ConnectionRefusedError
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial import unittest
from twisted.web.client import RequestTransmissionFailed, ResponseFailed, ResponseNeverReceived
from twisted.web.server import Site

from txlb import LoadBalancer
from txlb._proxy.failures import FAILURES, Kind
from txlb._records.summary import dechunk, summarize
from txlb._upstream.client import IDLE_TIMEOUT, UpstreamClient
from txlb._upstream.connection import UpstreamConnection
from txlb._upstream.heads import BadResponse, parse_head, request_head
from txlb._upstream.resend import RESEND_WINDOW, may_send_again

from ..helpers import ClientConnection, FakeUpstream, keep_records, parse_response

SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")


def chunk(payload: bytes, extension: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n" % (len(payload), extension, payload)


class Owner:
    """Records what a response reports: the body's producer, its bytes, how it ended."""

    def __init__(self) -> None:
        self.producer: Any = None
        self.data = b""
        self.ended: list[Failure | None] = []

    def body_started(self, producer: Any) -> None:
        self.producer = producer

    def body_chunk(self, data: bytes) -> None:
        self.data += data

    def body_ended(self, failure: Failure | None) -> None:
        self.ended.append(failure)


class ClientTests(unittest.TestCase):
    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.client = UpstreamClient(self.reactor, connect_timeout=5)

    def send(self, method: bytes = b"POST", body: bytes | None = b"{}") -> list[Any]:
        result: list[Any] = []
        self.client.send("127.0.0.1", 8002, method, b"/v1/x?a=1",
                         [(b"x-forwarded-for", b"10.0.0.1")], body).addBoth(result.append)
        return result

    def connect(self, index: int = -1) -> tuple[UpstreamConnection, StringTransport]:
        host, port, factory, timeout, _ = self.reactor.tcpClients[index]
        self.assertEqual((host, port, timeout), ("127.0.0.1", 8002, 5))
        protocol = factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        return protocol, transport

    def test_request_head(self) -> None:
        self.send()
        _, transport = self.connect()
        self.assertEqual(transport.value(),
                         b"POST /v1/x?a=1 HTTP/1.1\r\nHost: 127.0.0.1:8002\r\n"
                         b"X-Forwarded-For: 10.0.0.1\r\nContent-Length: 2\r\n\r\n{}")

    def test_a_body_is_written_as_its_own_bytes_after_the_head(self) -> None:
        """Joined onto its head, a body of megabytes was copied on every request."""
        body = b"x" * (4 << 20)
        self.send(body=body)
        writes: list[bytes] = []

        class Recording(StringTransport):
            def write(self, data: bytes) -> None:
                writes.append(data)
                super().write(data)

        factory = self.reactor.tcpClients[-1][2]
        factory.buildProtocol(None).makeConnection(Recording())
        self.assertEqual(writes[0], request_head(
            b"POST", b"/v1/x?a=1", b"127.0.0.1:8002", [(b"x-forwarded-for", b"10.0.0.1")],
            body))
        self.assertIs(writes[1], body)

    def test_an_idle_connection_the_backend_closed_unseen_is_not_reused(self) -> None:
        """
        The backend's FIN is queued on the socket but the reactor has not read it yet: the
        request goes on a new connection, not onto one that would fail under it.
        """
        for peeked, reused in ((b"", False), (b"H", False), (ConnectionResetError(), False),
                               (BlockingIOError(), True)):
            client = UpstreamClient(MemoryReactorClock(), connect_timeout=5)
            self.client, self.reactor = client, client._reactor  # type: ignore[attr-defined]
            result = self.send(method=b"GET", body=None)
            connection, transport = self.connect()
            connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            result[0].deliver(Owner(), raw=True)
            self.assertEqual(client.idle_count("127.0.0.1", 8002), 1)

            class Socket:
                def recv(self, size: int, flags: int, answer: Any = peeked) -> bytes:
                    self.flags = flags
                    if isinstance(answer, Exception):
                        raise answer
                    return answer

            transport.socket = Socket()  # type: ignore[attr-defined]
            transport.clear()
            self.send(method=b"GET", body=None)
            self.assertEqual(len(self.reactor.tcpClients), 1 if reused else 2, peeked)
            self.assertEqual(bool(transport.value()), reused, peeked)
            self.assertEqual(transport.disconnecting, not reused, peeked)
            flags = transport.socket.flags  # type: ignore[attr-defined]
            self.assertEqual(flags, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # never taken

    def test_an_idle_connection_whose_backend_said_nothing_is_reused(self) -> None:
        """
        On a real TCP socket: a backend that sent nothing and still holds its end keeps its
        pooled connection in use (the peek finds nothing waiting); once it has closed its
        end, the next request goes on a new connection.
        """
        listener = socket.create_server(("127.0.0.1", 0))
        self.addCleanup(listener.close)
        for backend_closes, reused in ((False, True), (True, False)):
            client = UpstreamClient(MemoryReactorClock(), connect_timeout=5)
            self.client, self.reactor = client, client._reactor  # type: ignore[attr-defined]
            result = self.send(method=b"GET", body=None)
            connection, transport = self.connect()
            connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            result[0].deliver(Owner(), raw=True)
            ours = socket.create_connection(listener.getsockname())
            self.addCleanup(ours.close)
            theirs, _ = listener.accept()
            self.addCleanup(theirs.close)
            if backend_closes:
                theirs.close()
                ours.recv(1, socket.MSG_PEEK)  # wait until the FIN is here
            transport.socket = ours  # type: ignore[attr-defined]
            transport.clear()
            self.send(method=b"GET", body=None)
            self.assertEqual(len(self.reactor.tcpClients), 1 if reused else 2, backend_closes)
            self.assertEqual(bool(transport.value()), reused, backend_closes)

    def test_no_body_no_content_length(self) -> None:
        self.assertNotIn(b"Content-Length", request_head(b"GET", b"/", b"h", [], None))
        self.assertIn(b"Content-Length: 0\r\n", request_head(b"POST", b"/", b"h", [], b""))

    def test_fixed_length_then_connection_reused(self) -> None:
        result = self.send()
        connection, transport = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel")
        response = result[0]
        self.assertEqual((response.code, response.length, response.chunked), (200, 5, False))
        owner = Owner()
        response.deliver(owner, raw=True)
        self.assertEqual(owner.ended, [])
        connection.dataReceived(b"lo")
        self.assertEqual((owner.data, owner.ended), (b"hello", [None]))
        self.assertEqual(self.client.idle_count("127.0.0.1", 8002), 1)
        transport.clear()
        self.send(method=b"GET", body=None)
        self.assertEqual(len(self.reactor.tcpClients), 1)  # no second connection
        self.assertTrue(transport.value().startswith(b"GET /v1/x?a=1 HTTP/1.1\r\n"))

    def test_chunked_raw_passes_framing_untouched(self) -> None:
        """Every byte split, extensions kept; only the last chunk and trailers are held."""
        result = self.send()
        connection, _ = self.connect()
        body = chunk(b"data: one\n\n", b";ext=1") + chunk(b"data: two\n\n")
        wire = SSE_HEAD + body + b"0\r\ntrailer: x\r\n\r\n"
        for index in range(len(wire)):
            connection.dataReceived(wire[index:index + 1])
            if index == len(SSE_HEAD) - 1:
                owner = Owner()
                result[0].deliver(owner, raw=True)
        self.assertTrue(result[0].chunked)
        self.assertEqual(owner.data, body)
        self.assertEqual(owner.ended, [None])
        self.assertEqual(self.client.idle_count("127.0.0.1", 8002), 1)

    def test_chunked_decoded(self) -> None:
        result = self.send()
        connection, _ = self.connect()
        connection.dataReceived(SSE_HEAD + chunk(b"abc") + b"3\r\nde")
        owner = Owner()
        result[0].deliver(owner, raw=False)
        connection.dataReceived(b"f\r\n0\r\n\r\n")
        self.assertEqual((owner.data, owner.ended), (b"abcdef", [None]))

    def test_bad_chunk_framing_fails_the_body(self) -> None:
        result = self.send()
        connection, transport = self.connect()
        owner = Owner()
        connection.dataReceived(SSE_HEAD)
        result[0].deliver(owner, raw=True)
        connection.dataReceived(b"3\r\nabcXY")  # no CRLF after the data
        self.assertEqual(len(owner.ended), 1)
        self.assertIsInstance(owner.ended[0].value, ResponseFailed)  # type: ignore[union-attr]
        self.assertTrue(transport.disconnecting or transport.disconnected)
        self.assertEqual(self.client.idle_count("127.0.0.1", 8002), 0)

    def test_lenient_chunk_sizes_refused(self) -> None:
        for size_line in (b"+3", b" 3", b"1_0", b"-1", b"0x3", b"", b"1" * 17):
            result = self.send()
            connection, _ = self.connect()
            owner = Owner()
            connection.dataReceived(SSE_HEAD)
            result[0].deliver(owner, raw=True)
            connection.dataReceived(size_line + b"\r\nabc\r\n")
            self.assertEqual(len(owner.ended), 1, size_line)
            self.assertIsInstance(owner.ended[0].value, ResponseFailed)  # type: ignore[union-attr]

    def test_control_characters_in_the_head_refused(self) -> None:
        """A bare LF in the phrase would let a backend add headers for the client."""
        for head in (b"HTTP/1.1 200 OK\nSet-Cookie: a=b\r\n\r\n",
                     b"HTTP/1.1 200 O\x00K\r\n\r\n",
                     b"HTTP/1.1 200 OK\r\nX: a\rb\r\n\r\n",
                     b"HTTP/1.1 200 OK\r\nX Model: a\r\n\r\n",
                     b"HTTP/1.1 042 Odd\r\n\r\n"):
            result = self.send()
            connection, transport = self.connect()
            connection.dataReceived(head)
            self.assertIsInstance(result[0].value, ResponseFailed, head)
            self.assertTrue(transport.disconnected)

    def test_chunk_extension_with_a_bare_lf_refused(self) -> None:
        result = self.send()
        connection, _ = self.connect()
        owner = Owner()
        connection.dataReceived(SSE_HEAD)
        result[0].deliver(owner, raw=True)
        connection.dataReceived(b"8;\nABCDEFGH\r\n0\r\n\r\n")
        self.assertEqual(owner.data, b"")
        self.assertIsInstance(owner.ended[0].value, ResponseFailed)  # type: ignore[union-attr]

    def test_long_chunk_extension_refused_even_when_complete(self) -> None:
        result = self.send()
        connection, _ = self.connect()
        owner = Owner()
        connection.dataReceived(SSE_HEAD)
        result[0].deliver(owner, raw=True)
        connection.dataReceived(b"1;" + b"x" * 5000 + b"\r\na\r\n")
        self.assertIsInstance(owner.ended[0].value, ResponseFailed)  # type: ignore[union-attr]

    def test_bytes_after_a_bodiless_response_stop_reuse(self) -> None:
        result = self.send()
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200 OK\r\n")
        result[0].deliver(Owner(), raw=False)
        self.assertEqual(self.client.idle_count("127.0.0.1", 8002), 0)

    def test_both_lengths_or_http10_chunked_stop_reuse(self) -> None:
        for head in (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n",
                     b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"):
            result = self.send()
            connection, _ = self.connect()
            connection.dataReceived(head)
            owner = Owner()
            result[0].deliver(owner, raw=False)
            connection.dataReceived(b"3\r\nabc\r\n0\r\n\r\n")
            connection.connectionLost(Failure(ConnectionDone()))
            self.assertEqual(owner.ended, [None])
            self.assertEqual(self.client.idle_count("127.0.0.1", 8002), 0, head)

    def test_reset_ends_a_close_delimited_body_as_a_failure(self) -> None:
        result = self.send()
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\n\r\nsome")
        owner = Owner()
        result[0].deliver(owner, raw=True)
        connection.connectionLost(Failure(ConnectionLost()))
        self.assertIsInstance(owner.ended[0].value, ResponseFailed)  # type: ignore[union-attr]

    def test_a_head_trickled_in_is_not_rescanned(self) -> None:
        result = self.send()
        connection, _ = self.connect()
        head = b"HTTP/1.1 200 OK\r\nX-Pad: " + b"p" * 3000 + b"\r\nContent-Length: 0\r\n\r\n"
        for index in range(len(head)):
            connection.dataReceived(head[index:index + 1])
        self.assertEqual(result[0].code, 200)

    def test_a_head_over_the_limit_is_refused_even_in_one_read(self) -> None:
        result = self.send()
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nX: " + b"p" * 70_000 + b"\r\n\r\n")
        self.assertIsInstance(result[0].value, ResponseFailed)

    def test_interim_responses_are_skipped(self) -> None:
        result = self.send()
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
        self.assertEqual(result[0].code, 204)

    def test_bad_status_line_is_a_failed_response(self) -> None:
        result = self.send()
        connection, transport = self.connect()
        connection.dataReceived(b"ICY 200 OK\r\n\r\n")
        self.assertIsInstance(result[0].value, ResponseFailed)
        self.assertTrue(transport.disconnected)

    def test_obs_fold_refused(self) -> None:
        self.assertRaises(BadResponse, parse_head, b"HTTP/1.1 200 OK\r\nA: b\r\n c")
        self.assertRaises(BadResponse, parse_head, b"HTTP/1.1 200 OK\r\nA : b")

    def test_conflicting_lengths_refused(self) -> None:
        result = self.send()
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n"
                                b"Content-Length: 2\r\n\r\nab")
        self.assertIsInstance(result[0].value, ResponseFailed)

    def test_content_length_no_client_could_hold_is_a_bad_response(self) -> None:
        """
        A length past 2**63-1 (nginx's off_t) is no length: a bad response, refused before
        any head reaches the client (passed on, the client would wait for a body that
        never comes); 2**63-1 itself is a length like any other.
        """
        for value in (b"99999999999999999999999", b"%d" % 2**63):
            result = self.send()
            connection, transport = self.connect()
            connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: " + value
                                    + b"\r\n\r\nab")
            self.assertIsInstance(result[0].value, ResponseFailed, value)
            (reason,) = result[0].value.reasons
            self.assertIsInstance(reason.value, BadResponse)
            self.assertTrue(transport.disconnected)
        result = self.send()
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n"
                                % (2**63 - 1))
        self.assertEqual(result[0].length, 2**63 - 1)

    def test_lost_before_head_is_response_never_received(self) -> None:
        result = self.send()
        connection, _ = self.connect()
        connection.connectionLost(Failure(ConnectionLost()))
        self.assertIsInstance(result[0].value, ResponseNeverReceived)

    def test_lost_with_part_of_the_request_unsent_is_transmission_failed(self) -> None:
        """The backend never had the whole request: the proxy may send it elsewhere."""
        result = self.send(body=b"x" * 1000)
        connection, transport = self.connect()
        # what a socket transport looks like when the kernel took only part of the write
        transport.dataBuffer = b"x" * 300  # type: ignore[attr-defined]
        transport.offset = 100  # type: ignore[attr-defined]
        transport._tempDataBuffer = []  # type: ignore[attr-defined]
        connection.connectionLost(Failure(ConnectionLost()))
        self.assertIsInstance(result[0].value, RequestTransmissionFailed)

    def test_lost_after_everything_left_is_response_never_received(self) -> None:
        result = self.send(body=b"x" * 1000)
        connection, transport = self.connect()
        transport.dataBuffer = b"x" * 300  # type: ignore[attr-defined]
        transport.offset = 300  # type: ignore[attr-defined]
        transport._tempDataBuffer = []  # type: ignore[attr-defined]
        connection.connectionLost(Failure(ConnectionLost()))
        self.assertIsInstance(result[0].value, ResponseNeverReceived)

    def test_stale_pooled_connection_is_retried_on_a_new_one(self) -> None:
        first = self.send()
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        first[0].deliver(Owner(), raw=False)
        second = self.send()
        connection.connectionLost(Failure(ConnectionDone()))  # the backend closed it
        self.assertEqual(second, [])
        self.assertEqual(len(self.reactor.tcpClients), 2)
        fresh, transport = self.connect()
        self.assertTrue(transport.value().startswith(b"POST /v1/x?a=1 HTTP/1.1\r\n"))
        fresh.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(second[0].code, 200)

    def test_a_request_the_backend_held_is_not_sent_twice(self) -> None:
        """Closed long after it was written: the backend may have started on it."""
        first = self.send()
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        first[0].deliver(Owner(), raw=False)
        second = self.send()
        self.reactor.advance(120)
        connection.connectionLost(Failure(ConnectionDone()))
        self.assertIsInstance(second[0].value, ResponseNeverReceived)
        self.assertEqual(len(self.reactor.tcpClients), 1)

    def test_an_expired_idle_connection_is_never_handed_out(self) -> None:
        first = self.send()
        connection, transport = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        first[0].deliver(Owner(), raw=False)
        self.reactor.advance(IDLE_TIMEOUT)  # closing, but connectionLost has not come yet
        transport.clear()
        self.send()
        self.assertEqual(transport.value(), b"")
        self.assertEqual(len(self.reactor.tcpClients), 2)

    def test_close_delimited_body(self) -> None:
        result = self.send()
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\n\r\nsome")
        owner = Owner()
        result[0].deliver(owner, raw=True)
        self.assertIsNone(result[0].length)
        connection.connectionLost(Failure(ConnectionDone()))
        self.assertEqual((owner.data, owner.ended), (b"some", [None]))
        self.assertEqual(self.client.idle_count("127.0.0.1", 8002), 0)

    def test_truncated_body_fails(self) -> None:
        result = self.send()
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nsome")
        owner = Owner()
        result[0].deliver(owner, raw=True)
        connection.connectionLost(Failure(ConnectionLost()))
        self.assertIsInstance(owner.ended[0].value, ResponseFailed)  # type: ignore[union-attr]

    def test_connection_close_is_not_pooled(self) -> None:
        result = self.send()
        connection, transport = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nConnection: close\r\n"
                                b"Content-Length: 0\r\n\r\n")
        result[0].deliver(Owner(), raw=False)
        self.assertEqual(self.client.idle_count("127.0.0.1", 8002), 0)
        self.assertTrue(transport.disconnecting)

    def test_head_response_has_no_body(self) -> None:
        result = self.send(method=b"HEAD", body=None)
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n")
        owner = Owner()
        result[0].deliver(owner, raw=False)
        self.assertEqual((owner.data, owner.ended), (b"", [None]))

    def test_connect_failure_is_reported(self) -> None:
        result = self.send()
        _, _, factory, _, _ = self.reactor.tcpClients[-1]
        factory.clientConnectionFailed(None, Failure(ConnectionRefusedError()))
        self.assertIsInstance(result[0].value, ConnectionRefusedError)

    def test_cancel_while_connecting_and_while_waiting(self) -> None:
        deferred = self.client.send("127.0.0.1", 8002, b"GET", b"/", [], None)
        connector = self.reactor.connectors[-1]
        deferred.addErrback(lambda f: None)
        deferred.cancel()
        self.assertTrue(connector.stoppedConnecting)
        waiting = self.client.send("127.0.0.1", 8002, b"GET", b"/", [], None)
        waiting.addErrback(lambda f: None)
        _, transport = self.connect()
        waiting.cancel()
        self.assertTrue(transport.disconnected)  # aborted: the backend stops at once

    def test_flow_control_reaches_the_socket(self) -> None:
        result = self.send()
        connection, transport = self.connect()
        connection.dataReceived(SSE_HEAD)
        owner = Owner()
        result[0].deliver(owner, raw=True)
        owner.producer.pauseProducing()
        self.assertEqual(transport.producerState, "paused")
        owner.producer.resumeProducing()
        self.assertEqual(transport.producerState, "producing")
        owner.producer.pauseProducing()
        connection.dataReceived(b"0\r\n\r\n")  # ended while paused: pooled, reading again
        self.assertEqual(transport.producerState, "producing")
        self.assertEqual(self.client.idle_count("127.0.0.1", 8002), 1)

    def test_stop_producing_aborts(self) -> None:
        result = self.send()
        connection, transport = self.connect()
        connection.dataReceived(SSE_HEAD)
        owner = Owner()
        result[0].deliver(owner, raw=True)
        owner.producer.stopProducing()
        self.assertTrue(transport.disconnected)
        connection.connectionLost(Failure(ConnectionLost()))
        self.assertEqual(owner.ended, [])  # the one who stopped it needs no report

    def test_idle_connections_close_before_the_backend_closes_them(self) -> None:
        result = self.send()
        connection, transport = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        result[0].deliver(Owner(), raw=False)
        self.reactor.advance(IDLE_TIMEOUT)
        self.assertTrue(transport.disconnecting)
        connection.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.client.idle_count("127.0.0.1", 8002), 0)

    def test_dechunk(self) -> None:
        body = chunk(b"hello ", b";x=y") + chunk(b"world")
        self.assertEqual(dechunk(body + b"0\r\n\r\n"), b"hello world")
        self.assertEqual(dechunk(body + b"5\r\nwo"), b"hello worldwo")  # capture cut short


class ResendRuleTests(unittest.SynchronousTestCase):
    """:func:`~txlb._upstream.resend.may_send_again`, the one rule, case by case."""

    def test_a_failed_write_may_always_be_sent_again(self) -> None:
        for reused in (False, True):
            for answered in (False, True):
                self.assertTrue(may_send_again(write_failed=True, reused=reused,
                                               answered=answered, held=60.0))

    def test_a_quick_close_of_a_reused_connection_before_any_answer(self) -> None:
        self.assertTrue(may_send_again(write_failed=False, reused=True, answered=False,
                                       held=0.0))
        self.assertTrue(may_send_again(write_failed=False, reused=True, answered=False,
                                       held=0.05))
        self.assertFalse(may_send_again(write_failed=False, reused=True, answered=False,
                                        held=0.0501))

    def test_never_a_fresh_connection_nor_an_answered_request(self) -> None:
        self.assertFalse(may_send_again(write_failed=False, reused=False, answered=False,
                                        held=0.0))
        self.assertFalse(may_send_again(write_failed=False, reused=True, answered=True,
                                        held=0.0))

    def test_the_window_is_50_ms(self) -> None:
        self.assertEqual(RESEND_WINDOW, 0.050)


class StaleConnectionTests(unittest.SynchronousTestCase):
    """
    A POST sent on a reused (pooled) connection that the backend then closes: sent again on
    a new connection only when the backend provably never read it -- the write failed, or
    it closed within 50 ms of the request's last byte, before any byte of response.
    """

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.client = UpstreamClient(self.reactor, connect_timeout=5)

    def send(self) -> list[Any]:
        result: list[Any] = []
        self.client.send("127.0.0.1", 8002, b"POST", b"/v1/completions", [],
                         b'{"prompt": "x"}').addBoth(result.append)
        return result

    def connect(self) -> tuple[UpstreamConnection, StringTransport]:
        protocol = self.reactor.tcpClients[-1][2].buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        return protocol, transport

    def reused(self) -> tuple[UpstreamConnection, StringTransport, list[Any]]:
        """A first request answered (its connection pooled), then a second one written on
        that same connection; the clock reads 0 when it is written."""
        first = self.send()
        connection, transport = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        first[0].deliver(Owner(), raw=False)
        self.assertEqual(self.client.idle_count("127.0.0.1", 8002), 1)
        transport.clear()
        second = self.send()
        self.assertEqual(transport.value().count(b"POST /v1/completions "), 1)
        self.assertEqual(self.reactor.seconds(), 0)
        return connection, transport, second

    def assert_resent_and_answered(self, second: list[Any]) -> None:
        self.assertEqual(second, [])
        self.assertEqual(len(self.reactor.tcpClients), 2)  # once more, on a new connection
        fresh, transport = self.connect()
        self.assertTrue(transport.value().startswith(b"POST /v1/completions HTTP/1.1\r\n"))
        self.assertTrue(transport.value().endswith(b'{"prompt": "x"}'))
        fresh.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(second[0].code, 200)

    def assert_not_resent(self, second: list[Any]) -> None:
        self.assertEqual(len(self.reactor.tcpClients), 1)  # the backend saw it once
        self.assertIsInstance(second[0].value, ResponseNeverReceived)

    def test_closed_10_ms_after_the_last_byte_is_sent_again(self) -> None:
        connection, _, second = self.reused()
        self.reactor.advance(0.010)
        connection.connectionLost(Failure(ConnectionDone()))
        self.assert_resent_and_answered(second)

    def test_reset_800_ms_after_the_last_byte_is_never_sent_again(self) -> None:
        """The backend held the POST 0.8 s (an engine crashing in its prefill)."""
        connection, _, second = self.reused()
        self.reactor.advance(0.8)
        connection.connectionLost(Failure(ConnectionLost()))
        self.assert_not_resent(second)

    def test_a_failed_write_is_sent_again_however_late(self) -> None:
        """Part of the request never left: the backend cannot have read it, held or not."""
        connection, transport, second = self.reused()
        # what a socket transport holds when the kernel took only part of the write
        transport.dataBuffer = b"x" * 10  # type: ignore[attr-defined]
        transport.offset = 0  # type: ignore[attr-defined]
        transport._tempDataBuffer = []  # type: ignore[attr-defined]
        self.reactor.advance(2.0)  # a large body still leaving when the backend went
        connection.connectionLost(Failure(ConnectionLost()))
        self.assert_resent_and_answered(second)

    def test_closed_50_ms_after_the_last_byte_is_sent_again(self) -> None:
        connection, _, second = self.reused()
        self.reactor.advance(0.050)
        connection.connectionLost(Failure(ConnectionDone()))
        self.assert_resent_and_answered(second)

    def test_closed_just_past_50_ms_is_never_sent_again(self) -> None:
        connection, _, second = self.reused()
        self.reactor.advance(0.0501)
        connection.connectionLost(Failure(ConnectionDone()))
        self.assert_not_resent(second)

    def test_the_window_counts_from_the_requests_last_byte(self) -> None:
        """Not from when the connection was pooled or the first request was sent."""
        first = self.send()
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        first[0].deliver(Owner(), raw=False)
        self.reactor.advance(3.0)  # idle in the pool, under IDLE_TIMEOUT
        second = self.send()
        self.reactor.advance(0.040)
        connection.connectionLost(Failure(ConnectionDone()))
        self.assert_resent_and_answered(second)

    def test_a_byte_of_response_means_the_backend_read_it(self) -> None:
        connection, _, second = self.reused()
        connection.dataReceived(b"HTTP/1.1 2")
        connection.connectionLost(Failure(ConnectionLost()))
        self.assert_not_resent(second)


class PassThroughTests(unittest.TestCase):
    """The whole proxy path in memory, with the real upstream client."""

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.lb = LoadBalancer(["127.0.0.1:8002"], reactor=self.reactor,
                               probe_agent=FakeUpstream())
        self.records: list[Any] = keep_records(self.lb)
        self.site = Site(self.lb.resource(), reactor=self.reactor)

    def backend(self) -> tuple[UpstreamConnection, StringTransport]:
        _, _, factory, _, _ = self.reactor.tcpClients[-1]
        protocol = factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        return protocol, transport

    def test_http11_client_gets_the_backends_framing(self) -> None:
        client = ClientConnection(self.site)
        client.request(b"POST", b"/v1/chat/completions", body=b'{"model": "m"}')
        backend, _ = self.backend()
        event = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
        backend.dataReceived(SSE_HEAD + chunk(event, b";sig=1"))
        self.assertIn(chunk(event, b";sig=1"), client.transport.value())  # not re-encoded
        backend.dataReceived(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        raw = client.transport.value()
        self.assertTrue(raw.endswith(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"))
        self.assertEqual(raw.count(b"0\r\n\r\n"), 1)
        response = parse_response(raw)
        self.assertTrue(response.complete)
        self.assertEqual(response.body, event + b"data: [DONE]\n\n")
        summary = summarize(self.records[-1])
        self.assertEqual((summary.status, summary.preview, summary.outcome), (200, "hi", "ok"))

    def test_http10_client_gets_the_payload(self) -> None:
        client = ClientConnection(self.site)
        client.send(b"POST /v1/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}")
        backend, _ = self.backend()
        backend.dataReceived(SSE_HEAD + chunk(b"data: a\n\n") + chunk(b"data: b\n\n"))
        backend.dataReceived(b"0\r\n\r\n")
        raw = client.transport.value()
        self.assertTrue(raw.endswith(b"\r\n\r\ndata: a\n\ndata: b\n\n"), raw)

    def test_client_backpressure_pauses_the_backend(self) -> None:
        client = ClientConnection(self.site)
        client.request(b"POST", b"/v1/completions", body=b"{}")
        backend, backend_transport = self.backend()
        backend.dataReceived(SSE_HEAD + chunk(b"data: a\n\n"))
        client.transport.producer.pauseProducing()  # the client's socket is full
        self.assertEqual(backend_transport.producerState, "paused")
        client.transport.producer.resumeProducing()
        self.assertEqual(backend_transport.producerState, "producing")

    def test_client_disconnect_aborts_the_backend(self) -> None:
        client = ClientConnection(self.site)
        client.request(b"POST", b"/v1/completions", body=b"{}")
        backend, backend_transport = self.backend()
        backend.dataReceived(SSE_HEAD + chunk(b"data: a\n\n"))
        client.disconnect()
        self.assertTrue(backend_transport.disconnected)
        self.assertEqual(self.records[-1].outcome, "client_abort")
        self.assertEqual(self.lb.pool.slots.in_flight, 0)

    def test_backend_failing_mid_stream_truncates_the_client(self) -> None:
        client = ClientConnection(self.site)
        client.request(b"POST", b"/v1/completions", body=b"{}")
        backend, _ = self.backend()
        backend.dataReceived(SSE_HEAD + chunk(b"data: a\n\n"))
        backend.connectionLost(Failure(ConnectionLost()))
        self.assertTrue(client.transport.disconnected)
        self.assertFalse(client.transport.value().endswith(b"0\r\n\r\n"))
        self.assertEqual(self.records[-1].outcome, "upstream_error")


class HeldThenResetTests(unittest.TestCase):
    """
    The whole proxy path in memory, with the real upstream client and its pool warm: a POST
    written on a reused connection that the backend holds and then resets reaches no
    backend a second time -- neither the same one on a new connection nor another one.
    """

    WARM = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    BODY = b'{"model": "m", "prompt": "x"}'

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.probes = FakeUpstream()

    def build(self, backends: list[str]) -> None:
        self.lb = LoadBalancer(backends, reactor=self.reactor, probe_agent=self.probes,
                               policy="round-robin")  # --retries 2, the default
        self.records: list[Any] = keep_records(self.lb)
        self.site = Site(self.lb.resource(), reactor=self.reactor)

    def post(self) -> ClientConnection:
        client = ClientConnection(self.site)
        client.request(b"POST", b"/v1/completions", body=self.BODY)
        return client

    def warm(self) -> tuple[UpstreamConnection, StringTransport]:
        """One request answered on a new connection, which goes back to the pool."""
        client = self.post()
        protocol = self.reactor.tcpClients[-1][2].buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        protocol.dataReceived(self.WARM)
        self.assertEqual(client.response().status, 200)
        transport.clear()
        return protocol, transport

    def sent(self, transport: StringTransport) -> int:
        return transport.value().count(b"POST /v1/completions ")

    def test_held_800_ms_then_reset_is_502_and_sent_once(self) -> None:
        self.build(["127.0.0.1:8002"])
        backend, transport = self.warm()
        client = self.post()
        self.assertEqual(self.sent(transport), 1)  # on the pooled connection
        self.reactor.advance(0.8)
        backend.connectionLost(Failure(ConnectionLost()))
        self.assertEqual(len(self.reactor.tcpClients), 1)  # no new connection for it
        response = client.response()
        rule = FAILURES[Kind.CLOSED_UNANSWERED]
        self.assertEqual(response.status, rule.status)
        self.assertIn(b"closed the connection without answering", response.body)
        record = self.records[-1]
        self.assertEqual((record.status, record.outcome, record.tries),
                         (502, rule.outcome, 1))
        # probed at once (the table's "probed at once"), and still in rotation
        self.assertEqual([c.uri for c in self.probes.calls][-1:],
                         [b"http://127.0.0.1:8002/health"])
        self.assertTrue(all(b.health.healthy for b in self.lb.pool))
        self.assertEqual(self.lb.pool.slots.in_flight, 0)

    def test_closed_at_once_is_sent_again_and_answered(self) -> None:
        """The idle-close race: the client never sees it."""
        self.build(["127.0.0.1:8002"])
        backend, _ = self.warm()
        client = self.post()
        self.reactor.advance(0.010)
        backend.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(len(self.reactor.tcpClients), 2)
        fresh = self.reactor.tcpClients[-1][2].buildProtocol(None)
        transport = StringTransport()
        fresh.makeConnection(transport)
        self.assertEqual(self.sent(transport), 1)
        self.assertTrue(transport.value().endswith(self.BODY))
        fresh.dataReceived(self.WARM)
        self.assertEqual((client.response().status, client.response().body), (200, b"{}"))
        self.assertEqual((self.records[-1].outcome, self.records[-1].tries), ("ok", 1))
        self.assertEqual(self.probes.calls, [])  # nothing is wrong with that backend

    def test_held_then_reset_is_never_sent_to_another_backend(self) -> None:
        """Failover to another backend follows the same rule: the backend had the request
        whole and held it, so it may be generating; a second backend would generate too."""
        self.build(["127.0.0.1:8002", "127.0.0.1:8003"])
        pooled = [self.warm(), self.warm()]  # round-robin: one pooled connection to each
        self.assertEqual({c[2].attempt.port for c in self.reactor.tcpClients},
                         {8002, 8003})
        client = self.post()
        holding = [pair for pair in pooled if self.sent(pair[1])]
        self.assertEqual(len(holding), 1)
        (backend, _), = holding
        self.reactor.advance(0.8)
        backend.connectionLost(Failure(ConnectionLost()))
        self.assertEqual(len(self.reactor.tcpClients), 2)  # no new connection anywhere
        self.assertEqual(sum(self.sent(transport) for _, transport in pooled), 1)
        self.assertEqual(client.response().status, 502)
        self.assertEqual(self.records[-1].tries, 1)

class FramingProperties(unittest.TestCase):
    @settings(max_examples=200, deadline=None)
    @given(payloads=st.lists(st.binary(min_size=1, max_size=40), max_size=8),
           cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
           raw=st.booleans())
    def test_any_split_of_a_chunked_body(self, payloads: list[bytes], cuts: list[int],
                                         raw: bool) -> None:
        """However the reads fall, raw mode hands on exactly the framing before the last
        chunk, decoded mode exactly the payload, and the end is seen once."""
        reactor = MemoryReactorClock()
        client = UpstreamClient(reactor, connect_timeout=5)
        result: list[Any] = []
        client.send("127.0.0.1", 1, b"GET", b"/", [], None).addBoth(result.append)
        protocol = reactor.tcpClients[-1][2].buildProtocol(None)
        protocol.makeConnection(StringTransport())
        protocol.dataReceived(SSE_HEAD)
        owner = Owner()
        result[0].deliver(owner, raw=raw)
        framed = b"".join(chunk(p) for p in payloads)
        wire = framed + b"0\r\n\r\n"
        points = sorted({min(c, len(wire)) for c in cuts} | {0, len(wire)})
        for start, end in zip(points, points[1:], strict=False):
            protocol.dataReceived(wire[start:end])
        self.assertEqual(owner.data, framed if raw else b"".join(payloads))
        self.assertEqual(owner.ended, [None])
