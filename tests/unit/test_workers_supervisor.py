"""
``--workers N``: the supervisor (txlb._workers.supervisor) and the worker's side of its pipes
(txlb._workers.worker) as services and protocols in memory, with a reactor that records the
processes it would spawn.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from typing import Any

import attrs
from prometheus_client.parser import text_string_to_metric_families
from treq.testing import StubTreq
from twisted.internet.error import ProcessTerminated
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import Logger, LogLevel, formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from txlb import build_config
from txlb._balancer import LoadBalancer
from txlb._cluster.shared_counts import SharedCounts
from txlb._records.summary import Summary
from txlb._workers import worker as _workerproc
from txlb._workers.supervisor import YOUNG, WorkerProcess, WorkerSupervisor
from txlb._workers.wire import Answer, Down, Finished, summary_message
from txlb._workers.worker import PipeWriter, SupervisorLink

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
               workers: int = 2, backends: str = "127.0.0.1:9") -> WorkerSupervisor:
    config = build_config({"workers": str(workers), "backends": backends,
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
        real = pools.workers[1].slots.exclusive

        def exclusive(choose: Any, *args: Any) -> Any:
            result = real(choose, *args)
            if result is None and not held.released:  # preempted right after the lock
                held.release()  # worker 0's request ends; the supervisor then checks:
                if shared.waiters(1) > 0:
                    kicks.append(1)
            return result

        self.patch(pools.workers[1].slots, "exclusive", exclusive)
        waiting = pools.routers[1].acquire()
        self.patch(pools.workers[1].slots, "exclusive", real)
        if kicks:
            pools.routers[1].pool.slots.capacity_changed()  # the kick arrives
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


def _ended_young(sup: WorkerSupervisor, index: int) -> None:
    worker = sup.workers[index]
    worker.processEnded(Failure(ProcessTerminated(exitCode=1)))


class SupervisorTests(SynchronousTestCase):
    def started(self, reactor: SpawningReactor) -> WorkerSupervisor:
        sup = supervisor(self, reactor)
        sup.privilegedStartService()
        sup.startService()
        for worker, _ in reactor.spawned:
            worker.transport = StringTransport()
        return sup

    def test_only_requests_that_held_a_slot_wake_other_workers(self) -> None:
        """A refusal (404, 429, a 503) freed no slot: no kicks, no refresh for it."""
        reactor = SpawningReactor()
        sup = self.started(reactor)
        first, second = sup.workers[0], sup.workers[1]
        row = SharedCounts(sup.shared.fd, 2, sup.shared.slots_max, row=1)
        self.addCleanup(row.close)
        row.set_waiters(3)
        assert isinstance(second.transport, StringTransport)
        second.transport.clear()
        refused = Summary(time=1.0, orid="-", backend=None, method="POST",
                          path="/v1/completions", status=404, kind="error",
                          outcome="proxy_error", dur=0.0)
        sup.received(first, [Finished(refused, False)])
        self.assertNotIn(b"kick", second.transport.value())
        served = attrs.evolve(refused, backend="127.0.0.1:9", status=200, outcome="ok")
        sup.received(first, [Finished(served, True)])
        self.assertIn(b"kick", second.transport.value())

    def test_a_bad_summary_is_refused_and_the_next_messages_still_handled(self) -> None:
        """
        A worker's ``end`` whose summary is not the field table's (the old positional
        list, a field missing or of the wrong type) is logged, naming what is wrong, and
        counted nowhere; the supervisor goes on with the messages after it.
        """
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        sup = supervisor(self)
        process = WorkerProcess(sup, 0, 0.0)
        good = Summary(time=1.0, orid="-", backend=KEYS[0], method="POST",
                       path="/v1/completions", status=200, kind="other", outcome="ok",
                       dur=0.5)
        fields = json.loads(summary_message(good, True))[2]
        hostile = [["end", True, list(fields.values())],
                   ["end", True, {**fields, "status": "200"}],
                   ["end", True, {k: v for k, v in fields.items() if k != "dur"}],
                   ["end", True]]
        lines = b"".join(json.dumps(message).encode() + b"\n" for message in hostile)
        process.childDataReceived(3, lines + summary_message(good, True))
        requests = sup.balancer.metrics.registry.get_sample_value(
            "txlb_requests_total", {"backend": KEYS[0], "method": "POST", "status_class": "2xx"})
        self.assertEqual(requests, 1.0)
        warnings = [formatEvent(e) for e in events if e.get("log_level") == LogLevel.warn]
        self.assertEqual(len(warnings), 4)
        self.assertIn("the summary an object", warnings[0])
        self.assertIn("summary field 'status' must be an integer, not a string", warnings[1])
        self.assertIn("missing ['dur']", warnings[2])
        self.assertEqual(self.flushLoggedErrors(), [])

    def test_what_workers_report_of_backends(self) -> None:
        """A worker's hung verdict counts as one; its answers carry who caused them."""
        sup = supervisor(self, backends="127.0.0.1:9,127.0.0.1:10,127.0.0.1:11,127.0.0.1:12")
        worker = WorkerProcess(sup, 0, 0.0)
        garbage, failing, hung, _ = list(sup.balancer.pool)
        for _ in range(10):  # 5xx to bodies that are not JSON: the worker sends None
            sup.received(worker, [Answer(garbage.key, 500, None)])
        self.assertTrue(garbage.health.healthy)
        self.assertEqual(garbage.verdicts.errors_in_a_row, 0)
        sup.received(worker, [Answer(failing.key, 500, "ip:10.0.0.1")] * 5)
        self.assertTrue(failing.health.healthy)  # one client alone
        sup.received(worker, [Answer(failing.key, 500, "ip:10.0.0.2")])
        self.assertFalse(failing.health.healthy)
        self.assertEqual(failing.verdicts.outlier_ejections, 1)
        sup.received(worker, [Down(hung.key, "hung: no byte from any of 2 requests")])
        self.assertFalse(hung.health.healthy)
        self.assertEqual(hung.verdicts.hung_ejections, 1)

    def test_the_queue_length_is_every_workers(self) -> None:
        """
        Under --workers the requests wait in the workers' routers, never in the
        supervisor's: txlb_queue_length (like the dashboard's queue) is their sum, not
        the supervisor's own router's, which is always 0.
        """
        sup = supervisor(self)
        row = SharedCounts(sup.shared.fd, 2, sup.shared.slots_max, row=1)
        self.addCleanup(row.close)
        row.set_waiters(3)
        text = sup.balancer.metrics.exposition().decode()
        [family] = [f for f in text_string_to_metric_families(text)
                    if f.name == "txlb_queue_length"]
        self.assertEqual([sample.value for sample in family.samples], [3])
        self.assertEqual(sup.balancer.history.sample().queued, 3)

    def test_a_crash_loop_backs_off_and_never_gives_up(self) -> None:
        reactor = SpawningReactor()
        sup = self.started(reactor)
        delays = []
        for _ in range(6):
            _ended_young(sup, 0)
            (call,) = [c for c in reactor.getDelayedCalls() if c.func == sup._restart]
            delays.append(call.getTime() - reactor.seconds())
            reactor.advance(delays[-1])
            self.assertIn(0, sup.workers)
        self.assertEqual(delays, [2.0, 4.0, 8.0, 16.0, 30.0, 30.0])
        self.assertEqual(sup.restarts[0], 6)
        # a worker that lived past YOUNG restarts promptly again
        reactor.advance(YOUNG + 1)
        sup.workers[0].processEnded(Failure(ProcessTerminated(exitCode=1)))
        (call,) = [c for c in reactor.getDelayedCalls() if c.func == sup._restart]
        self.assertAlmostEqual(call.getTime() - reactor.seconds(), 0.1)

    def test_a_restart_that_cannot_spawn_is_logged_and_retried(self) -> None:
        reactor = SpawningReactor()
        sup = self.started(reactor)
        _ended_young(sup, 1)
        reactor.failures = 2
        reactor.advance(2.0)  # the restart: spawnProcess raises
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)
        self.assertNotIn(1, sup.workers)
        reactor.advance(4.0)  # raises again, and is tried again
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)
        reactor.advance(8.0)
        self.assertIn(1, sup.workers)

    def test_admin_drain_and_remove_report_the_workers_counts(self) -> None:
        sup = supervisor(self)
        balancer = sup.balancer
        row = SharedCounts(sup.shared.fd, 2, sup.shared.slots_max, row=0)
        self.addCleanup(row.close)
        (state,) = balancer.pool.shared_state()
        row.assign("127.0.0.1:9", state["slot"])
        row.take("127.0.0.1:9")  # a worker's request in flight
        admin = StubTreq(balancer.admin_resource())

        def call(method: str, path: str) -> tuple[int, Any]:
            response = self.successResultOf(admin.request(method, "http://127.0.0.1" + path))
            return response.code, json.loads(self.successResultOf(response.content()))

        code, drained = call("POST", "/backends/127.0.0.1:9/drain")
        self.assertEqual((code, drained["active"]), (200, 1))
        code, removing = call("DELETE", "/backends/127.0.0.1:9")
        self.assertEqual((code, removing["active"], removing["removed"]), (202, 1, False))


