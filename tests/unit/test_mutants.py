"""
Tests written to kill mutants that survived ``python -m bench.mutation``: each pins a
behaviour the rest of the suite ran but never checked (bench/results/mutation.md lists them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from twisted.internet import error as neterror
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from txlb import BackendSpec, IPreparesRequests, Policy, Pool, RoutingRequest, build_config
from txlb._cluster.backend import Backend
from txlb._cluster.backend_engine import EngineReading
from txlb._cluster.backend_health import Health
from txlb._cluster.outlier import OutlierRule, fleet_can_spare, judge_answer
from txlb._cluster.slow_start import SlowStart
from txlb._cluster.store import LocalStore, Marks, OwnMarks
from txlb._records.summary import RequestRecord
from txlb._scheduling.affinity import BoundedLoadRing
from txlb._scheduling.request import ANY_REQUEST
from txlb._scheduling.router import ModelRoute, Router
from txlb._upstream.client import UpstreamClient

from ..helpers import ClientConnection, FakeResponse, ObserverTap
from . import test_failover
from .test_failover import FailoverTestCase
from .test_proxy import ProxyTestCase
from .test_upstream import Owner


class ProxyMutantTests(ProxyTestCase):
    def test_send_timeout_counts_from_the_pause(self) -> None:
        """A paused client is cut ``send_timeout`` after it stopped reading, not sooner."""
        self.build(["127.0.0.1:8002"], read_timeout=5, send_timeout=60)
        client = self.client()
        client.request(b"GET", b"/stream")
        response = self.upstream.last.respond(FakeResponse(200))
        response.send(b"a")
        self.clock.advance(1)
        client.transport.producer.pauseProducing()  # at t=1
        self.clock.advance(59.5)  # t=60.5: read watchdog fired at 5, re-armed for the pause
        self.assertFalse(client.transport.disconnected)
        self.clock.advance(1)  # t=61.5: 60 s since the pause
        self.assertTrue(client.transport.disconnected)

    def test_the_transport_stopping_the_stream_stops_the_backend(self) -> None:
        client = self.client()
        client.request(b"GET", b"/stream")
        response = self.upstream.last.respond(FakeResponse(200))
        response.send(b"a")
        client.transport.producer.stopProducing()  # what a TCP transport does on loss
        self.assertTrue(response.transport.stopped)

    def test_status_and_models_answer_200(self) -> None:
        for path in (b"/__lb_status", b"/v1/models"):
            client = self.client()
            client.request(b"GET", path)
            self.assertEqual(client.response().status, 200, path)

    def test_a_request_while_shutting_down_is_refused_and_its_connection_closed(self) -> None:
        """
        503 with Retry-After (the health interval, rounded up, never under 1 s), then the
        kept-alive connection is closed so the client goes elsewhere.
        """
        self.build(["127.0.0.1:8002"], health_interval=1)
        self.lb.proxy.shutting_down = True
        client = self.client()
        client.request(b"GET", b"/v1/models/x")
        answer = client.response()
        self.assertEqual((answer.status, answer.header(b"retry-after")), (503, [b"1"]))
        self.assertTrue(client.transport.disconnecting)
        self.assertEqual(self.upstream.calls, [])

    def test_body_forwarded_byte_for_byte_when_the_model_is_no_alias(self) -> None:
        body = b'{"model":"m","prompt":"x",  "n":1}'
        client = self.client()
        client.request(b"POST", b"/v1/completions", body=body)
        self.assertEqual(self.upstream.last.body, body)

    def test_internal_error_before_the_head_is_a_502(self) -> None:
        def explode(*_: object) -> None:
            raise RuntimeError("a bookkeeping bug")

        context = self.lb.proxy.context
        context.observer = ObserverTap(context.observer, answered=explode)
        client = self.client()
        client.request(b"GET", b"/v1/x")
        self.upstream.last.respond(FakeResponse(200, length=0)).end()
        answer = client.response()
        self.assertEqual(answer.status, 502)
        self.assertEqual(json.loads(answer.body)["error"]["message"], "internal proxy error")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_absolute_form_with_only_a_query(self) -> None:
        client = self.client()
        client.send(b"GET http://lb.example?x=1 HTTP/1.1\r\nHost: lb.example\r\n\r\n")
        self.assertTrue(self.upstream.last.uri.endswith(b":8002/?x=1")
                        or self.upstream.last.uri.endswith(b":8003/?x=1"),
                        self.upstream.last.uri)

    def test_default_send_timeout_is_60s(self) -> None:
        self.assertEqual(self.lb.proxy.context.send_timeout, 60.0)


class RetryWindowBoundaryTests(FailoverTestCase):
    def test_no_new_try_once_the_window_has_passed_exactly(self) -> None:
        self.build(retry_window=2)
        client = self.post()
        self.clock.advance(2)
        self.upstream.calls[0].fail(neterror.ConnectionRefusedError())
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertEqual(client.response().status, 502)

    def test_a_try_just_inside_the_window(self) -> None:
        self.build(retry_window=2)
        self.post()
        self.clock.advance(1.9)
        self.upstream.calls[0].fail(neterror.ConnectionRefusedError())
        self.assertEqual(len(self.upstream.calls), 2)


class UpstreamMutantTests(SynchronousTestCase):
    def test_close_idle_closes_every_pooled_connection(self) -> None:
        reactor = MemoryReactorClock()
        client = UpstreamClient(reactor, connect_timeout=5)
        transports = []
        for port in (8002, 8003):
            result: list[Any] = []
            client.send("127.0.0.1", port, b"GET", b"/", [], None).addBoth(result.append)
            _, _, factory, _, _ = reactor.tcpClients[-1]
            protocol = factory.buildProtocol(None)
            transport = StringTransport()
            protocol.makeConnection(transport)
            protocol.dataReceived(b"HTTP/1.1 204 No Content\r\n\r\n")
            result[0].deliver(Owner(), raw=False)
            transports.append(transport)
        self.assertEqual(client.idle_count("127.0.0.1", 8002), 1)
        client.close_idle()
        self.assertTrue(all(t.disconnecting for t in transports))
        self.assertEqual(client.idle_count("127.0.0.1", 8003), 0)


class _Slots:
    """Records what a pool asks of its shared in-flight counts."""

    def __init__(self) -> None:
        self.assigned: list[tuple[str, int]] = []

    def register(self, key: str) -> int:
        return 7

    def assign(self, key: str, slot: int) -> None:
        self.assigned.append((key, slot))

    def take(self, key: str) -> None:
        pass

    def give_back(self, key: str) -> None:
        pass


class BackendMutantTests(SynchronousTestCase):
    def test_slow_start_never_takes_a_backend_to_zero(self) -> None:
        clock = Clock()
        backend = Backend(BackendSpec("127.0.0.1", 8002, weight=2),
                          health=Health(healthy=False), slow_start=SlowStart(clock, 10))
        clock.advance(100)
        backend.came_up(clock.seconds())
        self.assertEqual(backend.slow_start.ramp, 0.01)
        self.assertGreater(backend.effective_weight, 0)
        clock.advance(5)
        self.assertEqual(backend.slow_start.ramp, 0.5)
        clock.advance(50)
        self.assertEqual(backend.slow_start.ramp, 1.0)

    def test_a_worker_takes_the_supervisors_slots(self) -> None:
        supervisor = Pool((BackendSpec("127.0.0.1", 8002),), shared=_Slots())  # type: ignore[arg-type]
        worker_slots = _Slots()
        worker = Pool((), shared=worker_slots)  # type: ignore[arg-type]
        worker.mirror(supervisor.shared_state())
        self.assertEqual(worker_slots.assigned, [("127.0.0.1:8002", 7)])
        supervisor.drain(supervisor.get("127.0.0.1:8002"))
        supervisor.mark_down(supervisor.get("127.0.0.1:8002"), "test")
        worker.mirror(supervisor.shared_state())
        mirrored = worker.get("127.0.0.1:8002")
        self.assertEqual((mirrored.health.draining, mirrored.health.healthy), (True, False))
        states: list[Any] = supervisor.shared_state()
        states[0]["slot"] = None
        worker_slots.assigned.clear()
        worker.mirror(states)
        self.assertEqual(worker_slots.assigned, [])

    def test_probes_ok_counts_each_good_probe(self) -> None:
        pool = Pool((BackendSpec("127.0.0.1", 8002),))
        backend = pool.get("127.0.0.1:8002")
        for _ in range(3):
            pool.probe_succeeded(backend, rise=1)
        self.assertEqual(backend.health.probes_ok, 3)
        self.assertEqual(backend.detailed_status()["probes_ok"], 3)


class BackendCounterTests(SynchronousTestCase):
    """The per-backend counters and averages the admin status and metrics report."""

    def setUp(self) -> None:
        self.pool = Pool(tuple(BackendSpec("127.0.0.1", p) for p in (8002, 8003, 8004)))
        self.backend = self.pool.get("127.0.0.1:8002")

    def test_marked_down_is_told_once_per_change(self) -> None:
        """``on_down`` listeners (a --workers worker reports through one) hear each change."""
        heard: list[tuple[str, str]] = []
        self.pool.on_down.append(lambda backend, reason: heard.append((backend.key, reason)))
        self.pool.mark_down(self.backend, "proxy: connection refused")
        self.pool.mark_down(self.backend, "proxy: connection refused")  # already down
        self.assertEqual(heard, [("127.0.0.1:8002", "proxy: connection refused")])

    def test_probes_failed_counts_from_zero(self) -> None:
        self.assertEqual(self.backend.health.probes_failed, 0)
        for _ in range(2):
            self.pool.probe_failed(self.backend, "health: HTTP 503", definitive=True, fall=3)
        self.assertEqual(self.backend.detailed_status()["probes_failed"], 2)

    def test_latency_is_an_ewma_rounded_to_a_tenth_of_a_millisecond(self) -> None:
        from txlb._cluster.backend_pace import EWMA_ALPHA, _ewma

        self.assertEqual(_ewma(None, 2.0), 2.0)
        self.assertAlmostEqual(_ewma(1.0, 3.0), 1.0 + EWMA_ALPHA * 2.0)
        self.assertAlmostEqual(_ewma(3.0, 1.0), 3.0 - EWMA_ALPHA * 2.0)
        self.backend.pace.timed(0.123456, None)
        self.assertEqual(self.backend.detailed_status()["latency_ewma_s"], 0.1235)

    def test_the_5xx_count_starts_again_after_an_ejection(self) -> None:
        for number in range(self.pool.outliers.consecutive_5xx):  # a streak of two clients
            self.pool.record_answer(self.backend, 500, client=f"10.0.0.{number % 2}")
        self.assertFalse(self.backend.health.healthy)
        self.assertEqual(self.backend.verdicts.errors_in_a_row, 0)

    def test_a_passive_ejection_restarts_the_rise_count(self) -> None:
        self.pool.probe_succeeded(self.backend, rise=2)  # one good probe while up
        self.pool.mark_down(self.backend, "proxy: connection refused")
        self.pool.probe_succeeded(self.backend, rise=2)
        self.assertFalse(self.backend.health.healthy)  # one success since the ejection, not two
        self.pool.probe_succeeded(self.backend, rise=2)
        self.assertTrue(self.backend.health.healthy)



class _SavedMarks(OwnMarks):
    """A store's marks as another balancer would read them: every save kept."""

    def __init__(self) -> None:
        self.saved: list[tuple[str, Marks]] = []

    def save(self, spec: BackendSpec, marks: Marks, reason: str = "",
             origin: str | None = None) -> None:
        self.saved.append((spec.key, marks))

    def members(self) -> list[tuple[BackendSpec, Marks]]:
        return []


