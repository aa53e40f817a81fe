"""
The fair queue under ``--workers``: every change of a tenant's counter that one worker makes
reaches the supervisor and every other worker, so a tenant spreading its connections over
the workers is counted once, and a respawned worker starts with the fleet's counters.
"""

from __future__ import annotations

import os
from typing import Any

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from txlb import LoadBalancer
from txlb._cluster.shared_counts import SharedCounts
from txlb._scheduling.fairness import FairShares
from txlb._scheduling.request import RoutingRequest
from txlb._workers.supervisor import WorkerSupervisor
from txlb._workers.wire import Served, WireError, decode, encode
from txlb._workers.worker import SupervisorLink

from ..helpers import FakeUpstream
from .test_budgets_workers import config
from .test_workers_supervisor import SpawningReactor


class WireTests(SynchronousTestCase):
    def test_a_change_round_trips(self) -> None:
        self.assertEqual(decode(encode(Served("search", -12.5))), Served("search", -12.5))

    def test_a_hostile_change_is_refused(self) -> None:
        for line in (b'{"t": "served", "tenant": "a b", "amount": 1}',
                     b'{"t": "served", "tenant": "a", "amount": 1e300}',
                     b'{"t": "served", "tenant": "a", "amount": "1"}',
                     b'{"t": "served", "tenant": "a", "amount": true}',
                     b'{"t": "served", "tenant": "' + b"a" * 65 + b'", "amount": 1}'):
            with self.assertRaises(WireError):
                decode(line)


class ConvergenceTests(SynchronousTestCase):
    def test_two_processes_told_each_others_changes_hold_the_same_counters(self) -> None:
        """Every change is an addition (lifts too): the order they arrive in is no matter."""
        one, two = FairShares(enabled=True), FairShares(enabled=True)
        to_two: list[tuple[str, float]] = []
        to_one: list[tuple[str, float]] = []
        one.report_to(lambda tenant, amount: to_two.append((tenant, amount)))
        two.report_to(lambda tenant, amount: to_one.append((tenant, amount)))
        for fair, tenant in ((one, "a"), (two, "b"), (one, "a"), (two, "a")):
            request = RoutingRequest(tenant=tenant, body=b'{"max_tokens": 40}',
                                     json={"max_tokens": 40})
            fair.joined("default", request)
            fair.price(request, b"/v1/completions", b"POST")
            fair.granted(request)
        for tenant, amount in reversed(to_two):
            two.served_elsewhere(tenant, amount)
        for tenant, amount in to_one:
            one.served_elsewhere(tenant, amount)
        self.assertEqual(one.counters, two.counters)
        self.assertGreater(one.counters["a"], one.counters["b"])


class SupervisorTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = SpawningReactor()
        shared = SharedCounts.create(3)
        self.addCleanup(lambda: os.close(shared.fd))
        self.addCleanup(shared.close)
        self.balancer = LoadBalancer(config=config(workers="3"), reactor=self.reactor,
                                     inflight=shared)
        self.sup = WorkerSupervisor(self.balancer, shared, self.reactor, 3)
        self.addCleanup(lambda: self.sup.socket.close() if self.sup.socket else None)
        self.sup.privilegedStartService()
        self.sup.startService()
        for worker, _ in self.reactor.spawned:
            worker.transport = StringTransport()
            worker.transport.clear()

    def sent(self, index: int) -> list[Any]:
        transport = self.sup.workers[index].transport
        assert isinstance(transport, StringTransport)
        return [decode(line) for line in transport.value().splitlines()]

    def test_a_workers_change_reaches_the_others_and_the_supervisor(self) -> None:
        self.sup.received(self.sup.workers[0], [Served("search", 300.0)])
        self.assertEqual(self.sent(0), [])
        self.assertEqual(self.sent(1), [Served("search", 300.0)])
        self.assertEqual(self.sent(2), [Served("search", 300.0)])
        self.assertEqual(self.balancer.fairness.counters, {"search": 300.0})

    def test_a_respawned_worker_starts_with_the_fleets_counters(self) -> None:
        self.sup.received(self.sup.workers[0], [Served("search", 300.0),
                                                Served("search", -20.0)])
        self.reactor.spawned.clear()
        spawn = self.reactor.spawnProcess

        def connected(protocol: Any, *args: Any, **kwargs: Any) -> Any:
            protocol.transport = StringTransport()
            return spawn(protocol, *args, **kwargs)

        self.reactor.spawnProcess = connected  # type: ignore[method-assign]
        self.sup._spawn(2)
        (worker, _), = self.reactor.spawned
        lines = [decode(line) for line in worker.transport.value().splitlines()]
        self.assertIn(Served("search", 280.0), lines)
        link = SupervisorLink(Clock(), 2)
        link.balancer = LoadBalancer(config=config(), reactor=Clock(), agent=FakeUpstream(),
                                     probe_agent=FakeUpstream())
        link.dataReceived(b"".join(encode(m) for m in lines if isinstance(m, Served)))
        self.assertEqual(link.balancer.fairness.counters, {"search": 280.0})
