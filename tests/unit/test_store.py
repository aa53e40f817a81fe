"""
The store seam (txlb._cluster.store): the local store changes nothing, and a second store --
a tiny in-memory one shared by two pools, standing in for one shared between machines -- makes
two balancers agree on counts, drains, health and membership through exactly the calls the
pool makes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer
from zope.interface.verify import verifyObject

from txlb import BackendSpec, LoadBalancer
from txlb._cluster.local_store import LocalStore, TokenBuckets, TokenLevels
from txlb._cluster.pool import Pool
from txlb._cluster.shared_counts import SharedCounts
from txlb._cluster.store import (
    IBackendMarks,
    IBackendStore,
    IInFlightCounts,
    IRateBuckets,
    ITokenLevels,
    Marks,
    OwnMarks,
)
from txlb._scheduling.policies.least_conn import LeastConnections
from txlb._scheduling.router import Router

from ..helpers import ClientConnection, FakeUpstream

A, B = "127.0.0.1:8002", "127.0.0.1:8003"
SPECS = (BackendSpec("127.0.0.1", 8002), BackendSpec("127.0.0.1", 8003, max_conns=1))


@attrs.define
class _Table:
    """What the shared store holds: one row of in-flight counts per balancer, and marks."""

    slots: dict[str, int] = attrs.field(factory=dict)
    in_flight: defaultdict[tuple[str, int], int] = attrs.field(
        factory=lambda: defaultdict(int))
    started: defaultdict[int, int] = attrs.field(factory=lambda: defaultdict(int))
    marks: dict[str, tuple[BackendSpec, Marks]] = attrs.field(factory=dict)
    locked: bool = False


@implementer(IInFlightCounts)
@attrs.define
class _TableCounts:
    table: _Table
    me: str

    def register(self, key: str) -> int:
        return self.table.slots.setdefault(key, len(self.table.slots))

    def assign(self, key: str, slot: int) -> None:
        self.table.slots[key] = slot

    def slot(self, key: str) -> int:
        return self.table.slots[key]

    def take(self, key: str) -> None:
        self.table.in_flight[self.me, self.slot(key)] += 1
        self.table.started[self.slot(key)] += 1

    def give_back(self, key: str) -> None:
        self.table.in_flight[self.me, self.slot(key)] -= 1

    def untake(self, key: str) -> None:
        self.table.in_flight[self.me, self.slot(key)] -= 1
        self.table.started[self.slot(key)] -= 1

    def total(self, key: str) -> int:
        slot = self.slot(key)
        return sum(n for (_, s), n in self.table.in_flight.items() if s == slot)

    def totals(self) -> Sequence[int]:
        by_slot = sorted(self.table.slots.items(), key=lambda item: item[1])
        return [self.total(key) for key, _ in by_slot]

    def started(self, key: str) -> int:
        return self.table.started[self.slot(key)]

    def mine(self, key: str) -> int:
        return self.table.in_flight[self.me, self.slot(key)]

    def lock(self) -> None:
        assert not self.table.locked
        self.table.locked = True

    def unlock(self) -> None:
        self.table.locked = False


@implementer(IBackendMarks)
@attrs.define
class _TableMarks:
    table: _Table

    def save(self, spec: BackendSpec, marks: Marks, reason: str = "",
             origin: str | None = None) -> None:
        self.table.marks[spec.key] = (spec, marks)

    def configured(self) -> None:
        pass

    def forget(self, key: str) -> None:
        pass

    def origin(self, key: str) -> str | None:
        return None

    def members(self) -> Sequence[tuple[BackendSpec, Marks]]:
        return list(self.table.marks.values())


@implementer(IRateBuckets)
class _Refusing:
    def take(self, key: str) -> float:
        return 7.0


@implementer(IBackendStore)
@attrs.define
class _TableStore:
    """One balancer's view of the shared table."""

    table: _Table
    me: str
    counts: IInFlightCounts = attrs.field(init=False)
    marks: IBackendMarks = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.counts = _TableCounts(self.table, self.me)
        self.marks = _TableMarks(self.table)

    def rate_buckets(self, rate: float, burst: int, clock: object) -> IRateBuckets:
        return _Refusing()

    def token_levels(self, clock: IReactorTime) -> ITokenLevels:
        return TokenLevels(clock)