class BackendFullRunTests(SynchronousTestCase):
    """Survivors of the full mutation run of txlb/_cluster/backend.py."""

    def setUp(self) -> None:
        self.marks = _SavedMarks()
        self.pool = Pool(tuple(BackendSpec("127.0.0.1", p) for p in (8002, 8003, 8004)),
                         store=LocalStore(marks=self.marks))
        self.backend = self.pool.get("127.0.0.1:8002")
        self.changes: list[None] = []
        self.updates: list[None] = []
        self.pool.on_change.append(lambda: self.changes.append(None))

    def test_responses_are_counted_by_status_class(self) -> None:
        """The admin's ``responses``: one count per class, the edges of each class in it."""
        for status in (200, 299, 404, 499, 503, 599, 503):
            self.pool.record_result(self.backend, status, 0.1, None)
        self.assertEqual(self.backend.detailed_status()["responses"],
                         {"2xx": 2, "4xx": 2, "5xx": 3})

    def test_latency_moves_a_fifth_of_the_way_and_ttft_only_when_timed(self) -> None:
        self.pool.record_result(self.backend, 200, 1.0, 0.5)
        self.pool.record_result(self.backend, 200, 3.0, None)  # no first token timed
        status = self.backend.detailed_status()
        self.assertEqual((status["latency_ewma_s"], status["ttft_ewma_s"]), (1.4, 0.5))
        self.pool.record_result(self.backend, 200, 1.4, 1.5)
        self.assertEqual(self.backend.detailed_status()["ttft_ewma_s"], 0.7)

    def test_requests_count_each_request_from_zero(self) -> None:
        self.assertEqual(self.backend.status()["requests"], 0)
        self.pool.slots.acquire(self.backend).release()
        self.pool.slots.acquire(self.backend)
        self.assertEqual(self.backend.status()["requests"], 2)

    def test_shared_counts_give_the_all_process_requests(self) -> None:
        """``--workers``: the status shows every process's requests, as the table counts them."""
        shared = _Totals()
        shared.started = lambda key: 5  # type: ignore[method-assign]
        pool = Pool((BackendSpec("127.0.0.1", 8002),), shared=shared)  # type: ignore[arg-type]
        backend = pool.get("127.0.0.1:8002")
        pool.refresh()
        self.assertEqual(backend.status()["requests"], 5)
        backend.counts.counted(2)  # the in-flight total alone (taken under the lock)
        self.assertEqual((backend.counts.active, backend.status()["requests"]), (2, 5))

    def test_a_worker_restarts_its_local_counts_on_a_new_scrape_only(self) -> None:
        """
        queue-depth adds what this worker sent since the engine was scraped: counted from
        zero, kept while the supervisor's scrape is the same one, restarted by a new one.
        """
        from txlb._scheduling.policies.queue_depth import QueueDepth

        supervisor = Backend(BackendSpec("127.0.0.1", 8002))
        worker = Backend(BackendSpec("127.0.0.1", 8002))
        self.assertEqual((worker.counts.started_since_scrape, supervisor.engine.scrapes), (0, 0))
        supervisor.engine_scraped(4.0, None)
        self.assertEqual(supervisor.engine.scrapes, 1)
        worker.mirror(json.loads(json.dumps(supervisor.shared_state())))
        worker.counts.took_slot()
        worker.counts.took_slot()
        worker.counts.gave_slot()
        worker.mirror(json.loads(json.dumps(supervisor.shared_state())))  # the same scrape
        counts = worker.counts
        self.assertEqual((counts.started_since_scrape, counts.finished_since_scrape), (2, 1))
        self.assertEqual(QueueDepth.depth(worker), 5.0)
        supervisor.engine_scraped(4.0, None)
        self.assertEqual(supervisor.engine.scrapes, 2)
        worker.mirror(json.loads(json.dumps(supervisor.shared_state())))
        counts = worker.counts
        self.assertEqual((counts.started_since_scrape, counts.finished_since_scrape), (0, 0))
        self.assertEqual(QueueDepth.depth(worker), 4.0)

    def test_the_shared_state_crosses_to_workers_as_json(self) -> None:
        self.pool.set_engine_depth(self.backend, 1, 2)
        worker = Pool(())
        worker.mirror(json.loads(json.dumps(self.pool.shared_state())))
        mirrored = worker.get("127.0.0.1:8002")
        self.assertEqual((mirrored.engine.depth, mirrored.engine.scrapes), (3, 1))

    def test_the_streak_keeps_its_first_two_clients(self) -> None:
        for client in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
            self.backend.verdicts.answered(500, client)
        self.assertEqual(self.backend.verdicts.streak_clients, ("10.0.0.1", "10.0.0.2"))

    def test_a_drain_is_saved_and_told_once(self) -> None:
        """Other balancers read the drain from the store; waiting requests hear of it."""
        self.pool.drain(self.backend)
        self.assertEqual(self.marks.saved[-1], ("127.0.0.1:8002", Marks(True, True, False)))
        self.assertEqual((len(self.marks.saved), len(self.changes)), (4, 1))  # 3 added
        self.pool.drain(self.backend)  # already draining: nothing new to say
        self.assertEqual((len(self.marks.saved), len(self.changes)), (4, 1))

    def test_back_up_is_told_once(self) -> None:
        """A recovery is saved, logged and told once; later good probes say nothing."""
        from twisted.logger import formatEvent, globalLogPublisher

        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        self.pool.mark_down(self.backend, "proxy: connection refused")
        for _ in range(3):
            self.pool.probe_succeeded(self.backend, rise=1)
        self.assertTrue(self.backend.health.healthy)
        self.assertEqual(self.marks.saved[-1], ("127.0.0.1:8002", Marks(True, False, False)))
        self.assertEqual(len(self.changes), 2)  # down, up
        self.assertEqual(len([e for e in events if "back up" in formatEvent(e)]), 1)

    def test_forgetting_an_unknown_queue_depth_tells_no_worker(self) -> None:
        self.pool.on_update.append(lambda: self.updates.append(None))
        self.pool.forget_engine_depth(self.backend)
        self.assertEqual(self.updates, [])
        self.pool.set_engine_depth(self.backend, 1, 0)
        self.pool.forget_engine_depth(self.backend)
        self.assertEqual((len(self.updates), self.backend.engine.depth), (2, None))

    def test_two_leases_on_one_backend_are_two(self) -> None:
        first, second = self.pool.slots.acquire(self.backend), self.pool.slots.acquire(self.backend)
        self.assertNotEqual(first, second)
        self.assertEqual(len({first, second}), 2)
        self.assertIs(first.released, False)
        first.release()
        self.assertIs(first.released, True)
        self.assertEqual(self.backend.counts.active, 1)

    def test_a_4xx_answer_ends_a_5xx_streak(self) -> None:
        needed = self.pool.outliers.consecutive_5xx
        for status in (499, 400):  # the top and the bottom of the 4xx class
            self.streak(needed - 1)
            self.pool.record_answer(self.backend, status, client="10.0.0.1")
            self.assertEqual(self.backend.verdicts.errors_in_a_row, 0)
        self.streak(needed - 1)
        self.assertTrue(self.backend.health.healthy)

    def streak(self, count: int) -> None:
        for number in range(count):
            self.pool.record_answer(self.backend, 503, client=f"10.0.0.{number % 2}")

    def test_a_streak_after_a_success_needs_the_full_count(self) -> None:
        needed = self.pool.outliers.consecutive_5xx
        self.streak(needed - 1)
        self.pool.record_answer(self.backend, 200, client="10.0.0.1")
        self.streak(needed - 1)
        self.assertTrue(self.backend.health.healthy)
        self.streak(1)
        self.assertFalse(self.backend.health.healthy)

    def test_a_streak_after_coming_back_needs_the_full_count(self) -> None:
        self.streak(self.pool.outliers.consecutive_5xx)  # ejected: the cool-down follows
        self.assertFalse(self.backend.health.healthy)
        self.pool.clock.advance(3600)  # type: ignore[attr-defined]
        self.pool.probe_succeeded(self.backend, rise=1)
        self.assertTrue(self.backend.health.healthy)
        self.streak(self.pool.outliers.consecutive_5xx - 1)
        self.assertTrue(self.backend.health.healthy)
        self.streak(1)
        self.assertFalse(self.backend.health.healthy)

    def test_fall_counts_from_the_last_good_probe(self) -> None:
        for _ in range(2):
            self.pool.probe_failed(self.backend, "health: timeout", definitive=False, fall=3)
        self.pool.probe_succeeded(self.backend, rise=1)
        self.assertEqual(self.backend.health.failures_in_a_row, 0)
        for _ in range(2):
            self.pool.probe_failed(self.backend, "health: timeout", definitive=False, fall=3)
        self.assertEqual(self.backend.health.failures_in_a_row, 2)
        self.assertTrue(self.backend.health.healthy)
        self.pool.probe_failed(self.backend, "health: timeout", definitive=False, fall=3)
        self.assertFalse(self.backend.health.healthy)

    def test_rise_counts_from_the_last_failed_probe(self) -> None:
        self.assertEqual(self.backend.health.successes_in_a_row, 0)
        self.pool.mark_down(self.backend, "proxy: connection refused")
        for _ in range(2):
            self.pool.probe_succeeded(self.backend, rise=3)
        self.assertEqual(self.backend.health.successes_in_a_row, 2)
        self.pool.probe_failed(self.backend, "health: timeout", definitive=False, fall=3)
        for _ in range(2):
            self.pool.probe_succeeded(self.backend, rise=3)
        self.assertFalse(self.backend.health.healthy)
        self.pool.probe_succeeded(self.backend, rise=3)
        self.assertTrue(self.backend.health.healthy)

    def test_hung_ejections_are_counted_from_zero(self) -> None:
        self.assertEqual(self.backend.detailed_status()["hung_ejections"], 0)
        self.pool.mark_hung(self.backend, "hung: no byte for 60 s")
        self.assertEqual(self.backend.detailed_status()["hung_ejections"], 1)

    def test_weight_is_the_configured_one(self) -> None:
        backend = Backend(BackendSpec("127.0.0.1", 8002, weight=3))
        self.assertEqual((backend.spec.weight, backend.effective_weight), (3, 3.0))


