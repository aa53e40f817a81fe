"""
Hostile clients against the lean main-port server (txlb._server.lean): what a review found.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.server import NOT_DONE_YET

from txlb._server.lean import LeanSite
from txlb._server.lean_channel import LeanChannel

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


class ReviewTestCase(SynchronousTestCase):
    def connect(self, resource: Any = None) -> tuple[LeanChannel, StringTransport]:
        self.clock = Clock()
        self.resource = resource if resource is not None else _Echo()
        site = LeanSite(self.resource, max_body=4096, header_timeout=5, reactor=self.clock)
        peer = IPv4Address("TCP", "10.0.0.1", 4000)
        transport = StringTransport(peerAddress=peer)
        channel = site.buildProtocol(peer)
        channel.makeConnection(transport)
        return channel, transport


class TrailerTests(ReviewTestCase):
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


class LeadingEmptyLineTests(ReviewTestCase):
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



class FieldValueTests(ReviewTestCase):
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


class QueueTests(ReviewTestCase):
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
