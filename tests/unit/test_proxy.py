"""
The proxy resource end to end in memory: a real Site channel on the client side, a fake
Agent on the upstream side, a Clock for every timer.
"""

from __future__ import annotations

import json

from twisted.internet import error as neterror
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import RequestTransmissionFailed, ResponseFailed, ResponseNeverReceived
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from txlb import LoadBalancer
from txlb._proxy.client_end import cut_answer

from ..helpers import ClientConnection, FakeResponse, FakeUpstream

BACKENDS = ["127.0.0.1:8002", "127.0.0.1:8003"]


class ProxyTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.build(BACKENDS)

    def build(self, backends: list[str], **options: object) -> None:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.lb = LoadBalancer(
            backends, reactor=self.clock, agent=self.upstream, probe_agent=FakeUpstream(),
            **options,
        )
        self.site = Site(self.lb.resource(), reactor=self.clock)

    def client(self) -> ClientConnection:
        return ClientConnection(self.site)

    def active(self) -> dict[str, int]:
        return {b.key: b.counts.active for b in self.lb.pool}


class ForwardingTests(ProxyTestCase):
    def test_request_forwarded_as_it_came(self) -> None:
        """
        Method, path, query, body and repeated headers reach the backend unchanged;
        hop-by-hop headers and those named in Connection do not.
        """
        client = self.client()
        client.request(
            b"POST",
            b"/v1/chat/completions?x=1&y=%2F",
            headers=[
                (b"X-Custom", b"one"),
                (b"X-Custom", b"two"),
                (b"Authorization", b"Bearer secret"),
                (b"Connection", b"keep-alive, X-Secret-Hop"),
                (b"X-Secret-Hop", b"drop me"),
                (b"Keep-Alive", b"timeout=5"),
                (b"TE", b"trailers"),
                (b"Upgrade", b"websocket"),
                (b"Proxy-Connection", b"keep-alive"),
                (b"X-Forwarded-For", b"203.0.113.7"),
                (b"X-Forwarded-Proto", b"https"),
            ],
            body=b'{"model": "m"}',
        )
        call = self.upstream.last
        self.assertEqual(call.method, b"POST")
        self.assertIn(call.uri, [b"http://127.0.0.1:8002/v1/chat/completions?x=1&y=%2F",
                                 b"http://127.0.0.1:8003/v1/chat/completions?x=1&y=%2F"])
        self.assertEqual(call.body, b'{"model": "m"}')
        self.assertEqual(call.header(b"x-custom"), [b"one", b"two"])
        self.assertEqual(call.header(b"authorization"), [b"Bearer secret"])
        for hop in (b"connection", b"x-secret-hop", b"keep-alive", b"te", b"upgrade",
                    b"proxy-connection", b"host", b"content-length"):
            self.assertEqual(call.header(hop), [], hop)
        self.assertEqual(call.header(b"x-forwarded-for"), [b"203.0.113.7, 10.1.2.3"])
        self.assertEqual(call.header(b"x-forwarded-proto"), [b"http"])

    def test_get_without_body_sends_no_body(self) -> None:
        self.client().request(b"GET", b"/v1/embeddings")
        self.assertIsNone(self.upstream.last.body)
        self.assertEqual(self.upstream.last.header(b"x-forwarded-for"), [b"10.1.2.3"])

    def test_response_returned_as_sent(self) -> None:
        """Status, phrase, repeated headers and body as the backend sent them, plus X-Backend."""
        client = self.client()
        client.request(b"GET", b"/thing")
        response = self.upstream.last.respond(
            FakeResponse(
                201,
                [
                    (b"Set-Cookie", b"a=1"),
                    (b"Set-Cookie", b"b=2"),
                    (b"Content-Type", b"application/json"),
                    (b"Connection", b"X-Hop"),
                    (b"X-Hop", b"gone"),
                    (b"Keep-Alive", b"timeout=5"),
                    (b"Server", b"uvicorn"),
                ],
                length=7,
                phrase=b"Created",
            )
        )
        response.send(b'{"a":1}')
        response.end()
        result = client.response()
        self.assertEqual(result.status, 201)
        self.assertIn(b"HTTP/1.1 201 Created", client.transport.value())
        self.assertEqual(result.header(b"set-cookie"), [b"a=1", b"b=2"])
        self.assertEqual(result.header(b"content-type"), [b"application/json"])
        self.assertEqual(result.header(b"content-length"), [b"7"])
        self.assertEqual(result.header(b"transfer-encoding"), [])
        self.assertEqual(result.header(b"x-hop"), [])
        self.assertEqual(result.header(b"keep-alive"), [])
        self.assertEqual(result.header(b"server"), [b"uvicorn"])
        backend = result.header(b"x-backend")[0].decode()
        self.assertIn(backend, BACKENDS)
        self.assertEqual(result.header(b"x-backend-port"), [backend.split(":")[1].encode()])
        self.assertEqual(result.body, b'{"a":1}')
        self.assertTrue(result.complete)
        self.assertEqual(self.active(), {k: 0 for k in BACKENDS})

    def test_no_content_type_invented(self) -> None:
        client = self.client()
        client.request(b"GET", b"/empty")
        self.upstream.last.respond(FakeResponse(200, length=0)).end()
        self.assertEqual(client.response().header(b"content-type"), [])

    def test_mounted_below_another_site(self) -> None:
        """Mounted at /llm/, the prefix is removed and the rest (still encoded) is forwarded."""
        root = Resource()
        root.putChild(b"llm", self.lb.resource())
        client = ClientConnection(Site(root, reactor=self.clock))
        client.request(b"GET", b"/llm/v1/models/a%2Fb?q=1")
        self.assertTrue(self.upstream.last.uri.endswith(b"/v1/models/a%2Fb?q=1"))
        self.assertNotIn(b"/llm", self.upstream.last.uri)