class HealthMutantTests(SynchronousTestCase):
    """The prober's extras: learning models, scraping the engine queue, probing on demand."""

    def checker(self, spec: BackendSpec, scrape: bool = False) -> tuple[Any, Any, Any]:
        from txlb._cluster.health import HealthChecker

        from ..helpers import FakeUpstream

        agent = FakeUpstream()
        pool = Pool((spec,))
        checker = HealthChecker(pool, agent, Clock(), interval=2, timeout=1, path="/health",
                                rise=1, fall=3, scrape_engine_queue=scrape)
        checker.startService()
        self.addCleanup(checker.stopService)
        return checker, agent, pool.get(spec.key)

    def paths(self, agent: Any) -> list[bytes]:
        return [call.uri.split(b"8002", 1)[1] for call in agent.calls]

    def test_prometheus_sum(self) -> None:
        from txlb._cluster.health import prometheus_sum

        text = ("# HELP vllm:num_requests_running x\n"
                'vllm:num_requests_running{model_name="a"} 2\n'
                'vllm:num_requests_running{model_name="b"} 1.5\n'
                "vllm:num_requests_running_total 100\n"
                "vllm:num_requests_running{broken} \n"
                "vllm:num_requests_running \n"
                "vllm:num_requests_running{x=\"y\"} nan-ish\n")
        self.assertEqual(prometheus_sum(text, "vllm:num_requests_running"), 3.5)
        self.assertEqual(prometheus_sum("vllm:num_requests_waiting 4\n",
                                        "vllm:num_requests_waiting"), 4.0)
        self.assertIsNone(prometheus_sum("other 1\n", "vllm:num_requests_waiting"))

    def test_models_are_learned_only_when_none_are_configured(self) -> None:
        _, agent, _ = self.checker(BackendSpec("127.0.0.1", 8002, models=("m",)))
        agent.calls[0].respond(FakeResponse(200, length=0)).end()
        self.assertEqual(self.paths(agent), [b"/health"])

    def test_redirects_from_models_and_metrics_are_not_followed(self) -> None:
        _, agent, backend = self.checker(BackendSpec("127.0.0.1", 8002), scrape=True)
        agent.calls[0].respond(FakeResponse(200, length=0)).end()
        self.assertEqual(sorted(self.paths(agent)), [b"/health", b"/metrics", b"/v1/models"])
        for call in agent.calls[1:]:
            call.respond(FakeResponse(
                302, [(b"location", b"http://127.0.0.1:8002/elsewhere")], length=0)).end()
        self.assertEqual(len(agent.calls), 3)
        self.assertIsNone(backend.engine.depth)

    def test_probe_soon_probes_unless_a_probe_is_running(self) -> None:
        checker, agent, backend = self.checker(BackendSpec("127.0.0.1", 8002, models=("m",)))
        checker.probe_soon(backend)
        self.assertEqual(len(agent.calls), 1)  # the start-up probe is still running
        agent.calls[0].respond(FakeResponse(200, length=0)).end()
        checker.probe_soon(backend)
        self.assertEqual(len(agent.calls), 2)

    def scrape(self, text: bytes) -> Any:
        _, agent, backend = self.checker(BackendSpec("127.0.0.1", 8002, models=("m",)),
                                         scrape=True)
        agent.calls[0].respond(FakeResponse(200, length=0)).end()
        metrics = agent.calls[1]
        self.assertTrue(metrics.uri.endswith(b"/metrics"))
        response = metrics.respond(FakeResponse(
            200, [(b"content-type", b"text/plain; charset=utf-8")], length=len(text)))
        response.send(text)
        response.end()
        return backend

    def test_engine_depth_is_running_plus_waiting(self) -> None:
        backend = self.scrape(b"vllm:num_requests_running 2\nvllm:num_requests_waiting 3\n")
        self.assertEqual(backend.engine.depth, 5)

    def test_engine_depth_needs_both_gauges(self) -> None:
        for text in (b"vllm:num_requests_running 2\n", b"vllm:num_requests_waiting 3\n"):
            self.assertIsNone(self.scrape(text).engine_depth, text)


