"""
``--workers`` with ``--shared-state``, without a Redis: the supervisor as the host's one
replica (txlb._shared.host: its row is its workers' sum, the other replicas' counts reach
every worker's totals through the table's remote row), and the workers' rate-limit takes
made through it (txlb._workers.relay), on a :class:`~twisted.internet.task.Clock`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from txlb import build_config
from txlb._balancer import LoadBalancer
from txlb._cluster.shared_counts import SharedCounts
from txlb._cluster.store_capabilities import ISharedRateTakes
from txlb._shared.host import SCAN_INTERVAL, HostCounts, HostScan
from txlb._shared.rate import TAKE, bucket_name
from txlb._shared.store import FLUSH_DELAY, RedisStore
from txlb._workers.relay import (
    RELAY_DELAY,
    RELAY_TIMEOUT,
    TakeRelay,
    WorkerRelay,
    WorkerStore,
    take_levels,
)
from txlb._workers.supervisor import WorkerSupervisor
from txlb._workers.wire import (
    Levels,
    Message,
    Shared,
    Spent,
    Take,
    Taken,
    WireError,
    decode,
    encode,
)
from txlb._workers.worker import SupervisorLink

from .test_shared_state import SPEC, FakeRedis
from .test_workers_supervisor import SpawningReactor

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
#: a bucket's name as a worker sends it (a client key's digest)
BUCKET = bucket_name("ip:10.0.0.9")


def table(test: SynchronousTestCase, workers: int = 2) -> SharedCounts:
    shared = SharedCounts.create(workers)
    test.addCleanup(lambda: os.close(shared.fd))
    test.addCleanup(shared.close)
    return shared


def worker_view(test: SynchronousTestCase, shared: SharedCounts, row: int) -> SharedCounts:
    """A worker's view of the table, with the supervisor's slot numbers."""
    view = SharedCounts(shared.fd, shared.workers, shared.slots_max, row=row)
    test.addCleanup(view.close)
    for key in shared.backends():
        view.assign(key, shared.slot(key))
    return view


def hsets(redis: FakeRedis) -> list[tuple[Any, ...]]:
    return [command for command in redis.sent if command[0] == "HSET"]


class HostCountsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.redis = FakeRedis()
        self.shared = table(self)
        for key in (A, B):
            self.shared.register(key)
        self.counts = HostCounts(self.shared)
        self.store = RedisStore(SPEC, self.clock, self.redis, replica="host1",
                                counts=self.counts)
        self.workers = [worker_view(self, self.shared, row) for row in (0, 1)]

    def poll_args(self) -> list[Any]:
        polls = [command for command in self.redis.sent if command[0] == "EVALSHA"]
        return list(polls[-1][3:])

    def test_the_hosts_row_is_the_sum_of_its_workers(self) -> None:
        first, second = self.workers
        first.take(A)
        second.take(A)
        second.take(B)
        self.redis.replies["EVALSHA"] = ["2", "0"]
        self.store.start()
        # prefix, replica, lease, then the host's row: both workers' requests, summed
        self.assertEqual(self.poll_args(), ["txlb", "host1", 3000, A, 2, B, 1])

    def test_the_other_replicas_counts_reach_every_workers_totals(self) -> None:
        first, second = self.workers
        first.take(A)
        self.redis.replies["EVALSHA"] = ["3", "0", A, "2", B, "4", A, "1"]
        self.store.start()
        for view in self.workers:
            # least-connections and max_conns in each worker see the fleet
            self.assertEqual(view.totals()[:2], [1 + 3, 4])
            self.assertEqual(view.total(B), 4)
        self.assertEqual((first.mine(A), second.mine(A)), (1, 0))
        # the host's own counts (its row, what it waits for when draining) leave them out
        self.assertEqual((self.counts.mine(A), self.shared.mine(A)), (1, 1))
        self.assertEqual(self.counts.row(), {A: 1})

    def test_a_workers_take_is_published_within_the_scan_and_flush(self) -> None:
        self.redis.replies["EVALSHA"] = ["2", "0"]
        self.store.start()
        scan = HostScan(self.counts, self.clock)
        scan.startService()
        self.addCleanup(scan.stopService)
        self.workers[1].take(B)
        self.clock.advance(SCAN_INTERVAL)
        self.assertEqual(hsets(self.redis), [])  # written together within the flush delay
        self.clock.advance(FLUSH_DELAY)
        self.assertEqual(hsets(self.redis), [("HSET", "txlb:inflight:host1", B, 1)])
        self.workers[1].give_back(B)
        self.clock.advance(SCAN_INTERVAL)
        self.clock.advance(FLUSH_DELAY)
        self.assertEqual(hsets(self.redis)[-1], ("HSET", "txlb:inflight:host1", B, 0))
        count = len(self.redis.sent)
        self.clock.advance(SCAN_INTERVAL * 3)  # nothing moved: nothing written
        self.assertEqual([c for c in self.redis.sent[count:] if c[0] == "HSET"], [])

    def test_redis_gone_each_worker_keeps_the_hosts_view(self) -> None:
        self.workers[0].take(A)
        self.redis.replies["EVALSHA"] = ["2", "0", A, "5"]
        self.store.start()
        freed: list[int] = []
        self.store.on_freed = lambda: freed.append(1)
        self.assertEqual(self.workers[1].total(A), 6)
        self.redis.stalled = True
        self.clock.advance(0.25)
        self.clock.advance(0.5)
        self.assertFalse(self.store.link.connected)
        self.assertEqual(self.workers[1].total(A), 1)  # the host's own, exact
        self.assertEqual(freed, [1])  # the queues look again

    def test_a_hostile_row_is_ignored(self) -> None:
        self.redis.replies["EVALSHA"] = ["2", "0", A, "-5", A, "x", "9.9.9.9:1", "3",
                                         B, "99999999", A, "2"]
        self.store.start()
        self.assertEqual(self.shared.remote(), {A: 2})

    def test_a_workers_release_is_told_once_per_slot(self) -> None:
        fell: list[tuple[str, int]] = []
        self.counts.on_fell = lambda key, slots: fell.append((key, slots))
        first, second = self.workers
        first.take(A)
        second.take(A)
        self.counts.row()  # published: 2
        first.give_back(A)
        second.give_back(A)
        self.counts.changed_row()
        self.assertEqual(fell, [(A, 2)])
        self.counts.changed_row()
        self.assertEqual(fell, [(A, 2)])  # nothing more fell

    def test_the_slot_scripts_reads_and_announcements_reach_the_workers(self) -> None:
        self.counts.note_others(A, 3)  # a refused slot: the others hold 3
        self.assertEqual(self.workers[0].total(A), 3)
        self.assertTrue(self.counts.other_freed(A))  # another replica freed one
        self.assertEqual(self.workers[1].total(A), 2)
        self.assertFalse(self.counts.other_freed(B))  # none of theirs there: nothing
        self.counts.note_others("9.9.9.9:1", 5)  # unknown: ignored
        self.assertEqual(self.shared.remote(), {A: 2})

    def test_the_supervisor_takes_no_slot(self) -> None:
        with self.assertRaises(RuntimeError):
            self.counts.take(A)


class RelayTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.sent: list[Message] = []
        self.relay = WorkerRelay(self.sent.append, self.clock, workers=2)
        self.store = WorkerStore(table(self), self.relay)
        self.buckets = self.store.rate_buckets(10.0, 10, self.clock)

    def test_a_take_is_decided_at_once_and_sent_to_the_supervisor(self) -> None:
        self.relay.update(True, 2)
        self.assertEqual(self.buckets.take("ip:1"), 0.0)
        self.assertEqual(self.sent, [])  # sent with the takes of the next few ms
        self.clock.advance(RELAY_DELAY)
        (take,) = self.sent
        assert isinstance(take, Take)
        self.assertEqual((take.rate, take.burst), (10.0, 10))
        self.assertEqual(take.bucket, bucket_name("ip:1"))
        self.assertNotIn("ip:1", take.bucket)  # digested, as a replica's own take
        # the fleet's bucket is empty: the answer sets the copy, the next take waits
        self.relay.answered(Taken(take.id, True, -10.0))
        self.assertGreater(self.buckets.take("ip:1"), 0)

    def test_each_worker_refills_at_its_share_of_the_fleet(self) -> None:
        self.relay.update(True, 3)
        self.assertEqual(self.relay.deciders(), 6)  # 3 hosts x this host's 2 workers
        # a new key's copy: its share of the burst, 10 / 6
        allowed = sum(self.buckets.take("ip:2") == 0 for _ in range(5))
        self.assertEqual(allowed, 1)

    def test_a_burst_of_takes_goes_in_one_write(self) -> None:
        self.relay.update(True, 1)
        for client in range(5):
            self.buckets.take(f"ip:{client}")
        self.clock.advance(RELAY_DELAY - 0.001)
        self.assertEqual(self.sent, [])
        self.clock.advance(0.001)
        self.assertEqual([m.id for m in self.sent if isinstance(m, Take)], [0, 1, 2, 3, 4])

    def test_redis_gone_nothing_is_sent_and_the_copy_decides(self) -> None:
        self.relay.update(False, 2)
        self.assertEqual(self.buckets.take("ip:1"), 0.0)
        self.assertEqual(self.sent, [])

    def test_no_answer_counts_as_unshared_and_is_forgotten(self) -> None:
        self.relay.update(True, 1)
        self.buckets.take("ip:1")
        self.assertEqual(self.relay.pending(), 1)
        self.clock.advance(RELAY_TIMEOUT)
        self.assertEqual(self.relay.pending(), 0)
        self.assertEqual(getattr(self.buckets, "unshared", None), 1)
        self.relay.answered(Taken(0, True, 5.0))  # late: ignored
        self.relay.answered(Taken(12345, True, 5.0))  # never asked: ignored

    def test_a_failed_run_counts_as_unshared(self) -> None:
        self.relay.update(True, 1)
        self.buckets.take("ip:1")
        self.relay.answered(Taken(0, False, None))
        self.assertEqual(getattr(self.buckets, "unshared", None), 1)

    def test_an_answer_that_is_no_level_leaves_the_copy(self) -> None:
        self.relay.update(True, 1)
        self.buckets.take("ip:1")
        self.relay.answered(Taken(0, True, None))
        self.assertEqual(getattr(self.buckets, "unshared", None), 0)

    def test_pending_runs_are_bounded(self) -> None:
        relay = WorkerRelay(self.sent.append, self.clock, workers=1, max_pending=2)
        relay.update(True, 1)
        failures: list[Any] = []
        for _ in range(3):
            relay.take(BUCKET, 1.0, 1).addErrback(failures.append)
        self.clock.advance(RELAY_DELAY)
        self.assertEqual((len(self.sent), len(failures)), (2, 1))  # the third: at once
        self.clock.advance(RELAY_TIMEOUT)
        self.assertEqual(len(failures), 3)


class TakeRelayTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.redis = FakeRedis()
        self.store = RedisStore(SPEC, self.clock, self.redis, replica="host1")
        self.store.link.call("PING", probe=True)
        self.relay = TakeRelay(ISharedRateTakes(self.store))

    def taken(self, message: Take, relay: TakeRelay | None = None) -> Taken:
        answers: list[Taken] = []
        (relay or self.relay).take(message).addCallback(answers.append)
        (answer,) = answers
        return answer

    def test_a_take_runs_on_the_hosts_link(self) -> None:
        self.redis.replies["EVALSHA"] = b"7.5"
        answer = self.taken(Take(4, BUCKET, 10.0, 10))
        self.assertEqual(answer, Taken(4, True, 7.5))
        self.assertEqual(self.redis.sent[-1],
                         ("EVALSHA", TAKE.sha, 1, f"txlb:rate:{BUCKET}", "10.0", "10"))

    def test_anything_else_is_refused_without_reaching_redis(self) -> None:
        sent = len(self.redis.sent)
        for message in (
            Take(1, "marks", 1.0, 1),  # not a bucket's digest
            Take(2, "txlb:marks", 1.0, 1),  # a key outside the buckets
            Take(3, BUCKET.upper(), 1.0, 1),  # not a digest txlb makes
            Take(4, BUCKET, 0.0, 1),  # no rate
            Take(5, BUCKET, 1.0, 0),  # no burst
        ):
            self.assertEqual(self.taken(message), Taken(message.id, False, None))
        self.assertEqual(len(self.redis.sent), sent)
        self.assertEqual(self.relay.refused, 5)

    def test_redis_gone_the_answer_says_so(self) -> None:
        self.redis.broken = True
        self.store.link.call("PING", probe=True).addErrback(lambda failure: None)
        self.assertEqual(self.taken(Take(9, BUCKET, 1.0, 1)), Taken(9, False, None))

    def test_an_answer_that_is_no_level_says_so(self) -> None:
        self.redis.replies["EVALSHA"] = "x"
        self.assertEqual(self.taken(Take(3, BUCKET, 1.0, 1)), Taken(3, True, None))

    def test_any_store_that_shares_rate_buckets_serves_the_workers(self) -> None:
        asked: list[tuple[str, float, int]] = []

        @implementer(ISharedRateTakes)
        class OtherStore:
            def take_shared(self, bucket: str, rate: float, burst: int
                            ) -> Deferred[float | None]:
                asked.append((bucket, rate, burst))
                return succeed(2.5)

        relay = TakeRelay(ISharedRateTakes(OtherStore()))
        self.assertEqual(self.taken(Take(6, BUCKET, 10.0, 10), relay), Taken(6, True, 2.5))
        self.assertEqual(asked, [(BUCKET, 10.0, 10)])

    def test_without_a_store_that_shares_them_no_take_is_answered(self) -> None:
        self.assertEqual(self.taken(Take(7, BUCKET, 1.0, 1), TakeRelay(None)),
                         Taken(7, False, None))


class WireTests(SynchronousTestCase):
    def test_the_relay_messages_cross_the_pipe(self) -> None:
        for message in (Take(1, BUCKET, 1.0, 2), Taken(1, True, 3.5), Taken(2, True, None),
                        Taken(3, False, None), Shared(True, 4)):
            self.assertEqual(decode(encode(message)), message)

    def test_oversized_or_mistyped_takes_are_refused(self) -> None:
        for line in (
            {"t": "take", "id": 1, "bucket": "k" * 65, "rate": 1.0, "burst": 1},
            {"t": "take", "id": 1, "bucket": "", "rate": 1.0, "burst": 1},
            {"t": "take", "id": -1, "bucket": "k", "rate": 1.0, "burst": 1},
            {"t": "take", "id": 1, "bucket": 1, "rate": 1.0, "burst": 1},
            {"t": "take", "id": 1, "bucket": "k", "rate": "1", "burst": 1},
            {"t": "take", "id": 1, "bucket": "k", "rate": 1.0, "burst": -1},
            {"t": "take", "id": 1, "bucket": "k", "rate": 1.0, "burst": 1, "script": "x"},
            {"t": "taken", "id": 1, "answered": True, "level": "3.5"},
            {"t": "taken", "id": 1, "answered": 1, "level": None},
            {"t": "shared", "connected": 1, "replicas": 2},
        ):
            with self.assertRaises(WireError):
                decode(json.dumps(line).encode())


def shared_supervisor(test: SynchronousTestCase, redis: FakeRedis, config_file: str | None = None,
                      ) -> tuple[WorkerSupervisor, SpawningReactor]:
    """A ``--workers 2 --shared-state`` supervisor as tap builds it, on a fake Redis."""
    options = {"workers": "2", "log_file": "none",
               "listen": "tcp:0:interface=127.0.0.1", "admin": "none",
               "shared-state": "redis://127.0.0.1:1/0"}
    options.update({"config": config_file} if config_file else {"backends": A})
    config = build_config(options, {})
    shared = table(test)
    reactor = SpawningReactor()
    assert config.shared_state is not None
    store = RedisStore(config.shared_state, reactor, redis, replica="host1",
                       counts=HostCounts(shared))
    balancer = LoadBalancer(config=config, reactor=reactor, store=store)
    sup = WorkerSupervisor(balancer, shared, reactor, 2)
    test.addCleanup(lambda: sup.socket.close() if sup.socket is not None else None)
    sup.privilegedStartService()
    sup.startService()
    for worker, _ in reactor.spawned:
        worker.transport = StringTransport()
    return sup, reactor


def lines(transport: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in transport.value().splitlines()]


class SupervisorTests(SynchronousTestCase):
    def test_the_supervisor_is_the_hosts_replica_and_relays(self) -> None:
        redis = FakeRedis()
        redis.replies["EVALSHA"] = ["3", "0"]
        redis.replies["HGETALL"] = []
        sup, reactor = shared_supervisor(self, redis)
        sup.balancer.store.start()  # type: ignore[attr-defined]
        first = sup.workers[0]
        # the workers hear that Redis answers and how many replicas share it
        self.assertIn({"t": "shared", "connected": True, "replicas": 3},
                      lines(first.transport))
        redis.replies["EVALSHA"] = b"4.0"
        sup.received(first, [Take(7, BUCKET, 10.0, 10)])
        self.assertEqual(lines(first.transport)[-1],
                         {"t": "taken", "id": 7, "answered": True, "level": 4.0})
        sup.received(first, [Take(8, "f" * 40, 10.0, 10)])  # not a digest txlb makes
        self.assertEqual(lines(first.transport)[-1],
                         {"t": "taken", "id": 8, "answered": False, "level": None})

    def test_a_slot_freed_elsewhere_kicks_the_workers_that_wait(self) -> None:
        redis = FakeRedis()
        redis.replies["EVALSHA"] = ["2", "0", A, "2"]
        redis.replies["HGETALL"] = []
        sup, reactor = shared_supervisor(self, redis)
        sup.balancer.store.start()  # type: ignore[attr-defined]
        waiting = worker_view(self, sup.shared, 1)
        waiting.set_waiters(1)
        for worker in sup.workers.values():
            worker.transport.clear()  # type: ignore[union-attr]
        redis.replies["EVALSHA"] = ["2", "0", A, "1"]  # the other replica ended one
        reactor.advance(0.1)
        self.assertNotIn(b"kick", sup.workers[0].transport.value())  # type: ignore[union-attr]
        self.assertIn(b"kick", sup.workers[1].transport.value())  # type: ignore[union-attr]


BUDGET = 'backends = ["10.0.0.1:8000"]\n[[budgets]]\nname = "per-ip"\nkey = "ip"\n' \
    'tokens_per_minute = 600\n'


class BudgetLevelsTests(SynchronousTestCase):
    def test_the_fleets_levels_reach_every_worker(self) -> None:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write(BUDGET)
        redis = FakeRedis()
        redis.replies["EVALSHA"] = ["2", "0"]
        redis.replies["HGETALL"] = []
        sup, reactor = shared_supervisor(self, redis, path)
        sup.balancer.store.start()  # type: ignore[attr-defined]
        first, second = sup.workers[0], sup.workers[1]
        # worker 0 reserved 150; the fleet's bucket (other hosts spent too) is at -20 after
        redis.replies["EVALSHA"] = ["-20.0"]
        sup.received(first, [Spent([["per-ip", 60.0, "ip:10.0.0.9"]], 150, 0)])
        self.assertTrue(any(c[0] == "EVALSHA" and "-150.0" in c for c in redis.sent))
        reactor.advance(0)
        key = "per-ip\x1f60\x1fip:10.0.0.9"
        for worker in (first, second):
            self.assertIn({"t": "levels", "levels": [[key, 600.0, 10.0, -20.0]]},
                          lines(worker.transport))

    def test_a_worker_takes_the_levels_and_ignores_what_is_no_bucket(self) -> None:
        from txlb._cluster.local_store import TokenLevels

        clock = Clock()
        levels = TokenLevels(clock)
        bucket = ("b", 600.0, 10.0)
        taken = take_levels(levels, Levels([
            ["b", 600.0, 10.0, -20.0],
            ["c", 0, 10.0, 5.0],  # no capacity
            ["d", 600.0, -1, 5.0],  # no rate
            ["e", 600.0, 10.0, 601.0],  # above its capacity
            ["f", 600.0, 10.0, -600.0 * 61],  # past the debt bound
        ]))
        self.assertEqual((taken, levels.level(bucket), len(levels)), (1, -20.0, 1))


class FreedSlotsTests(SynchronousTestCase):
    def test_the_workers_releases_are_announced_and_others_wake_them(self) -> None:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write('backends = [{url = "http://10.0.0.1:8000", max_conns = 2}, '
                         '"10.0.0.2:8000"]\n')
        redis = FakeRedis()
        redis.replies["EVALSHA"] = ["2", "0", A, "1"]
        redis.replies["HGETALL"] = []
        sup, reactor = shared_supervisor(self, redis, path)
        store = sup.balancer.store
        assert isinstance(store, RedisStore)
        store.start()
        sup.balancer.pool.shared_state()  # the slots the workers are given
        worker = worker_view(self, sup.shared, 0)
        worker.take(A)
        worker.take(B)
        reactor.advance(SCAN_INTERVAL)
        reactor.advance(FLUSH_DELAY)
        worker.give_back(A)
        worker.give_back(B)  # no max_conns: nobody waits for it
        reactor.advance(SCAN_INTERVAL)
        reactor.advance(FLUSH_DELAY)
        published = [c for c in redis.sent if c[0] == "PUBLISH"]
        self.assertEqual(published, [("PUBLISH", store.freed_channel, f"host1 {A}")])
        # another replica's announcement: one fewer of theirs, the waiting worker kicked
        waiting = worker_view(self, sup.shared, 1)
        waiting.set_waiters(1)
        for each in sup.workers.values():
            each.transport.clear()  # type: ignore[union-attr]
        sup.balancer.slots.heard_freed(A)
        self.assertEqual(waiting.total(A), 0)
        self.assertIn(b"kick", sup.workers[1].transport.value())  # type: ignore[union-attr]


class WorkerConfigTests(SynchronousTestCase):
    def test_a_worker_never_connects_to_redis_itself(self) -> None:
        from txlb._workers.wire import config_blob

        config = build_config({"workers": "2", "backends": A,
                               "shared-state": "redis://:pw@127.0.0.1:1/0"}, {})
        own = SupervisorLink._own_config(config_blob(config))
        self.assertIsNone(own.shared_state)
        self.assertEqual(own.workers, 1)