class StreamingTests(ProxyTestCase):
    def start_stream(self) -> tuple[ClientConnection, FakeResponse]:
        client = self.client()
        client.request(b"POST", b"/v1/chat/completions", body=b'{"stream": true}')
        response = self.upstream.last.respond(
            FakeResponse(200, [(b"Content-Type", b"text/event-stream")])
        )
        return client, response

    def test_each_chunk_written_when_it_arrives(self) -> None:
        client, response = self.start_stream()
        response.send(b'data: {"n": 1}\n\n')
        self.assertEqual(client.response().body, b'data: {"n": 1}\n\n')
        self.assertFalse(client.response().complete)
        response.send(b'data: {"n": 2}\n\n')
        self.assertEqual(client.response().body, b'data: {"n": 1}\n\ndata: {"n": 2}\n\n')
        response.send(b"data: [DONE]\n\n")
        response.end()
        self.assertTrue(client.response().complete)
        self.assertEqual(client.response().header(b"content-type"), [b"text/event-stream"])

    def test_slow_client_pauses_the_backend(self) -> None:
        """
        When the client's socket fills, Twisted pauses the channel's producer: that must be
        the upstream connection, so the backend read stops instead of being buffered.
        """
        client, response = self.start_stream()
        response.send(b"data: 1\n\n")
        # what the TCP transport does when its send buffer is full:
        client.transport.producer.pauseProducing()
        self.assertTrue(response.transport.paused)
        client.transport.producer.resumeProducing()
        self.assertFalse(response.transport.paused)

    def test_proxy_holds_nothing_back(self) -> None:
        """Bytes leave the proxy as they arrive: written == received at every step."""
        client, response = self.start_stream()
        for n in range(200):
            response.send(b"x" * 1000)
            self.assertEqual(len(client.response().body), (n + 1) * 1000)


class DisconnectTests(ProxyTestCase):
    def test_disconnect_before_headers_cancels_upstream(self) -> None:
        client = self.client()
        client.request(b"POST", b"/v1/completions", body=b"{}")
        call = self.upstream.last
        self.assertEqual(sum(self.active().values()), 1)
        client.disconnect()
        self.assertTrue(call.cancelled)
        self.assertEqual(sum(self.active().values()), 0)
        self.clock.advance(1000)  # no watchdog left behind to fire
        self.assertEqual(sum(self.active().values()), 0)

    def test_disconnect_mid_stream_closes_upstream(self) -> None:
        client = self.client()
        client.request(b"POST", b"/v1/completions", body=b'{"stream": true}')
        response = self.upstream.last.respond(FakeResponse(200))
        response.send(b"data: 1\n\n")
        client.disconnect()
        self.assertTrue(response.transport.stopped)
        self.assertEqual(sum(self.active().values()), 0)
        # The upstream then reports the loss; the slot must not be released twice.
        response.end(Failure(ResponseFailed([Failure(neterror.ConnectionAborted())])))
        self.assertEqual(sum(self.active().values()), 0)

    def test_disconnect_mid_fixed_length_body(self) -> None:
        client = self.client()
        client.request(b"GET", b"/big")
        response = self.upstream.last.respond(FakeResponse(200, length=100))
        response.send(b"x" * 10)
        client.disconnect()
        self.assertTrue(response.transport.stopped)
        self.assertEqual(sum(self.active().values()), 0)


