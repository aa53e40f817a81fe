"""
``--workers``' fair handoff: a slot freed in one worker goes to the least served tenant
waiting in any worker.  Two workers' real pools, routers and fair shares over one shared
table, in memory; the supervisor's two jobs -- relaying each counter change, and kicking
the other worker's queue when a slot frees -- done by the test, as it does them.
"""

from __future__ import annotations

from pathlib import Path

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from txlb._cluster.pool import Pool
from txlb._cluster.shared_counts import FAIR_TENANTS
from txlb._cluster.slots import Lease
from txlb._config import build_config
from txlb._scheduling.classes import PriorityClasses
from txlb._scheduling.fairness import FairShares
from txlb._scheduling.handoff import HANDOFF_GRACE
from txlb._scheduling.policies.least_conn import LeastConnections
from txlb._scheduling.request import RoutingRequest
from txlb._scheduling.router import Router
from txlb._workers.handoff import FairHandoff

from .test_workers import KEYS, Table, specs

KEYS_FILE = Path(__file__).parent.parent / "fixtures" / "keys" / "keys.toml"


def config() -> object:
    return build_config({"backends": KEYS[0], "auth": "keys", "keys-file": str(KEYS_FILE),
                         "log_file": "none"}, {})


class Fleet:
    """Two workers over one table, one backend at max_conns 1, VTC on."""

    def __init__(self, test: SynchronousTestCase, handoff: bool = True) -> None:
        self.table = Table(test)
        self.clock = Clock()
        self.conf = config()
        supervisor = Pool(specs(KEYS[0], max_conns=1), clock=self.clock,
                          shared=self.table.supervisor)
        self.routers: list[Router] = []
        self.fairness: list[FairShares] = []
        self.refused: list[object] = []  # the failures of requests refused
        for view in self.table.rows:
            pool = Pool(clock=self.clock, shared=view)
            pool.mirror(supervisor.shared_state())
            fair = FairShares(enabled=True)
            fair.reconfigure(self.conf)  # type: ignore[arg-type]
            classes = PriorityClasses(self.conf)  # type: ignore[arg-type]
            router = Router(pool, LeastConnections(), self.clock, classes=classes,
                            fairness=fair)
            if handoff:  # as txlb._workers.worker wires it
                fair_handoff = FairHandoff(view, classes, fair)
                fair_handoff.reconfigure(self.conf)  # type: ignore[arg-type]
                router.tell_queue_length(fair_handoff.queue_changed)
                router.handoff.defer_with(fair_handoff.defers)
                fair.lift_with(fair_handoff.waiting_elsewhere)
            else:
                router.tell_queue_length(view.set_waiters)
            self.routers.append(router)
            self.fairness.append(fair)
        for here, there in ((0, 1), (1, 0)):  # the supervisor relays each change
            self.fairness[here].report_to(
                lambda tenant, amount, there=there: self.fairness[there].served_elsewhere(
                    tenant, amount))

    def request(self, worker: int, tenant: str, prompt: int = 100) -> RoutingRequest:
        body = b'{"prompt": "' + b"x" * (4 * prompt) + b'", "max_tokens": 10}'
        request = RoutingRequest(tenant=tenant, body=body)
        self.fairness[worker].price(request, b"/v1/completions", b"POST")
        return request

    def acquire(self, worker: int, request: RoutingRequest) -> list[Lease]:
        got: list[Lease] = []

        def granted(lease: Lease) -> None:
            self.fairness[worker].granted(request)
            got.append(lease)

        self.routers[worker].acquire(request).addCallbacks(granted, self.refused.append)
        return got

    def kick(self, worker: int) -> None:
        """The supervisor heard a slot end elsewhere: this worker's queue looks again."""
        self.routers[worker].pool.slots.capacity_changed()


