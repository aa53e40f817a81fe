"""The prober on an injected clock, with every probe answered (or not) by the test."""

from __future__ import annotations

from twisted.internet import error as neterror
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseNeverReceived

from txlb import BackendSpec, Pool
from txlb._cluster.health import HealthChecker

from ..helpers import FakeResponse, FakeUpstream, UpstreamCall

A = BackendSpec("127.0.0.1", 8002)
B = BackendSpec("127.0.0.1", 8003)
#: the same with configured models: probed, never asked for models or metrics
A_M = BackendSpec("127.0.0.1", 8002, models=("m",))
B_M = BackendSpec("127.0.0.1", 8003, models=("m",))


class HealthCheckerTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.agent = FakeUpstream()
        self.pool = Pool((A_M, B_M))
        self.a = self.pool.get(A.key)
        self.b = self.pool.get(B.key)
        self.checker = HealthChecker(
            self.pool, self.agent, self.clock, interval=2, timeout=1, path="/health",
            rise=2, fall=3,
        )
        self.checker.startService()
        self.addCleanup(self.checker.stopService)

    def pending(self, spec: BackendSpec) -> UpstreamCall:
        calls = [c for c in self.agent.calls if spec.key.encode() in c.uri
                 and not c.deferred.called]
        self.assertEqual(len(calls), 1, f"expected one pending probe of {spec.key}")
        return calls[0]

    def answer(self, spec: BackendSpec, code: int) -> None:
        self.pending(spec).respond(FakeResponse(code, length=0)).end()

    def test_probes_every_backend_at_start(self) -> None:
        uris = sorted(c.uri for c in self.agent.calls)
        self.assertEqual(uris, [b"http://127.0.0.1:8002/health", b"http://127.0.0.1:8003/health"])
        self.assertEqual({c.method for c in self.agent.calls}, {b"GET"})

    def test_non_200_marks_down_at_once(self) -> None:
        self.answer(A, 503)
        self.assertFalse(self.a.health.healthy)
        self.assertEqual(self.a.health.last_probe_error, "health: HTTP 503")
        self.answer(B, 200)
        self.assertTrue(self.b.health.healthy)

    def test_refused_marks_down_at_once(self) -> None:
        self.pending(A).fail(neterror.ConnectionRefusedError())
        self.assertFalse(self.a.health.healthy)

    def test_ambiguous_failures_need_fall_in_a_row(self) -> None:
        self.pending(A).fail(ResponseNeverReceived([Failure(neterror.ConnectionLost())]))
        self.assertTrue(self.a.health.healthy)
        self.clock.advance(2)
        self.clock.advance(1)  # timeout: no answer within 1 s
        self.assertTrue(self.a.health.healthy)
        self.assertEqual(self.a.health.last_probe_error, "health: no answer within 1s")
        self.clock.advance(1)  # third probe starts at t=4
        self.pending(A).fail(ResponseNeverReceived([Failure(neterror.ConnectionLost())]))
        self.assertFalse(self.a.health.healthy)

    def test_success_resets_the_fall_count(self) -> None:
        for _ in range(5):
            self.pending(A).fail(ResponseNeverReceived([Failure(neterror.ConnectionLost())]))
            self.clock.advance(2)
            self.answer(A, 200)
            self.clock.advance(2)
        self.assertTrue(self.a.health.healthy)

    def test_rise_successes_bring_it_back(self) -> None:
        self.answer(A, 503)
        self.clock.advance(2)
        self.answer(A, 200)
        self.assertFalse(self.a.health.healthy)  # rise=2
        self.clock.advance(2)
        self.answer(A, 200)
        self.assertTrue(self.a.health.healthy)

    def test_hung_probe_stalls_nothing(self) -> None:
        """
        A backend whose probe never answers is not probed twice at once, and the other
        backends keep being probed every interval.
        """
        checker = HealthChecker(self.pool, self.agent, self.clock, interval=2, timeout=30,
                                path="/health", rise=1, fall=3)
        self.checker.stopService()
        self.agent.calls.clear()
        checker.startService()
        self.addCleanup(checker.stopService)
        for _ in range(5):
            self.answer(B, 200)
            self.clock.advance(2)
        probes_of_a = [c for c in self.agent.calls if b"8002" in c.uri]
        self.assertEqual(len(probes_of_a), 1)
        self.assertEqual(len([c for c in self.agent.calls if b"8003" in c.uri]), 6)

    def test_a_stalled_models_or_metrics_body_does_not_stop_the_probes(self) -> None:
        """
        A backend that answers ``/v1/models`` (or ``/metrics``) with a head and then never
        finishes the body: that read is under the probe timeout too.  Before, the probe
        never ended, so that backend was never probed again -- an engine that froze
        mid-body stayed in rotation however dead it was afterwards.
        """
        self.pool = Pool((BackendSpec(A.host, A.port), B))  # A's models are to be learned
        self.a = self.pool.get(A.key)
        checker = HealthChecker(self.pool, self.agent, self.clock, interval=2, timeout=1,
                                path="/health", rise=1, fall=1, scrape_engine_queue=True)
        self.checker.stopService()
        self.agent.calls.clear()
        checker.startService()
        self.addCleanup(checker.stopService)
        self.answer(A, 200)
        extras = [c for c in self.agent.calls if b"8002" in c.uri and not c.deferred.called]
        self.assertEqual(sorted(c.uri.rsplit(b"/", 1)[1] for c in extras),
                         [b"metrics", b"models"])
        stalled = [call.respond(FakeResponse(200)) for call in extras]
        for response in stalled:
            response.send(b"{")  # ... and nothing more, ever
        self.clock.advance(2)
        self.clock.advance(2)
        self.pending(A).fail(neterror.ConnectionRefusedError())
        self.assertFalse(self.a.health.healthy)
        # and the stalled reads were not left open: one connection per probe would pile up
        self.assertTrue(all(response.transport.stopped for response in stalled))

    def test_stop_cancels_probes_and_loop(self) -> None:
        self.checker.stopService()
        self.assertTrue(all(c.cancelled for c in self.agent.calls))
        count = len(self.agent.calls)
        self.clock.advance(100)
        self.assertEqual(len(self.agent.calls), count)
        self.assertTrue(self.a.health.healthy and self.b.health.healthy)


