"""
The main port's twisted.web channel (:mod:`txlb._server.site`): what a client or an operator
sees of it -- its framing checks, its refusals and their bodies, the head deadline (the
configured one, and on every request of a connection), TCP_NODELAY, ``ProxySite``'s
defaults -- and of the 413 an embedder's own channel gives.

Written to kill the mutants of ``txlb/_server/site.py`` that survived ``python -m
bench.mutation`` (bench/results/mutation-full/_server-site.json).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.address import IPv6Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import formatEvent, globalLogPublisher
from twisted.web.http import HTTPChannel
from twisted.web.resource import Resource
from twisted.web.server import Site

from txlb._server.site import LimitedRequest, ProxySite
from txlb.tap import _AdminSite

from ..helpers import ClientConnection, FakeResponse, parse_response
from .test_failover import FailoverTestCase


class _Ok(Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.rendered: list[bytes] = []

    def render(self, request: Any) -> bytes:
        self.rendered.append(request.content.read())
        return b"ok"


class _NoDelayTransport(StringTransport):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.no_delay: list[bool] = []

    def setTcpNoDelay(self, enabled: bool) -> None:  # noqa: N802 (Twisted's name)
        self.no_delay.append(enabled)


def _error(raw: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(parse_response(raw).body)["error"]
    return error


class ChannelTests(FailoverTestCase):
    def events(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        return events

    def test_the_connection_asks_for_tcp_nodelay(self) -> None:
        """Streamed tokens are small writes: Nagle's algorithm must not hold them back."""
        self.build()
        transport = _NoDelayTransport()
        channel = self.site.buildProtocol(None)
        channel.makeConnection(transport)
        self.assertEqual(transport.no_delay, [True])

    def test_connection_close_among_tokens_is_said_back(self) -> None:
        """``Connection: keep-alive, close`` closes, and the response says so."""
        self.build()
        client = self.client()
        client.request(b"GET", b"/v1/models", headers=[(b"Connection", b"keep-alive, close")])
        response = client.response()
        self.assertEqual(response.status, 200)
        self.assertEqual(response.header(b"connection"), [b"close"])
        self.assertTrue(client.transport.disconnecting)

    def test_an_http10_answer_says_no_connection_close(self) -> None:
        """HTTP/1.0 closes by default: no ``Connection`` header is added to say it."""
        self.build()
        client = self.client()
        client.send(b"GET /v1/models HTTP/1.0\r\nHost: x\r\n\r\n")
        response = client.response()
        self.assertEqual(response.status, 200)
        self.assertEqual(response.header(b"connection"), [])

    def test_chunked_twice_after_another_coding_is_400(self) -> None:
        """``gzip, chunked, chunked``: chunked more than once, the length is unknowable."""
        self.build()
        client = self.client()
        client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Transfer-Encoding: gzip, chunked, chunked\r\n\r\n0\r\n\r\n")
        self.assertEqual(client.response().status, 400)
        self.assertIn("final transfer coding", _error(client.transport.value())["message"])
        self.assertEqual(self.upstream.calls, [])

    def test_a_slow_body_is_not_cut_by_the_head_deadline(self) -> None:
        """The head deadline is for the head: a body may take longer (after the head)."""
        self.build(header_timeout=10)
        client = self.client()
        client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"
                    b'{"pr')
        self.clock.advance(5)
        client.send(b'om')  # the first bytes after the head
        self.clock.advance(20)
        self.assertFalse(client.transport.disconnecting)
        self.assertEqual(client.transport.value(), b"")
        client.send(b'pt"}')
        self.assertEqual([call.body for call in self.upstream.calls], [b'{"prompt"}'])
        self.answer(0, 200, b'{"ok": 1}')
        self.assertEqual(client.response().status, 200)

    def test_a_body_in_its_own_packet_gets_no_head_deadline(self) -> None:
        self.build(header_timeout=10)
        client = self.client()
        client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n")
        client.send(b"ab")
        self.clock.advance(30)
        self.assertFalse(client.transport.disconnecting)
        client.send(b"cd")
        self.assertEqual([call.body for call in self.upstream.calls], [b"abcd"])

    def test_a_malformed_head_and_a_malformed_body_say_which(self) -> None:
        self.build()
        client = self.client()
        client.send(b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
        self.assertEqual(client.response().status, 400)
        self.assertEqual(_error(client.transport.value())["message"],
                         "malformed request line or headers")
        client = self.client()
        client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n")
        self.assertEqual(client.response().status, 400)
        self.assertEqual(_error(client.transport.value())["message"],
                         "malformed request body framing")
        self.assertEqual(self.upstream.calls, [])

    def test_a_refused_last_header_stops_the_head_there(self) -> None:
        """
        An invalid last header is refused, and nothing of the request follows the 400: no
        ``100 Continue`` the client could read as the start of another answer.
        """
        self.build()
        client = self.client()
        client.send(b"POST /v1/completions HTTP/1.1\r\nExpect: 100-continue\r\n"
                    b"Content-Length: 2\r\nHost: a b\r\n\r\n")
        raw = client.transport.value()
        self.assertTrue(raw.startswith(b"HTTP/1.1 400 "), raw)
        self.assertNotIn(b"100 Continue", raw)
        self.assertEqual(raw.count(b"HTTP/1.1"), 1)
        self.assertEqual(self.records[-1].status, 400)

    def test_one_refusal_per_connection_when_the_body_is_over_the_limit(self) -> None:
        """
        A chunk over ``--max-body`` is 413, and a framing fault later in the same bytes
        writes nothing after it (a second answer to one request).
        """
        self.build(max_body="10B")
        client = self.client()
        client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                    b"14\r\n" + b"x" * 20 + b"\r\nzz\r\n")
        raw = client.transport.value()
        self.assertTrue(raw.startswith(b"HTTP/1.1 413 "), raw)
        self.assertEqual(raw.count(b"HTTP/1.1"), 1)
        self.assertEqual(_error(raw)["code"], 413)
        self.assertEqual([r.status for r in self.records], [413])
        client.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")  # nothing more parsed
        self.assertEqual(client.transport.value(), raw)

    def test_every_visible_ascii_byte_may_be_in_the_target(self) -> None:
        """``!`` and ``~`` are visible ASCII (RFC 3986 sub-delims and unreserved)."""
        self.build()
        client = self.client()
        client.request(b"GET", b"/v1/models/a!b~c")
        self.assertEqual([call.uri.split(b"/", 3)[3] for call in self.upstream.calls],
                         [b"v1/models/a!b~c"])
        response = self.upstream.last.respond(FakeResponse(200, length=2))
        response.send(b"{}")
        response.end()
        self.assertEqual(client.response().status, 200)

    def test_every_control_character_in_a_header_value_is_400_and_a_tab_is_not(self) -> None:
        """
        RFC 9110 5.5: a field value holds no control character but HTAB; each other one
        (0x01-0x08, 0x0B, 0x0C, 0x0E-0x1F, DEL) is refused as llhttp refuses it, before any
        backend sees the request.
        """
        self.build()
        for byte in [*range(0x01, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F]:
            client = self.client()
            client.request(b"GET", b"/v1/models/m", headers=[(b"X-Odd", b"a%cb" % byte)])
            raw = client.transport.value()
            self.assertTrue(raw.startswith(b"HTTP/1.1 400 "), hex(byte))
            # in the error shape of every refusal (each server words its own reason)
            self.assertTrue(_error(raw)["message"], hex(byte))
        self.assertEqual(self.upstream.calls, [])
        client = self.client()
        client.request(b"GET", b"/v1/models/m", headers=[(b"X-Odd", b"a\tb")])
        self.assertEqual(len(self.upstream.calls), 1)

    def test_a_slow_head_is_logged_with_its_ipv6_peer_in_brackets(self) -> None:
        events = self.events()
        site = ProxySite(_Ok(), header_timeout=10, reactor=(clock := Clock()))  # no repeats
        transport = StringTransport(peerAddress=IPv6Address("TCP", "2001:db8::1", 40000))
        channel = site.buildProtocol(None)
        channel.makeConnection(transport)
        channel.dataReceived(b"GET / HTTP/1.1\r\n")
        clock.advance(11)
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 408 "))
        lines = [formatEvent(e) for e in events]
        self.assertIn("client [2001:db8::1]:40000 sent no complete request head within 10s",
                      lines)

    def test_a_slow_head_without_a_summary_is_one_line_each(self) -> None:
        events = self.events()
        site = ProxySite(_Ok(), header_timeout=10, reactor=(clock := Clock()))
        clients = [ClientConnection(site, peer=f"10.9.3.{n}") for n in range(2)]
        for client in clients:
            client.send(b"GET / HTTP/1.1\r\n")
        clock.advance(11)
        lines = [formatEvent(e) for e in events]
        self.assertEqual([line for line in lines if "sent no complete" in line],
                         ["client 10.9.3.0:40000 sent no complete request head within 10s",
                          "client 10.9.3.1:40000 sent no complete request head within 10s"])

    def test_starting_the_site_logs_nothing(self) -> None:
        """No "Starting factory <ProxySite ...>" line: it says nothing to operators."""
        events = self.events()
        self.build()
        self.site.doStart()
        self.site.doStop()
        self.assertEqual([formatEvent(e) for e in events
                          if "factory" in formatEvent(e).lower()], [])


class AdminPortDeadlineTests(FailoverTestCase):
    def test_the_admin_port_gives_a_head_30_seconds(self) -> None:
        """The admin port has no ``--header-timeout`` of its own: ProxyChannel's 30 s."""
        self.build()
        client = ClientConnection(_AdminSite(self.lb.admin_resource(), reactor=self.clock))
        client.send(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        self.clock.advance(29.5)
        self.assertEqual(client.transport.value(), b"")
        self.clock.advance(1)
        self.assertTrue(client.transport.value().startswith(b"HTTP/1.1 408 "))
        self.assertEqual(_error(client.transport.value())["message"],
                         "request headers not received within 30s")


class EmbedderChannelTests(FailoverTestCase):
    """``LimitedRequest`` in an embedder's own ``Site`` and ``HTTPChannel``."""

    def site_of(self, **attributes: Any) -> tuple[Site, _Ok, list[tuple[Any, int, bytes]]]:
        resource = _Ok()
        refused: list[tuple[Any, int, bytes]] = []
        site = Site(resource, reactor=Clock())
        site.protocol = HTTPChannel
        site.requestFactory = LimitedRequest
        site.max_body = 100  # type: ignore[attr-defined]
        site.on_refused = lambda *args: refused.append(args)  # type: ignore[attr-defined]
        for name, value in attributes.items():
            setattr(site, name, value)
        return site, resource, refused

    def test_a_body_over_the_limit_is_413_in_an_embedders_channel(self) -> None:
        site, resource, refused = self.site_of()
        client = ClientConnection(site)
        client.send(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n")
        response = client.response()
        self.assertEqual(response.status, 413)
        self.assertEqual(response.header(b"connection"), [b"close"])
        self.assertEqual(_error(client.transport.value())["code"], 413)
        self.assertTrue(client.transport.disconnecting)
        [(request, status, body)] = refused
        self.assertEqual((request.method, request.uri, status), (b"POST", b"/v1/embeddings", 413))
        self.assertEqual(json.loads(body)["error"]["code"], 413)
        self.assertEqual(resource.rendered, [])

    def test_a_chunked_body_over_the_limit_is_413_there_too(self) -> None:
        site, resource, refused = self.site_of()
        client = ClientConnection(site)
        client.send(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n" + b"80\r\n" + b"x" * 128 + b"\r\n")
        self.assertEqual(client.response().status, 413)
        self.assertEqual([status for _, status, _ in refused], [413])
        self.assertEqual(resource.rendered, [])

    def test_a_body_within_the_limit_is_served(self) -> None:
        site, resource, refused = self.site_of()
        client = ClientConnection(site)
        client.request(b"POST", b"/v1/embeddings", body=b"x" * 100)
        self.assertEqual(client.response().status, 200)
        self.assertEqual((resource.rendered, refused), ([b"x" * 100], []))

    def test_a_proxy_site_without_on_refused_still_answers_413(self) -> None:
        site = ProxySite(_Ok(), max_body=10, reactor=Clock())
        client = ClientConnection(site)
        client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n")
        self.assertEqual(client.response().status, 413)
        self.assertEqual(_error(client.transport.value())["code"], 413)


class RefuseContractTests(FailoverTestCase):
    def test_every_refusal_says_stop_parsing_and_only_the_first_is_written(self) -> None:
        """
        ``refuse`` returns ``False`` (twisted.web's "stop parsing this header") whether it
        wrote the answer or one was written already: a channel subclass's own header check
        returns it as is.
        """
        self.build()
        client = self.client()
        client.send(b"GET / HTTP/1.1\r\n")
        channel = client.channel
        self.assertIs(channel.refuse(400, "first"), False)
        self.assertIs(channel.refuse(431, "second"), False)
        raw = client.transport.value()
        self.assertEqual((raw.count(b"HTTP/1.1"), _error(raw)["message"]), (1, "first"))


class HeadDeadlineAndDefaultsTests(FailoverTestCase):
    def test_the_head_deadline_is_the_configured_one(self) -> None:
        self.build(header_timeout=10)
        client = self.client()
        client.send(b"GET / HTTP/1.1\r\nHost: x\r\n")
        self.clock.advance(9.5)
        self.assertFalse(client.transport.disconnecting)
        self.clock.advance(1)
        self.assertTrue(client.transport.value().startswith(b"HTTP/1.1 408 "))
        self.assertEqual(json.loads(client.response().body)["error"]["code"], 408)

    def test_a_refused_body_says_413_in_its_json_too(self) -> None:
        self.build(max_body="1KiB")
        client = self.client()
        client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        self.assertEqual(json.loads(client.response().body)["error"]["code"], 413)
        self.assertEqual(self.records[-1].status, 413)

    def test_the_next_request_on_a_connection_gets_a_deadline_too(self) -> None:
        self.build(header_timeout=10)
        client = self.client()
        client.request(b"GET", b"/one")
        self.answer(0, 200)
        client.transport.clear()
        client.send(b"GET /two HTTP/1.1\r\nHost: x\r\n")  # and no more
        self.clock.advance(11)
        self.assertTrue(client.transport.value().startswith(b"HTTP/1.1 408 "))
        self.assertEqual(len(self.upstream.calls), 1)

    def test_proxy_site_defaults(self) -> None:
        """No body limit and a 30 s head deadline unless told otherwise."""
        from twisted.internet.address import IPv4Address
        from twisted.web.resource import Resource

        from txlb._server.site import ProxySite

        class Ok(Resource):
            isLeaf = True

            def render(self, request: Any) -> bytes:
                return b"ok"

        site = ProxySite(Ok(), reactor=Clock())
        self.assertEqual(site.max_body, 0)
        channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 1))
        self.assertEqual(channel.header_timeout, 30.0)
        client = ClientConnection(site)
        client.request(b"POST", b"/", body=b"x" * 100_000)  # max_body 0: no limit
        self.assertEqual(client.response().status, 200)
        # the request class in a Site that sets no limit at all: no limit either
        from twisted.web.server import Site

        from txlb._server.site import LimitedRequest

        plain = Site(Ok(), reactor=Clock())
        plain.requestFactory = LimitedRequest
        client = ClientConnection(plain)
        client.request(b"POST", b"/", body=b"x" * 100)
        self.assertEqual(client.response().status, 200)