class InterfaceTests(SynchronousTestCase):
    def test_the_local_parts_provide_their_interfaces(self) -> None:
        self.assertTrue(verifyObject(IBackendStore, LocalStore()))
        self.assertTrue(verifyObject(IBackendMarks, OwnMarks()))
        self.assertTrue(verifyObject(IRateBuckets, TokenBuckets(1, 1, Clock())))
        self.assertTrue(verifyObject(ITokenLevels, TokenLevels(Clock())))
        counts = SharedCounts.create(1, 4)
        self.addCleanup(counts.close)
        self.assertTrue(verifyObject(IInFlightCounts, counts))

    def test_the_test_store_provides_them_too(self) -> None:
        store = _TableStore(_Table(), "one")
        self.assertTrue(verifyObject(IBackendStore, store))
        self.assertTrue(verifyObject(IInFlightCounts, store.counts))
        self.assertTrue(verifyObject(IBackendMarks, store.marks))

    def test_the_local_store_makes_buckets_on_the_given_clock(self) -> None:
        clock = Clock()
        buckets = LocalStore().rate_buckets(1, 1, clock)
        self.assertEqual(buckets.take("k"), 0.0)
        self.assertEqual(buckets.take("k"), 1.0)
        clock.advance(1)
        self.assertEqual(buckets.take("k"), 0.0)


class LocalStoreTests(SynchronousTestCase):
    def test_a_pool_uses_the_local_store_by_default(self) -> None:
        pool = Pool(SPECS)
        self.assertIsInstance(pool.store, LocalStore)
        self.assertIsNone(pool.shared)

    def test_shared_counts_become_the_local_stores_counts(self) -> None:
        counts = _TableCounts(_Table(), "one")
        pool = Pool(SPECS, shared=counts)
        self.assertIs(pool.store.counts, counts)
        self.assertIs(pool.shared, counts)

    def test_own_marks_keep_nothing_so_refresh_changes_nothing(self) -> None:
        pool = Pool(SPECS)
        changes: list[None] = []
        pool.on_change.append(lambda: changes.append(None))
        a = pool.get(A)
        assert a is not None
        pool.drain(a)
        pool.mark_down(a, "test")
        del changes[:]
        pool.refresh()
        self.assertEqual((a.health.draining, a.health.healthy, changes), (True, False, []))
        self.assertEqual(OwnMarks().members(), ())


