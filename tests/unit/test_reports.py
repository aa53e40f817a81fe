"""
A ``--workers`` worker's request observer and the supervisor's side of it
(txlb._workers.reports): what a worker's proxy observes reaches the supervisor's one
bookkeeper as typed messages, and the books come out as a single process keeps them.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from txlb import LoadBalancer
from txlb._records.bookkeeper import SummaryConsumer, policy_learns
from txlb._records.observer import IRequestObserver
from txlb._records.summary import Summary
from txlb._workers.reports import SupervisorForwarder, WorkerReports
from txlb._workers.supervisor import WorkerProcess
from txlb._workers.wire import (
    Answer,
    Down,
    Finished,
    Kick,
    Message,
    Ready,
    Retry,
    Stop,
    Suspect,
    Wait,
    decode,
    encode,
)

from ..helpers import ClientConnection, FakeResponse, FakeUpstream
from .test_bookkeeper import a_record, a_summary
from .test_workers_supervisor import supervisor

A, B = "127.0.0.1:8002", "127.0.0.1:8003"


def sample(lb: LoadBalancer, name: str, **labels: str) -> float:
    value = lb.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


class ForwarderTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.sent: list[Message] = []
        self.forwarder = SupervisorForwarder(self.sent.append)
        self.lb = LoadBalancer([A, B], reactor=Clock(), agent=FakeUpstream(),
                               probe_agent=FakeUpstream(), log_file="none")

    def backend(self, key: str) -> Any:
        backend = self.lb.pool.get(key)
        assert backend is not None
        return backend

    def test_it_is_a_request_observer(self) -> None:
        self.assertTrue(verifyObject(IRequestObserver, self.forwarder))

    def test_every_event_becomes_its_message(self) -> None:
        forwarder, backend = self.forwarder, self.backend(A)
        forwarder.answered(backend, 503, "ip:10.0.0.1")
        forwarder.answered(backend, 500, None)
        forwarder.suspect(backend)
        forwarder.retried()
        forwarder.waited(0.5)
        forwarder.down(backend, "proxy: connection refused")
        self.assertEqual(self.sent, [
            Answer(A, 503, "ip:10.0.0.1"), Answer(A, 500, None), Suspect(A), Retry(),
            Wait(0.5), Down(A, "proxy: connection refused")])

    def test_a_finished_request_is_summarised_here_once_for_every_reader(self) -> None:
        local: list[Summary] = []
        self.forwarder.summaries.add(SummaryConsumer("local", lambda s, a: local.append(s)))
        self.forwarder.ended(a_record())
        (message,) = self.sent
        assert isinstance(message, Finished)
        self.assertTrue(message.answered)
        self.assertIs(message.summary, local[0])
        self.assertEqual(self.forwarder.summaries.summarised, 1)

    def test_the_workers_own_policy_learns_what_it_served(self) -> None:
        lb = LoadBalancer([A], reactor=Clock(), agent=FakeUpstream(),
                          probe_agent=FakeUpstream(), log_file="none", policy="latency",
                          observer=self.forwarder)
        self.forwarder.summaries.add(policy_learns(lb.pool, lb.policy))
        self.forwarder.ended(a_record())
        backend = lb.pool.get(A)
        assert backend is not None
        self.assertEqual(lb.policy.describe(backend), {"latency_peak_ewma_s": 0.25})


class WorkerReportsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.probes = FakeUpstream()
        self.lb = LoadBalancer([A, B], reactor=Clock(), agent=FakeUpstream(),
                               probe_agent=self.probes, log_file="none")
        self.reports = WorkerReports(3, self.lb.pool, self.lb.bookkeeper)

    def test_a_finished_request_is_counted_and_says_whether_it_freed_a_slot(self) -> None:
        self.assertTrue(self.reports.apply(Finished(a_summary(A), True)))
        refused = Summary(time=0.0, orid="-", backend=None,  # type: ignore[arg-type]
                          method="POST", path="/v1/completions", status=404, kind="error",
                          outcome="proxy_error", dur=0.0)  # a refusal held no slot
        self.assertFalse(self.reports.apply(Finished(refused, False)))
        self.assertEqual(sample(self.lb, "txlb_requests_total", backend=A, method="POST",
                                status_class="2xx"), 1.0)
        backend = self.lb.pool.get(A)
        assert backend is not None
        self.assertEqual(backend.counts.responses, {"2xx": 1})

    def test_events_reach_the_bookkeeper(self) -> None:
        for message in (Retry(), Retry(), Wait(2.0), Suspect(B), Down(A, "proxy: refused")):
            self.assertFalse(self.reports.apply(message))
        self.assertEqual(sample(self.lb, "txlb_retries_total"), 2.0)
        self.assertEqual(sample(self.lb, "txlb_queue_wait_seconds_sum"), 2.0)
        self.assertEqual(len(self.probes.calls), 1)  # B probed now
        backend = self.lb.pool.get(A)
        assert backend is not None
        self.assertFalse(backend.health.healthy)

    def test_the_reporting_worker_is_named_in_the_log(self) -> None:
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        self.reports.apply(Down(A, "proxy: connection refused"))
        self.assertIn("worker 3: proxy: connection refused",
                      [event.get("reason") for event in events])

    def test_reports_of_a_backend_no_longer_in_the_pool_are_ignored(self) -> None:
        for message in (Answer("10.9.9.9:1", 500, "c"), Suspect("10.9.9.9:1"),
                        Down("10.9.9.9:1", "hung: x")):
            self.assertFalse(self.reports.apply(message))
        self.assertEqual(self.probes.calls, [])

    def test_a_message_only_a_supervisor_sends_is_ignored(self) -> None:
        self.assertFalse(self.reports.apply(Kick()))  # type: ignore[arg-type]
        self.assertFalse(self.reports.apply(Ready(1)))


class SameBooksTests(SynchronousTestCase):
    """A worker's traffic, through the pipe, is counted by the supervisor as its own."""

    def test_a_retried_request_is_counted_once_with_its_retry(self) -> None:
        sent: list[bytes] = []
        upstream = FakeUpstream()
        worker = LoadBalancer([A, B], reactor=Clock(), agent=upstream,
                              probe_agent=FakeUpstream(), log_file="none", retries=1,
                              observer=SupervisorForwarder(lambda m: sent.append(encode(m))))
        client = ClientConnection(worker.site())
        client.request(b"POST", b"/v1/completions", body=b'{"prompt": "x"}')
        upstream.last.respond(FakeResponse(503, length=0))
        upstream.last.respond(FakeResponse(200, length=0)).end()
        self.assertEqual(client.response().status, 200)
        kinds = [type(decode(line[:-1])).__name__ for line in sent]
        self.assertEqual(kinds, ["Answer", "Retry", "Answer", "Finished"])
        self.assertEqual(worker.summaries.summarised, 0)  # the worker keeps no books

        sup = supervisor(self, backends=f"{A},{B}")
        process = WorkerProcess(sup, 0, 0.0)
        process.childDataReceived(3, b"".join(sent))
        books = sup.balancer
        self.assertEqual(sample(books, "txlb_retries_total"), 1.0)
        self.assertEqual(sum(sample(books, "txlb_requests_total", backend=key, method="POST",
                                    status_class="2xx") for key in (A, B)), 1.0)
        self.assertEqual(books.summaries.summarised, 0)  # summarised once, in the worker


