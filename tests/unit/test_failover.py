"""Retries, passive outlier ejection, slow start, rate limits and client limits, in memory."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

from twisted.internet import error as neterror
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseFailed

from txlb import LoadBalancer, build_config
from txlb._cluster.local_store import TokenBuckets

from ..helpers import ClientConnection, FakeResponse, FakeUpstream, keep_records

THREE = ["127.0.0.1:8002", "127.0.0.1:8003", "127.0.0.1:8004"]


class FailoverTestCase(SynchronousTestCase):
    def build(self, backends: list[str] | None = THREE, **options: Any) -> None:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.probes = FakeUpstream()
        if options.get("config") is None:
            options.pop("config", None)
            options.setdefault("log_file", "none")
        self.lb = LoadBalancer(backends, reactor=self.clock, agent=self.upstream,
                               probe_agent=self.probes, rng=random.Random(11), **options)
        self.records: list[Any] = keep_records(self.lb)
        self.site = self.lb.site()

    def client(self, peer: str = "10.1.2.3") -> ClientConnection:
        return ClientConnection(self.site, peer=peer)

    def post(self, body: bytes = b'{"prompt": "x"}', **kwargs: Any) -> ClientConnection:
        client = self.client(**kwargs)
        client.request(b"POST", b"/v1/completions", body=body)
        return client

    def backend_of(self, n: int) -> str:
        return self.upstream.calls[n].uri.split(b"/")[2].decode()

    def answer(self, n: int, code: int, body: bytes = b"{}") -> None:
        response = self.upstream.calls[n].respond(
            FakeResponse(code, [(b"Content-Type", b"application/json")], length=len(body)))
        response.send(body)
        response.end()


class RetryTests(FailoverTestCase):
    def setUp(self) -> None:
        self.build()

    def test_refused_is_retried_elsewhere_with_the_same_body(self) -> None:
        client = self.post(b'{"prompt": "replay me"}')
        self.upstream.calls[0].fail(neterror.ConnectionRefusedError())
        self.assertEqual(len(self.upstream.calls), 2)
        self.assertNotEqual(self.backend_of(0), self.backend_of(1))
        self.assertEqual(self.upstream.calls[1].body, b'{"prompt": "replay me"}')
        self.answer(1, 200, b'{"ok": true}')
        response = client.response()
        self.assertEqual((response.status, response.body), (200, b'{"ok": true}'))
        self.assertEqual(response.header(b"x-backend"), [self.backend_of(1).encode()])
        self.assertEqual(self.records[-1].tries, 2)
        self.assertEqual(self.lb.metrics.registry.get_sample_value("txlb_retries_total"), 1)
        self.assertEqual(self.lb.pool.slots.in_flight, 0)

    def test_502_or_503_answer_is_discarded_and_retried(self) -> None:
        client = self.post()
        first = self.upstream.calls[0].respond(FakeResponse(503, length=10))
        self.assertTrue(first.transport.stopped)  # its body is not read, let alone relayed
        self.upstream.calls[1].respond(FakeResponse(502))
        self.answer(2, 200, b'{"third": 1}')
        self.assertEqual(len({self.backend_of(n) for n in range(3)}), 3)
        self.assertEqual(client.response().body, b'{"third": 1}')

    def test_when_every_try_fails_the_last_answer_goes_as_it_came(self) -> None:
        client = self.post()
        self.upstream.calls[0].respond(FakeResponse(503))
        self.upstream.calls[1].fail(neterror.ConnectionRefusedError())
        self.answer(2, 503, b'{"object": "error", "message": "overloaded"}')
        self.assertEqual(len(self.upstream.calls), 3)  # 1 + --retries 2
        response = client.response()
        self.assertEqual(response.status, 503)
        self.assertEqual(response.body, b'{"object": "error", "message": "overloaded"}')

    def test_only_untried_backends(self) -> None:
        self.build(THREE[:2])
        client = self.post()
        self.upstream.calls[0].fail(neterror.ConnectionRefusedError())
        self.upstream.calls[1].fail(neterror.ConnectionRefusedError())
        self.assertEqual(len(self.upstream.calls), 2)
        self.assertEqual(client.response().status, 502)

    def test_timeout_is_never_retried(self) -> None:
        self.build(read_timeout=5)
        client = self.post()
        self.clock.advance(5)
        self.assertEqual(client.response().status, 504)
        self.assertEqual(len(self.upstream.calls), 1)

    def test_no_new_try_after_the_window(self) -> None:
        self.build(retry_window=2)
        client = self.post()
        self.clock.advance(3)
        self.upstream.calls[0].respond(FakeResponse(503, length=0)).end()
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertEqual(client.response().status, 503)

    def test_nothing_retried_once_the_response_started(self) -> None:
        client = self.post()
        response = self.upstream.calls[0].respond(FakeResponse(200))
        response.send(b"partial")
        response.end(Failure(ResponseFailed([Failure(neterror.ConnectionLost())])))
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertFalse(client.response().complete)

    def test_no_retry_that_would_have_to_queue(self) -> None:
        """The only untried backend is full: the 503 at hand goes to the client as it came."""
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write('[[backends]]\nurl = "127.0.0.1:8002"\nmax_conns = 1\n'
                         '[[backends]]\nurl = "127.0.0.1:8003"\nmax_conns = 1\n')
        self.build(config=build_config({"config": path, "log-file": "none"}, {}),
                   backends=None)
        busy = self.post()  # takes one backend's only slot
        client = self.post()
        self.answer(1, 503, b'{"message": "overloaded"}')
        self.assertEqual(len(self.upstream.calls), 2)
        self.assertEqual(client.response().status, 503)
        self.assertEqual(client.response().body, b'{"message": "overloaded"}')
        self.assertEqual(busy.transport.value(), b"")

    def test_retry_window_counts_from_the_first_try(self) -> None:
        """Time spent queued for a slot does not use up the retry window."""
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write('retry-window = 5\n'
                         '[[backends]]\nurl = "127.0.0.1:8002"\nmax_conns = 1\n'
                         '[[backends]]\nurl = "127.0.0.1:8003"\nmax_conns = 1\n'
                         '[[backends]]\nurl = "127.0.0.1:8004"\nmax_conns = 1\n')
        self.build(config=build_config({"config": path, "log-file": "none"}, {}),
                   backends=None)
        for _ in range(3):
            self.post()
        client = self.post()  # queued
        self.clock.advance(12)
        self.answer(0, 200)  # a slot frees: the queued request goes out
        self.answer(1, 200)  # and another backend becomes free for its retry
        self.upstream.calls[3].fail(neterror.ConnectionRefusedError())
        self.assertEqual(len(self.upstream.calls), 5)  # retried, 12 s after arrival
        self.answer(4, 200, b'{"ok": 1}')
        self.assertEqual(client.response().body, b'{"ok": 1}')

    def test_client_leaving_during_a_retry(self) -> None:
        self.build(backends=THREE)
        client = self.post()
        self.upstream.calls[0].fail(neterror.ConnectionRefusedError())
        client.disconnect()
        self.assertTrue(self.upstream.calls[1].cancelled)
        self.assertEqual(self.lb.pool.slots.in_flight, 0)


class OutlierTests(FailoverTestCase):
    def setUp(self) -> None:
        self.build(THREE[:2], outlier_5xx=3, outlier_cooldown=10, retries=0)
        self.bad = self.lb.pool.get(THREE[0])
        assert self.bad is not None

    def five_hundred_from_bad(self, count: int, body: bytes = b'{"prompt": "x"}',
                              peers: int = 2) -> None:
        """``count`` 5xx answers from the bad backend, to ``peers`` clients in turn."""
        for n in range(count):
            peer = f"10.1.2.{n % peers + 3}"
            self.post(body, peer=peer)
            call = self.upstream.last
            if call.uri.split(b"/")[2].decode() == THREE[0]:
                call.respond(FakeResponse(500, length=0)).end()
            else:
                call.respond(FakeResponse(200, length=0)).end()
                self.post(body, peer=peer)
                self.upstream.last.respond(FakeResponse(500, length=0)).end()

    def test_consecutive_5xx_eject_for_a_growing_cooldown(self) -> None:
        self.five_hundred_from_bad(3)
        assert self.bad is not None
        self.assertFalse(self.bad.health.healthy)
        self.assertEqual(self.bad.health.ejected_until, 10)
        self.lb.pool.probe_succeeded(self.bad, rise=1)  # /health is fine, but cooling down
        self.assertFalse(self.bad.health.healthy)
        self.clock.advance(10)
        self.lb.pool.probe_succeeded(self.bad, rise=1)
        self.assertTrue(self.bad.health.healthy)
        self.five_hundred_from_bad(3)
        self.assertEqual(self.bad.health.ejected_until, 10 + 20)  # second ejection: twice as long
        self.assertEqual(self.bad.verdicts.outlier_ejections, 2)

    def test_a_good_answer_resets_the_count(self) -> None:
        assert self.bad is not None
        for n, status in enumerate((500, 500, 200, 500, 500)):
            self.lb.pool.record_answer(self.bad, status, f"ip:10.0.0.{n}")
        self.assertTrue(self.bad.health.healthy)

    def test_garbage_bodies_never_eject(self) -> None:
        """
        llama.cpp answers 500 to a body that is not JSON: many such requests, from many
        clients, leave the backend in rotation -- and do not hide a real streak either.
        """
        assert self.bad is not None
        self.five_hundred_from_bad(15, body=b"not json at all", peers=5)
        self.assertTrue(self.bad.health.healthy)
        self.assertEqual(self.bad.verdicts.errors_in_a_row, 0)
        self.five_hundred_from_bad(3, body=b"")  # a POST without a body: the same
        self.assertTrue(self.bad.health.healthy)
        self.five_hundred_from_bad(3, body=b"[1, 2]")  # JSON, but not an object
        self.assertTrue(self.bad.health.healthy)

    def test_json_only_python_accepts_never_ejects(self) -> None:
        """
        Python's parser takes ``NaN``, ``Infinity``, numbers past a double and lone
        surrogates; JSON (RFC 8259) and llama.cpp's parser do not: it answers 500
        ("parse error", "number overflow", "invalid string: surrogate"), the request's
        fault as much as a body that is no JSON at all.
        """
        assert self.bad is not None
        for body in (b'{"prompt": "x", "t": NaN}', b'{"prompt": "x", "t": -Infinity}',
                     b'{"prompt": "x", "t": 1e400}', b'{"prompt": "x", "t": 1' + b"0" * 400
                     + b'}', b'{"prompt": "\\ud800"}'):
            self.five_hundred_from_bad(6, body=body, peers=3)
            self.assertTrue(self.bad.health.healthy, body)
            self.assertEqual(self.bad.verdicts.errors_in_a_row, 0, body)

    def test_one_client_alone_never_ejects(self) -> None:
        """A streak of 5xx all caused by one client's requests is that client's doing."""
        assert self.bad is not None
        self.five_hundred_from_bad(15, peers=1)
        self.assertTrue(self.bad.health.healthy)
        self.five_hundred_from_bad(3, peers=2)  # a second client: now it is the backend
        self.assertFalse(self.bad.health.healthy)

    def test_the_client_key_follows_rate_key(self) -> None:
        """With ``--rate-key token`` two tokens from one address are two clients."""
        for rate_key, ejected in (("ip", False), ("token", True)):
            self.build(THREE[:2], outlier_5xx=2, retries=0, rate_key=rate_key)
            bad = self.lb.pool.get(THREE[0])
            assert bad is not None
            for n in range(12):
                client = self.client()
                client.request(b"POST", b"/v1/completions", body=b'{"prompt": "x"}',
                               headers=[(b"Authorization", b"Bearer t%d" % (n % 3))])
                call = self.upstream.last
                status = 500 if call.uri.split(b"/")[2].decode() == THREE[0] else 200
                call.respond(FakeResponse(status, length=0)).end()
            self.assertEqual(bad.health.healthy, not ejected, rate_key)

    def test_outliers_never_take_the_last_healthy_ones(self) -> None:
        """Backends down on health count too: ejection stops at half the fleet out."""
        self.build(THREE, outlier_5xx=3, retries=0)
        first, second, third = list(self.lb.pool)
        self.lb.pool.mark_down(first, "health")
        self.lb.pool.mark_down(second, "health")
        for n in range(5):
            self.lb.pool.record_answer(third, 500, f"ip:10.0.0.{n}")
        self.assertTrue(third.health.healthy)

    def test_never_more_than_half_the_fleet(self) -> None:
        good = self.lb.pool.get(THREE[1])
        assert self.bad is not None and good is not None
        for n in range(3):
            self.lb.pool.record_answer(self.bad, 503, f"ip:10.0.0.{n}")
        self.assertFalse(self.bad.health.healthy)
        for n in range(10):
            self.lb.pool.record_answer(good, 503, f"ip:10.0.0.{n}")
        self.assertTrue(good.health.healthy)  # 2 of 2 would be more than half


class SlowStartTests(FailoverTestCase):
    def test_share_ramps_linearly(self) -> None:
        self.build(THREE[:2], slow_start=100)
        cold = self.lb.pool.get(THREE[0])
        assert cold is not None
        self.lb.pool.mark_down(cold, "restart")
        self.lb.pool.mark_up(cold)

        def share() -> float:
            before = len(self.upstream.calls)
            for _ in range(2000):
                client = self.post()
                self.upstream.last.respond(FakeResponse(200, length=0)).end()
                # gone once answered: 6,000 idle connections would leave their timeouts
                # on the clock, and task.Clock sorts its calls on every callLater
                client.disconnect()
            picked = Counter(self.backend_of(n) for n in range(before, before + 2000))
            return picked[THREE[0]] / 2000

        # its weight ramps from 0 to 1 over 100 s, and its share follows its weight
        self.clock.advance(10)
        self.assertLess(abs(share() - 0.1 / 1.1), 0.01)
        self.clock.advance(40)
        self.assertLess(abs(share() - 0.5 / 1.5), 0.01)
        self.clock.advance(60)
        self.assertLess(abs(share() - 0.5), 0.01)


class RateLimitTests(FailoverTestCase):
    def test_bucket_per_client_then_429(self) -> None:
        self.build(rate_limit="1/s", rate_burst=3)
        for _ in range(3):
            self.assertEqual(self.post().transport.value(), b"")  # forwarded, pending
        refused = self.post().response()
        self.assertEqual(refused.status, 429)
        self.assertEqual(refused.header(b"retry-after"), [b"1"])
        self.assertEqual(json.loads(refused.body)["error"]["type"], "rate_limit_exceeded")
        self.assertEqual(len(self.upstream.calls), 3)
        self.assertEqual(self.post(peer="10.9.9.9").transport.value(), b"")  # another client
        self.clock.advance(1)
        self.assertEqual(self.post().transport.value(), b"")
        self.assertEqual(len(self.upstream.calls), 5)
        self.assertEqual(self.records[-1].status, 429)

    def test_token_key_never_keeps_the_token(self) -> None:
        self.build(rate_limit="1/m", rate_burst=1, rate_key="token")
        for token, expected in ((b"sk-a", b""), (b"sk-a", None), (b"sk-b", b"")):
            client = self.client()
            client.request(b"POST", b"/v1/completions",
                           headers=[(b"Authorization", b"Bearer " + token)], body=b"{}")
            if expected is None:
                self.assertEqual(client.response().status, 429)
            else:
                self.assertEqual(client.transport.value(), expected)
        limiter = self.lb.proxy.rate_limiter
        assert limiter is not None
        self.assertNotIn("sk-a", repr(limiter.buckets._buckets))

    def test_memory_stays_bounded_under_many_keys(self) -> None:
        clock = Clock()
        buckets = TokenBuckets(rate=10, burst=10, clock=clock, max_keys=50_000)
        for n in range(100_000):
            buckets.take(f"client-{n}")
        self.assertLessEqual(len(buckets), 50_000)
        clock.advance(2)  # every bucket is full again: the next request sweeps them
        buckets.take("one-more")
        self.assertEqual(len(buckets), 1)


class ClientLimitTests(FailoverTestCase):
    def test_content_length_over_max_body_is_413_at_once(self) -> None:
        self.build(max_body="1KiB")
        client = self.client()
        client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        raw = client.transport.value()
        self.assertTrue(raw.startswith(b"HTTP/1.1 413 "), raw)
        self.assertTrue(client.transport.disconnecting)
        client.send(b"x" * 5000)  # the rest, if it comes, is dropped
        self.assertEqual(self.upstream.calls, [])
        self.assertEqual(self.records[-1].status, 413)

    def test_refused_body_gets_no_100_continue_and_is_logged(self) -> None:
        self.build(max_body="1KiB")
        client = self.client()
        client.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Expect: 100-continue\r\nContent-Length: 5000\r\n\r\n")
        raw = client.transport.value()
        self.assertTrue(raw.startswith(b"HTTP/1.1 413 "), raw)
        self.assertNotIn(b"100 Continue", raw)
        record = self.records[-1]
        self.assertEqual((record.method, record.path, record.status),
                         (b"POST", b"/v1/chat/completions", 413))

    def test_chunked_body_crossing_max_body(self) -> None:
        self.build(max_body="1KiB")
        client = self.client()
        client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
        client.send(b"200\r\n" + b"a" * 512 + b"\r\n")
        self.assertEqual(client.transport.value(), b"")
        client.send(b"200\r\n" + b"b" * 512 + b"\r\n" + b"10\r\n" + b"c" * 16 + b"\r\n0\r\n\r\n")
        self.assertTrue(client.transport.value().startswith(b"HTTP/1.1 413 "))
        self.assertEqual(self.upstream.calls, [])

    def test_body_at_the_limit_passes(self) -> None:
        self.build(max_body="1KiB")
        self.post(b"x" * 1024)
        self.assertEqual(len(self.upstream.calls), 1)

    def test_slow_head_is_cut_off(self) -> None:
        self.build(header_timeout=10)
        client = self.client()
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 100:
            client.send(bytes([byte]))  # one byte a second: never idle, never done
            self.clock.advance(1)
            if client.transport.disconnecting:
                break
        self.assertTrue(client.transport.value().startswith(b"HTTP/1.1 408 "))
        self.assertTrue(client.transport.disconnecting)
        self.assertEqual(self.upstream.calls, [])

    def test_head_deadline_is_per_request(self) -> None:
        self.build(header_timeout=10)
        client = self.client()
        client.request(b"GET", b"/one")
        self.answer(0, 200)
        self.clock.advance(30)  # an idle keep-alive gap is not a slow head
        client.request(b"GET", b"/two")
        self.assertEqual(len(self.upstream.calls), 2)

    def test_oversized_header_block_refused(self) -> None:
        self.build()
        client = self.client()
        client.send(b"GET / HTTP/1.1\r\n" + b"X-Big: " + b"a" * 20000 + b"\r\n\r\n")
        self.assertTrue(client.transport.value().startswith(b"HTTP/1.1 431 "))
        many = self.client()
        many.send(b"GET / HTTP/1.1\r\n" + b"".join(
            b"X-H%d: %s\r\n" % (i, b"b" * 100) for i in range(200)) + b"\r\n")
        self.assertTrue(many.transport.value().startswith(b"HTTP/1.1 400 "))
        self.assertEqual(self.upstream.calls, [])