class SharedStoreTests(SynchronousTestCase):
    """Two pools over one in-memory store: what one balancer does, the other sees."""

    def setUp(self) -> None:
        self.clock = Clock()
        table = _Table()
        self.table = table
        self.one = Pool(SPECS, clock=self.clock, store=_TableStore(table, "one"))
        self.two = Pool(SPECS, clock=self.clock, store=_TableStore(table, "two"))

    def backend(self, pool: Pool, key: str):  # type: ignore[no-untyped-def]
        backend = pool.get(key)
        assert backend is not None
        return backend

    def test_membership_is_saved_as_backends_are_added(self) -> None:
        self.assertEqual(self.table.marks, {A: (SPECS[0], Marks()), B: (SPECS[1], Marks())})

    def test_a_drain_reaches_the_other_balancer(self) -> None:
        self.one.drain(self.backend(self.one, A))
        self.assertFalse(self.backend(self.two, A).health.draining)
        changes: list[None] = []
        self.two.on_change.append(lambda: changes.append(None))
        self.two.refresh()
        self.assertTrue(self.backend(self.two, A).health.draining)
        self.assertEqual(len(changes), 1)  # waiting requests look again
        self.one.undrain(self.backend(self.one, A))
        self.two.refresh()
        self.assertFalse(self.backend(self.two, A).health.draining)

    def test_a_health_verdict_reaches_the_other_balancer(self) -> None:
        self.one.mark_down(self.backend(self.one, A), "refused")
        self.two.refresh()
        other = self.backend(self.two, A)
        self.assertFalse(other.health.healthy)
        self.clock.advance(5)
        self.one.mark_up(self.backend(self.one, A))
        self.two.refresh()
        self.assertTrue(other.health.healthy)
        self.assertEqual(other.slow_start.up_since, 5)  # its slow start counts from the news

    def test_a_removal_reaches_the_other_balancer_and_waits_for_its_requests(self) -> None:
        lease = self.two.slots.acquire(self.backend(self.two, A))
        self.one.remove(self.backend(self.one, A))
        self.assertIsNone(self.one.get(A))  # idle here: gone at once
        self.two.refresh()
        self.assertTrue(self.backend(self.two, A).health.removing)  # still busy there
        lease.release()
        self.assertIsNone(self.two.get(A))

    def test_a_backend_added_by_one_reaches_the_other_with_its_marks(self) -> None:
        spec = BackendSpec("127.0.0.1", 8004)
        added = self.one.add(spec)
        self.one.add(BackendSpec("127.0.0.1", 8005))
        self.one.mark_down(added, "refused")
        self.two.refresh()
        other = self.backend(self.two, spec.key)
        self.assertEqual((other.spec, other.health.healthy), (spec, False))
        self.assertEqual([b.key for b in self.two], [A, B, spec.key, "127.0.0.1:8005"])
        self.assertTrue(self.backend(self.two, "127.0.0.1:8005").health.healthy)

    def test_a_healthy_newcomer_wakes_waiting_requests(self) -> None:
        self.one.add(BackendSpec("127.0.0.1", 8005))
        changes: list[None] = []
        self.two.on_change.append(lambda: changes.append(None))
        self.two.refresh()
        self.assertEqual(len(changes), 1)

    def test_a_removed_backend_is_not_added_back(self) -> None:
        self.one.remove(self.backend(self.one, A))
        self.two.refresh()
        self.assertIsNone(self.two.get(A))
        self.two.refresh()
        self.assertIsNone(self.two.get(A))
        self.one.add(SPECS[0])  # an operator adds it again
        self.two.refresh()
        self.assertTrue(self.backend(self.two, A).health.healthy)

    def test_counts_are_shared_so_max_conns_holds_across_balancers(self) -> None:
        self.one.slots.acquire(self.backend(self.one, B))  # B takes one request at most
        self.two.refresh()
        self.assertEqual(self.backend(self.two, B).counts.active, 1)
        self.assertEqual(self.backend(self.two, B).counts.requests, 1)
        router = Router(self.two, LeastConnections(), self.clock)
        waiting = router.acquire(exclude=frozenset({A}))
        self.assertNoResult(waiting)  # B is full with the other balancer's request
        waiting.cancel()
        self.failureResultOf(waiting)

    def test_the_stores_own_rate_buckets_decide(self) -> None:
        buckets = self.one.store.rate_buckets(10, 10, self.clock)
        self.assertEqual(buckets.take("ip:10.0.0.1"), 7.0)


class BalancerStoreTests(SynchronousTestCase):
    """``LoadBalancer(store=...)``: the seam an embedder (and the scale-out work) plugs into."""

    def build(self, **options: object) -> LoadBalancer:
        return LoadBalancer([A, B], reactor=Clock(), agent=FakeUpstream(),
                            probe_agent=FakeUpstream(), log_file="none", **options)

    def test_the_local_store_by_default_with_the_workers_counts(self) -> None:
        counts = _TableCounts(_Table(), "one")
        lb = self.build(inflight=counts)
        self.assertIsInstance(lb.store, LocalStore)
        self.assertIs(lb.pool.shared, counts)

    def test_a_given_store_holds_the_pools_marks_and_the_rate_buckets(self) -> None:
        table = _Table()
        lb = self.build(store=_TableStore(table, "one"), rate_limit="100/s")
        self.assertEqual(set(table.marks), {A, B})
        lb.pool.drain(lb.pool.get(A))  # type: ignore[arg-type]
        self.assertTrue(table.marks[A][1].draining)
        client = ClientConnection(lb.site(), peer="10.1.2.3")
        client.request(b"POST", b"/v1/completions", body=b'{"prompt": "x"}')
        refused = client.response()  # the store's buckets refuse everyone, for 7 s
        self.assertEqual((refused.status, refused.header(b"retry-after")), (429, [b"7"]))

    def test_a_store_brings_its_own_counts(self) -> None:
        with self.assertRaises(TypeError):
            self.build(store=_TableStore(_Table(), "one"),
                       inflight=_TableCounts(_Table(), "one"))
