"""
A reload under ``--workers``: the supervisor passes the config it applied to every worker
(a ``reload`` message) and to those it starts later; a worker applies it with the same
reload code, leaving its backends to the supervisor's pool.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from txlb import build_config
from txlb._balancer import LoadBalancer
from txlb._reload import ReloadRefused
from txlb._workers.wire import Reload, config_blob, config_from, decode, encode
from txlb._workers.worker import SupervisorLink

from ..helpers import FakeUpstream
from .test_workers_supervisor import SpawningReactor, supervisor


def sent(transport: StringTransport) -> list[object]:
    return [decode(line) for line in transport.value().splitlines()]


class SupervisorPassesItOnTests(SynchronousTestCase):
    def test_every_worker_and_every_later_one_gets_the_applied_config(self) -> None:
        reactor = SpawningReactor()
        sup = supervisor(self, reactor)
        sup.privilegedStartService()
        sup.startService()
        transports = [StringTransport() for _ in reactor.spawned]
        for (worker, _), transport in zip(reactor.spawned, transports, strict=True):
            worker.transport = transport
        new = build_config({"workers": "2", "backends": "127.0.0.1:9,127.0.0.1:10",
                            "listen": "tcp:0:interface=127.0.0.1", "log_file": "none",
                            "admin": "none", "queue-timeout": "4"}, {})
        self.assertEqual(sup.balancer.reload(new), 2)
        for transport in transports:
            reloads = [m for m in sent(transport) if isinstance(m, Reload)]
            self.assertEqual(len(reloads), 1)
            self.assertEqual(config_from(reloads[0].config).queue_timeout, 4)
        # a worker started after the reload (a respawn) is sent the new config in its Hello
        self.assertEqual(config_from(sup._config_blob).queue_timeout, 4)

    def test_a_refused_reload_sends_nothing(self) -> None:
        reactor = SpawningReactor()
        sup = supervisor(self, reactor)
        sup.privilegedStartService()
        sup.startService()
        transports = [StringTransport() for _ in reactor.spawned]
        for (worker, _), transport in zip(reactor.spawned, transports, strict=True):
            worker.transport = transport
        self.failureResultOf(sup.balancer.reload_from_source(), ReloadRefused)  # no --config
        for transport in transports:
            self.assertEqual([m for m in sent(transport) if isinstance(m, Reload)], [])


class WorkerAppliesItTests(SynchronousTestCase):
    def test_a_worker_takes_the_settings_and_leaves_its_backends_to_the_supervisor(
            self) -> None:
        config = build_config({"backends": "127.0.0.1:9", "log-file": "none"}, {})
        clock = Clock()
        link = SupervisorLink(clock, 0)
        link.balancer = LoadBalancer(config=config, reactor=clock, agent=FakeUpstream(),
                                     probe_agent=FakeUpstream())
        new = build_config({"backends": "127.0.0.1:10", "log-file": "none",
                            "queue-timeout": "4", "policy": "p2c"}, {})
        link.dataReceived(encode(Reload(config_blob(new))))
        balancer = link.balancer
        self.assertEqual((balancer.router.queue_timeout, balancer.router.policy.name),
                         (4, "p2c"))
        self.assertEqual([b.key for b in balancer.pool], ["127.0.0.1:9"])  # the mirror's
        self.assertEqual(balancer.config.log_file, "none")

    def test_a_bad_blob_is_logged_and_changes_nothing(self) -> None:
        config = build_config({"backends": "127.0.0.1:9", "log-file": "none"}, {})
        clock = Clock()
        link = SupervisorLink(clock, 0)
        link.balancer = LoadBalancer(config=config, reactor=clock, agent=FakeUpstream(),
                                     probe_agent=FakeUpstream())
        link.dataReceived(encode(Reload("bm90IGEgcGlja2xl")))
        self.assertIs(link.balancer.config, config)
        self.assertTrue(self.flushLoggedErrors())


class MirroredRespecificationTests(SynchronousTestCase):
    def test_a_worker_keeps_its_backend_object_and_requests_when_the_spec_changes(
            self) -> None:
        """The supervisor's State after a reload changed a weight: the same backend, in place."""
        from txlb._cluster.pool import Pool
        from txlb._config import BackendSpec

        supervisor_pool = Pool((BackendSpec("127.0.0.1", 9, weight=1, max_conns=2),))
        worker_pool = Pool()
        worker_pool.mirror(supervisor_pool.shared_state())
        backend = worker_pool.get("127.0.0.1:9")
        assert backend is not None
        lease = worker_pool.slots.acquire(backend)
        source = supervisor_pool.get("127.0.0.1:9")
        assert source is not None
        supervisor_pool.respecify(source, BackendSpec("127.0.0.1", 9, weight=4, max_conns=1))
        worker_pool.mirror(supervisor_pool.shared_state())
        self.assertIs(worker_pool.get("127.0.0.1:9"), backend)
        self.assertEqual((backend.spec.weight, backend.spec.max_conns, backend.counts.active),
                         (4, 1, 1))
        lease.release()
        self.assertEqual(backend.counts.active, 0)


class SharedTableTests(SynchronousTestCase):
    def test_more_new_backends_than_the_shared_table_holds_is_refused_whole(self) -> None:
        import os

        from txlb._cluster.shared_counts import SharedCounts

        shared = SharedCounts.create(1, slots=3)
        self.addCleanup(lambda: os.close(shared.fd))
        self.addCleanup(shared.close)
        config = build_config({"backends": "127.0.0.1:9", "log-file": "none"}, {})
        lb = LoadBalancer(config=config, reactor=Clock(), agent=FakeUpstream(),
                          probe_agent=FakeUpstream(), inflight=shared)
        too_many = build_config({"backends": ",".join(f"127.0.0.1:{p}" for p in range(9, 13)),
                                 "log-file": "none", "queue-timeout": "4"}, {})
        with self.assertRaises(ReloadRefused) as caught:
            lb.reload(too_many)
        self.assertIn("shared table", str(caught.exception))
        self.assertEqual(([b.key for b in lb.pool], lb.router.queue_timeout),
                         (["127.0.0.1:9"], 30))
        fits = build_config({"backends": "127.0.0.1:9,127.0.0.1:10,127.0.0.1:11",
                             "log-file": "none"}, {})
        self.assertEqual(lb.reload(fits), 2)
        self.assertEqual(len(lb.pool), 3)
