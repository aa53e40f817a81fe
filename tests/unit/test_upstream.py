"""
txlb's own upstream HTTP/1.1 client (:mod:`txlb._upstream.client`), in memory.

The client connects through a ``MemoryReactorClock``; each test plays the backend by
feeding bytes to the connection and reading what was written on its ``StringTransport``.
The second half runs the whole proxy path in memory (client ``Site`` -> exchange -> this
client -> backend bytes) to pin what the pass-through promises the client.
"""

from __future__ import annotations

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
from txlb._records.summary import dechunk, summarize
from txlb._upstream.client import (
    IDLE_TIMEOUT,
    BadResponse,
    UpstreamClient,
    UpstreamConnection,
    parse_head,
    request_head,
)

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
        self.assertEqual(self.lb.pool.in_flight, 0)

    def test_backend_failing_mid_stream_truncates_the_client(self) -> None:
        client = ClientConnection(self.site)
        client.request(b"POST", b"/v1/completions", body=b"{}")
        backend, _ = self.backend()
        backend.dataReceived(SSE_HEAD + chunk(b"data: a\n\n"))
        backend.connectionLost(Failure(ConnectionLost()))
        self.assertTrue(client.transport.disconnected)
        self.assertFalse(client.transport.value().endswith(b"0\r\n\r\n"))
        self.assertEqual(self.records[-1].outcome, "upstream_error")


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
