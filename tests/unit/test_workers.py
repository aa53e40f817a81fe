"""
``--workers N`` in memory: the shared in-flight table, pools of several "processes"
sharing it (each a view with its own row, as the worker processes are), the state the
supervisor mirrors to its workers, and the messages between them.
"""

from __future__ import annotations

import os

import attrs
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from txlb import BackendSpec, build_config
from txlb._cluster.pool import Pool
from txlb._cluster.shared_counts import SharedCounts
from txlb._records.summary import Summary
from txlb._scheduling.policies.least_conn import LeastConnections
from txlb._scheduling.request import RoutingRequest
from txlb._scheduling.router import Router, RoutingError
from txlb._workers.wire import (
    Finished,
    Kick,
    Lines,
    Log,
    Wait,
    config_blob,
    config_from,
    decode,
    encode,
)

KEYS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000")


def specs(*keys: str, max_conns: int = 0) -> tuple[BackendSpec, ...]:
    out = []
    for key in keys:
        host, port = key.rsplit(":", 1)
        out.append(BackendSpec(host, int(port), max_conns=max_conns))
    return tuple(out)


class Table:
    """One table with a supervisor view and one view per worker row, as the processes have."""

    def __init__(self, test: SynchronousTestCase, workers: int = 2, slots: int = 16) -> None:
        self.supervisor = SharedCounts.create(workers, slots)
        self.rows = [SharedCounts(self.supervisor.fd, workers, slots, row=row)
                     for row in range(workers)]
        test.addCleanup(self.close)

    def close(self) -> None:
        for view in [*self.rows, self.supervisor]:
            view.close()
        os.close(self.supervisor.fd)


class SharedCountsTests(SynchronousTestCase):
    def test_counts_sum_over_rows_and_each_writes_its_own(self) -> None:
        table = Table(self)
        sup, (w0, w1) = table.supervisor, table.rows
        slot = sup.register(KEYS[0])
        for view in (w0, w1):
            view.assign(KEYS[0], slot)
        w0.take(KEYS[0])
        w0.take(KEYS[0])
        w1.take(KEYS[0])
        self.assertEqual([v.total(KEYS[0]) for v in (sup, w0, w1)], [3, 3, 3])
        self.assertEqual((w0.mine(KEYS[0]), w1.mine(KEYS[0]), sup.mine(KEYS[0])), (2, 1, 3))
        w0.give_back(KEYS[0])
        self.assertEqual((sup.total(KEYS[0]), sup.started(KEYS[0])), (2, 3))
        self.assertEqual(sup.row_status(0)["in_flight"], 1)
        self.assertEqual(sup.row_status(1)["requests"], 1)

    def test_retire_zeroes_a_dead_workers_row_but_keeps_its_request_count(self) -> None:
        table = Table(self)
        sup, (w0, w1) = table.supervisor, table.rows
        for view in (w0, w1):
            view.assign(KEYS[0], sup.register(KEYS[0]))
        w0.set_pid(1234)
        w0.set_waiters(2)
        for _ in range(5):
            w0.take(KEYS[0])  # SIGKILLed with five in flight
        w1.take(KEYS[0])
        sup.retire(0)
        self.assertEqual(sup.total(KEYS[0]), 1)
        self.assertEqual(sup.started(KEYS[0]), 6)
        self.assertEqual(sup.row_status(0), {"pid": 0, "in_flight": 0, "requests": 0,
                                             "queued": 0})
        self.assertEqual(sup.waiters(0), 0)

    def test_slots_are_per_address_and_limited(self) -> None:
        table = Table(self, slots=2)
        sup = table.supervisor
        self.assertEqual(sup.register("a:1"), 0)
        self.assertEqual(sup.register("b:1"), 1)
        self.assertEqual(sup.register("a:1"), 0)  # the same address keeps its slot
        self.assertRaises(ValueError, sup.register, "c:1")
        self.assertRaises(ValueError, table.rows[0].assign, "c:1", 2)
        self.assertEqual(sup.total("unknown:1"), 0)

    def test_totals_cover_slots_learned_out_of_order(self) -> None:
        """A restarted worker may know slots 0 and 3 only (1 and 2 were removed before)."""
        table = Table(self)
        sup, worker = table.supervisor, table.rows[0]
        for key in ("a:1", "b:1", "c:1", "d:1"):
            sup.register(key)
        worker.assign("a:1", 0)
        worker.assign("d:1", 3)
        worker.take("d:1")
        self.assertEqual(worker.totals(), [0, 0, 0, 1])
        self.assertEqual(sup.totals(), [0, 0, 0, 1])

    def test_lock_is_reentrant_within_a_process(self) -> None:
        table = Table(self)
        view = table.rows[0]
        with view.locked(), view.locked():
            pass
        with view.locked():
            pass  # released and taken again