class ErrorTests(ProxyTestCase):
    def error_of(self, client: ClientConnection) -> dict[str, object]:
        result = client.response()
        self.assertEqual(result.header(b"content-type"), [b"application/json"])
        error: dict[str, object] = json.loads(result.body)["error"]
        self.assertEqual(error["code"], result.status)
        self.assertIsInstance(error["message"], str)
        self.assertIsInstance(error["type"], str)
        return error

    def test_refused_is_502_and_marks_down(self) -> None:
        self.build(BACKENDS, retries=0)
        client = self.client()
        client.request(b"GET", b"/")
        key = self.upstream.last.uri.split(b"/")[2].decode()
        self.upstream.last.fail(neterror.ConnectionRefusedError())
        self.assertEqual(client.response().status, 502)
        self.error_of(client)
        pool = {b.key: b for b in self.lb.pool}
        self.assertFalse(pool[key].health.healthy)
        self.assertEqual(sum(self.active().values()), 0)
        # the next request avoids the ejected backend
        self.client().request(b"GET", b"/")
        self.assertNotIn(key.encode(), self.upstream.last.uri)

    def test_reset_after_the_whole_request_is_502_never_retried(self) -> None:
        """
        The backend had the whole request, then closed or reset without answering: it may
        have generated already, so the client gets 502 and no second backend sees it.
        """
        self.build(BACKENDS)  # retries on by default
        client = self.client()
        client.request(b"POST", b"/v1/chat/completions", body=b'{"model": "m"}')
        self.upstream.last.fail(
            ResponseNeverReceived([Failure(neterror.ConnectionLost("reset by peer"))])
        )
        self.assertEqual(client.response().status, 502)
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertTrue(all(b.health.healthy for b in self.lb.pool))  # only a probe may eject
        self.assertEqual(sum(self.active().values()), 0)

    def test_reset_while_sending_is_retried_elsewhere_and_marks_down(self) -> None:
        self.build(BACKENDS)
        client = self.client()
        client.request(b"POST", b"/v1/chat/completions", body=b'{"model": "m"}')
        first = self.upstream.last.uri.split(b"/")[2]
        self.upstream.last.fail(
            RequestTransmissionFailed([Failure(neterror.ConnectionLost("reset by peer"))]))
        self.assertEqual(len(self.upstream.calls), 2)
        self.assertNotIn(first, self.upstream.last.uri)
        self.assertEqual(self.upstream.last.body, b'{"model": "m"}')
        self.upstream.last.respond(FakeResponse(200, length=0)).end()
        self.assertEqual(client.response().status, 200)
        self.assertEqual([b.key.encode() for b in self.lb.pool if not b.health.healthy], [first])

    def test_other_failure_is_502_without_ejection(self) -> None:
        client = self.client()
        client.request(b"GET", b"/")
        self.upstream.last.fail(ResponseFailed([Failure(ValueError("bad status line"))]))
        self.assertEqual(client.response().status, 502)
        self.error_of(client)
        self.assertTrue(all(b.health.healthy for b in self.lb.pool))

    def test_silent_backend_is_504_without_ejection(self) -> None:
        self.build(BACKENDS, read_timeout=30)
        client = self.client()
        client.request(b"POST", b"/v1/completions", body=b"{}")
        call = self.upstream.last
        self.clock.advance(29.9)
        self.assertEqual(client.transport.value(), b"")
        self.clock.advance(0.2)
        self.assertEqual(client.response().status, 504)
        self.assertEqual(self.error_of(client)["type"], "gateway_timeout")
        self.assertTrue(call.cancelled)
        self.assertTrue(all(b.health.healthy for b in self.lb.pool))
        self.assertEqual(sum(self.active().values()), 0)

    def test_watchdog_reset_by_every_chunk(self) -> None:
        self.build(BACKENDS, read_timeout=10)
        client = self.client()
        client.request(b"GET", b"/stream")
        response = self.upstream.last.respond(FakeResponse(200))
        for _ in range(10):  # 90 s in all, never 10 s of silence
            self.clock.advance(9)
            response.send(b"tick\n")
        self.assertFalse(client.transport.disconnected)
        self.clock.advance(10)  # now silent too long, after the head was sent
        self.assertTrue(response.transport.stopped)
        self.assertTrue(client.transport.disconnected)
        self.assertFalse(client.response().complete)
        self.assertEqual(sum(self.active().values()), 0)

    def test_failure_mid_body_truncates_client(self) -> None:
        client = self.client()
        client.request(b"GET", b"/stream")
        response = self.upstream.last.respond(FakeResponse(200))
        response.send(b"partial")
        response.end(Failure(ResponseFailed([Failure(neterror.ConnectionLost())])))
        self.assertTrue(client.transport.disconnected)
        result = client.response()
        self.assertEqual(result.body, b"partial")
        self.assertFalse(result.complete)  # no final zero-length chunk: not a fake success
        self.assertEqual(sum(self.active().values()), 0)

    def test_no_backend_is_503_with_retry_after(self) -> None:
        for backend in self.lb.pool:
            self.lb.pool.mark_down(backend, "test")
        client = self.client()
        client.request(b"GET", b"/")
        self.assertEqual(client.response().status, 503)
        self.assertEqual(client.response().header(b"retry-after"), [b"10"])
        self.error_of(client)
        self.assertEqual(self.upstream.calls, [])