class FairHandoffTests(SynchronousTestCase):
    def scenario(self, fleet: Fleet) -> tuple[list[Lease], list[Lease], list[Lease]]:
        """
        Worker 0 holds the slot for alpha (now well served); beta, never served, waits
        in worker 1; then another alpha request queues in worker 0.
        """
        held = fleet.acquire(0, fleet.request(0, "alpha", prompt=5000))
        self.assertEqual(len(held), 1)
        beta = fleet.acquire(1, fleet.request(1, "beta"))
        alpha = fleet.acquire(0, fleet.request(0, "alpha"))
        self.assertEqual((alpha, beta), ([], []))
        self.assertLess(fleet.fairness[0].counters.get("beta", 0.0),
                        fleet.fairness[0].counters["alpha"])
        return held, alpha, beta

    def test_the_freed_slot_goes_to_the_other_workers_less_served_tenant(self) -> None:
        fleet = Fleet(self)
        held, alpha, beta = self.scenario(fleet)
        held[0].release()  # worker 0's own dispatch runs first ...
        self.assertEqual(alpha, [])  # ... and leaves the slot
        fleet.kick(1)
        self.assertEqual(len(beta), 1)
        fleet.clock.advance(HANDOFF_GRACE)  # the grace ends: the slot is beta's already
        self.assertEqual(alpha, [])
        beta[0].release()
        fleet.kick(0)
        self.assertEqual(len(alpha), 1)  # nothing left elsewhere: alpha's turn

    def test_without_the_handoff_each_worker_serves_its_own(self) -> None:
        fleet = Fleet(self, handoff=False)
        held, alpha, beta = self.scenario(fleet)
        held[0].release()
        fleet.kick(1)
        self.assertEqual((len(alpha), beta), (1, []))

    def test_a_slot_left_and_not_taken_is_served_here_after_the_grace(self) -> None:
        """The other worker never looks (or its waiter cannot use the slot): not lost."""
        fleet = Fleet(self)
        held, alpha, beta = self.scenario(fleet)
        held[0].release()
        fleet.clock.advance(HANDOFF_GRACE * 0.9)
        self.assertEqual(alpha, [])
        fleet.clock.advance(HANDOFF_GRACE * 0.2)
        self.assertEqual((len(alpha), beta), (1, []))

    def test_the_more_served_waiter_elsewhere_does_not_hold_a_slot_here(self) -> None:
        """Worker 1 holds beta's waiter and alpha is better served: worker 1 keeps it."""
        fleet = Fleet(self)
        held = fleet.acquire(1, fleet.request(1, "beta", prompt=50))
        beta = fleet.acquire(1, fleet.request(1, "beta"))
        alpha = fleet.acquire(0, fleet.request(0, "alpha", prompt=5000))
        self.assertEqual((alpha, beta), ([], []))
        held[0].release()
        self.assertEqual(len(beta), 1)  # alpha's counter, lifted on arrival, is higher

    def test_another_class_is_not_waited_for(self) -> None:
        fleet = Fleet(self)
        held, alpha, beta = self.scenario(fleet)
        classes = fleet.routers[0].classes.order
        other = next(c for c in classes if c.rank != fleet.routers[0].classes.get("default").rank)
        handoff = FairHandoff(fleet.table.rows[0], fleet.routers[0].classes, fleet.fairness[0])
        handoff.reconfigure(fleet.conf)  # type: ignore[arg-type]
        self.assertTrue(handoff.defers(fleet.routers[0].classes.get("default"), "alpha"))
        self.assertFalse(handoff.defers(other, "alpha"))
        self.assertFalse(handoff.defers(fleet.routers[0].classes.get("default"), "beta"))
        self.assertFalse(handoff.defers(fleet.routers[0].classes.get("default"), None))

    def test_fifo_never_hands_off(self) -> None:
        fleet = Fleet(self)
        held, alpha, beta = self.scenario(fleet)
        for fair in fleet.fairness:
            fair.enabled = False
        held[0].release()
        self.assertEqual(len(alpha), 1)

    def test_a_shutdown_cancels_the_grace(self) -> None:
        fleet = Fleet(self)
        held, alpha, beta = self.scenario(fleet)
        held[0].release()
        graces = [call for call in fleet.clock.getDelayedCalls()
                  if getattr(call.func, "__name__", "") == "_grace_over"]
        self.assertEqual(len(graces), 1)
        fleet.routers[0].abandon_queue("stopping")
        self.assertFalse(graces[0].active())
        self.assertEqual((alpha, len(fleet.refused)), ([], 1))


class FairCellsTests(SynchronousTestCase):
    def test_a_bitmap_round_trips_every_word_and_the_sign_bit(self) -> None:
        table = Table(self)
        bits = (1 << 0) | (1 << 63) | (1 << 64) | (1 << (FAIR_TENANTS - 1))
        table.rows[0].set_waiters(3)
        table.rows[0].set_fair_waiting(2, bits)
        self.assertEqual(list(table.rows[1].others_fair_waiting()), [(2, bits)])
        self.assertEqual(list(table.rows[0].others_fair_waiting()), [])  # not its own

    def test_a_worker_without_waiters_publishes_nothing(self) -> None:
        table = Table(self)
        table.rows[0].set_fair_waiting(1, 0b101)
        self.assertEqual(list(table.rows[1].others_fair_waiting()), [])  # waiters 0
        table.rows[0].set_waiters(1)
        table.rows[0].set_fair_waiting(-1, 0)
        self.assertEqual(list(table.rows[1].others_fair_waiting()), [])

    def test_a_retired_row_publishes_nothing(self) -> None:
        table = Table(self)
        table.rows[0].set_waiters(2)
        table.rows[0].set_fair_waiting(0, 1)
        table.supervisor.retire(0)
        self.assertEqual(list(table.rows[1].others_fair_waiting()), [])