class RoutingMutantTests(ProxyTestCase):
    def test_an_empty_queue_reports_no_wait(self) -> None:
        status = self.lb.router.queue_status()
        self.assertEqual((status["length"], status["oldest_wait_s"]), (0, 0.0))

    def test_503_names_the_model_or_says_this_request(self) -> None:
        for backend in self.lb.pool:
            self.lb.pool.mark_down(backend, "test")
        for body, expected in ((b'{"model": "m"}', "model `m`"), (b"{}", "this request")):
            client = self.client()
            client.request(b"POST", b"/v1/completions", body=body)
            answer = client.response()
            self.assertEqual(answer.status, 503)
            self.assertIn(expected, json.loads(answer.body)["error"]["message"])

    def test_an_alias_routes_without_a_given_rng(self) -> None:
        from txlb._scheduling.router import ModelRoute, Router

        router = Router(self.lb.pool, self.lb.policy, self.clock, queue_timeout=1,
                        retry_after=1, routes={"chat": ModelRoute("chat", (("m", 1),))})
        self.assertEqual(router.resolve("chat"), "m")


class SiteMutantTests(FailoverTestCase):
    def test_the_head_deadline_is_the_configured_one(self) -> None:
        self.build(header_timeout=10)
        client = self.client()
        client.send(b"GET / HTTP/1.1\r\nHost: x\r\n")
        self.clock.advance(9.5)
        self.assertFalse(client.transport.disconnecting)
        self.clock.advance(1)
        self.assertTrue(client.transport.value().startswith(b"HTTP/1.1 408 "))
        self.assertEqual(json.loads(client.response().body)["error"]["code"], 408)

    def test_a_refused_body_says_413_in_its_json_too(self) -> None:
        self.build(max_body="1KiB")
        client = self.client()
        client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        self.assertEqual(json.loads(client.response().body)["error"]["code"], 413)
        self.assertEqual(self.records[-1].status, 413)

    def test_the_next_request_on_a_connection_gets_a_deadline_too(self) -> None:
        self.build(header_timeout=10)
        client = self.client()
        client.request(b"GET", b"/one")
        self.answer(0, 200)
        client.transport.clear()
        client.send(b"GET /two HTTP/1.1\r\nHost: x\r\n")  # and no more
        self.clock.advance(11)
        self.assertTrue(client.transport.value().startswith(b"HTTP/1.1 408 "))
        self.assertEqual(len(self.upstream.calls), 1)

    def test_proxy_site_defaults(self) -> None:
        """No body limit and a 30 s head deadline unless told otherwise."""
        from twisted.internet.address import IPv4Address
        from twisted.web.resource import Resource

        from txlb._server.site import ProxySite

        class Ok(Resource):
            isLeaf = True

            def render(self, request: Any) -> bytes:
                return b"ok"

        site = ProxySite(Ok(), reactor=Clock())
        self.assertEqual(site.max_body, 0)
        channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 1))
        self.assertEqual(channel.header_timeout, 30.0)
        client = ClientConnection(site)
        client.request(b"POST", b"/", body=b"x" * 100_000)  # max_body 0: no limit
        self.assertEqual(client.response().status, 200)
        # the request class in a Site that sets no limit at all: no limit either
        from twisted.web.server import Site

        from txlb._server.site import LimitedRequest

        plain = Site(Ok(), reactor=Clock())
        plain.requestFactory = LimitedRequest
        client = ClientConnection(plain)
        client.request(b"POST", b"/", body=b"x" * 100)
        self.assertEqual(client.response().status, 200)