class StatusTests(ProxyTestCase):
    def test_lb_status(self) -> None:
        client = self.client()
        client.request(b"POST", b"/v1/completions", body=b"{}")  # one in flight
        self.lb.pool.mark_down(self.lb.pool.get("127.0.0.1:8003"), "test")  # type: ignore[arg-type]
        status = self.client()
        status.request(b"GET", b"/__lb_status")
        body = json.loads(status.response().body)
        self.assertEqual(body["healthy"], 1)
        self.assertEqual(body["total"], 2)
        entries = {b["backend"]: b for b in body["backends"]}
        self.assertEqual(set(entries), set(BACKENDS))
        self.assertEqual(entries["127.0.0.1:8002"]["active"], 1)
        self.assertIs(entries["127.0.0.1:8003"]["healthy"], False)
        self.assertIs(entries["127.0.0.1:8002"]["draining"], False)
        self.assertEqual(len(self.upstream.calls), 1)  # answered locally

    def test_other_methods_on_status_path_are_forwarded(self) -> None:
        self.client().request(b"POST", b"/__lb_status", body=b"")
        self.assertEqual(len(self.upstream.calls), 1)

    def status_from(self, peer: str) -> bool:
        """Ask for /__lb_status from ``peer``: True if answered locally, False if proxied."""
        calls = len(self.upstream.calls)
        client = ClientConnection(self.site, peer=peer)
        client.request(b"GET", b"/__lb_status")
        if len(self.upstream.calls) == calls:
            self.assertIn("backends", json.loads(client.response().body))
            return True
        self.assertTrue(self.upstream.last.uri.endswith(b"/__lb_status"))
        return False

    def test_local_answers_get_a_result_log_line(self) -> None:
        """Every request gets its line, those txlb answers itself too (nothing forwarded)."""
        from ..helpers import keep_records

        records = keep_records(self.lb)
        self.client().request(b"GET", b"/__lb_status")
        self.client().request(b"GET", b"/v1/models", headers=[(b"X-Orid", b"o-1")])
        self.assertEqual([(r.method, r.path, r.status, r.backend, r.outcome, r.orid_header)
                          for r in records],
                         [(b"GET", b"/__lb_status", 200, None, "ok", None),
                          (b"GET", b"/v1/models", 200, None, "ok", b"o-1")])
        self.assertEqual(self.upstream.calls, [])

    def test_lb_status_off_is_proxied_like_any_path(self) -> None:
        self.build(BACKENDS, lb_status="off")
        self.assertFalse(self.status_from("127.0.0.1"))
        self.assertFalse(self.status_from("10.1.2.3"))

    def test_lb_status_loopback_only(self) -> None:
        self.build(BACKENDS, lb_status="loopback")
        self.assertTrue(self.status_from("127.0.0.1"))
        self.assertTrue(self.status_from("127.8.9.10"))
        self.assertFalse(self.status_from("10.1.2.3"))
        self.assertFalse(self.status_from("192.168.1.1"))

    def test_lb_status_on_by_default_for_everyone(self) -> None:
        self.assertTrue(self.status_from("10.1.2.3"))

    def backend_headers_for(self, peer: str) -> tuple[list[bytes], list[bytes]]:
        client = ClientConnection(self.site, peer=peer)
        client.request(b"GET", b"/x")
        self.upstream.last.respond(FakeResponse(200, length=0)).end()
        response = client.response()
        return response.header(b"x-backend"), response.header(b"x-backend-port")

    def test_x_backend_off(self) -> None:
        self.build(BACKENDS, x_backend="off")
        self.assertEqual(self.backend_headers_for("127.0.0.1"), ([], []))

    def test_x_backend_off_also_drops_the_backends_own(self) -> None:
        """
        A backend that is itself a balancer (or an nginx adding the header) sends its own
        ``X-Backend``; with ``off`` it was passed on, naming an address the option hides.
        """
        self.build(BACKENDS, x_backend="off")
        client = ClientConnection(self.site, peer="10.1.2.3")
        client.request(b"GET", b"/x")
        self.upstream.last.respond(FakeResponse(
            200, headers=[(b"X-Backend", b"10.9.9.9:8000"), (b"X-Backend-Port", b"8000")],
            length=0)).end()
        response = client.response()
        self.assertEqual((response.header(b"x-backend"), response.header(b"x-backend-port")),
                         ([], []))

    def test_x_backend_loopback_only(self) -> None:
        self.build(BACKENDS, x_backend="loopback")
        backend, port = self.backend_headers_for("127.0.0.1")
        self.assertEqual(len(backend), 1)
        self.assertEqual(port, [backend[0].rsplit(b":", 1)[1]])
        self.assertEqual(self.backend_headers_for("10.1.2.3"), ([], []))

    def error_messages_for(self, peer: str, **options: object) -> list[bytes]:
        """The body of every error txlb makes itself about one backend, asked by ``peer``."""
        bodies = []
        failures = [
            neterror.ConnectionRefusedError(),
            ResponseNeverReceived([Failure(neterror.ConnectionLost("reset by peer"))]),
            RequestTransmissionFailed([Failure(neterror.ConnectionLost("reset"))]),
            neterror.TimeoutError(),
            ValueError("unparseable"),
        ]
        for error in failures:
            self.build(BACKENDS, retries=0, **options)
            client = ClientConnection(self.site, peer=peer)
            client.request(b"GET", b"/x")
            self.upstream.last.fail(error)
            bodies.append(client.response().body)
        self.build(BACKENDS, retries=0, read_timeout=5, **options)
        client = ClientConnection(self.site, peer=peer)
        client.request(b"GET", b"/x")
        self.clock.advance(6)
        bodies.append(client.response().body)
        self.assertTrue(all(b'"code": 50' in body for body in bodies), bodies)
        return bodies

    def test_x_backend_off_hides_the_backend_in_error_messages_too(self) -> None:
        """
        An operator who turns X-Backend off does not want backend addresses shown; txlb's
        own 502/504 messages must not name the backend either.
        """
        for body in self.error_messages_for("127.0.0.1", x_backend="off"):
            self.assertNotIn(b"127.0.0.1:800", body)
            self.assertIn(b"the backend", body)

    def test_x_backend_loopback_names_the_backend_in_errors_only_to_local_clients(
            self) -> None:
        for body in self.error_messages_for("10.1.2.3", x_backend="loopback"):
            self.assertNotIn(b"127.0.0.1:800", body)
        for body in self.error_messages_for("127.0.0.1", x_backend="loopback"):
            self.assertIn(b"backend 127.0.0.1:800", body)

    def test_x_backend_on_names_the_backend_in_error_messages(self) -> None:
        for body in self.error_messages_for("10.1.2.3"):
            self.assertIn(b"backend 127.0.0.1:800", body)

    def test_exposure_values_checked(self) -> None:
        from txlb import ConfigError
        for option in ("lb_status", "x_backend"):
            with self.assertRaises(ConfigError):
                LoadBalancer(BACKENDS, reactor=self.clock, **{option: "maybe"})