class _RaisingAgent(FakeUpstream):
    """An agent that raises at once for one backend, as treq did for ``[::1]``."""

    def __init__(self, poisoned: bytes) -> None:
        super().__init__()
        self.poisoned = poisoned

    def request(self, method: bytes, uri: bytes, headers: object = None,
                bodyProducer: object = None) -> object:
        if self.poisoned in uri:
            raise ValueError("cannot build a request for this URL")
        return super().request(method, uri, headers, bodyProducer)  # type: ignore[arg-type]


class ProbeErrorTests(SynchronousTestCase):
    """A probe that raises for any reason fails that backend's probe, and only that."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.agent = _RaisingAgent(b":8002/")
        self.pool = Pool((A, B))
        self.checker = HealthChecker(self.pool, self.agent, self.clock, interval=2, timeout=1,
                                     path="/health", rise=1, fall=2)
        self.checker.startService()
        self.addCleanup(self.checker.stopService)

    def answer_b(self) -> None:
        pending = [c for c in self.agent.calls if b"8003/health" in c.uri and not c.deferred.called]
        self.assertEqual(len(pending), 1)
        pending[0].respond(FakeResponse(200, length=0)).end()

    def test_the_loop_and_the_other_backends_go_on(self) -> None:
        for _ in range(4):
            self.answer_b()
            self.clock.advance(2)
        self.assertEqual(len([c for c in self.agent.calls if b"8003/health" in c.uri]), 5)
        assert self.checker._loop is not None
        self.assertTrue(self.checker._loop.running)
        self.assertTrue(self.pool.get(B.key).health.healthy)  # type: ignore[union-attr]

    def test_the_raising_backend_counts_failed_probes(self) -> None:
        a = self.pool.get(A.key)
        assert a is not None
        self.assertTrue(a.health.healthy)  # fall=2: one failure is not enough
        self.assertIn("cannot build a request", a.health.last_probe_error or "")
        self.answer_b()
        self.clock.advance(2)
        self.assertFalse(a.health.healthy)
        self.assertNotIn(A.key, [b.key for b in self.checker._probing])


class EngineScrapeFailureTests(SynchronousTestCase):
    """A failed ``/metrics`` scrape drops the engine's queue depth for every process."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.agent = FakeUpstream()
        self.pool = Pool((BackendSpec("127.0.0.1", 8002, models=("m",)),))
        self.backend = self.pool.get(A.key)
        self.checker = HealthChecker(self.pool, self.agent, self.clock, interval=2, timeout=1,
                                     path="/health", rise=1, fall=3, scrape_engine_queue=True)

    def test_a_failed_scrape_reaches_the_update_hook(self) -> None:
        assert self.backend is not None
        self.pool.set_engine_depth(self.backend, 3, 1)
        updates: list[int] = []
        self.pool.on_update.append(lambda: updates.append(1))
        self.checker.startService()
        self.addCleanup(self.checker.stopService)
        self.agent.last.respond(FakeResponse(200, length=0)).end()
        seen = len(updates)
        scrape = self.agent.last
        self.assertTrue(scrape.uri.endswith(b"/metrics"))
        scrape.fail(neterror.ConnectionLost())
        self.assertIsNone(self.backend.engine.depth)
        # the worker processes mirror on this hook: without it they kept the stale depth
        self.assertEqual(len(updates), seen + 1)
