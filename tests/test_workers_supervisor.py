"""
``--workers N``: the supervisor (txlb._supervisor) and the worker's side of its pipes
(txlb._workerproc) as services and protocols in memory, with a reactor that records the
processes it would spawn.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from txlb import build_config
from txlb._balancer import LoadBalancer
from txlb._shm import SharedCounts
from txlb._supervisor import WorkerSupervisor

from .test_workers import KEYS, SharedPools, specs


class SpawningReactor(MemoryReactorClock):
    """Records ``spawnProcess`` calls (and can be told to fail the next ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.spawned: list[tuple[Any, list[str]]] = []
        self.failures = 0

    def spawnProcess(self, protocol: Any, executable: Any, args: Any = (), env: Any = None,
                     path: Any = None, uid: Any = None, gid: Any = None, usePTY: Any = False,
                     childFDs: Any = None) -> Any:
        if self.failures:
            self.failures -= 1
            raise OSError(24, "Too many open files")
        self.spawned.append((protocol, list(args)))
        return None


def supervisor(test: SynchronousTestCase, reactor: Any = None,
               workers: int = 2) -> WorkerSupervisor:
    config = build_config({"workers": str(workers), "backends": "127.0.0.1:9",
                           "listen": "tcp:0:interface=127.0.0.1", "log_file": "none",
                           "admin": "none"}, {})
    shared = SharedCounts.create(workers)
    test.addCleanup(lambda: os.close(shared.fd))
    test.addCleanup(shared.close)
    reactor = reactor if reactor is not None else SpawningReactor()
    balancer = LoadBalancer(config=config, reactor=reactor, inflight=shared)
    result = WorkerSupervisor(balancer, shared, reactor, workers)

    def close() -> None:
        if result.socket is not None:
            result.socket.close()

    test.addCleanup(close)
    return result


class PrivilegedStartTests(SynchronousTestCase):
    def test_the_port_is_bound_before_privileges_are_dropped(self) -> None:
        """
        twistd drops privileges (``-u``) between privilegedStartService and startService:
        the main port must be bound in the first (port 80 needs root to bind), the
        workers spawned in the second.
        """
        reactor = SpawningReactor()
        sup = supervisor(self, reactor)
        sup.privilegedStartService()
        assert sup.socket is not None
        port = sup.socket.getsockname()[1]
        self.assertNotEqual(port, 0)
        self.assertEqual(reactor.spawned, [])
        probe = socket.create_connection(("127.0.0.1", port), timeout=1)  # listening already
        probe.close()
        sup.startService()
        self.assertEqual(len(reactor.spawned), 2)
        self.assertEqual(sup.socket.getsockname()[1], port)  # bound once, not again


class CrossWorkerQueueTests(SynchronousTestCase):
    def test_a_slot_freed_while_a_request_is_queueing_is_not_lost(self) -> None:
        """
        Worker 1 finds the only backend full; worker 0 releases it (and the supervisor
        looks for waiters to wake) before worker 1 has published its queue: the waiter
        must either take the slot at once or be visible to the supervisor.
        """
        pools = SharedPools(self, specs(KEYS[0], max_conns=1), queue_timeout=30)
        held = self.successResultOf(pools.routers[0].acquire())
        shared = pools.table.supervisor
        kicks = []
        real = pools.workers[1].exclusive

        def exclusive(choose: Any, *args: Any) -> Any:
            result = real(choose, *args)
            if result is None and not held.released:  # preempted right after the lock
                held.release()  # worker 0's request ends; the supervisor then checks:
                if shared.waiters(1) > 0:
                    kicks.append(1)
            return result

        self.patch(pools.workers[1], "exclusive", exclusive)
        waiting = pools.routers[1].acquire()
        self.patch(pools.workers[1], "exclusive", real)
        if kicks:
            pools.routers[1].pool.capacity_changed()  # the kick arrives
        lease = self.successResultOf(waiting)
        self.assertEqual(lease.backend.key, KEYS[0])
        self.assertEqual(shared.waiters(1), 0)
        self.assertEqual(shared.totals()[0], 1)

    def test_retry_gate_reads_the_other_workers_counts(self) -> None:
        """can_serve_now answers from the shared totals, not this worker's last look."""
        pools = SharedPools(self, specs(KEYS[0], KEYS[1], max_conns=1))
        first, second = pools.routers
        mine = self.successResultOf(first.acquire())
        theirs = self.successResultOf(second.acquire())
        other = frozenset({mine.backend.key})
        self.assertFalse(first.can_serve_now(None, other))  # both full: a retry would queue
        theirs.release()
        self.assertTrue(first.can_serve_now(None, other))  # one is free now