class LeastConnectionsTests(ProxyTestCase):
    def test_burst_spread_evenly(self) -> None:
        """40 simultaneous streams over 8 backends: none above 5, all 8 used."""
        backends = [f"127.0.0.1:{port}" for port in range(9000, 9008)]
        self.build(backends)
        peak = {key: 0 for key in backends}
        clients = []
        for _ in range(40):
            client = self.client()
            client.request(b"POST", b"/v1/chat/completions", body=b'{"stream": true}')
            clients.append(client)
            for key, active in self.active().items():
                peak[key] = max(peak[key], active)
        self.assertLessEqual(max(peak.values()), 5)
        self.assertEqual(min(peak.values()), 5)
        # every way out releases: finish some, drop some
        for n, call in enumerate(self.upstream.calls):
            if n % 2:
                call.respond(FakeResponse(200)).end()
            else:
                clients[n].disconnect()
        self.assertEqual(set(self.active().values()), {0})

    def test_sequential_requests_rotate(self) -> None:
        """16 sequential requests over 4 idle backends land 4 on each."""
        backends = [f"127.0.0.1:{port}" for port in range(9000, 9004)]
        self.build(backends)
        for _ in range(16):
            self.client().request(b"GET", b"/")
            self.upstream.last.respond(FakeResponse(200, length=0)).end()
        counts = {b.key: b.counts.requests for b in self.lb.pool}
        self.assertEqual(counts, {key: 4 for key in backends})