class PolicyMutantTests(SynchronousTestCase):
    def backends(self, *weights: int) -> list[Backend]:
        return [Backend(BackendSpec("127.0.0.1", 8002 + n, weight=w))
                for n, w in enumerate(weights)]

    def test_p2c_gives_an_idle_heavier_backend_its_share(self) -> None:
        import random

        from txlb._scheduling.policies.p2c import PowerOfTwoChoices

        policy = PowerOfTwoChoices(random.Random(4))
        heavy, light = self.backends(3, 1)
        picks = [policy.choose([heavy, light]) for _ in range(400)]
        self.assertGreater(picks.count(heavy), 250)  # ties go to the first drawn (3:1)

    def test_latency_prefers_the_heavier_of_equal_backends(self) -> None:
        from txlb._scheduling.policies.peak_ewma import PeakEwmaLatency

        policy = PeakEwmaLatency(Clock())
        light, heavy = self.backends(1, 2)
        for backend in (light, heavy):
            policy.sample(backend, 0.5)
            backend.counts.counted(1)
        self.assertIs(policy.choose([light, heavy]), heavy)

    def test_latency_without_decay_takes_the_last_sample(self) -> None:
        from txlb._scheduling.policies.peak_ewma import PeakEwmaLatency

        policy = PeakEwmaLatency(Clock(), decay=0)
        (backend,) = self.backends(1)
        policy.sample(backend, 2.0)
        policy.sample(backend, 1.0)
        self.assertEqual(policy.estimate(backend), 1.0)


