"""
The hung-backend detector (txlb._cluster.hung), in memory on a Clock: a backend whose every request
stops getting bytes is out within 3 s at the default settings; a slow one is not.
"""

from __future__ import annotations

import random
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from txlb import LoadBalancer
from txlb._cluster.backend import Backend

from ..helpers import ClientConnection, FakeResponse, FakeUpstream

THREE = ["127.0.0.1:8002", "127.0.0.1:8003", "127.0.0.1:8004"]
STEP = 0.05


class HungTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.probes = FakeUpstream()
        self.lb = LoadBalancer(THREE, reactor=self.clock, agent=self.upstream,
                               probe_agent=self.probes, rng=random.Random(3),
                               log_file="none", retries=0)
        self.lb.hung.startService()
        self.addCleanup(self.lb.hung.stopService)
        self.site = self.lb.site()
        self.reasons: list[str] = []
        self.lb.pool.on_down.append(lambda backend, reason: self.reasons.append(reason))
        #: the body of each stream the test drives, by the backend it went to
        self.streams: dict[str, list[FakeResponse]] = {key: [] for key in THREE}
        self.waiting: dict[str, list[Any]] = {key: [] for key in THREE}

    def backend(self, key: str) -> Backend:
        backend = self.lb.pool.get(key)
        assert backend is not None
        return backend

    def post(self) -> tuple[ClientConnection, str]:
        client = ClientConnection(self.site)
        client.request(b"POST", b"/v1/chat/completions",
                       body=b'{"model": "m", "stream": true}')
        call = self.upstream.last
        key = call.uri.split(b"/")[2].decode()
        return client, key

    def open_streams(self, count: int) -> None:
        """``count`` streaming requests, spread over the backends, each with its head."""
        for _ in range(count):
            _, key = self.post()
            self.streams[key].append(self.upstream.last.respond(FakeResponse(
                200, [(b"Content-Type", b"text/event-stream")])))

    def open_waiting(self, key: str) -> None:
        """A request that ``key`` has and has not answered yet (a long prefill)."""
        while True:
            _, got = self.post()
            if got == key:
                self.waiting[key].append(self.upstream.last)
                return
            self.streams[got].append(self.upstream.last.respond(FakeResponse(
                200, [(b"Content-Type", b"text/event-stream")])))

    def flow(self, seconds: float, flowing: set[str], answer_probes: int | None = None,
            ) -> float | None:
        """
        Let ``seconds`` pass in small steps, the streams of ``flowing`` backends sending a
        token at each; answer each hung-detector probe with ``answer_probes`` (None: never).
        Returns when the first backend went down (or None).
        """
        elapsed = 0.0
        down_at = None
        answered = 0
        while elapsed < seconds:
            for key in flowing:
                for stream in self.streams[key]:
                    stream.send(b'data: {"x": 1}\n\n')
            self.clock.advance(STEP)
            elapsed += STEP
            if answer_probes is not None:
                for call in self.probes.calls[answered:]:
                    if not call.deferred.called:
                        call.respond(FakeResponse(answer_probes, length=0)).end()
                answered = len(self.probes.calls)
            if down_at is None and not all(b.healthy for b in self.lb.pool):
                down_at = elapsed
        return down_at

    def probed(self, key: str) -> int:
        return sum(1 for call in self.probes.calls if call.uri.split(b"/")[2].decode() == key)


