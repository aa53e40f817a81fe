"""
One backend's state as the admin status, the metrics and the other processes read it: the
slow-start ramp, the probe and answer counters and averages, the 5xx and probe streaks, the
marks saved to the store and told to listeners, and the state a worker mirrors.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from txlb import BackendSpec, Pool
from txlb._cluster.backend import Backend
from txlb._cluster.backend_health import Health
from txlb._cluster.local_store import LocalStore
from txlb._cluster.slow_start import SlowStart
from txlb._cluster.store import Marks, OwnMarks

from .test_pool import RecordingSlots, SharedTotals


class RampMirrorAndProbeCountTests(SynchronousTestCase):
    def test_slow_start_never_takes_a_backend_to_zero(self) -> None:
        clock = Clock()
        backend = Backend(BackendSpec("127.0.0.1", 8002, weight=2),
                          health=Health(healthy=False), slow_start=SlowStart(clock, 10))
        clock.advance(100)
        backend.came_up(clock.seconds())
        self.assertEqual(backend.slow_start.ramp, 0.01)
        self.assertGreater(backend.effective_weight, 0)
        clock.advance(5)
        self.assertEqual(backend.slow_start.ramp, 0.5)
        clock.advance(50)
        self.assertEqual(backend.slow_start.ramp, 1.0)

    def test_a_worker_takes_the_supervisors_slots(self) -> None:
        supervisor = Pool((BackendSpec("127.0.0.1", 8002),), shared=RecordingSlots())  # type: ignore[arg-type]
        worker_slots = RecordingSlots()
        worker = Pool((), shared=worker_slots)  # type: ignore[arg-type]
        worker.mirror(supervisor.shared_state())
        self.assertEqual(worker_slots.assigned, [("127.0.0.1:8002", 7)])
        supervisor.drain(supervisor.get("127.0.0.1:8002"))
        supervisor.mark_down(supervisor.get("127.0.0.1:8002"), "test")
        worker.mirror(supervisor.shared_state())
        mirrored = worker.get("127.0.0.1:8002")
        self.assertEqual((mirrored.health.draining, mirrored.health.healthy), (True, False))
        states: list[Any] = supervisor.shared_state()
        states[0]["slot"] = None
        worker_slots.assigned.clear()
        worker.mirror(states)
        self.assertEqual(worker_slots.assigned, [])

    def test_probes_ok_counts_each_good_probe(self) -> None:
        pool = Pool((BackendSpec("127.0.0.1", 8002),))
        backend = pool.get("127.0.0.1:8002")
        for _ in range(3):
            pool.probe_succeeded(backend, rise=1)
        self.assertEqual(backend.health.probes_ok, 3)
        self.assertEqual(backend.detailed_status()["probes_ok"], 3)


class BackendCounterTests(SynchronousTestCase):
    """The per-backend counters and averages the admin status and metrics report."""

    def setUp(self) -> None:
        self.pool = Pool(tuple(BackendSpec("127.0.0.1", p) for p in (8002, 8003, 8004)))
        self.backend = self.pool.get("127.0.0.1:8002")

    def test_marked_down_is_told_once_per_change(self) -> None:
        """``on_down`` listeners (a --workers worker reports through one) hear each change."""
        heard: list[tuple[str, str]] = []
        self.pool.on_down.append(lambda backend, reason: heard.append((backend.key, reason)))
        self.pool.mark_down(self.backend, "proxy: connection refused")
        self.pool.mark_down(self.backend, "proxy: connection refused")  # already down
        self.assertEqual(heard, [("127.0.0.1:8002", "proxy: connection refused")])

    def test_probes_failed_counts_from_zero(self) -> None:
        self.assertEqual(self.backend.health.probes_failed, 0)
        for _ in range(2):
            self.pool.probe_failed(self.backend, "health: HTTP 503", definitive=True, fall=3)
        self.assertEqual(self.backend.detailed_status()["probes_failed"], 2)

    def test_latency_is_an_ewma_rounded_to_a_tenth_of_a_millisecond(self) -> None:
        from txlb._cluster.backend_pace import EWMA_ALPHA, _ewma

        self.assertEqual(_ewma(None, 2.0), 2.0)
        self.assertAlmostEqual(_ewma(1.0, 3.0), 1.0 + EWMA_ALPHA * 2.0)
        self.assertAlmostEqual(_ewma(3.0, 1.0), 3.0 - EWMA_ALPHA * 2.0)
        self.backend.pace.timed(0.123456, None)
        self.assertEqual(self.backend.detailed_status()["latency_ewma_s"], 0.1235)

    def test_the_5xx_count_starts_again_after_an_ejection(self) -> None:
        for number in range(self.pool.outliers.consecutive_5xx):  # a streak of two clients
            self.pool.record_answer(self.backend, 500, client=f"10.0.0.{number % 2}")
        self.assertFalse(self.backend.health.healthy)
        self.assertEqual(self.backend.verdicts.errors_in_a_row, 0)

    def test_a_passive_ejection_restarts_the_rise_count(self) -> None:
        self.pool.probe_succeeded(self.backend, rise=2)  # one good probe while up
        self.pool.mark_down(self.backend, "proxy: connection refused")
        self.pool.probe_succeeded(self.backend, rise=2)
        self.assertFalse(self.backend.health.healthy)  # one success since the ejection, not two
        self.pool.probe_succeeded(self.backend, rise=2)
        self.assertTrue(self.backend.health.healthy)


class _SavedMarks(OwnMarks):
    """A store's marks as another balancer would read them: every save kept."""

    def __init__(self) -> None:
        self.saved: list[tuple[str, Marks]] = []

    def save(self, spec: BackendSpec, marks: Marks, reason: str = "",
             origin: str | None = None) -> None:
        self.saved.append((spec.key, marks))

    def members(self) -> list[tuple[BackendSpec, Marks]]:
        return []