class HostileLinesTests(SynchronousTestCase):
    """What a broken worker writes costs the supervisor a logged line, never a crash."""

    def test_malformed_lines_are_skipped_alone(self) -> None:
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        sup = supervisor(self, backends=f"{A},{B}")
        process = WorkerProcess(sup, 1, 0.0)
        hostile = [
            b"not json at all\n",
            b'{"t": "answer", "backend": "127.0.0.1:8002", "status": "500"}\n',
            b'{"t": "reboot"}\n',
            b'["end", "yes", {}]\n',
            b'{"t": "stop"}\n',  # only a supervisor sends that
            b"\xff\xfe\n",
        ]
        process.childDataReceived(3, encode(Retry()) + b"".join(hostile) + encode(Retry()))
        self.assertEqual(sample(sup.balancer, "txlb_retries_total"), 2.0)
        warnings = [e for e in events if e.get("log_level") == LogLevel.warn
                    and e.get("index") == 1]
        self.assertEqual(len(warnings), len(hostile))
        self.assertEqual(self.flushLoggedErrors(), [])


class WorkerSideTests(SynchronousTestCase):
    """The worker's end of the pipe refuses what is no message too, and keeps reading."""

    def test_a_malformed_line_from_the_supervisor_is_skipped(self) -> None:
        from twisted.internet.testing import MemoryReactorClock

        from txlb._workers.worker import SupervisorLink

        link = SupervisorLink(MemoryReactorClock(), 0)
        stops: list[str] = []
        self.patch(link, "stop", stops.append)
        link.dataReceived(b'{"t": "hello"}\n' + b"\x00garbage\n" + encode(Kick())
                          + encode(Stop()))
        self.assertEqual(stops, ["the supervisor asked"])  # a kick before any hello: ignored
        self.assertIsNone(link.balancer)

    def test_reports_are_encoded_onto_the_pipe(self) -> None:
        from twisted.internet.testing import MemoryReactorClock, StringTransport

        from txlb._workers.worker import SupervisorLink

        link = SupervisorLink(MemoryReactorClock(), 0)
        link.makeConnection(StringTransport())
        link.report(Suspect(A))
        link.report(Finished(a_summary(A), True))
        assert isinstance(link.transport, StringTransport)
        lines = link.transport.value().splitlines()
        self.assertEqual([decode(line) for line in lines],
                         [Suspect(A), Finished(a_summary(A), True)])