class HungTests(HungTestCase):
    def test_a_stopped_backend_is_out_within_3s(self) -> None:
        """Every request on it stalls, the others flow: probed, no answer, marked down."""
        self.open_streams(6)
        hung = THREE[0]
        self.assertEqual(len(self.streams[hung]), 2)
        self.flow(1, flowing=set(THREE))
        down_at = self.flow(5, flowing=set(THREE[1:]))
        assert down_at is not None
        self.assertLess(down_at, 3.0)
        backend = self.backend(hung)
        self.assertFalse(backend.healthy)
        self.assertEqual(backend.hung_ejections, 1)
        self.assertIn("hung: no byte from any of 2 requests for", " ".join(self.reasons))
        self.assertEqual(self.probed(hung), 1)
        self.assertTrue(all(self.backend(key).healthy for key in THREE[1:]))
        # new requests go elsewhere; those it has are left to finish or time out
        for _ in range(4):
            self.assertNotEqual(self.post()[1], hung)
        self.assertFalse(any(call.cancelled for call in self.upstream.calls))
        metrics = self.lb.metrics.registry.get_sample_value(
            "txlb_backend_hung_ejections_total", {"backend": hung})
        self.assertEqual(metrics, 1)

    def test_a_confirming_probe_that_stalls_is_closed(self) -> None:
        """
        A stopped engine's kernel may still take the probe and a half-sent head may come
        back: the 1 s timeout cancels the body read, which must close that connection, not
        leave one open per confirmation.
        """
        self.open_streams(6)
        hung = THREE[0]
        self.flow(1, flowing=set(THREE))
        stalled = []
        while not stalled:
            self.flow(STEP, flowing=set(THREE[1:]))
            for call in self.probes.calls:
                if not call.deferred.called:
                    stalled.append(call.respond(FakeResponse(200)))  # a head, no body end
        self.flow(2, flowing=set(THREE[1:]))
        self.assertFalse(self.backend(hung).healthy)
        self.assertIn("/health did not answer in 1s", " ".join(self.reasons))
        self.assertTrue(stalled[0].transport.stopped)

    def test_a_hung_backend_with_requests_waiting_for_their_head(self) -> None:
        """Requests sent to it that never get a head count as much as stalled streams."""
        self.open_streams(2)  # one stream each on two backends
        hung = next(key for key in THREE if not self.streams[key])
        self.open_waiting(hung)
        down_at = self.flow(5, flowing=set(THREE))
        assert down_at is not None
        self.assertLess(down_at, 3.0)
        self.assertFalse(self.backend(hung).healthy)

    def test_slow_prefill_while_its_other_streams_flow(self) -> None:
        """A long prefill stalls one request; its other streams flow: never suspected."""
        self.open_streams(3)
        slow = THREE[0]
        self.open_waiting(slow)
        self.assertIsNone(self.flow(30, flowing=set(THREE)))
        self.assertEqual(self.probed(slow), 0)

    def test_silent_but_health_answers(self) -> None:
        """
        Every stream of it silent (a prefill stalling the batch), /health answers: slow,
        not hung; probed again only after another stall of silence.
        """
        self.open_streams(3)
        slow = THREE[0]
        self.assertIsNone(self.flow(10, flowing=set(THREE[1:]), answer_probes=200))
        self.assertTrue(self.backend(slow).healthy)
        self.assertGreaterEqual(self.probed(slow), 3)
        self.assertLessEqual(self.probed(slow), 10 / 1.25)

    def test_health_answering_503_confirms(self) -> None:
        self.open_streams(3)
        self.assertIsNotNone(self.flow(5, flowing=set(THREE[1:]), answer_probes=503))
        self.assertIn("/health answered 503", " ".join(self.reasons))

    def test_a_byte_during_the_probe_clears_it(self) -> None:
        self.open_streams(3)
        slow = THREE[0]
        self.flow(1.6, flowing=set(THREE[1:]))
        self.assertEqual(self.probed(slow), 1)
        self.streams[slow][0].send(b"data: {}\n\n")  # it was only slow
        self.assertIsNone(self.flow(0.9, flowing=set(THREE)))
        self.assertTrue(self.backend(slow).healthy)

    def test_all_silent_at_once_is_not_one_backends_fault(self) -> None:
        self.open_streams(3)
        self.assertIsNone(self.flow(10, flowing=set()))
        self.assertEqual(len(self.probes.calls), 0)

    def test_its_own_slow_first_bytes_raise_the_bar(self) -> None:
        """A backend whose first bytes take 2 s on average is quiet only after 8 s."""
        self.open_streams(2)
        slow = next(key for key in THREE if not self.streams[key])
        self.backend(slow).record_result(200, 2.0, ttft=2.0)
        self.open_waiting(slow)
        self.assertIsNone(self.flow(7.5, flowing=set(THREE)))
        self.assertEqual(self.probed(slow), 0)
        self.assertIsNotNone(self.flow(2.0, flowing=set(THREE)))

    def test_a_stall_of_txlb_itself_says_nothing(self) -> None:
        """After the reactor was held up itself, the unread sockets are not silence."""
        self.open_streams(3)
        self.clock.advance(5)  # one late tick: everything looks silent
        self.assertEqual(len(self.probes.calls), 0)

    def test_never_more_than_half_the_fleet(self) -> None:
        self.open_streams(3)
        self.lb.pool.mark_down(self.backend(THREE[1]), "health")
        self.flow(5, flowing={THREE[2]})
        self.assertTrue(self.backend(THREE[0]).healthy)
        self.assertEqual(self.probed(THREE[0]), 2)  # suspected twice in 5 s; it stays in

    def test_a_client_reading_slowly_is_not_backend_silence(self) -> None:
        """While txlb holds a stream back for its slow client, the backend may be quiet."""
        self.open_streams(3)
        slow = THREE[0]
        exchange = next(e for e in self.lb.proxy.live if e.backend.key == slow)
        exchange.pauseProducing()
        self.assertIsNone(self.flow(5, flowing=set(THREE[1:])))
        self.assertEqual(self.probed(slow), 0)

    def test_off(self) -> None:
        lb = LoadBalancer(THREE, reactor=self.clock, agent=self.upstream,
                          probe_agent=self.probes, log_file="none", hung_after=0)
        self.assertNotIn(lb.hung, list(lb.service()))  # type: ignore[call-overload]