class ResultLogMutantTests(SynchronousTestCase):
    """The result log's formats and its recovery after a failed write."""

    def summary(self, **fields: Any) -> Any:
        from txlb._records.summary import summarize

        record = RequestRecord(started=1.0, method=b"POST", path=b"/v1/completions",
                               orid_header=None, request_body=b'{"max_tokens": 9}',
                               backend="127.0.0.1:8002", status=200, ended=2.5,
                               content_type=b"application/json")
        record.capture(b'{"choices": [{"text": "hi"}]}')
        import attrs

        return attrs.evolve(summarize(record), **fields)

    def test_text_line_fields(self) -> None:
        from txlb._records.resultlog import format_text

        line = format_text(self.summary())
        self.assertIn(" finish=- ctok=-/9 thinking=False think=False empty=False clen=2 ",
                      line)
        line = format_text(self.summary(finish="stop", completion_tokens=2, think=True))
        self.assertIn(" finish=stop ctok=2/9 thinking=False think=True ", line)

    def test_json_line_fields(self) -> None:
        from txlb._records.resultlog import format_json

        plain = json.loads(format_json(self.summary()))
        self.assertNotIn("trunc", plain)
        self.assertNotIn("tries", plain)
        from datetime import datetime
        self.assertEqual(datetime.fromisoformat(plain["time"]).timestamp(), 2.5, plain["time"])
        marked = json.loads(format_json(self.summary(truncated=True, tries=2)))
        self.assertEqual((marked["trunc"], marked["tries"]), (True, 2))

    def test_a_failed_write_recovers_and_says_so_once(self) -> None:
        from pathlib import Path

        from twisted.logger import globalLogPublisher

        from txlb._records.resultlog import RETRY_SECONDS, ResultLog

        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        path = Path(self.mktemp())
        path.parent.mkdir(parents=True, exist_ok=True)
        clock = Clock()
        log = ResultLog(str(path), max_bytes=10**7, backups=1, fmt="text", clock=clock)
        self.addCleanup(log.close)
        sink: Any = log._sink

        def full(data: bytes) -> None:
            raise OSError(28, "No space left on device")

        original, sink.write = sink.write, full
        log.write(self.summary())
        self.assertEqual(log.dropped, 1)
        sink.write = original
        clock.advance(RETRY_SECONDS)
        for _ in range(3):
            log.write(self.summary())
        self.assertEqual(log.written, 3)
        self.assertEqual(len(path.read_text().splitlines()), 3)
        again = [e for e in events if "writable again" in str(e.get("log_format", ""))]
        self.assertEqual(len(again), 1)

    def test_standard_output_is_written_unbuffered(self) -> None:
        import os
        import tempfile

        from txlb._records.resultlog import ResultLog

        with tempfile.TemporaryFile() as captured:
            saved = os.dup(1)
            os.dup2(captured.fileno(), 1)
            try:
                log = ResultLog("-", max_bytes=0, backups=0, fmt="text", clock=Clock())
                log.write(self.summary())
                captured.seek(0)
                written = captured.read()  # before close: nothing held in a buffer
                log.close()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
        self.assertEqual(written.count(b"\n"), 1)
        self.assertIn(b"status=200", written)


class SummaryMutantTests(SynchronousTestCase):
    def test_dechunk(self) -> None:
        from txlb._records.summary import dechunk

        self.assertEqual(dechunk(b"1\r\na\r\n10\r\n" + b"b" * 16 + b"\r\n2;x=1\r\ncc\r\n0\r\n\r\n"),
                         b"a" + b"b" * 16 + b"cc")
        self.assertEqual(dechunk(b"1\r\na\r\n"), b"a")
        self.assertEqual(dechunk(b"zz\r\nbad\r\n"), b"")
        self.assertEqual(dechunk(b"1\r\na\r\n5"), b"a")  # capture cut in a size line

    def test_only_the_first_choice_counts(self) -> None:
        from txlb._records.summary import summarize

        record = RequestRecord(started=0.0, method=b"POST", path=b"/v1/chat/completions",
                               orid_header=None, request_body=b'{"n": 2}',
                               backend="127.0.0.1:8002", status=200, ended=1.0,
                               content_type=b"application/json")
        record.capture(json.dumps({"choices": [
            {"index": 0, "message": {"content": "one"}, "finish_reason": "stop"},
            {"index": 1, "message": {"content": "second choice"}},
            "not a choice",
        ]}).encode())
        summary = summarize(record)
        self.assertEqual((summary.preview, summary.clen), ("one", 3))


class AffinityAndQueueMutantTests(FailoverTestCase):
    def test_requests_without_a_session_key_rotate(self) -> None:
        self.build(affinity="header:X-Session")
        seen = []
        for n in range(3):
            self.post()
            seen.append(self.backend_of(n))
            self.answer(n, 200)
        self.assertEqual(sorted(seen), sorted(test_failover.THREE))

    def test_queue_wait_is_reported_to_the_millisecond(self) -> None:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write('[[backends]]\nurl = "127.0.0.1:8002"\nmax_conns = 1\n')
        self.build(config=build_config({"config": path, "log-file": "none"}, {}),
                   backends=None)
        self.post()
        self.post()  # queued
        self.clock.advance(1.23456)
        self.assertEqual(self.lb.router.queue_status()["oldest_wait_s"], 1.235)