class EdgeCaseTests(ProxyTestCase):
    """Request targets, synchronous agent failures, slow clients, HEAD."""

    def test_absolute_form_forwarded_in_origin_form(self) -> None:
        client = self.client()
        client.send(b"GET http://lb.example/v1/files?x=1 HTTP/1.1\r\nHost: lb.example\r\n\r\n")
        self.assertTrue(self.upstream.last.uri.endswith((b":8002/v1/files?x=1",
                                                         b":8003/v1/files?x=1")),
                        self.upstream.last.uri)

    def test_absolute_form_with_https_too(self) -> None:
        client = self.client()
        client.send(b"GET HTTPS://lb.example/v1/files?x=1 HTTP/1.1\r\nHost: lb.example\r\n\r\n")
        self.assertTrue(self.upstream.last.uri.endswith((b":8002/v1/files?x=1",
                                                         b":8003/v1/files?x=1")),
                        self.upstream.last.uri)

    def test_absolute_form_keeps_a_query_that_comes_before_any_path(self) -> None:
        """
        ``http://h?x=1`` is path ``/`` and query ``x=1``; the query was dropped, and in
        ``http://h?a=/b`` the ``/`` inside the query was taken for the start of the path.
        """
        for target, forwarded in [(b"http://lb.example?x=1", b"/?x=1"),
                                  (b"http://lb.example?a=/__lb_status", b"/?a=/__lb_status"),
                                  (b"HTTP://lb.example", b"/"),
                                  (b"http://lb.example/p?q=/r", b"/p?q=/r")]:
            calls = len(self.upstream.calls)
            client = self.client()
            client.send(b"GET " + target + b" HTTP/1.1\r\nHost: lb.example\r\n\r\n")
            self.assertEqual(len(self.upstream.calls), calls + 1, target)
            self.assertEqual(self.upstream.last.uri.split(b":80", 1)[1][2:], forwarded,
                             target)

    def test_target_that_is_not_a_path_is_400(self) -> None:
        client = self.client()
        client.send(b"GET v1/models HTTP/1.1\r\nHost: lb.example\r\n\r\n")
        self.assertEqual(client.response().status, 400)
        self.assertEqual(self.upstream.calls, [])

    def test_asterisk_answered_by_twisted_web_not_forwarded(self) -> None:
        client = self.client()
        client.send(b"OPTIONS * HTTP/1.1\r\nHost: lb.example\r\n\r\n")
        self.assertEqual(client.response().status, 200)
        self.assertEqual(self.upstream.calls, [])

    def test_agent_raising_synchronously_is_502(self) -> None:
        def explode(*args: object) -> None:
            raise ValueError("invalid method")

        self.upstream.request = explode  # type: ignore[assignment,method-assign]
        client = self.client()
        client.request(b"GET", b"/")
        self.assertEqual(client.response().status, 502)
        self.assertEqual(sum(self.active().values()), 0)

    def test_already_failed_request_is_502(self) -> None:
        from twisted.internet.defer import fail

        self.upstream.request = (  # type: ignore[method-assign]
            lambda *a, **k: fail(neterror.ConnectionRefusedError()))
        client = self.client()
        client.request(b"GET", b"/")
        self.assertEqual(client.response().status, 502)
        self.assertEqual(sum(self.active().values()), 0)

    def test_head_sent_before_the_first_byte_of_body(self) -> None:
        client = self.client()
        client.request(b"POST", b"/v1/chat/completions", body=b'{"stream": true}')
        self.upstream.last.respond(FakeResponse(200, [(b"Content-Type", b"text/event-stream")]))
        self.assertTrue(client.transport.value().startswith(b"HTTP/1.1 200 OK\r\n"))
        self.assertEqual(client.response().body, b"")

    def test_failure_before_first_body_byte_truncates(self) -> None:
        client = self.client()
        client.request(b"GET", b"/stream")
        response = self.upstream.last.respond(FakeResponse(200))
        response.end(Failure(ResponseFailed([Failure(neterror.ConnectionLost())])))
        result = client.response()
        self.assertEqual(result.status, 200)
        self.assertFalse(result.complete)
        self.assertTrue(client.transport.disconnected)

    def test_fixed_length_failure_before_its_body_is_a_502(self) -> None:
        client = self.client()
        client.request(b"GET", b"/thing")
        response = self.upstream.last.respond(
            FakeResponse(200, [(b"X-From-Backend", b"1")], length=100))
        self.assertEqual(client.transport.value(), b"")  # head waits for the body
        response.end(Failure(ResponseFailed([Failure(neterror.ConnectionLost())])))
        result = client.response()
        self.assertEqual(result.status, 502)
        self.assertEqual(json.loads(result.body)["error"]["code"], 502)
        self.assertEqual(result.header(b"x-from-backend"), [])
        self.assertEqual(sum(self.active().values()), 0)

    def test_content_length_no_client_could_hold_is_a_502(self) -> None:
        """
        A backend's Content-Length past 2**63-1 is a bad response: 502 before any of its
        head, as nginx answers, rather than its head passed on and the connection cut.
        """
        from ..helpers import keep_records

        records = keep_records(self.lb)
        client = self.client()
        client.request(b"GET", b"/thing")
        response = FakeResponse(200, [(b"X-From-Backend", b"1")], length=10**23)
        self.upstream.last.respond(response)
        # at once, not after a head waiting for the first body bytes
        self.assertTrue(client.transport.value().startswith(b"HTTP/1.1 502 "))
        result = client.response()
        # the failure table's bad-response row (its message; no retry, no blame)
        self.assertRegex(json.loads(result.body)["error"]["message"],
                         r"^bad response from backend 127\.0\.0\.1:800[23]$")
        self.assertEqual(result.header(b"x-from-backend"), [])
        self.assertNotIn(b"99999", client.transport.value())
        self.assertTrue(result.complete)
        (record,) = records
        self.assertEqual((record.status, record.outcome), (502, "upstream_error"))
        self.assertEqual(sum(self.active().values()), 0)

    def test_fixed_length_silence_before_its_body_is_a_504(self) -> None:
        self.build(BACKENDS, read_timeout=5)
        client = self.client()
        client.request(b"GET", b"/thing")
        response = self.upstream.last.respond(FakeResponse(200, length=100))
        self.clock.advance(5)
        self.assertEqual(client.response().status, 504)
        self.assertTrue(response.transport.stopped)  # the backend connection is closed
        self.assertEqual(sum(self.active().values()), 0)

    def test_slow_client_does_not_trip_the_read_timeout(self) -> None:
        """While the client is the one not reading, the backend's silence is not its fault."""
        self.build(BACKENDS, read_timeout=10, send_timeout=60)
        client = self.client()
        client.request(b"GET", b"/stream")
        response = self.upstream.last.respond(FakeResponse(200))
        response.send(b"a")
        client.transport.producer.pauseProducing()
        self.clock.advance(50)
        self.assertFalse(client.transport.disconnected)
        self.assertFalse(response.transport.stopped)
        client.transport.producer.resumeProducing()
        self.assertFalse(response.transport.paused)
        self.clock.advance(10)  # now the backend really is silent
        self.assertTrue(client.transport.disconnected)
        self.assertTrue(response.transport.stopped)

    def test_client_that_stops_reading_is_cut_after_send_timeout(self) -> None:
        """A stalled client cannot pin a GPU slot: cut after --send-timeout."""
        self.build(BACKENDS, read_timeout=300, send_timeout=30)
        client = self.client()
        client.request(b"GET", b"/stream")
        response = self.upstream.last.respond(FakeResponse(200))
        response.send(b"a")
        client.transport.producer.pauseProducing()
        self.clock.advance(29)
        self.assertFalse(client.transport.disconnected)
        self.clock.advance(1)
        self.assertTrue(client.transport.disconnected)
        self.assertTrue(response.transport.stopped)  # vLLM aborts the generation
        self.assertEqual(sum(self.active().values()), 0)

    def test_head_keeps_content_length(self) -> None:
        client = self.client()
        client.request(b"HEAD", b"/file")
        self.upstream.last.respond(
            FakeResponse(200, [(b"Content-Length", b"1234")], length=0)).end()
        raw = client.transport.value()
        self.assertIn(b"Content-Length: 1234\r\n", raw)
        self.assertTrue(raw.endswith(b"\r\n\r\n"))

    def test_204_loses_its_framing_headers(self) -> None:
        """RFC 9110 section 8.6: a 204 must not carry Content-Length; a 304 may."""
        for length in (b"0", b"17"):
            client = self.client()
            client.request(b"DELETE", b"/v1/files/f-1")
            self.upstream.last.respond(FakeResponse(
                204, [(b"Content-Length", length), (b"X-Request-Id", b"r1")], length=0)).end()
            raw = client.transport.value()
            self.assertTrue(raw.startswith(b"HTTP/1.1 204 "), raw)
            head = raw.split(b"\r\n\r\n", 1)[0].lower()
            self.assertNotIn(b"content-length", head)
            self.assertNotIn(b"transfer-encoding", head)
            self.assertIn(b"x-request-id: r1", head)
            self.assertTrue(raw.endswith(b"\r\n\r\n"))
        client = self.client()
        client.request(b"GET", b"/file")
        self.upstream.last.respond(
            FakeResponse(304, [(b"Content-Length", b"1234")], length=0)).end()
        self.assertIn(b"Content-Length: 1234\r\n", client.transport.value())

    def test_reset_triggers_an_immediate_probe(self) -> None:
        probes = FakeUpstream()
        self.lb = LoadBalancer(BACKENDS, reactor=self.clock, agent=self.upstream,
                               probe_agent=probes)
        self.site = Site(self.lb.resource(), reactor=self.clock)
        client = self.client()
        client.request(b"GET", b"/")
        key = self.upstream.last.uri.split(b"/")[2]
        self.upstream.last.fail(ResponseNeverReceived([Failure(neterror.ConnectionLost())]))
        self.assertEqual([c.uri for c in probes.calls], [b"http://" + key + b"/health"])
        probes.last.respond(FakeResponse(200, length=0)).end()
        self.assertTrue(all(b.health.healthy for b in self.lb.pool))  # a stale pooled connection

    def test_unknown_option_refused(self) -> None:
        self.assertRaises(TypeError, LoadBalancer, BACKENDS, reactor=self.clock,
                          helth_interval=2)


