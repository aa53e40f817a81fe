"""The dashboard's history: one sample a second on the reactor's clock, bounded, merged."""

from __future__ import annotations

import os
import tracemalloc
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from txlb import BackendSpec
from txlb._admin.history import CAPACITY, History, HistoryService
from txlb._cluster.backend import Backend
from txlb._records.summary import Summary

from .test_admin import A, AdminTestCase, B


def summary(backend: str = A, status: int = 200, ttft: float | None = 0.2,
            outcome: str = "ok") -> Summary:
    return Summary(time=0.0, orid="-", backend=backend, method="POST",
                   path="/v1/chat/completions", status=status, kind="other", outcome=outcome,
                   dur=1.0, ttft=ttft)


class HistoryTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.pool = [Backend(BackendSpec("127.0.0.1", 8002)),
                     Backend(BackendSpec("127.0.0.1", 8003))]
        self.queue = 0
        self.history = History(self.clock, lambda: self.pool, lambda: self.queue)

    def tick(self) -> dict[str, Any]:
        self.clock.advance(1)
        return self.history.sample().as_json()

    def test_rates_percentiles_and_per_backend_counts(self) -> None:
        for index in range(100):
            self.history.observe(summary(ttft=0.01 * (index + 1)))  # 10 ms .. 1 s
        self.history.observe(summary(backend=B, status=502, ttft=None,
                                     outcome="upstream_error"))
        self.history.observe(summary(backend="-", status=503, ttft=None,
                                     outcome="proxy_error"))
        self.pool[0].counts.counted(3)
        self.queue = 2
        sample = self.tick()
        self.assertEqual(sample["rps"], 102.0)
        # within the histogram's 10% of the true 0.50 s and 0.99 s
        self.assertTrue(0.5 <= sample["ttfb_p50_s"] <= 0.55, sample)
        self.assertTrue(0.99 <= sample["ttfb_p99_s"] <= 1.09, sample)
        self.assertEqual((sample["in_flight"], sample["queued"]), (3, 2))
        self.assertEqual((sample["5xx"], sample["errors"]), (2, 1))
        a, b = sample["backends"][A], sample["backends"][B]
        self.assertEqual((a["in_flight"], a["rps"], a["5xx"], a["errors"]), (3, 100.0, 0, 0))
        self.assertAlmostEqual(a["ttfb_s"], 0.505, places=3)
        self.assertEqual((b["rps"], b["ttfb_s"], b["5xx"], b["errors"]), (1.0, None, 1, 1))

    def test_each_sample_counts_only_its_own_second(self) -> None:
        self.history.observe(summary())
        self.tick()
        quiet = self.tick()
        self.assertEqual((quiet["rps"], quiet["ttfb_p50_s"]), (0.0, None))
        self.assertEqual(quiet["backends"][A]["ttfb_s"], None)

    def test_unanswered_requests_give_no_ttfb(self) -> None:
        self.history.observe(summary(ttft=0.3), answered=False)
        self.assertIsNone(self.tick()["ttfb_p50_s"])

    def test_the_ring_is_bounded(self) -> None:
        for _ in range(CAPACITY + 50):
            self.history.observe(summary())
            self.tick()
        self.assertEqual(len(self.history.samples), CAPACITY)
        self.assertEqual(len(self.history.since(None)), CAPACITY)
        last = self.history.samples[-1].time
        self.assertEqual([s["t"] for s in self.history.since(last - 2)], [last - 1, last])

    def test_names_not_in_the_pool_are_forgotten(self) -> None:
        """A backend removed (or a name never in the pool) holds no memory after a sample."""
        for index in range(1000):
            self.history.observe(summary(backend=f"10.0.0.{index % 250}:{index}"))
        sample = self.tick()
        self.assertEqual(set(sample["backends"]), {A, B})
        self.assertEqual(set(self.history._tallies), set())

    def test_observe_allocates_nothing_once_a_backend_is_known(self) -> None:
        """Per request: counters only.  A thousand requests take no memory that stays."""
        done = summary()
        self.history.observe(done)
        tracemalloc.start()
        self.addCleanup(tracemalloc.stop)
        before = tracemalloc.take_snapshot()
        for _ in range(1000):
            self.history.observe(done)
        after = tracemalloc.take_snapshot()
        grown = sum(stat.size_diff for stat in after.compare_to(before, "filename")
                    if stat.traceback[0].filename.endswith(os.path.join("_admin", "history.py")))
        self.assertLess(grown, 1024)

    def test_service_samples_every_second_on_the_injected_clock(self) -> None:
        service = HistoryService(self.history)
        service.startService()
        self.clock.advance(0.5)
        self.assertEqual(len(self.history.samples), 0)
        for _ in range(5):
            self.clock.advance(1)
        self.assertEqual(len(self.history.samples), 5)
        service.stopService()
        self.clock.advance(10)
        self.assertEqual(len(self.history.samples), 5)

    def test_a_failing_sample_does_not_stop_the_loop(self) -> None:
        service = HistoryService(self.history)
        service.startService()
        self.addCleanup(service.stopService)
        self.history.queued = lambda: 1 // 0
        self.clock.advance(1)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.history.queued = lambda: 0
        self.clock.advance(1)
        self.assertEqual(len(self.history.samples), 1)


class HistoryEndpointTests(AdminTestCase):
    """GET /status/history on the admin port, fed by the balancer's own bookkeeping."""

    def test_samples_from_the_balancer(self) -> None:
        service = self.lb.service()
        service.startService()
        self.addCleanup(service.stopService)
        self.lb.bookkeeper.finished(summary())
        self.clock.advance(1)
        self.lb.bookkeeper.finished(summary(backend=B, status=500))
        self.clock.advance(1)
        code, body = self.call("GET", "/status/history")
        self.assertEqual(code, 200)
        self.assertEqual((body["interval_s"], body["capacity"]), (1.0, CAPACITY))
        first, second = body["samples"]
        self.assertEqual(first["backends"][A]["rps"], 1.0)
        self.assertEqual(second["backends"][B]["5xx"], 1)
        code, newer = self.call("GET", f"/status/history?since={first['t']}")
        self.assertEqual([s["t"] for s in newer["samples"]], [second["t"]])

    def test_bad_since_is_a_json_400(self) -> None:
        for value in ("soon", "nan", "inf"):
            code, body = self.call("GET", f"/status/history?since={value}")
            self.assertEqual(code, 400, value)
            self.assertEqual(body["error"]["code"], 400)

    def test_status_shows_ejection_and_slow_start(self) -> None:
        backend = self.lb.pool.get(A)
        assert backend is not None
        backend.ejected(self.clock.seconds() + 12)
        code, body = self.call("GET", "/status")
        row = next(b for b in body["backends"] if b["backend"] == A)
        self.assertEqual((row["ejected_for_s"], row["slow_start_ramp"]), (12, 1.0))


class HistoryTokenTests(AdminTestCase):
    token = "s3cret-token"

    def test_history_needs_the_token(self) -> None:
        code, _ = self.call("GET", "/status/history")
        self.assertEqual(code, 401)
        code, _ = self.call("GET", "/status/history",
                            headers={"Authorization": "Bearer s3cret-token"})
        self.assertEqual(code, 200)