class _Totals(_Slots):
    """Shared counts as a worker's pool reads them back (``Pool.refresh``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {7: 0}
        self.own = 0
        self.slot = lambda key: 7

    def totals(self) -> dict[int, int]:
        return self.counts

    def started(self, key: str) -> int:
        return 0

    def mine(self, key: str) -> int:
        return self.own


class PoolMutantTests(SynchronousTestCase):
    def test_idle_is_when_nothing_is_in_flight(self) -> None:
        pool = Pool((BackendSpec("127.0.0.1", 8002),))
        backend = pool.get("127.0.0.1:8002")
        first, second = pool.slots.acquire(backend), pool.slots.acquire(backend)
        idle = pool.slots.when_idle()
        first.release()
        self.assertNoResult(idle)
        second.release()
        self.successResultOf(idle)

    def test_a_removed_backend_leaves_on_refresh_once_this_worker_is_done(self) -> None:
        shared = _Totals()
        pool = Pool((BackendSpec("127.0.0.1", 8002),), shared=shared)  # type: ignore[arg-type]
        backend = pool.get("127.0.0.1:8002")
        shared.counts[7] = shared.own = 1  # a request of this worker's is in flight
        backend.health.leaving()
        pool.refresh()
        self.assertIs(pool.get("127.0.0.1:8002"), backend)
        shared.counts[7] = shared.own = 0  # it ended (counted down in shared memory)
        pool.refresh()
        self.assertIsNone(pool.get("127.0.0.1:8002"))


class MoreMutantTests(SynchronousTestCase):
    def test_every_policy_provides_the_interface(self) -> None:
        from zope.interface.verify import verifyObject

        from txlb._scheduling.policies import IPolicy
        from txlb._scheduling.policies.registry import BUILT_IN, make_policy

        for name in (factory.name for factory in BUILT_IN):
            self.assertTrue(verifyObject(IPolicy, make_policy(name, Clock(), None)), name)

    def test_queue_depth_prefers_the_emptier_engine(self) -> None:
        from txlb._scheduling.policies.registry import make_policy

        policy = make_policy("queue-depth", Clock(), None)
        empty, busy = (Backend(BackendSpec("127.0.0.1", p),
                                        engine=EngineReading(depth=depth))
                       for p, depth in ((8002, 0.0), (8003, 0.5)))
        self.assertEqual({policy.choose([empty, busy]).key for _ in range(4)}, {empty.key})

    def test_a_formatter_bug_loses_the_line_not_the_request(self) -> None:
        from pathlib import Path

        from txlb._records.resultlog import ResultLog

        path = Path(self.mktemp())
        path.parent.mkdir(parents=True, exist_ok=True)
        log = ResultLog(str(path), max_bytes=10**7, backups=1, fmt="text", clock=Clock())
        self.addCleanup(log.close)

        def broken(summary: object) -> str:
            raise KeyError("a formatter bug")

        log.format = broken
        log.write(ResultLogMutantTests.summary(self))  # type: ignore[arg-type]
        self.assertEqual(len(self.flushLoggedErrors(KeyError)), 1)

    def test_text_line_says_tries_only_when_retried(self) -> None:
        from txlb._records.resultlog import format_text

        self.assertNotIn("tries=", format_text(ResultLogMutantTests.summary(self)))  # type: ignore[arg-type]
        self.assertIn(" tries=2", format_text(ResultLogMutantTests.summary(self, tries=2)))  # type: ignore[arg-type]

    def test_an_sse_answer_that_opens_with_a_comment(self) -> None:
        from txlb._records.summary import summarize

        record = RequestRecord(started=0.0, method=b"POST", path=b"/v1/chat/completions",
                               orid_header=None, request_body=b"{}",
                               backend="127.0.0.1:8002", status=200, ended=1.0,
                               content_type=b"text/event-stream")
        record.capture(b': ping\n\ndata: {"choices": [{"index": 0, "delta": {"content": "hi"},'
                       b' "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
        summary = summarize(record)
        self.assertEqual((summary.finish, summary.preview), ("stop", "hi"))


class CiSampleMutantTests(SynchronousTestCase):
    """Survivors of CI's seeded sample."""

    def test_a_host_that_is_no_valid_idna_name_still_gets_a_host_header(self) -> None:
        reactor = MemoryReactorClock()
        client = UpstreamClient(reactor, connect_timeout=5)
        host = "a" * 64 + ".example"  # a label over 63 characters: not IDNA
        client.send(host, 8002, b"GET", b"/", [], None)
        _, _, factory, _, _ = reactor.tcpClients[-1]
        protocol = factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        self.assertIn(b"\r\nHost: " + host.encode() + b":8002\r\n", transport.value())

    def test_p2c_with_one_candidate(self) -> None:
        import random

        from txlb._scheduling.policies.p2c import PowerOfTwoChoices

        (only,) = [Backend(BackendSpec("127.0.0.1", 8002))]
        self.assertIs(PowerOfTwoChoices(random.Random(1)).choose([only]), only)

    def test_a_log_moved_away_is_reopened_at_its_path(self) -> None:
        from pathlib import Path

        from txlb._records.resultlog import RETRY_SECONDS, ResultLog

        directory = Path(self.mktemp())
        directory.mkdir(parents=True)
        path = directory / "lb_results.log"
        clock = Clock()
        log = ResultLog(str(path), max_bytes=10**7, backups=1, fmt="text", clock=clock)
        self.addCleanup(log.close)
        summary = ResultLogMutantTests.summary(self)  # type: ignore[arg-type]
        log.write(summary)
        path.rename(directory / "moved.log")  # logrotate's move,
        path.write_text("")  # and its create: another file at the same path
        clock.advance(RETRY_SECONDS)
        log.write(summary)
        self.assertEqual(len(path.read_text().splitlines()), 1)
        self.assertEqual(len((directory / "moved.log").read_text().splitlines()), 1)
        clock.advance(RETRY_SECONDS)
        log.write(summary)  # unchanged file: kept open, appended to
        self.assertEqual(len(path.read_text().splitlines()), 2)


@implementer(IPreparesRequests)
class _CountsPrepares(Policy):
    """Counts ``prepare`` calls and picks the first candidate."""

    name = "counts-prepares"

    def __init__(self) -> None:
        self.prepared = 0

    def prepare(self, request: RoutingRequest) -> None:
        self.prepared += 1

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        return candidates[0]


class _FailingChoice(Policy):
    name = "failing-choice"

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        raise RuntimeError("the policy broke")