class PipesToTheSupervisorTests(SynchronousTestCase):
    """A worker's pipes back to a supervisor that stopped reading never block it."""

    def pipe(self) -> tuple[int, int]:
        read, write = os.pipe()
        self.addCleanup(os.close, read)
        self.addCleanup(os.close, write)
        os.set_blocking(read, False)
        return read, write

    def test_log_lines_past_the_limit_are_dropped_never_blocking(self) -> None:
        read, write = self.pipe()
        reactor = MemoryReactorClock()
        recovered: list[int] = []
        writer = PipeWriter(reactor, write, 4096, recovered.append)
        line = b"x" * 99 + b"\n"
        accepted = sum(writer.write(line) for _ in range(2000))  # 200 KB: past pipe + limit
        self.assertGreater(writer.dropped, 0)
        self.assertEqual(accepted + writer.dropped, 2000)
        self.assertLessEqual(writer.pending(), 4096)
        self.assertIn(writer, reactor.getWriters())
        received = b""
        for _ in range(100):  # the supervisor reads again
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(read, 65536):
                    received += chunk
            if not writer.pending():
                break
            writer.doWrite()
        self.assertEqual(writer.pending(), 0)
        self.assertNotIn(writer, reactor.getWriters())
        self.assertEqual(recovered, [2000 - accepted])
        self.assertEqual(writer.dropped, 0)
        self.assertEqual(received, line * accepted)  # whole lines, in order

    def test_messages_past_the_limit_are_dropped_while_the_pipe_is_full(self) -> None:
        self.patch(_workerproc, "MESSAGE_BUFFER", 1000)
        events: list[dict[str, Any]] = []
        self.patch(_workerproc, "log", Logger(observer=events.append))
        link = SupervisorLink(Clock(), 0)
        transport = StringTransport()
        link.makeConnection(transport)
        self.assertIs(transport.producer, link)
        link.pauseProducing()  # the pipe is full: the supervisor does not read
        for _ in range(30):
            link.send(b"y" * 99 + b"\n")
        self.assertEqual(len(transport.value()), 1000)
        self.assertEqual(link.dropped, 20)
        link.resumeProducing()  # it read everything
        self.assertEqual([event.get("count") for event in events], [20])
        link.send(b"z\n")
        self.assertTrue(transport.value().endswith(b"z\n"))
