"""
Token budgets under ``--workers``: what one worker's budgets take and give back reaches
the supervisor and every other worker, so a client cannot get N times its budget by
spreading its connections over N workers.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from txlb import LoadBalancer, build_config
from txlb._cluster.shared_counts import SharedCounts
from txlb._workers.supervisor import WorkerSupervisor
from txlb._workers.wire import BudgetRefused, Spent, decode, encode
from txlb._workers.worker import SupervisorLink

from ..helpers import ClientConnection, FakeResponse, FakeUpstream
from .test_workers_supervisor import SpawningReactor

BUDGETS = [{"name": "per-ip", "key": "ip", "tokens_per_minute": 600}]
WHERE = ["per-ip", 60.0, "ip:10.1.2.3"]
BUCKET = ("per-ip\x1f60\x1fip:10.1.2.3", 600.0, 10.0)


def config(**more: Any) -> Any:
    return build_config({"backends": "127.0.0.1:9", "log_file": "none", "admin": "none",
                         "listen": "tcp:0:interface=127.0.0.1", "budgets": BUDGETS,
                         **more}, {})


class SupervisorRelayTests(SynchronousTestCase):
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

    def test_what_one_worker_spent_reaches_the_others_and_the_supervisor(self) -> None:
        spent = Spent([WHERE], 450.0, 0)
        self.sup.received(self.sup.workers[0], [spent])
        self.assertEqual(self.sent(0), [])  # not back to the one that spent it
        self.assertEqual(self.sent(1), [spent])
        self.assertEqual(self.sent(2), [spent])
        budgets = self.balancer.budgets
        self.assertEqual(budgets.levels.level(BUCKET), 150)
        # reconciled: 300 of the 450 given back, the request cost 150
        self.sup.received(self.sup.workers[2], [Spent([WHERE], -300.0, 150)])
        self.assertEqual(budgets.levels.level(BUCKET), 450)
        self.assertEqual(budgets.charged, {"per-ip": 150})
        self.assertEqual(len(self.sent(0)), 1)
        self.assertEqual(self.balancer.budgets.status()["budget_keys_tracked"], 1)

    def test_refusals_are_counted_in_the_supervisors_metrics(self) -> None:
        self.sup.received(self.sup.workers[1], [BudgetRefused("per-ip"),
                                                BudgetRefused("not-a-budget")])
        sample = self.balancer.metrics.registry.get_sample_value
        self.assertEqual(sample("txlb_budget_refused_total", {"budget": "per-ip"}), 1)
        self.assertIsNone(sample("txlb_budget_refused_total", {"budget": "not-a-budget"}))

    def test_a_respawned_worker_starts_with_the_fleets_levels(self) -> None:
        self.sup.received(self.sup.workers[0], [Spent([WHERE], 450.0, 0)])
        other = ["per-ip", 60.0, "ip:10.9.9.9"]
        self.sup.received(self.sup.workers[1], [Spent([other], 30.0, 0),
                                                Spent([other], -30.0, 0)])  # full again
        self.reactor.spawned.clear()
        spawn = self.reactor.spawnProcess

        def connected(protocol: Any, *args: Any, **kwargs: Any) -> Any:
            protocol.transport = StringTransport()  # as spawnProcess connects it
            return spawn(protocol, *args, **kwargs)

        self.reactor.spawnProcess = connected  # type: ignore[method-assign]
        self.sup._spawn(2)  # as after worker 2 died
        (worker, _), = self.reactor.spawned
        lines = [decode(line) for line in worker.transport.value().splitlines()]
        self.assertEqual(lines[0].kind, "hello")
        self.assertEqual(lines[1:], [Spent([WHERE], 450.0, 0)])
        # what the worker does with it: its levels are the supervisor's
        link = SupervisorLink(Clock(), 2)
        link.balancer = LoadBalancer(config=config(), reactor=Clock(), agent=FakeUpstream(),
                                     probe_agent=FakeUpstream())
        link.dataReceived(b"".join(encode(message) for message in lines[1:]))
        self.assertEqual(link.balancer.budgets.levels.level(BUCKET), 150)

    def test_buckets_of_budgets_it_does_not_have_are_ignored(self) -> None:
        self.sup.received(self.sup.workers[0], [Spent([["gone", 60, "ip:x"]], 5.0, 5)])
        self.assertEqual(len(self.balancer.budgets.levels), 0)
        self.assertEqual(self.balancer.budgets.charged, {})


class WorkerSideTests(SynchronousTestCase):
    """A worker: its budgets report what they spend, and apply what the others spent."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.link = SupervisorLink(self.clock, 0)
        self.lines: list[bytes] = []
        self.link.send = self.lines.append  # type: ignore[method-assign]
        self.upstream = FakeUpstream()
        balancer = LoadBalancer(config=config(), reactor=self.clock, agent=self.upstream,
                                probe_agent=FakeUpstream(), rng=random.Random(1))
        self.link.balancer = balancer
        budgets = balancer.budgets
        budgets.on_spent = lambda buckets, amount, charged: self.link.report(
            Spent([list(where) for where in buckets], amount, charged))
        budgets.on_refused = lambda name: self.link.report(BudgetRefused(name))
        self.budgets = budgets
        self.site = balancer.site()

    def test_another_workers_spending_is_applied_here(self) -> None:
        self.link.dataReceived(encode(Spent([WHERE], 590.0, 0)))
        self.assertEqual(self.budgets.levels.level(BUCKET), 10)
        client = ClientConnection(self.site)
        client.request(b"POST", b"/v1/completions",
                       body=json.dumps({"prompt": "x" * 100, "max_tokens": 5}).encode())
        self.assertEqual(client.response().status, 429)
        self.assertEqual(decode(self.lines[-1][:-1]), BudgetRefused("per-ip"))

    def test_its_own_reservations_and_reconciliations_are_reported(self) -> None:
        client = ClientConnection(self.site)
        body = json.dumps({"prompt": "x" * 108, "max_tokens": 50}).encode()
        self.assertEqual(len(body), 140)  # 35 + 50
        client.request(b"POST", b"/v1/completions", body=body)
        self.assertEqual(decode(self.lines[-1][:-1]), Spent([WHERE], 85, 0))
        answer = json.dumps({"choices": [{"text": "hi"}],
                             "usage": {"prompt_tokens": 20, "completion_tokens": 10}}).encode()
        response = self.upstream.last.respond(FakeResponse(
            200, [(b"Content-Type", b"application/json")], length=len(answer)))
        response.send(answer)
        response.end()
        spent = [decode(line[:-1]) for line in self.lines if b'"spent"' in line]
        self.assertEqual(spent[-1], Spent([WHERE], -55, 30))