class RouterFullRunTests(SynchronousTestCase):
    """Mutants of ``_scheduling/router`` that survived its full run (mutation-full/)."""

    def router(self, policy: Policy, *specs: BackendSpec,
               affinity: bool = False) -> Router:
        self.clock = Clock()
        pool = Pool(specs or (BackendSpec("127.0.0.1", 8002),), clock=self.clock)
        return Router(pool, policy, self.clock,
                      affinity=BoundedLoadRing() if affinity else None)

    def test_prepare_is_skipped_only_when_affinity_chooses(self) -> None:
        """
        Affinity routes a request with a session key by its hash, so the policy's
        per-request work (hashing a whole prompt, for cache-aware) is wasted on it -- and
        only on it: every other request must be prepared.
        """
        for affinity, session, prepared in ((False, None, 1), (False, "s", 1),
                                            (True, None, 1), (True, "s", 0)):
            policy = _CountsPrepares()
            router = self.router(policy, affinity=affinity)
            self.successResultOf(router.acquire(RoutingRequest(session=session))).release()
            self.assertEqual(policy.prepared, prepared, (affinity, session))

    def test_a_failing_policy_is_logged_once_a_minute_from_any_start(self) -> None:
        router = self.router(_FailingChoice())
        self.clock.advance(1000)  # a process that has run a while: the stamp is not 0

        def fail_at(seconds: float) -> int:
            self.clock.advance(seconds - self.clock.seconds())
            self.successResultOf(router.acquire()).release()
            return len(self.flushLoggedErrors(RuntimeError))

        self.assertEqual(fail_at(1000), 1)
        self.assertEqual(fail_at(1001), 0)
        self.assertEqual(fail_at(1059.5), 0)  # still within the minute
        self.assertEqual(fail_at(1060), 1)

    def test_models_of_every_healthy_backend_are_listed_past_a_down_one(self) -> None:
        router = self.router(_CountsPrepares(),
                             BackendSpec("127.0.0.1", 8002, models=("a",)),
                             BackendSpec("127.0.0.1", 8003, models=("b",)),
                             BackendSpec("127.0.0.1", 8004, models=("c",)))
        down = router.pool.get("127.0.0.1:8002")
        assert down is not None
        router.pool.mark_down(down, "refused")
        listed = router.model_list()
        self.assertEqual([entry["id"] for entry in listed["data"]], ["b", "c"])  # type: ignore[index]

    def test_listed_models_txlb_describes_itself_have_the_openai_shape(self) -> None:
        """
        A model known only from the config, and an alias, are listed as OpenAI's API lists
        a model: ``created`` 0 (no date is known), owned by txlb.
        """
        router = self.router(_CountsPrepares(),
                             BackendSpec("127.0.0.1", 8002, models=("m",)))
        router.routes = {"alias": ModelRoute("alias", (("m", 1),))}
        self.assertEqual(router.model_list(), {"object": "list", "data": [
            {"id": "alias", "object": "model", "created": 0, "owned_by": "txlb"},
            {"id": "m", "object": "model", "created": 0, "owned_by": "txlb"}]})

    def test_an_alias_in_a_configured_list_hides_no_model_after_it(self) -> None:
        """
        An alias is listed inside its model's entry, not as an entry of its own -- and
        skipping it must not skip the models the config lists after it.
        """
        router = self.router(_CountsPrepares(),
                             BackendSpec("127.0.0.1", 8002, models=("short", "other")))
        backend = router.pool.get("127.0.0.1:8002")
        assert backend is not None
        router.pool.set_models(backend, [{"id": "long", "object": "model",
                                          "aliases": ["short"]}])
        listed = router.model_list()["data"]
        self.assertEqual([entry["id"] for entry in listed], ["other"])  # type: ignore[attr-defined]


class HeadFullRunTests(SynchronousTestCase):
    """Mutants of ``_proxy/head`` that survived its full run (mutation-full/)."""

    def test_an_absolute_form_target_keeps_a_url_inside_its_query(self) -> None:
        """Only the first ``://`` is the scheme's: a redirect URL in the query is data."""
        from txlb._proxy.head import origin_form

        self.assertEqual(origin_form(b"http://h:8000/cb?next=http://x/y"),
                         b"/cb?next=http://x/y")


class OutlierFullRunTests(SynchronousTestCase):
    """Mutants of ``_cluster/outlier`` that survived its full run (mutation-full/)."""

    def fleet(self, size: int) -> Pool:
        self.clock = Clock()
        return Pool([BackendSpec("127.0.0.1", 8002 + n) for n in range(size)], clock=self.clock)

    def streak(self, pool: Pool, backend: Backend, answers: int,
               rule: OutlierRule | None = None) -> list[str | None]:
        rule = rule or OutlierRule(consecutive_5xx=5, base_cooldown=30)
        return [judge_answer(rule, backend, 500, f"client{n % 2}", list(pool),
                             self.clock.seconds()) for n in range(answers)]

    def test_a_kept_backend_is_warned_about_once_per_streak(self) -> None:
        pool = self.fleet(2)
        first, second = list(pool)
        pool.mark_down(second, "refused")  # half the fleet is out: first must stay in
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        self.assertEqual(self.streak(pool, first, 9), [None] * 9)
        warned = [e for e in events if "stays in" in str(e.get("log_format", ""))]
        self.assertEqual(len(warned), 1)
        self.assertEqual(warned[0]["count"], 5)

    def test_a_5xx_the_request_provoked_never_ejects_even_after_a_streak(self) -> None:
        pool = self.fleet(2)
        first, second = list(pool)
        pool.mark_down(second, "refused")
        self.streak(pool, first, 5)  # a streak long enough, kept in while half was out
        pool.mark_up(second)
        verdict = judge_answer(OutlierRule(5, 30), first, 500, None, list(pool),
                               self.clock.seconds())
        self.assertIsNone(verdict)

    def test_up_to_half_the_fleet_may_be_out(self) -> None:
        pool = self.fleet(4)
        backends = list(pool)
        pool.mark_down(backends[0], "refused")
        self.assertTrue(fleet_can_spare(backends))  # a second of four may go
        pool.mark_down(backends[1], "refused")
        self.assertFalse(fleet_can_spare(backends))

    def test_the_cool_down_grows_to_ten_times_the_base_and_no_further(self) -> None:
        pool = self.fleet(2)
        first = list(pool)[0]
        cooldowns = []
        for _ in range(12):
            verdict = self.streak(pool, first, 5)[-1]
            assert verdict is not None
            cooldowns.append(verdict.rsplit(" ", 1)[-1])
            self.clock.advance(1000)  # past the cool-down: back in rotation
            self.assertTrue(first.eligible)
        self.assertEqual(cooldowns, [f"{30 * n}s" for n in range(1, 11)] + ["300s", "300s"])
