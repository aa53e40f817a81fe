"""
The main port's lean server (:mod:`txlb._server.lean`): what it must do itself because llhttp
leaves it to its caller -- the head's deadline, the body limit while the body arrives,
``100 Continue`` only for a wanted body, one answer at a time on a pipelined connection --
and twisted.web's request semantics the proxy relies on; and hostile clients on a raw
channel (:class:`RawChannelTestCase`): endless trailers and chunk extensions, stray empty
lines, field values' whitespace, requests held back behind one being answered.  In memory:
a Clock, a fake upstream, a ``StringTransport``.  (The framing table runs against it in
tests/integration/test_framing.py; the proxy suites in tests/unit/test_proxy_lean.py.)
"""

from __future__ import annotations

import tracemalloc
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from txlb import LoadBalancer
from txlb._proxy.incoming import read_body
from txlb._server.lean import LeanSite
from txlb._server.lean_channel import LeanChannel
from txlb._server.site import ProxySite

from ..helpers import ClientConnection, FakeResponse, FakeUpstream, keep_records
from . import test_reload

GET = b"GET /v1/models/x HTTP/1.1\r\nHost: lb.example\r\n\r\n"


def post(body: bytes, *headers: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: lb.example\r\n"
            + b"".join(h + b"\r\n" for h in headers)
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


class LeanTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.lb = LoadBalancer(["127.0.0.1:8002"], reactor=self.clock, agent=self.upstream,
                               probe_agent=FakeUpstream(), log_file="none",
                               max_body="1KiB", header_timeout=5)
        self.records = keep_records(self.lb)
        self.site = self.lb.main_factory()

    def client(self) -> ClientConnection:
        return ClientConnection(self.site)

    def answer(self, index: int, body: bytes = b"ok", length: bool = True) -> FakeResponse:
        response = self.upstream.calls[index].respond(
            FakeResponse(200, [(b"Content-Type", b"text/plain")],
                         length=len(body) if length else FakeResponse(200).length))
        response.send(body)
        return response


class HeadDeadlineTests(LeanTestCase):
    def test_a_head_trickling_in_gets_408_at_its_deadline(self) -> None:
        client = self.client()
        client.send(b"GET / HTTP/1.1\r\n")
        self.clock.advance(4)
        client.send(b"Host: lb.example\r\n")  # bytes keep coming: the deadline stays
        self.assertEqual(client.transport.value(), b"")
        self.clock.advance(1)
        self.assertEqual(client.response().status, 408)
        self.assertTrue(client.transport.disconnecting)
        self.assertEqual(self.upstream.calls, [])
        # one deadline per head, not one per read
        self.assertEqual([c for c in self.clock.getDelayedCalls()
                          if "head_too_slow" in repr(c.func)], [])

    def test_an_idle_kept_alive_connection_has_no_head_deadline(self) -> None:
        client = self.client()
        client.send(GET)
        self.answer(0).end()
        self.clock.advance(59)
        self.assertFalse(client.transport.disconnecting)
        self.assertEqual(client.transport.value().count(b"HTTP/1.1 "), 1)  # no 408

    def test_an_idle_connection_is_closed_after_60s_a_held_stream_is_not(self) -> None:
        idle = self.client()
        streaming = self.client()
        streaming.send(GET)
        stream = self.answer(0, b"data: 1\n\n", length=False)
        self.clock.advance(59)
        self.assertFalse(idle.transport.disconnecting)
        self.clock.advance(1)
        self.assertTrue(idle.transport.disconnecting)
        self.assertEqual(idle.transport.value(), b"")
        for _ in range(20):  # ten minutes of a stream: the client sends nothing meanwhile
            self.clock.advance(30)
            stream.send(b"data: 2\n\n")
        self.assertFalse(streaming.transport.disconnecting)
        self.clock.advance(15)
        stream.end()  # idle from here: a minute from the answer's end, not the request's
        self.clock.advance(59)
        self.assertFalse(streaming.transport.disconnecting)
        self.clock.advance(1)
        self.assertTrue(streaming.transport.disconnecting)

    def test_the_next_heads_deadline_runs_from_its_own_first_byte(self) -> None:
        client = self.client()
        client.send(GET)
        self.clock.advance(4)
        self.answer(0).end()
        client.send(b"GET /b HTTP/1.1\r\n")
        self.clock.advance(4)
        self.assertFalse(client.transport.disconnecting)
        self.clock.advance(1)
        self.assertTrue(client.transport.disconnecting)
        self.assertIn(b" 408 ", client.transport.value())


class BodyLimitTests(LeanTestCase):
    def test_a_chunked_body_over_the_limit_is_413_while_it_arrives(self) -> None:
        client = self.client()
        client.send(b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"400\r\n" + b"a" * 1024 + b"\r\n")
        self.assertEqual(client.transport.value(), b"")  # at the limit: still fine
        client.send(b"1\r\nb\r\n")  # one byte past it; the body has not ended
        self.assertEqual(client.response().status, 413)
        self.assertTrue(client.transport.disconnecting)
        self.assertEqual(self.upstream.calls, [])
        self.assertEqual([(r.method, r.status) for r in self.records], [(b"POST", 413)])

    def test_no_100_continue_for_a_body_refused_by_its_length(self) -> None:
        client = self.client()
        client.send(b"POST /t HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                    b"Content-Length: 2000\r\n\r\n")
        self.assertTrue(client.transport.value().startswith(b"HTTP/1.1 413 "))
        self.assertNotIn(b"100 Continue", client.transport.value())

    def test_100_continue_waits_for_the_answers_before_it(self) -> None:
        client = self.client()
        client.send(GET + b"POST /t HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                          b"Content-Length: 5\r\n\r\n")
        self.assertNotIn(b"100 Continue", client.transport.value())
        self.answer(0).end()
        raw = client.transport.value()
        self.assertTrue(raw.endswith(b"ok" + b"HTTP/1.1 100 Continue\r\n\r\n"), raw)
        client.send(b"hello")
        self.assertEqual(self.upstream.calls[1].body, b"hello")


class _BodyReader(Resource):
    """Takes each request's body as the proxy does (``incoming.read_body``) and keeps it."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[bytes] = []

    def render(self, request: Any) -> bytes:
        self.bodies.append(read_body(request))
        return b"ok"


class BodyMemoryTests(SynchronousTestCase):
    """A body costs its payload in memory, however the client frames it."""

    def setUp(self) -> None:
        self.reader = _BodyReader()
        self.site = LeanSite(self.reader, max_body=64 << 20, reactor=Clock())

    def traced_while(self, send: Any) -> tuple[int, int]:
        """Memory held after ``send()`` and its peak, above what was held before."""
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            send()
            held, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return held - before, peak - before

    def test_a_body_of_small_chunks_is_held_as_its_payload(self) -> None:
        """
        100,000 chunks of 32 bytes (3.2 MB), held before the last chunk: a list of spans
        held ~73 bytes per chunk, 2.3 times the payload.
        """
        chunks = 100_000
        data = b"0123456789abcdef" * 2
        framed = b"20\r\n" + data + b"\r\n"
        wire = framed * chunks
        reads = [wire[i:i + 65536] for i in range(0, len(wire), 65536)]
        client = ClientConnection(self.site)
        client.send(b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")

        def send() -> None:
            for read in reads:
                client.send(read)

        held, _ = self.traced_while(send)
        payload = len(data) * chunks
        self.assertLess(held, payload * 1.3, f"{held} bytes held for {payload} of payload")
        self.assertEqual(client.transport.value(), b"")
        client.send(b"0\r\n\r\n")
        self.assertEqual(self.reader.bodies, [data * chunks])

    def test_a_large_body_is_copied_once_on_its_way_to_the_proxy(self) -> None:
        """8 MiB in 64 KiB reads: the spans joined at the end peaked at twice the body."""
        size = 8 << 20
        body = bytes(range(256)) * (size // 256)
        reads = [body[i:i + 65536] for i in range(0, size, 65536)]
        client = ClientConnection(self.site)
        client.send(b"POST /t HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)

        def send() -> None:
            for read in reads:
                client.send(read)

        _, peak = self.traced_while(send)
        self.assertLess(peak, size * 1.4, f"a peak of {peak} bytes for a {size}-byte body")
        self.assertEqual(self.reader.bodies, [body])

    def test_tiny_chunks_are_refused_once_their_framing_outweighs_them(self) -> None:
        """2-byte chunks: 7 bytes on the wire and a parser call for every 2 of body."""
        client = ClientConnection(self.site)
        client.send(b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + b"2\r\nab\r\n" * 1024)
        self.assertEqual(client.transport.value(), b"")  # the allowance: still fine
        client.send(b"2\r\nab\r\n" * 1024)
        response = client.response()
        self.assertEqual(response.status, 400)
        self.assertIn(b"chunks are too small", response.body)
        self.assertTrue(client.transport.disconnecting)
        self.assertEqual(self.reader.bodies, [])

    def test_one_large_chunk_buys_no_run_of_tiny_ones(self) -> None:
        """The pace is judged per window of chunks, not averaged over the whole body."""
        for site in (self.site, self.twisted_site()):
            client = ClientConnection(site)
            client.send(b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                        + b"100000\r\n" + b"a" * 0x100000 + b"\r\n")
            client.send(b"1\r\nb\r\n" * 3000)  # a window and more
            response = client.response()
            self.assertEqual(response.status, 400, site)
            self.assertIn(b"chunks are too small", response.body)

    def test_extensions_are_framing_however_the_reads_fall(self) -> None:
        """
        Reads of 30 KB of chunk extensions and 16 bytes of data each: a read that held a
        byte of data once excused all the framing in it.
        """
        client = ClientConnection(self.site)
        client.send(b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        read = b"10;" + b"e" * 30_000 + b"\r\n" + b"d" * 16 + b"\r\n"
        for _ in range(20):
            client.send(read)
            if client.transport.value():
                break
        response = client.response()
        self.assertEqual(response.status, 400)
        self.assertIn(b"malformed request body framing", response.body)
        self.assertEqual(self.reader.bodies, [])

    def test_a_read_held_behind_a_waiting_request_is_not_framing(self) -> None:
        """
        Over TLS a read can arrive while reading is paused (every record of one socket
        read is handed on): one answer held, one request queued, a chunked body begun.
        The part of the read held back unparsed was counted as framing, then again when
        parsed, and a client's chunk of 32 KiB was refused.
        """
        held = _Hold()
        site = LeanSite(held, max_body=1 << 20, header_timeout=5, reactor=Clock())
        client = ClientConnection(site)
        get = b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\n"
        client.send(get + get + b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                    b"\r\n\r\n8000\r\n" + b"a" * 100)
        client.send(b"a" * (0x8000 - 100) + b"\r\n0\r\n\r\n")
        for _ in range(2):  # the answers before it, then it is parsed and in line
            held.rendered[-1].finish()
        self.assertEqual(len(held.rendered), 3, client.transport.value())
        self.assertEqual(held.rendered[2].content.read(), b"a" * 0x8000)

    def test_framing_in_proportion_to_the_payload_is_fine(self) -> None:
        """Chunks of 64 bytes with a 40-byte extension each: framing under the payload."""
        client = ClientConnection(self.site)
        chunk = b"40;name=" + b"v" * 32 + b"\r\n" + b"p" * 64 + b"\r\n"
        client.send(b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + chunk * 5000 + b"0\r\n\r\n")
        self.assertEqual(client.response().status, 200)
        self.assertEqual(self.reader.bodies, [b"p" * 64 * 5000])

    def twisted_site(self) -> ProxySite:
        return ProxySite(self.reader, max_body=64 << 20, reactor=Clock())

    def test_chunks_of_a_line_each_are_fine(self) -> None:
        """A client's generator yielding a short line at a time is far above the floor."""
        line = b'{"role": "user", "content": "hello"},'
        client = ClientConnection(self.site)
        client.send(b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + (b"%x\r\n%s\r\n" % (len(line), line)) * 5000 + b"0\r\n\r\n")
        self.assertEqual(client.response().status, 200)
        self.assertEqual(self.reader.bodies, [line * 5000])


class PipeliningTests(LeanTestCase):
    def test_answers_in_order_one_at_a_time(self) -> None:
        client = self.client()
        client.send(GET + GET.replace(b"/x", b"/y"))
        self.assertEqual(len(self.upstream.calls), 1)  # the second waits its turn
        first = self.answer(0, b"first")
        self.assertEqual(len(self.upstream.calls), 1)
        first.end()
        self.assertEqual(len(self.upstream.calls), 2)
        self.answer(1, b"second").end()
        raw = client.transport.value()
        self.assertLess(raw.index(b"first"), raw.index(b"second"))

    def test_reading_pauses_while_a_request_waits_behind_the_answered_one(self) -> None:
        client = self.client()
        client.send(GET)
        self.assertEqual(client.transport.producerState, "producing")
        client.send(GET)
        self.assertEqual(client.transport.producerState, "paused")
        self.answer(0).end()
        self.assertEqual(client.transport.producerState, "paused")  # one more in flight
        self.answer(1).end()
        self.assertEqual(client.transport.producerState, "producing")

    def test_connection_close_closes_after_the_answer(self) -> None:
        client = self.client()
        client.send(GET.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") + GET)
        self.answer(0).end()
        self.assertTrue(client.transport.disconnecting)
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertIn(b"Connection: close", client.transport.value())


class RequestSemanticsTests(LeanTestCase):
    def test_http_1_0_gets_the_stream_unchunked_and_a_close(self) -> None:
        client = self.client()
        client.send(b"GET /t HTTP/1.0\r\n\r\n")
        response = self.answer(0, b"data: 1\n\n", length=False)
        response.send(b"data: 2\n\n")
        response.end()
        raw = client.transport.value()
        self.assertTrue(raw.startswith(b"HTTP/1.0 200 OK\r\n"), raw)
        self.assertNotIn(b"chunked", raw.lower())
        self.assertTrue(raw.endswith(b"\r\n\r\ndata: 1\n\ndata: 2\n\n"), raw)
        self.assertTrue(client.transport.disconnecting)

    def test_a_chunked_stream_ends_with_the_last_chunk_only_when_it_ends(self) -> None:
        client = self.client()
        client.send(GET)
        response = self.upstream.calls[0].respond(FakeResponse(200, [(b"Content-Type",
                                                                      b"text/event-stream")]))
        response.send(b"data: 1\n\n")
        raw = client.transport.value()
        self.assertIn(b"Transfer-Encoding: chunked", raw)
        self.assertTrue(raw.endswith(b"9\r\ndata: 1\n\n\r\n"), raw)
        response.end()
        self.assertTrue(client.transport.value().endswith(b"\r\n0\r\n\r\n"))

    def test_every_answer_has_date_and_server_only_from_the_backend(self) -> None:
        """A Date always; a Server only as the backend sent it (txlb names no software)."""
        client = self.client()
        client.send(GET)
        self.answer(0).end()
        names = {name.lower() for name, _ in client.response().headers}
        self.assertIn(b"date", names)
        self.assertNotIn(b"server", names)

    def test_a_client_gone_mid_stream_stops_the_upstream(self) -> None:
        client = self.client()
        client.send(GET)
        response = self.answer(0, b"data: 1\n\n", length=False)
        client.disconnect()
        self.assertTrue(response.transport.stopped)
        self.assertEqual([r.outcome for r in self.records], ["client_abort"])

    def test_write_after_finish_and_finish_after_loss_raise_as_twisted_web(self) -> None:
        held: list[Any] = []

        class Holding:
            def render(self, request: Any) -> Any:
                held.append(request)
                return NOT_DONE_YET

        site = LeanSite(Holding(), reactor=self.clock)  # type: ignore[arg-type]
        client = ClientConnection(site)  # type: ignore[arg-type]
        client.send(GET)
        held[0].finish()
        self.assertRaises(RuntimeError, held[0].write, b"late")
        self.assertEqual(client.response().status, 200)
        gone = ClientConnection(site)  # type: ignore[arg-type]
        gone.send(GET)
        notified = held[1].notifyFinish()
        gone.disconnect()
        self.failureResultOf(notified, ConnectionDone)
        held[1].write(b"dropped")  # to a client that left: nothing, no error
        self.assertRaises(RuntimeError, held[1].finish)
        self.assertNotIn(b"dropped", gone.transport.value())

    def test_a_resource_that_raises_gets_a_500_and_the_connection_goes_on(self) -> None:
        class Broken:
            def render(self, request: Any) -> Any:
                raise ZeroDivisionError()

        site = LeanSite(Broken(), reactor=self.clock)  # type: ignore[arg-type]
        client = ClientConnection(site)  # type: ignore[arg-type]
        client.send(GET + GET)
        self.assertEqual(client.transport.value().count(b"HTTP/1.1 500 "), 2)
        self.assertFalse(client.transport.disconnecting)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 2)


class ParserTests(LeanTestCase):
    def test_a_method_llhttp_does_not_know_is_400_and_logged(self) -> None:
        client = self.client()
        client.send(b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(client.response().status, 400)
        self.assertTrue(client.transport.disconnecting)
        self.assertEqual(self.upstream.calls, [])
        self.assertEqual([(r.method, r.status) for r in self.records], [(b"-", 400)])

    def test_webdav_and_patch_methods_are_forwarded(self) -> None:
        for method in (b"PATCH", b"PROPFIND", b"PURGE"):
            client = self.client()
            client.send(method + b" /x HTTP/1.1\r\nHost: x\r\n\r\n")
            self.assertEqual(self.upstream.calls[-1].method, method)


class RenderFailureTests(SynchronousTestCase):
    def test_a_resource_failing_after_its_head_cuts_the_connection(self) -> None:
        class HalfWay:
            def render(self, request: Any) -> Any:
                request.write(b"part")
                raise ZeroDivisionError()

        client = ClientConnection(LeanSite(HalfWay(), reactor=Clock()))  # type: ignore[arg-type]
        client.send(GET + GET)
        self.assertTrue(client.transport.disconnecting)  # StringTransport: aborted or closed
        self.assertEqual(client.transport.value().count(b"HTTP/1.1 "), 1)
        self.assertFalse(client.response().complete)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)


class LeanReloadTests(test_reload.ReloadTestCase):
    def test_a_reload_retunes_the_lean_server(self) -> None:
        factory = self.lb.main_factory()
        self.rewrite('max-body = 10\nheader-timeout = 2\n' + self.first)
        self.reload()
        self.assertEqual((factory.max_body, factory.header_timeout), (10, 2.0))
        client = ClientConnection(factory)  # type: ignore[arg-type]
        client.request(b"POST", b"/", body=b"x" * 11)
        self.assertEqual(client.response().status, 413)
        slow = ClientConnection(factory)  # type: ignore[arg-type]
        slow.send(b"GET / HTTP/1.1\r\n")
        self.clock.advance(2)
        self.assertEqual(slow.response().status, 408)


class TlsTests(SynchronousTestCase):
    def test_alpn_agrees_on_http_1_1(self) -> None:
        """A TLS client offering ALPN (curl, httpx) is refused without a protocol named."""
        from twisted.internet.interfaces import IProtocolNegotiationFactory

        site = LeanSite(object(), reactor=Clock())  # type: ignore[arg-type]
        self.assertEqual(IProtocolNegotiationFactory(site).acceptableProtocols(),
                         [b"http/1.1"])


CHUNKED = (b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")


class _Echo:
    def __init__(self) -> None:
        self.rendered: list[Any] = []

    def render(self, request: Any) -> bytes:
        self.rendered.append(request)
        body = request.content.read()
        request.setHeader(b"content-length", b"%d" % len(body))
        return body


class _Hold:
    def __init__(self) -> None:
        self.rendered: list[Any] = []

    def render(self, request: Any) -> Any:
        self.rendered.append(request)
        return NOT_DONE_YET


class RawChannelTestCase(SynchronousTestCase):
    def connect(self, resource: Any = None) -> tuple[LeanChannel, StringTransport]:
        self.clock = Clock()
        self.resource = resource if resource is not None else _Echo()
        site = LeanSite(self.resource, max_body=4096, header_timeout=5, reactor=self.clock)
        peer = IPv4Address("TCP", "10.0.0.1", 4000)
        transport = StringTransport(peerAddress=peer)
        channel = site.buildProtocol(peer)
        channel.makeConnection(transport)
        return channel, transport


class TrailerTests(RawChannelTestCase):
    def test_an_endless_trailer_is_refused_not_buffered(self) -> None:
        """
        httptools buffers a header value until its line ends, and after the head nothing
        bounded it: a trailer that never ends grew without limit (64 KiB a read, with
        neither --max-body, the head deadline nor the idle timeout to stop it).
        """
        channel, transport = self.connect()
        channel.dataReceived(CHUNKED + b"3\r\nabc\r\n0\r\nX-Trailer: ")
        for _ in range(8):
            channel.dataReceived(b"a" * 65536)
            if transport.disconnecting:
                break
        self.assertTrue(transport.disconnecting)
        self.assertIn(b"HTTP/1.1 400 ", transport.value())
        self.assertEqual(self.resource.rendered, [])

    def test_an_endless_trailer_name_is_refused(self) -> None:
        channel, transport = self.connect()
        channel.dataReceived(CHUNKED + b"0\r\n")
        for _ in range(8):
            channel.dataReceived(b"a" * 65536)
            if transport.disconnecting:
                break
        self.assertTrue(transport.disconnecting)
        self.assertIn(b"HTTP/1.1 400 ", transport.value())

    def test_an_endless_chunk_extension_is_refused(self) -> None:
        channel, transport = self.connect()
        channel.dataReceived(CHUNKED + b"3;ext=")
        for _ in range(8):
            channel.dataReceived(b"a" * 65536)
            if transport.disconnecting:
                break
        self.assertTrue(transport.disconnecting)
        self.assertIn(b"HTTP/1.1 400 ", transport.value())

    def test_trailers_are_dropped_as_twisted_web_drops_them(self) -> None:
        """lb.site() discards trailers; a trailer named like a framing header is no 400."""
        channel, transport = self.connect()
        channel.dataReceived(CHUNKED + b"3\r\nabc\r\n0\r\nHost: y\r\n"
                             b"T: v\r\n\r\n")
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 200 "), transport.value())
        self.assertTrue(transport.value().endswith(b"\r\n\r\nabc"))
        request = self.resource.rendered[0]
        self.assertIsNone(request.getHeader(b"t"))

    def test_a_slow_but_legitimate_chunked_body_is_read(self) -> None:
        channel, transport = self.connect()
        channel.dataReceived(CHUNKED)
        for _ in range(200):
            channel.dataReceived(b"1;a=b\r\n")
            channel.dataReceived(b"x")
            channel.dataReceived(b"\r\n")
        channel.dataReceived(b"0\r\nT: v\r\n\r\n")
        self.assertTrue(transport.value().endswith(b"\r\n\r\n" + b"x" * 200))


class LeadingEmptyLineTests(RawChannelTestCase):
    def test_empty_lines_before_a_request_run_the_head_deadline(self) -> None:
        """
        llhttp skips CRLFs before a request line without starting a message, so "\\r\\n"
        every 50 s held a connection forever: no head deadline (lb.site() starts it on any
        byte and answers 408), and every read reset the idle timeout.
        """
        channel, transport = self.connect()
        for _ in range(4):
            channel.dataReceived(b"\r\n")
            self.clock.advance(2)
        self.assertTrue(transport.disconnecting)
        self.assertIn(b"HTTP/1.1 408 ", transport.value())

    def test_a_stray_crlf_after_a_request_being_answered_does_not_408_it(self) -> None:
        channel, transport = self.connect(_Hold())
        channel.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        channel.dataReceived(b"\r\n")
        self.clock.advance(30)
        self.assertFalse(transport.disconnecting)
        self.assertEqual(transport.value(), b"")


class FieldValueTests(RawChannelTestCase):
    def test_trailing_whitespace_of_a_field_value_is_not_part_of_it(self) -> None:
        """
        RFC 9110 5.5: OWS around a field value is not part of it.  llhttp strips the leading
        whitespace only, so ``Host: x `` was a 400 (lb.site() forwards it) and
        ``Expect: 100-continue `` got no ``100 Continue``.
        """
        channel, transport = self.connect()
        channel.dataReceived(b"POST /t HTTP/1.1\r\nHost: x \t\r\n"
                             b"Expect: 100-continue \r\nContent-Length: 3\r\n\r\n")
        self.assertEqual(transport.value(), b"HTTP/1.1 100 Continue\r\n\r\n")
        channel.dataReceived(b"abc")
        self.assertIn(b"HTTP/1.1 200 ", transport.value())
        request = self.resource.rendered[0]
        self.assertEqual(request.getHeader(b"host"), b"x")

    def test_a_request_line_over_16_kib_is_431_as_on_twisted_web(self) -> None:
        """The limit is the request line's (as twisted.web's), not its target's alone."""
        channel, transport = self.connect()
        target = b"/" + b"a" * (16385 - len(b"GET  HTTP/1.1") - 1)
        channel.dataReceived(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"HTTP/1.1 431 ", transport.value())


class HeldBackRequestTests(RawChannelTestCase):
    def test_pipelined_requests_behind_a_stream_are_not_all_parsed_at_once(self) -> None:
        """
        Reading pauses once one request waits (_PIPELINE_DEPTH), but a read is parsed
        whole: one 64 KiB read of small pipelined requests became ~2,400 LeanRequests
        (~2 MB) held behind a stream, where twisted.web keeps the unparsed bytes.
        """
        channel, transport = self.connect(_Hold())
        channel.dataReceived(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 2400)
        # at most the requests of one 4 KiB slice are parsed; the rest is held as bytes
        self.assertLess(len(channel._queue), 4096 // 27)
        self.assertTrue(channel._reading_paused)
        self.resource.rendered[0].finish()
        self.assertEqual(len(self.resource.rendered), 2)

    def test_the_requests_held_back_are_answered_in_order(self) -> None:
        channel, transport = self.connect()
        requests = b"".join(b"GET /%d HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n%d"
                            % (i, i % 10) for i in range(3000))
        channel.dataReceived(requests[:65536])
        channel.dataReceived(requests[65536:])
        self.assertEqual([r.uri for r in self.resource.rendered],
                         [b"/%d" % i for i in range(3000)])
        self.assertEqual(transport.value().count(b"HTTP/1.1 200 "), 3000)
        self.assertFalse(transport.disconnecting)

    def test_a_close_in_the_held_back_bytes_drops_what_follows(self) -> None:
        channel, transport = self.connect()
        get = b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
        channel.dataReceived(get * 300 + b"GET /last HTTP/1.1\r\nHost: x\r\n"
                             b"Connection: close\r\n\r\n" + get * 300)
        uris = [r.uri for r in self.resource.rendered]
        self.assertEqual(uris, [b"/a"] * 300 + [b"/last"])
        self.assertTrue(transport.disconnecting)

    def test_a_read_after_held_back_bytes_is_parsed_after_them(self) -> None:
        channel, transport = self.connect(_Hold())
        first = b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\n"
        second = (b"POST /2 HTTP/1.1\r\nHost: x\r\nX-Pad: %s\r\nContent-Length: 3000\r\n\r\n"
                  % (b"p" * 1500) + b"b" * 3000)
        raw = first + second + b"GET /3 HTTP/1.1\r\nHost: x\r\n\r\n"
        channel.dataReceived(raw[:4300])
        channel.dataReceived(raw[4300:])
        self.assertEqual([r.uri for r in self.resource.rendered], [b"/1"])
        self.resource.rendered[0].finish()
        self.assertEqual([r.uri for r in self.resource.rendered], [b"/1", b"/2"])
        self.assertEqual(self.resource.rendered[1].content.read(), b"b" * 3000)
        self.resource.rendered[1].finish()
        self.assertEqual([r.uri for r in self.resource.rendered], [b"/1", b"/2", b"/3"])

    def test_a_refusal_in_the_first_slice_of_a_read_stops_the_parse(self) -> None:
        """The parser is not fed again once a refusal stopped it (it raised, bare)."""
        channel, transport = self.connect()
        channel.dataReceived(b"GET /t HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"
                             + b"GET /" + b"a" * 17000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIn(b"HTTP/1.1 400 ", transport.value())
        self.assertTrue(transport.disconnecting)
