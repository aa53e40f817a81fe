"""
What the pool (:mod:`txlb._cluster.pool`) tells its listeners and its log, and how a worker's
pool follows its supervisor's: ``on_update`` listeners are called, a failing listener stops
no other, the log says what changed (and only when it changed), ``when_idle`` fires once
nothing is in flight, a mirror removes what the supervisor no longer has, a removed backend
leaves on refresh once this worker is done with it, a drain taken from the shared store
leaves a healthy backend up, and a withdrawn slot leaves the counts as they were.

Written for the behaviour the survivors of ``_cluster/pool``'s full mutation run showed no
test pinned down.  :class:`RecordingSlots` and :class:`SharedTotals` stand in for the shared
in-flight counts of ``--workers`` (tests.unit.test_backend uses them too).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from txlb import BackendSpec
from txlb._cluster.local_store import LocalStore
from txlb._cluster.models import MAX_MODEL_NAMES
from txlb._cluster.pool import Pool
from txlb._cluster.store import Marks, OwnMarks

A = BackendSpec("127.0.0.1", 8002)
B = BackendSpec("127.0.0.1", 8003)


@contextmanager
def logged() -> Iterator[list[str]]:
    """Every log line written meanwhile, formatted."""
    lines: list[str] = []

    def observe(event: dict[str, object]) -> None:
        lines.append(formatEvent(event) or "")

    globalLogPublisher.addObserver(observe)
    try:
        yield lines
    finally:
        globalLogPublisher.removeObserver(observe)


class StoredMarks(OwnMarks):
    """Marks another balancer saved: what ``members`` hands the pool at its next refresh."""

    def __init__(self) -> None:
        self.stored: list[tuple[BackendSpec, Marks]] = []
        self.saved: list[tuple[str, Marks]] = []

    def save(self, spec: BackendSpec, marks: Marks, reason: str = "",
             origin: str | None = None) -> None:
        self.saved.append((spec.key, marks))

    def members(self) -> Sequence[tuple[BackendSpec, Marks]]:
        stored, self.stored = self.stored, []
        return stored


class ListenerTests(SynchronousTestCase):
    def test_update_listeners_hear_every_change(self) -> None:
        pool = Pool((A,))
        heard: list[str] = []
        pool.on_update.append(lambda: heard.append("update"))
        pool.add(B)
        self.assertEqual(heard, ["update"])
        pool.set_engine(pool.get(A.key), "vllm")  # type: ignore[arg-type]
        self.assertEqual(heard, ["update", "update"])

    def test_a_failing_listener_stops_no_other(self) -> None:
        pool = Pool((A,))
        heard: list[str] = []

        def broken() -> None:
            raise RuntimeError("listener bug")

        pool.on_change.extend([broken, lambda: heard.append("change")])
        pool.on_update.extend([broken, lambda: heard.append("update")])
        with logged() as lines:
            pool.add(B)
        self.assertEqual(heard, ["change", "update"])
        self.assertEqual(lines.count("a pool listener failed"), 2)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)


class LogLineTests(SynchronousTestCase):
    def test_a_respecified_backend_without_models_says_learned(self) -> None:
        pool = Pool((A,))
        backend = pool.get(A.key)
        assert backend is not None
        with logged() as lines:
            pool.respecify(backend, BackendSpec("127.0.0.1", 8002, weight=3))
        self.assertIn("backend 127.0.0.1:8002 is now weight 3, max_conns 0, models "
                      "learned", lines)
        with logged() as lines:
            pool.respecify(backend, BackendSpec("127.0.0.1", 8002, weight=3, models=("m",)))
        self.assertIn("backend 127.0.0.1:8002 is now weight 3, max_conns 0, models m", lines)

    def test_keep_speaks_only_for_a_backend_being_removed(self) -> None:
        pool = Pool((A, B))
        backend = pool.get(A.key)
        assert backend is not None
        with logged() as lines:
            pool.keep(backend)
        self.assertEqual([line for line in lines if "stays" in line], [])
        lease = pool.slots.acquire(backend)  # in flight: removing it waits for this request
        pool.remove(backend)
        with logged() as lines:
            pool.keep(backend)
        self.assertIn("backend 127.0.0.1:8002 stays: the new config lists it", lines)
        self.assertFalse(backend.health.removing)
        lease.release()
        self.assertIs(pool.get(A.key), backend)

    def test_learned_models_are_logged_when_they_change(self) -> None:
        pool = Pool((A,))
        backend = pool.get(A.key)
        assert backend is not None
        entries: list[dict[str, object]] = [{"id": "m", "object": "model"}]
        with logged() as lines:
            pool.set_models(backend, entries)
            pool.set_models(backend, entries)
            pool.set_models(backend, [{"id": "n", "object": "model"}])
        self.assertEqual([line for line in lines if " serves " in line],
                         ["backend 127.0.0.1:8002 serves m", "backend 127.0.0.1:8002 serves n"])
        self.assertEqual([line for line in lines if "more model names" in line], [])
        many: list[dict[str, object]] = [{"id": f"m{n}"} for n in range(MAX_MODEL_NAMES + 2)]
        with logged() as lines:
            pool.set_models(backend, many)
        self.assertTrue(any("lists 2 more model names than txlb learns" in line
                            for line in lines), lines)

    def test_the_engine_is_logged_when_it_changes(self) -> None:
        pool = Pool((A,))
        backend = pool.get(A.key)
        assert backend is not None
        with logged() as lines:
            pool.set_engine(backend, "vllm")
            pool.set_engine(backend, "vllm")
            pool.set_engine(backend, "sglang")
        self.assertEqual([line for line in lines if " runs " in line],
                         ["backend 127.0.0.1:8002 runs vllm",
                          "backend 127.0.0.1:8002 runs sglang"])


class IdleTests(SynchronousTestCase):
    def test_an_idle_pool_is_idle_at_once(self) -> None:
        pool = Pool((A,))
        fired: list[object] = []
        pool.slots.when_idle().addCallback(fired.append)
        self.assertEqual(fired, [None])

    def test_a_slot_given_back_unused_is_not_idle_while_another_runs(self) -> None:
        """A refused choice withdrawn (``--shared-state``) while a request is still in flight."""
        pool = Pool((A, B))
        a, b = pool.get(A.key), pool.get(B.key)
        assert a is not None and b is not None
        running = pool.slots.acquire(a)
        fired: list[object] = []
        pool.slots.when_idle().addCallback(fired.append)
        pool.slots.withdraw(pool.slots.acquire(b))
        self.assertEqual(fired, [])
        running.release()
        self.assertEqual(fired, [None])


class MirrorTests(SynchronousTestCase):
    def test_a_backend_the_supervisor_dropped_leaves_the_worker_once_idle(self) -> None:
        supervisor = Pool((A, B))
        worker = Pool(())
        worker.mirror(supervisor.shared_state())
        self.assertEqual([b.key for b in worker], [A.key, B.key])
        held = worker.get(B.key)
        assert held is not None
        lease = worker.slots.acquire(held)
        only_a = [state for state in supervisor.shared_state()
                  if state["spec"][1] == A.port]
        worker.mirror(only_a)
        self.assertTrue(held.health.removing)  # draining here: its request runs on
        self.assertIs(worker.get(B.key), held)
        lease.release()
        self.assertIsNone(worker.get(B.key))
        gone = worker.get(A.key)
        assert gone is not None
        worker.mirror([])
        self.assertIsNone(worker.get(A.key))  # idle: gone at once


class StoredMarksTests(SynchronousTestCase):
    def build(self) -> tuple[Pool, StoredMarks]:
        marks = StoredMarks()
        return Pool((A, B), clock=Clock(), store=LocalStore(marks=marks)), marks

    def test_a_removal_this_replica_keeps_is_written_back(self) -> None:
        """Its own DNS still yields it (``keeps``): it stays, and says so in the store."""
        pool, marks = self.build()
        pool.ask_before_store_removal(lambda backend: True)
        marks.saved.clear()
        marks.stored = [(A, Marks(healthy=True, draining=True, removing=True))]
        pool.refresh()
        backend = pool.get(A.key)
        assert backend is not None
        self.assertFalse(backend.health.removing)
        self.assertFalse(backend.health.draining)
        self.assertEqual(marks.saved, [(A.key, Marks(healthy=True, draining=False,
                                                      removing=False))])

    def test_a_stored_drain_applies_to_a_backend_this_replica_keeps(self) -> None:
        pool, marks = self.build()
        pool.ask_before_store_removal(lambda backend: True)
        marks.stored = [(A, Marks(healthy=True, draining=True, removing=False))]
        pool.refresh()
        backend = pool.get(A.key)
        assert backend is not None
        self.assertTrue(backend.health.draining)

    def test_a_failing_suspect_listener_stops_no_other(self) -> None:
        pool, marks = self.build()
        heard: list[str] = []

        def broken(backend: object) -> None:
            raise RuntimeError("listener bug")

        pool.on_suspect.extend([broken, lambda backend: heard.append(backend.key)])
        marks.stored = [(A, Marks(healthy=False, draining=False, removing=False))]
        with logged() as lines:
            pool.refresh()
        self.assertEqual(heard, [A.key])
        self.assertIn("a pool listener failed", lines)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        backend = pool.get(A.key)
        assert backend is not None
        self.assertTrue(backend.health.healthy)  # each replica's own probe decides

    def test_a_stored_drain_leaves_a_healthy_backend_up(self) -> None:
        marks = StoredMarks()
        pool = Pool((A,), clock=Clock(), store=LocalStore(marks=marks))
        backend = pool.get(A.key)
        assert backend is not None
        self.assertTrue(backend.health.healthy)
        marks.stored = [(A, Marks(healthy=True, draining=True, removing=False))]
        pool.refresh()
        self.assertTrue(backend.health.draining)
        self.assertTrue(backend.health.healthy)


class WithdrawnSlotTests(SynchronousTestCase):
    def test_a_withdrawn_slot_leaves_the_counts_as_they_were(self) -> None:
        """A choice the shared store refused: nothing was sent, so nothing is counted."""
        pool = Pool((A,))
        backend = pool.get(A.key)
        assert backend is not None
        running = pool.slots.acquire(backend)
        before = (backend.counts.active, backend.counts.requests)
        pool.slots.withdraw(pool.slots.acquire(backend))
        self.assertEqual((backend.counts.active, backend.counts.requests), before)
        self.assertEqual(pool.slots.in_flight, 1)
        running.release()
        self.assertEqual((backend.counts.active, pool.slots.in_flight), (0, 0))

    def test_a_withdrawn_slot_is_not_counted_as_sent_since_the_scrape(self) -> None:
        """What queue-depth adds to the engine's last scrape: the requests sent since."""
        pool = Pool((A,))
        backend = pool.get(A.key)
        assert backend is not None
        pool.slots.acquire(backend)
        self.assertEqual(backend.counts.started_since_scrape, 1)
        pool.slots.withdraw(pool.slots.acquire(backend))
        self.assertEqual(backend.counts.started_since_scrape, 1)

    def test_a_withdrawn_lease_cannot_be_released_or_withdrawn_again(self) -> None:
        pool = Pool((A,))
        backend = pool.get(A.key)
        assert backend is not None
        running = pool.slots.acquire(backend)
        refused = pool.slots.acquire(backend)
        pool.slots.withdraw(refused)
        refused.release()  # a no-op: the slot is gone already
        self.assertFalse(refused.withdraw())
        self.assertEqual((backend.counts.active, pool.slots.in_flight), (1, 1))
        running.release()
        self.assertEqual(backend.counts.active, 0)

    def test_a_slot_taken_before_a_scrape_and_withdrawn_after_leaves_zero(self) -> None:
        """The scrape restarted the count: the withdrawn take is not in it, and never below 0."""
        pool = Pool((A,))
        backend = pool.get(A.key)
        assert backend is not None
        refused = pool.slots.acquire(backend)
        pool.set_engine_depth(backend, 1, 0)
        self.assertEqual(backend.counts.started_since_scrape, 0)
        pool.slots.withdraw(refused)
        self.assertEqual(backend.counts.started_since_scrape, 0)
        pool.slots.acquire(backend)
        pool.slots.acquire(backend)
        pool.slots.withdraw(pool.slots.acquire(backend))
        self.assertEqual(backend.counts.started_since_scrape, 2)

    def test_a_withdrawn_first_slot_leaves_no_request_counted(self) -> None:
        pool = Pool((A,))
        backend = pool.get(A.key)
        assert backend is not None
        pool.slots.withdraw(pool.slots.acquire(backend))
        self.assertEqual((backend.counts.active, backend.counts.requests), (0, 0))
        # counts read back meanwhile (--workers' shared table) never go below nothing
        refused = pool.slots.acquire(backend)
        backend.counts.counted(1, requests=0)
        pool.slots.withdraw(refused)
        self.assertEqual(backend.counts.requests, 0)