class LocalClientTests(SynchronousTestCase):
    """Which peers ``--lb-status loopback`` and ``--x-backend loopback`` count as local."""

    def local(self, address: object) -> bool:
        from txlb._proxy.incoming import is_local_client

        class _Request:
            def getClientAddress(self) -> object:
                return address

        return is_local_client(_Request())  # type: ignore[arg-type]

    def test_addresses(self) -> None:
        from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress

        self.assertTrue(self.local(IPv4Address("TCP", "127.0.0.1", 1)))
        self.assertTrue(self.local(IPv4Address("TCP", "127.200.0.9", 1)))
        self.assertTrue(self.local(IPv6Address("TCP", "::1", 1)))
        self.assertTrue(self.local(IPv6Address("TCP", "::ffff:127.0.0.1", 1)))
        self.assertTrue(self.local(UNIXAddress(b"/run/llmlb.sock")))
        self.assertFalse(self.local(IPv4Address("TCP", "10.0.0.1", 1)))
        self.assertFalse(self.local(IPv6Address("TCP", "::ffff:10.0.0.1", 1)))
        self.assertFalse(self.local(IPv6Address("TCP", "fe80::1", 1)))
        self.assertFalse(self.local(IPv4Address("TCP", "localhost", 1)))  # not an address


class CutAnswerTests(SynchronousTestCase):
    """
    ``cut_answer``, the ending of a failure after the head was sent: the client connection
    is aborted (a truncated response, never a clean one) -- and a client already gone is
    left as it is instead of raising in the middle of the exchange's way out (which would
    skip the outcome, the record's end and the bookkeeping after it).
    """

    def held(self) -> tuple[ClientConnection, Request]:
        """A client whose request the site holds open, and that request."""
        requests: list[Request] = []

        class Hold(Resource):
            isLeaf = True

            def render(self, request: Request) -> object:
                requests.append(request)
                return NOT_DONE_YET

        client = ClientConnection(Site(Hold(), reactor=Clock()))
        client.request(b"GET", b"/v1/completions")
        return client, requests[0]

    def test_a_cut_answer_aborts_the_client_connection_without_the_last_chunk(self) -> None:
        client, request = self.held()
        request.write(b"data: 1\n\n")
        cut_answer(request)
        self.assertTrue(client.transport.disconnected)  # aborted, not closed cleanly
        self.assertFalse(client.response().complete)

    def test_cutting_the_answer_of_a_client_already_gone_does_nothing(self) -> None:
        client, request = self.held()
        request.write(b"data: 1\n\n")
        client.disconnect()  # the request no longer has a channel
        cut_answer(request)  # must not raise
        self.assertFalse(client.transport.disconnected)