class BookkeepingTests(SynchronousTestCase):
    """Survivors of the full mutation run of txlb/_cluster/backend.py."""

    def setUp(self) -> None:
        self.marks = _SavedMarks()
        self.pool = Pool(tuple(BackendSpec("127.0.0.1", p) for p in (8002, 8003, 8004)),
                         store=LocalStore(marks=self.marks))
        self.backend = self.pool.get("127.0.0.1:8002")
        self.changes: list[None] = []
        self.updates: list[None] = []
        self.pool.on_change.append(lambda: self.changes.append(None))

    def test_responses_are_counted_by_status_class(self) -> None:
        """The admin's ``responses``: one count per class, the edges of each class in it."""
        for status in (200, 299, 404, 499, 503, 599, 503):
            self.pool.record_result(self.backend, status, 0.1, None)
        self.assertEqual(self.backend.detailed_status()["responses"],
                         {"2xx": 2, "4xx": 2, "5xx": 3})

    def test_latency_moves_a_fifth_of_the_way_and_ttft_only_when_timed(self) -> None:
        self.pool.record_result(self.backend, 200, 1.0, 0.5)
        self.pool.record_result(self.backend, 200, 3.0, None)  # no first token timed
        status = self.backend.detailed_status()
        self.assertEqual((status["latency_ewma_s"], status["ttft_ewma_s"]), (1.4, 0.5))
        self.pool.record_result(self.backend, 200, 1.4, 1.5)
        self.assertEqual(self.backend.detailed_status()["ttft_ewma_s"], 0.7)

    def test_requests_count_each_request_from_zero(self) -> None:
        self.assertEqual(self.backend.status()["requests"], 0)
        self.pool.slots.acquire(self.backend).release()
        self.pool.slots.acquire(self.backend)
        self.assertEqual(self.backend.status()["requests"], 2)

    def test_shared_counts_give_the_all_process_requests(self) -> None:
        """``--workers``: the status shows every process's requests, as the table counts them."""
        shared = SharedTotals()
        shared.started = lambda key: 5  # type: ignore[method-assign]
        pool = Pool((BackendSpec("127.0.0.1", 8002),), shared=shared)  # type: ignore[arg-type]
        backend = pool.get("127.0.0.1:8002")
        pool.refresh()
        self.assertEqual(backend.status()["requests"], 5)
        backend.counts.counted(2)  # the in-flight total alone (taken under the lock)
        self.assertEqual((backend.counts.active, backend.status()["requests"]), (2, 5))

    def test_a_worker_restarts_its_local_counts_on_a_new_scrape_only(self) -> None:
        """
        queue-depth adds what this worker sent since the engine was scraped: counted from
        zero, kept while the supervisor's scrape is the same one, restarted by a new one.
        """
        from txlb._scheduling.policies.queue_depth import QueueDepth

        supervisor = Backend(BackendSpec("127.0.0.1", 8002))
        worker = Backend(BackendSpec("127.0.0.1", 8002))
        self.assertEqual((worker.counts.started_since_scrape, supervisor.engine.scrapes), (0, 0))
        supervisor.engine_scraped(4.0, None)
        self.assertEqual(supervisor.engine.scrapes, 1)
        worker.mirror(json.loads(json.dumps(supervisor.shared_state())))
        worker.counts.took_slot()
        worker.counts.took_slot()
        worker.counts.gave_slot()
        worker.mirror(json.loads(json.dumps(supervisor.shared_state())))  # the same scrape
        counts = worker.counts
        self.assertEqual((counts.started_since_scrape, counts.finished_since_scrape), (2, 1))
        self.assertEqual(QueueDepth.depth(worker), 5.0)
        supervisor.engine_scraped(4.0, None)
        self.assertEqual(supervisor.engine.scrapes, 2)
        worker.mirror(json.loads(json.dumps(supervisor.shared_state())))
        counts = worker.counts
        self.assertEqual((counts.started_since_scrape, counts.finished_since_scrape), (0, 0))
        self.assertEqual(QueueDepth.depth(worker), 4.0)

    def test_the_shared_state_crosses_to_workers_as_json(self) -> None:
        self.pool.set_engine_depth(self.backend, 1, 2)
        worker = Pool(())
        worker.mirror(json.loads(json.dumps(self.pool.shared_state())))
        mirrored = worker.get("127.0.0.1:8002")
        self.assertEqual((mirrored.engine.depth, mirrored.engine.scrapes), (3, 1))

    def test_the_streak_keeps_its_first_two_clients(self) -> None:
        for client in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
            self.backend.verdicts.answered(500, client)
        self.assertEqual(self.backend.verdicts.streak_clients, ("10.0.0.1", "10.0.0.2"))

    def test_a_drain_is_saved_and_told_once(self) -> None:
        """Other balancers read the drain from the store; waiting requests hear of it."""
        self.pool.drain(self.backend)
        self.assertEqual(self.marks.saved[-1], ("127.0.0.1:8002", Marks(True, True, False)))
        self.assertEqual((len(self.marks.saved), len(self.changes)), (4, 1))  # 3 added
        self.pool.drain(self.backend)  # already draining: nothing new to say
        self.assertEqual((len(self.marks.saved), len(self.changes)), (4, 1))

    def test_back_up_is_told_once(self) -> None:
        """A recovery is saved, logged and told once; later good probes say nothing."""
        from twisted.logger import formatEvent, globalLogPublisher

        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        self.pool.mark_down(self.backend, "proxy: connection refused")
        for _ in range(3):
            self.pool.probe_succeeded(self.backend, rise=1)
        self.assertTrue(self.backend.health.healthy)
        self.assertEqual(self.marks.saved[-1], ("127.0.0.1:8002", Marks(True, False, False)))
        self.assertEqual(len(self.changes), 2)  # down, up
        self.assertEqual(len([e for e in events if "back up" in formatEvent(e)]), 1)

    def test_forgetting_an_unknown_queue_depth_tells_no_worker(self) -> None:
        self.pool.on_update.append(lambda: self.updates.append(None))
        self.pool.forget_engine_depth(self.backend)
        self.assertEqual(self.updates, [])
        self.pool.set_engine_depth(self.backend, 1, 0)
        self.pool.forget_engine_depth(self.backend)
        self.assertEqual((len(self.updates), self.backend.engine.depth), (2, None))

    def test_two_leases_on_one_backend_are_two(self) -> None:
        first, second = self.pool.slots.acquire(self.backend), self.pool.slots.acquire(self.backend)
        self.assertNotEqual(first, second)
        self.assertEqual(len({first, second}), 2)
        self.assertIs(first.released, False)
        first.release()
        self.assertIs(first.released, True)
        self.assertEqual(self.backend.counts.active, 1)

    def test_a_4xx_answer_ends_a_5xx_streak(self) -> None:
        needed = self.pool.outliers.consecutive_5xx
        for status in (499, 400):  # the top and the bottom of the 4xx class
            self.streak(needed - 1)
            self.pool.record_answer(self.backend, status, client="10.0.0.1")
            self.assertEqual(self.backend.verdicts.errors_in_a_row, 0)
        self.streak(needed - 1)
        self.assertTrue(self.backend.health.healthy)

    def streak(self, count: int) -> None:
        for number in range(count):
            self.pool.record_answer(self.backend, 503, client=f"10.0.0.{number % 2}")

    def test_a_streak_after_a_success_needs_the_full_count(self) -> None:
        needed = self.pool.outliers.consecutive_5xx
        self.streak(needed - 1)
        self.pool.record_answer(self.backend, 200, client="10.0.0.1")
        self.streak(needed - 1)
        self.assertTrue(self.backend.health.healthy)
        self.streak(1)
        self.assertFalse(self.backend.health.healthy)

    def test_a_streak_after_coming_back_needs_the_full_count(self) -> None:
        self.streak(self.pool.outliers.consecutive_5xx)  # ejected: the cool-down follows
        self.assertFalse(self.backend.health.healthy)
        self.pool.clock.advance(3600)  # type: ignore[attr-defined]
        self.pool.probe_succeeded(self.backend, rise=1)
        self.assertTrue(self.backend.health.healthy)
        self.streak(self.pool.outliers.consecutive_5xx - 1)
        self.assertTrue(self.backend.health.healthy)
        self.streak(1)
        self.assertFalse(self.backend.health.healthy)

    def test_fall_counts_from_the_last_good_probe(self) -> None:
        for _ in range(2):
            self.pool.probe_failed(self.backend, "health: timeout", definitive=False, fall=3)
        self.pool.probe_succeeded(self.backend, rise=1)
        self.assertEqual(self.backend.health.failures_in_a_row, 0)
        for _ in range(2):
            self.pool.probe_failed(self.backend, "health: timeout", definitive=False, fall=3)
        self.assertEqual(self.backend.health.failures_in_a_row, 2)
        self.assertTrue(self.backend.health.healthy)
        self.pool.probe_failed(self.backend, "health: timeout", definitive=False, fall=3)
        self.assertFalse(self.backend.health.healthy)

    def test_rise_counts_from_the_last_failed_probe(self) -> None:
        self.assertEqual(self.backend.health.successes_in_a_row, 0)
        self.pool.mark_down(self.backend, "proxy: connection refused")
        for _ in range(2):
            self.pool.probe_succeeded(self.backend, rise=3)
        self.assertEqual(self.backend.health.successes_in_a_row, 2)
        self.pool.probe_failed(self.backend, "health: timeout", definitive=False, fall=3)
        for _ in range(2):
            self.pool.probe_succeeded(self.backend, rise=3)
        self.assertFalse(self.backend.health.healthy)
        self.pool.probe_succeeded(self.backend, rise=3)
        self.assertTrue(self.backend.health.healthy)

    def test_hung_ejections_are_counted_from_zero(self) -> None:
        self.assertEqual(self.backend.detailed_status()["hung_ejections"], 0)
        self.pool.mark_hung(self.backend, "hung: no byte for 60 s")
        self.assertEqual(self.backend.detailed_status()["hung_ejections"], 1)

    def test_weight_is_the_configured_one(self) -> None:
        backend = Backend(BackendSpec("127.0.0.1", 8002, weight=3))
        self.assertEqual((backend.spec.weight, backend.effective_weight), (3, 3.0))