class ProbeTimeoutWhileFlowingTests(HungTestCase):
    """The active prober: a /health timeout while the backend's streams flow is busy-ness."""

    def test_health_timing_out_while_streams_flow(self) -> None:
        self.lb.health.startService()
        self.addCleanup(self.lb.health.stopService)
        self.open_streams(3)
        busy = THREE[0]
        for call in self.probes.calls:  # the first round, at start: all fine
            call.respond(FakeResponse(200, length=0)).end()
        answered = len(self.probes.calls)
        elapsed = 0.0
        while elapsed < 60:  # /health of `busy` never answers again; its streams flow
            for key in THREE:
                for stream in self.streams[key]:
                    stream.send(b"data: {}\n\n")
            for call in self.probes.calls[answered:]:
                if call.uri.split(b"/")[2].decode() != busy and not call.deferred.called:
                    call.respond(FakeResponse(200, length=0)).end()
            answered = len(self.probes.calls)
            self.clock.advance(0.1)
            elapsed += 0.1
        self.assertTrue(self.backend(busy).healthy)
        self.assertGreaterEqual(self.probed(busy), 5)
        self.assertEqual(self.backend(busy).failures_in_a_row, 0)

    def test_health_timing_out_while_silent_still_counts(self) -> None:
        self.lb.health.startService()
        self.addCleanup(self.lb.health.stopService)
        self.lb.hung.stopService()
        for _ in range(8):
            self.clock.advance(5)
        self.assertFalse(any(b.healthy for b in self.lb.pool))


class TimedOutTests(SynchronousTestCase):
    """A probe's timeout, however Twisted's Agent words it."""

    def test_kinds(self) -> None:
        from twisted.internet.defer import CancelledError, TimeoutError
        from twisted.internet.error import ConnectionRefusedError
        from twisted.python.failure import Failure
        from twisted.web.client import ResponseFailed, ResponseNeverReceived

        from txlb._cluster.hung import timed_out

        cancelled = Failure(CancelledError())
        self.assertTrue(timed_out(Failure(TimeoutError())))
        self.assertTrue(timed_out(Failure(ResponseNeverReceived([cancelled]))))
        self.assertTrue(timed_out(Failure(ResponseFailed([cancelled]))))
        self.assertFalse(timed_out(Failure(ConnectionRefusedError())))
        self.assertFalse(timed_out(Failure(ResponseNeverReceived(
            [Failure(ConnectionRefusedError())]))))


class RobustnessTests(HungTestCase):
    def test_a_failing_look_does_not_stop_the_looks(self) -> None:
        calls = []

        def broken() -> None:
            calls.append(1)
            raise RuntimeError("boom")

        self.lb.hung.check = broken  # type: ignore[method-assign]
        self.clock.advance(0.25)
        self.clock.advance(0.25)
        self.assertEqual(len(calls), 2)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)