class SharedPools:
    """A supervisor's pool and two workers' pools (with routers) over one table."""

    def __init__(self, test: SynchronousTestCase, backends: tuple[BackendSpec, ...],
                 queue_timeout: float = 30.0) -> None:
        self.table = Table(test)
        self.clock = Clock()
        self.supervisor = Pool(backends, clock=self.clock, shared=self.table.supervisor)
        self.workers = []
        self.routers = []
        for view in self.table.rows:
            pool = Pool(clock=self.clock, shared=view)
            pool.mirror(self.supervisor.shared_state())
            self.workers.append(pool)
            router = Router(pool, LeastConnections(), self.clock, queue_timeout=queue_timeout)
            router.on_queue_length = view.set_waiters  # as txlb._workers.main wires it
            self.routers.append(router)

    def sync(self) -> None:
        state = self.supervisor.shared_state()
        for pool in self.workers:
            pool.mirror(state)


class SharedPoolTests(SynchronousTestCase):
    def test_least_connections_is_exact_across_workers(self) -> None:
        pools = SharedPools(self, specs(*KEYS))
        leases = []
        for turn in range(8):  # alternate between the two workers, as accepts may
            leases.append(self.successResultOf(pools.routers[turn % 2].acquire()))
        self.assertEqual(sorted(leases[i].backend.key for i in range(8)), sorted(KEYS * 2))
        pools.supervisor.refresh()
        self.assertEqual([b.counts.active for b in pools.supervisor], [2, 2, 2, 2])
        self.assertEqual([b.counts.requests for b in pools.supervisor], [2, 2, 2, 2])
        status = pools.workers[1].status()
        self.assertEqual([b["active"] for b in status["backends"]], [2, 2, 2, 2])  # type: ignore[index]
        # each worker waits only for its own requests when it stops
        self.assertEqual(
            (pools.workers[0].slots.in_flight, pools.workers[1].slots.in_flight), (4, 4))
        for lease in leases[:4]:
            lease.release()
        self.assertEqual(pools.table.supervisor.row_status(0)["in_flight"], 2)

    def test_max_conns_holds_across_workers_and_a_kick_serves_the_queue(self) -> None:
        pools = SharedPools(self, specs(KEYS[0], max_conns=1))
        first = self.successResultOf(pools.routers[0].acquire())
        waiting = pools.routers[1].acquire()  # worker 1 sees the slot taken by worker 0
        self.assertNoResult(waiting)
        self.assertEqual(pools.table.supervisor.waiters(1), 1)
        first.release()
        self.assertNoResult(waiting)  # worker 1 cannot know yet ...
        pools.workers[1].slots.capacity_changed()  # ... until the supervisor kicks it
        lease = self.successResultOf(waiting)
        self.assertEqual(lease.backend.key, KEYS[0])
        self.assertEqual(pools.table.supervisor.waiters(1), 0)

    def test_mirror_copies_health_drain_models_and_membership(self) -> None:
        pools = SharedPools(self, specs(*KEYS[:3]))
        sup = pools.supervisor
        first, second, third = list(sup)
        sup.mark_down(first, "health: HTTP 503")
        sup.drain(second)
        sup.set_models(third, [{"id": "llama", "object": "model"}])
        sup.add(BackendSpec("10.0.0.9", 8000))
        pools.sync()
        worker = pools.workers[0]
        self.assertEqual([b.key for b in worker], [*KEYS[:3], "10.0.0.9:8000"])
        mirrored = {b.key: b for b in worker}
        self.assertFalse(mirrored[KEYS[0]].health.healthy)
        self.assertTrue(mirrored[KEYS[1]].health.draining)
        self.assertEqual(mirrored[KEYS[2]].models, ("llama",))
        lease = self.successResultOf(pools.routers[0].acquire(RoutingRequest(model="llama")))
        self.assertEqual(lease.backend.key, KEYS[2])
        # removal: the worker keeps the backend until its own request there ends
        sup.remove(sup.get(KEYS[2]))  # type: ignore[arg-type]
        self.assertIsNotNone(sup.get(KEYS[2]))  # in flight in a worker: not forgotten yet
        pools.sync()
        self.assertTrue(worker.get(KEYS[2]).health.removing)  # type: ignore[union-attr]
        lease.release()
        self.assertIsNone(worker.get(KEYS[2]))
        sup.refresh()  # the supervisor looks again when a worker reports a finished request
        self.assertIsNone(sup.get(KEYS[2]))

    def test_adding_past_the_tables_room_is_refused(self) -> None:
        table = Table(self, slots=16)
        pool = Pool(specs(*[f"10.0.1.{i}:8000" for i in range(16)]), shared=table.supervisor)
        self.assertRaises(ValueError, pool.add, BackendSpec("10.0.2.1", 8000))
        self.assertEqual(len(pool), 16)  # nothing half-added

    def test_engine_queue_scrapes_restart_the_workers_local_counts(self) -> None:
        pools = SharedPools(self, specs(KEYS[0]))
        lease = self.successResultOf(pools.routers[0].acquire())
        worker_backend = lease.backend
        self.assertEqual(worker_backend.counts.started_since_scrape, 1)
        backend = pools.supervisor.get(KEYS[0])
        assert backend is not None
        pools.supervisor.set_engine_depth(backend, 3, 1)
        pools.sync()
        self.assertEqual((worker_backend.engine.depth, worker_backend.counts.started_since_scrape),
                         (4, 0))
        pools.sync()  # the same scrape again: nothing restarts
        lease.release()
        pools.sync()
        self.assertEqual(worker_backend.counts.finished_since_scrape, 1)

    def test_passive_down_is_reported_once(self) -> None:
        pools = SharedPools(self, specs(*KEYS[:2]))
        reported: list[tuple[str, str]] = []
        worker = pools.workers[0]
        worker.on_down.append(lambda backend, reason: reported.append((backend.key, reason)))
        backend = worker.get(KEYS[0])
        assert backend is not None
        worker.mark_down(backend, "proxy: connection refused")
        worker.mark_down(backend, "proxy: connection refused")
        self.assertEqual(reported, [(KEYS[0], "proxy: connection refused")])

    def test_updates_fire_for_what_workers_mirror(self) -> None:
        pools = SharedPools(self, specs(KEYS[0]))
        updates: list[int] = []
        sup = pools.supervisor
        sup.on_update.append(lambda: updates.append(1))
        backend = sup.get(KEYS[0])
        assert backend is not None
        sup.probe_failed(backend, "health: reset", definitive=False, fall=3)
        sup.set_models(backend, [{"id": "m"}])
        sup.set_engine_depth(backend, 1, 2)
        self.assertEqual(len(updates), 3)

    def test_all_queued_routes_refused_when_nothing_can_serve(self) -> None:
        pools = SharedPools(self, specs(KEYS[0], max_conns=1), queue_timeout=5)
        self.successResultOf(pools.routers[0].acquire())
        waiting = pools.routers[1].acquire()
        pools.clock.advance(5)
        self.assertIsInstance(self.failureResultOf(waiting).value, RoutingError)
        self.assertEqual(pools.table.supervisor.waiters(1), 0)