class RecordingSlots:
    """Records what a pool asks of its shared in-flight counts."""

    def __init__(self) -> None:
        self.assigned: list[tuple[str, int]] = []

    def register(self, key: str) -> int:
        return 7

    def assign(self, key: str, slot: int) -> None:
        self.assigned.append((key, slot))

    def take(self, key: str) -> None:
        pass

    def give_back(self, key: str) -> None:
        pass


class SharedTotals(RecordingSlots):
    """Shared counts as a worker's pool reads them back (``Pool.refresh``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {7: 0}
        self.own = 0
        self.slot = lambda key: 7

    def totals(self) -> dict[int, int]:
        return self.counts

    def started(self, key: str) -> int:
        return 0

    def mine(self, key: str) -> int:
        return self.own


class IdleAndRefreshTests(SynchronousTestCase):
    def test_idle_is_when_nothing_is_in_flight(self) -> None:
        pool = Pool((BackendSpec("127.0.0.1", 8002),))
        backend = pool.get("127.0.0.1:8002")
        first, second = pool.slots.acquire(backend), pool.slots.acquire(backend)
        idle = pool.slots.when_idle()
        first.release()
        self.assertNoResult(idle)
        second.release()
        self.successResultOf(idle)

    def test_a_removed_backend_leaves_on_refresh_once_this_worker_is_done(self) -> None:
        shared = SharedTotals()
        pool = Pool((BackendSpec("127.0.0.1", 8002),), shared=shared)  # type: ignore[arg-type]
        backend = pool.get("127.0.0.1:8002")
        shared.counts[7] = shared.own = 1  # a request of this worker's is in flight
        backend.health.leaving()
        pool.refresh()
        self.assertIs(pool.get("127.0.0.1:8002"), backend)
        shared.counts[7] = shared.own = 0  # it ended (counted down in shared memory)
        pool.refresh()
        self.assertIsNone(pool.get("127.0.0.1:8002"))
