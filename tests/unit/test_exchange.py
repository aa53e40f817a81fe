"""
The per-request exchange (:mod:`txlb._proxy.exchange`): the read watchdog after data came or
a paused client resumed, the send timeout of a paused client, a stream the transport stops,
the retry window (at its edge, and on a clock far from 0), the failover's count of tries and
its refusal, the client key a 5xx is held against, the result log's first byte and chunked
framing, the warnings of a failed try, the body of a request sent on, a capacity listener
that fails, and an internal error before the head.

Most were written for the survivors of ``_proxy/exchange``'s full mutation run
(bench/results/mutation.md): behaviour the rest of the suite ran but never checked.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import error as neterror
from twisted.internet.defer import Deferred
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure
from twisted.web.client import ResponseNeverReceived

from txlb._proxy.exchange import Exchange
from txlb._records.summary import summarize
from txlb._scheduling.router import RoutingError

from ..helpers import FakeResponse, ObserverTap
from .test_failover import THREE, FailoverTestCase
from .test_proxy import ProxyTestCase
from .test_proxy_wire import FailoverWireMixin


class ExchangeTestCase(FailoverTestCase):
    def stream(self, n: int = 0) -> FakeResponse:
        return self.upstream.calls[n].respond(FakeResponse(200, [
            (b"Content-Type", b"text/event-stream")]))

    def events(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        return events

    def exchange(self) -> Exchange:
        (exchange,) = self.lb.proxy.live
        return exchange

    def exchange_timers(self) -> list[Any]:
        """The delayed calls pending that would wake an exchange."""
        return [call for call in self.clock.getDelayedCalls()
                if isinstance(getattr(call.func, "__self__", None), Exchange)]


class ReadWatchdogTests(ExchangeTestCase):
    def test_data_since_the_watchdog_was_set_delays_the_timeout_by_what_came(self) -> None:
        """A chunk at t=3 with a 5 s read timeout: the stream is cut at t=8, no later."""
        self.build(THREE[:1], read_timeout=5)
        client = self.post()
        response = self.stream()
        self.clock.advance(3)
        response.send(b"data: 1\n\n")
        self.clock.advance(4.5)  # t=7.5: the watchdog fired at 5 and sleeps until 8
        self.assertFalse(client.transport.disconnected)
        self.clock.advance(0.5)  # t=8
        self.assertTrue(client.transport.disconnected)
        self.assertEqual(self.records[-1].outcome, "timeout")
        self.assertEqual(self.records[-1].ended, 8)

    def test_a_client_that_resumed_leaves_the_read_timeout_as_it_was(self) -> None:
        """
        The client paused at t=1 (a 60 s send timeout) and read again at t=2: the backend's
        5 s of silence still count from t=2, the watchdog is not pushed to the client's
        deadline.
        """
        self.build(THREE[:1], read_timeout=5, send_timeout=60)
        client = self.post()
        self.stream()
        self.clock.advance(1)
        client.transport.producer.pauseProducing()
        self.clock.advance(1)
        client.transport.producer.resumeProducing()
        self.clock.advance(4.5)  # t=6.5
        self.assertFalse(client.transport.disconnected)
        self.clock.advance(0.5)  # t=7
        self.assertTrue(client.transport.disconnected)
        self.assertEqual(self.records[-1].outcome, "timeout")
        self.assertEqual(self.records[-1].ended, 7)

    def test_resuming_restarts_the_read_timeout(self) -> None:
        """
        The backend's silence while the client was paused was txlb's doing: on resume the
        read timeout counts again from then, and the hung detector sees it so.
        """
        self.build(THREE[:1], read_timeout=5, send_timeout=60)
        client = self.post()
        response = self.stream()
        response.send(b"data: 1\n\n")
        self.clock.advance(1)
        client.transport.producer.pauseProducing()
        self.assertIsNone(self.exchange().backend_waited_since)
        self.clock.advance(3)
        client.transport.producer.resumeProducing()  # t=4
        self.assertEqual(self.exchange().backend_waited_since, 4)
        self.clock.advance(4.5)  # t=8.5: 5 s after the last chunk, only 4.5 s since resume
        self.assertFalse(client.transport.disconnected)
        self.clock.advance(0.5)
        self.assertTrue(client.transport.disconnected)
        self.assertEqual(self.records[-1].ended, 9)

    def test_one_timer_per_exchange_whatever_the_client_does(self) -> None:
        """Pausing and resuming never leaves a second timer behind, nor one once ended."""
        self.build(THREE[:1], read_timeout=5, send_timeout=60)
        client = self.post()
        response = self.stream()
        for _ in range(3):
            client.transport.producer.pauseProducing()
            self.assertEqual(len(self.exchange_timers()), 1)
            self.clock.advance(1)
            client.transport.producer.resumeProducing()
            self.assertEqual(len(self.exchange_timers()), 1)
            response.send(b"data: 1\n\n")
        self.clock.advance(4)  # the read watchdog fires and sleeps again
        self.assertEqual(len(self.exchange_timers()), 1)
        response.end()
        self.assertEqual(self.exchange_timers(), [])
        self.assertTrue(client.response().complete)


class RetryTests(ExchangeTestCase):
    def test_the_retry_window_on_a_clock_far_from_zero(self) -> None:
        self.build()
        self.clock.advance(1000)
        client = self.post()
        self.upstream.calls[0].fail(neterror.ConnectionRefusedError())
        self.assertEqual(len(self.upstream.calls), 2)
        self.answer(1, 200, b'{"ok": 1}')
        self.assertEqual(client.response().body, b'{"ok": 1}')
        self.assertEqual(self.records[-1].tries, 2)

    def test_no_try_when_every_backend_was_tried(self) -> None:
        """Both backends refused: a 502 naming the last, two tries, one retry counted."""
        self.build(THREE[:2])
        client = self.post()
        self.upstream.calls[0].fail(neterror.ConnectionRefusedError())
        self.upstream.calls[1].fail(neterror.ConnectionRefusedError())
        self.assertEqual(client.response().status, 502)
        record = self.records[-1]
        self.assertEqual((record.tries, record.backend, record.outcome),
                         (2, self.backend_of(1), "upstream_error"))
        self.assertEqual(
            self.lb.metrics.registry.get_sample_value("txlb_retries_total"), 1)

    def test_the_last_untried_backends_answer_goes_as_it_came(self) -> None:
        """
        Both backends answered 503 (neither is marked down for it): no third try is
        attempted, the second 503 goes to the client as it came.
        """
        self.build(THREE[:2])
        client = self.post()
        self.answer(0, 503, b'{"message": "first"}')
        self.answer(1, 503, b'{"message": "second"}')
        self.assertEqual(len(self.upstream.calls), 2)
        response = client.response()
        self.assertEqual((response.status, response.body), (503, b'{"message": "second"}'))
        record = self.records[-1]
        self.assertEqual((record.tries, record.backend), (2, self.backend_of(1)))
        self.assertEqual(
            self.lb.metrics.registry.get_sample_value("txlb_retries_total"), 1)

    def hold_the_retry(self) -> tuple[list[Deferred[Any]], Any]:
        """The router's next acquire (a retry's) waits until the test answers it."""
        router = self.lb.proxy.router
        real = router.acquire
        held: list[Deferred[Any]] = []
        asked: list[Any] = []

        def acquire(routing: Any, exclude: frozenset[str] = frozenset()) -> Deferred[Any]:
            held.append(Deferred())
            asked.append((routing, exclude))
            return held[-1]

        router.acquire = acquire

        def give() -> None:
            router.acquire = real
            real(*asked[-1]).chainDeferred(held[-1])

        return held, give

    def test_a_retry_waiting_for_a_slot_is_not_backend_silence(self) -> None:
        """
        While a retry waits for its slot (a --shared-state gate confirming it), neither the
        read timeout runs nor the hung detector counts the wait against a backend.
        """
        self.build(read_timeout=5)
        client = self.post()
        held, give = self.hold_the_retry()
        self.upstream.calls[0].fail(neterror.ConnectionRefusedError())
        self.assertEqual(len(held), 1)
        self.assertIsNone(self.exchange().backend_waited_since)
        self.assertEqual(self.exchange_timers(), [])
        self.clock.advance(20)
        self.assertEqual(client.transport.value(), b"")
        give()
        self.assertEqual(len(self.upstream.calls), 2)
        self.assertEqual(self.exchange().backend_waited_since, 20)
        self.answer(1, 200, b'{"ok": 1}')
        self.assertEqual(client.response().body, b'{"ok": 1}')
        self.assertEqual(self.records[-1].tries, 2)

    def test_a_retry_refused_answers_with_the_routers_refusal(self) -> None:
        self.build()
        client = self.post()
        held, _ = self.hold_the_retry()
        self.upstream.calls[0].fail(neterror.ConnectionRefusedError())
        held[0].errback(RoutingError(503, "no backend is available for this request", 7))
        response = client.response()
        self.assertEqual(response.status, 503)
        self.assertIn(b"no backend is available for this request", response.body)
        self.assertEqual(response.header(b"retry-after"), [b"7"])
        self.assertEqual(self.records[-1].outcome, "upstream_error")
        self.assertEqual(self.lb.pool.slots.in_flight, 0)

    def test_a_client_leaving_while_its_retry_waits(self) -> None:
        """The wait is cancelled; nothing is logged as an error, nothing answered."""
        self.build()
        client = self.post()
        held, _ = self.hold_the_retry()
        self.upstream.calls[0].fail(neterror.ConnectionRefusedError())
        client.disconnect()
        self.assertTrue(held[0].called)
        self.assertEqual(self.records[-1].outcome, "client_abort")
        self.assertEqual(self.flushLoggedErrors(), [])
        self.assertEqual(len(self.upstream.calls), 1)


class BlameTests(ExchangeTestCase):
    def setUp(self) -> None:
        self.build(THREE[:2], outlier_5xx=3, outlier_cooldown=10, retries=0)
        self.bad = self.lb.pool.get(THREE[0])
        assert self.bad is not None

    def answer_bad(self, status: int, peer: str) -> None:
        """One request to the bad backend (the other answers 200 when chosen), as ``peer``."""
        for _ in range(2):
            self.post(peer=peer)
            call = self.upstream.last
            if call.uri.split(b"/")[2].decode() == THREE[0]:
                call.respond(FakeResponse(status, length=0)).end()
                return
            call.respond(FakeResponse(200, length=0)).end()
        raise AssertionError("the bad backend was not chosen")

    def test_a_504_streak_from_two_clients_ejects(self) -> None:
        for n in range(3):
            self.answer_bad(504, f"10.1.2.{n % 2 + 3}")
        assert self.bad is not None
        self.assertFalse(self.bad.health.healthy)

    def test_the_5xx_is_held_against_the_key_taken_when_routed(self) -> None:
        """A reload changing --rate-key meanwhile does not change who sent it."""
        self.post(peer="10.1.2.3")
        call = self.upstream.last
        self.lb.proxy.context.client_key = lambda request: "header:changed"
        call.respond(FakeResponse(500, length=0)).end()
        backend = self.lb.pool.get(call.uri.split(b"/")[2].decode())
        assert backend is not None
        self.assertEqual(backend.verdicts.streak_clients, ("ip:10.1.2.3",))


class ResultLogTests(ExchangeTestCase):
    def test_first_byte_is_the_first_chunks_time(self) -> None:
        self.build(THREE[:1])
        client = self.post()
        response = self.stream()
        self.clock.advance(1)
        response.send(b"data: 1\n\n")
        self.clock.advance(1)
        response.send(b"data: 2\n\n")
        response.end()
        self.assertTrue(client.response().complete)
        self.assertEqual(self.records[-1].first_byte, 1)
        self.assertEqual(summarize(self.records[-1]).ttft, 1)


class ChunkedPassThroughTests(FailoverWireMixin, ExchangeTestCase):
    def test_a_chunked_body_passed_on_is_logged_decoded(self) -> None:
        self.build(THREE[:1])
        client = self.post()
        response = self.upstream.calls[0].respond(FakeResponse(
            500, [(b"Content-Type", b"text/plain")]))
        response.send(b"engine ")
        response.send(b"exploded")
        response.end()
        self.assertEqual(client.response().body, b"engine exploded")
        record = self.records[-1]
        self.assertTrue(record.chunked)
        self.assertEqual(summarize(record).err_body, "engine exploded")


class FailedTryWarningTests(ExchangeTestCase):
    def formats(self, events: list[dict[str, Any]]) -> list[str]:
        return [str(e.get("log_format")) for e in events
                if e.get("log_namespace") == "txlb._proxy.resource"]

    def test_a_refused_connection_is_neither_closed_unanswered_nor_a_bad_response(
            self) -> None:
        self.build(THREE[:1])
        events = self.events()
        client = self.post()
        self.upstream.calls[0].fail(neterror.ConnectionRefusedError())
        self.assertEqual(client.response().status, 502)
        formats = self.formats(events)
        self.assertFalse([f for f in formats if "closed the connection" in f], formats)
        self.assertFalse([f for f in formats if "failed: {error}" in f], formats)

    def test_a_connection_closed_unanswered_says_so(self) -> None:
        self.build(THREE[:1])
        events = self.events()
        client = self.post()
        self.upstream.calls[0].fail(ResponseNeverReceived(
            [Failure(neterror.ConnectionDone())]))
        self.assertEqual(client.response().status, 502)
        formats = self.formats(events)
        self.assertEqual(
            [f for f in formats if "closed the connection" in f],
            ["backend {backend} closed the connection after receiving the whole request, "
             "before answering; not retried"])
        self.assertFalse([f for f in formats if "failed: {error}" in f], formats)

    def test_a_bad_response_says_what_failed(self) -> None:
        self.build(THREE[:1])
        events = self.events()
        self.post()
        self.upstream.calls[0].fail(ValueError("garbage status line"))
        formats = self.formats(events)
        self.assertIn("request to {backend} failed: {error}", formats)
        self.assertFalse([f for f in formats if "closed the connection" in f], formats)


class RequestBodyTests(ExchangeTestCase):
    def test_a_chunked_request_body_is_sent_on(self) -> None:
        self.build(THREE[:1])
        client = self.client()
        client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                    b"f\r\n{\"prompt\": \"x\"}\r\n0\r\n\r\n")
        self.assertEqual(self.upstream.calls[0].body, b'{"prompt": "x"}')

    def test_an_empty_body_with_a_length_is_sent_as_empty(self) -> None:
        self.build(THREE[:1])
        self.post(b"")
        self.assertEqual(self.upstream.calls[0].body, b"")

    def test_no_body_is_sent_as_none(self) -> None:
        self.build(THREE[:1])
        client = self.client()
        client.request(b"GET", b"/v1/models/x")
        self.assertIsNone(self.upstream.calls[0].body)


class CapacityListenerTests(ExchangeTestCase):
    def test_a_failing_listener_does_not_stop_the_ending(self) -> None:
        self.build(THREE[:1])
        client = self.post()
        lease = self.exchange().lease
        real = lease._on_release

        def broken(backend: Any) -> None:
            real(backend)
            raise RuntimeError("listener broke")

        lease._on_release = broken  # the pool's listener, failing
        self.answer(0, 200, b'{"ok": 1}')
        self.assertEqual(client.response().body, b'{"ok": 1}')
        self.assertEqual(self.records[-1].outcome, "ok")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual(self.lb.proxy.live, set())
        self.assertEqual(self.lb.pool.slots.in_flight, 0)


class UnwritableHeadTests(ExchangeTestCase):
    def test_a_head_twisted_cannot_write_closes_the_backends_response(self) -> None:
        """
        An embedder's Agent answered with a head the client's Request cannot write (its
        phrase is text, not bytes): nobody will read that response, so it is closed -- the
        backend stops generating -- and the client's connection is cut.
        """
        self.build(THREE[:1])
        client = self.post()
        response = self.upstream.calls[0].respond(FakeResponse(200, phrase="OK"))  # type: ignore[arg-type]
        self.assertTrue(response.transport.stopped)
        self.assertTrue(client.transport.disconnected)
        self.assertEqual(self.records[-1].outcome, "proxy_error")
        self.assertEqual(self.lb.pool.slots.in_flight, 0)
        self.assertEqual(len(self.flushLoggedErrors(TypeError)), 1)


class RelayToTheClientTests(ProxyTestCase):
    def test_send_timeout_counts_from_the_pause(self) -> None:
        """A paused client is cut ``send_timeout`` after it stopped reading, not sooner."""
        self.build(["127.0.0.1:8002"], read_timeout=5, send_timeout=60)
        client = self.client()
        client.request(b"GET", b"/stream")
        response = self.upstream.last.respond(FakeResponse(200))
        response.send(b"a")
        self.clock.advance(1)
        client.transport.producer.pauseProducing()  # at t=1
        self.clock.advance(59.5)  # t=60.5: read watchdog fired at 5, re-armed for the pause
        self.assertFalse(client.transport.disconnected)
        self.clock.advance(1)  # t=61.5: 60 s since the pause
        self.assertTrue(client.transport.disconnected)

    def test_the_transport_stopping_the_stream_stops_the_backend(self) -> None:
        client = self.client()
        client.request(b"GET", b"/stream")
        response = self.upstream.last.respond(FakeResponse(200))
        response.send(b"a")
        client.transport.producer.stopProducing()  # what a TCP transport does on loss
        self.assertTrue(response.transport.stopped)

    def test_internal_error_before_the_head_is_a_502(self) -> None:
        def explode(*_: object) -> None:
            raise RuntimeError("a bookkeeping bug")

        context = self.lb.proxy.context
        context.observer = ObserverTap(context.observer, answered=explode)
        client = self.client()
        client.request(b"GET", b"/v1/x")
        self.upstream.last.respond(FakeResponse(200, length=0)).end()
        answer = client.response()
        self.assertEqual(answer.status, 502)
        self.assertEqual(json.loads(answer.body)["error"]["message"], "internal proxy error")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_default_send_timeout_is_60s(self) -> None:
        self.assertEqual(self.lb.proxy.context.send_timeout, 60.0)


class RetryWindowBoundaryTests(FailoverTestCase):
    def test_no_new_try_once_the_window_has_passed_exactly(self) -> None:
        self.build(retry_window=2)
        client = self.post()
        self.clock.advance(2)
        self.upstream.calls[0].fail(neterror.ConnectionRefusedError())
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertEqual(client.response().status, 502)

    def test_a_try_just_inside_the_window(self) -> None:
        self.build(retry_window=2)
        self.post()
        self.clock.advance(1.9)
        self.upstream.calls[0].fail(neterror.ConnectionRefusedError())
        self.assertEqual(len(self.upstream.calls), 2)