class SinglePoolTests(SynchronousTestCase):
    def test_without_shared_counts_nothing_changes(self) -> None:
        pool = Pool(specs(*KEYS[:2]))
        self.assertIsNone(pool.shared)
        lease = pool.slots.exclusive(pool.slots.acquire, pool.get(KEYS[0]))
        self.assertEqual((lease.backend.counts.active, pool.slots.in_flight), (1, 1))
        pool.refresh()  # a no-op: the attribute is the count
        self.assertEqual(lease.backend.counts.active, 1)
        lease.release()
        self.assertEqual(pool.slots.in_flight, 0)


class WireTests(SynchronousTestCase):
    def test_summary_round_trip(self) -> None:
        summary = Summary(time=1.5, orid="ORD-1", backend="h:1", method="POST",
                          path="/v1/chat/completions", status=200, kind="completion",
                          outcome="ok", dur=2.0, ttft=0.1, finish="stop", preview="é\nx",
                          req_keys=["a", "b"], tries=2)
        self.assertEqual(decode(encode(Finished(summary, True))), Finished(summary, True))

    def test_lines_keep_partial_messages(self) -> None:
        lines = Lines()
        data = encode(Wait(1.5)) + encode(Kick())
        self.assertEqual(lines.feed(data[:5]), [])
        self.assertEqual([decode(x) for x in lines.feed(data[5:])], [Wait(1.5), Kick()])
        self.assertEqual(lines.feed(b""), [])

    def test_a_long_line_in_small_reads_costs_linear_time(self) -> None:
        """Pipes are read 8 KiB at a time: a 4 MB message must not be re-split per read."""
        lines = Lines()
        message = encode(Log("info", "-", "y" * 4_000_000))
        got = []
        for start in range(0, len(message), 8192):
            got += lines.feed(message[start:start + 8192])
        self.assertEqual([len(x) for x in got], [len(message) - 1])

    def test_an_oversize_line_is_dropped_and_the_next_one_kept(self) -> None:
        from txlb._workers import wire as _wire

        self.patch(_wire, "MAX_LINE", 100)
        lines = Lines()
        self.assertEqual(lines.feed(b"a" * 80), [])
        self.assertEqual(lines.feed(b"a" * 80), [])  # over the limit: dropped
        self.assertEqual(lines.feed(b"aaa\nnext\n"), [b"next"])
        self.assertEqual(lines.dropped, 1)

    def test_a_lone_surrogate_travels(self) -> None:
        summary = Summary(time=1.5, orid="-", backend="h:1", method="POST",
                          path="/v1/completions", status=404, kind="error",
                          outcome="proxy_error", dur=0.0, req_keys=["\ud800"])
        message = decode(encode(Finished(summary, False)))
        assert isinstance(message, Finished)
        self.assertEqual(message.summary.req_keys, ["\ud800"])

    def test_config_travels_whole(self) -> None:
        config = build_config({"workers": "2", "backends": "127.0.0.1:9,127.0.0.1:10",
                               "policy": "p2c"}, {})
        self.assertEqual(config_from(config_blob(config)), config)
        self.assertEqual(attrs.evolve(config, workers=1).workers, 1)
