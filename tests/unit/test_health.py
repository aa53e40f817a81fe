"""
The prober on an injected clock, with every probe answered (or not) by the test: what it
reads, refuses, marks and warns about -- its body limits, the metrics scrape and the engine
queue, learning models, recognising the engine, failed probes, probing on demand and a
retune.  Many were written for the behaviour the survivors of ``_cluster/health``'s full
mutation run showed no test pinned down.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import error as neterror
from twisted.internet.task import Clock
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseNeverReceived

from txlb import BackendSpec, Pool
from txlb._cluster.backend import Backend
from txlb._cluster.engines import UNKNOWN
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


class ProberExtrasTests(SynchronousTestCase):
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


#: models to be learned: asked for /v1/models and /metrics as it comes up
LEARNED = BackendSpec("127.0.0.1", 8002)


#: models configured: /metrics only with --policy queue-depth
CONFIGURED = BackendSpec("127.0.0.1", 8002, models=("m",))


OTHER = BackendSpec("127.0.0.1", 8003, models=("m",))


MODELS = '{"object": "list", "data": [{"id": "m", "object": "model"}]}'


VLLM = "vllm:num_requests_running 1\nvllm:num_requests_waiting 2\n"


LLAMACPP = "llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n"


#: docs/usage.md: "a body over 4 MiB is a failed read"
FOUR_MIB = 4 * 1024 * 1024


def padded(text: str, size: int) -> str:
    """``text`` after a Prometheus comment that makes the whole ``size`` bytes."""
    filler = size - len(text) - 2
    return "#" + "x" * filler + "\n" + text


class _Prober(SynchronousTestCase):
    """One backend (or two) and a prober whose every request the test answers."""

    def build(self, *specs: BackendSpec, queue_depth: bool = False, timeout: float = 1,
              rise: int = 1, fall: int = 3) -> Backend:
        self.clock = Clock()
        self.agent = FakeUpstream()
        self.pool = Pool(specs)
        self.checker = HealthChecker(self.pool, self.agent, self.clock, interval=2,
                                     timeout=timeout, path="/health", rise=rise, fall=fall,
                                     scrape_engine_queue=queue_depth)
        warnings: list[str] = []
        self.warnings = warnings

        def observe(event: dict[str, object]) -> None:
            if event.get("log_level") is LogLevel.warn:
                warnings.append(formatEvent(event))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        self.checker.startService()
        self.addCleanup(self.checker.stopService)
        backend = self.pool.get(specs[0].key)
        assert backend is not None
        return backend

    def calls(self, path: bytes) -> list[UpstreamCall]:
        return [c for c in self.agent.calls if c.uri.endswith(path)]

    def pending(self, path: bytes) -> UpstreamCall:
        calls = [c for c in self.calls(path) if not c.deferred.called]
        self.assertEqual(len(calls), 1, f"expected one pending GET {path!r}")
        return calls[0]

    def nothing_pending(self, path: bytes) -> None:
        self.assertEqual([c for c in self.calls(path) if not c.deferred.called], [], path)

    def answer(self, path: bytes, body: str = "", code: int = 200) -> None:
        response = self.pending(path).respond(FakeResponse(code))
        data = body.encode()
        response.send(data[:len(data) // 2])  # in two reads: the limit is on their sum
        response.send(data[len(data) // 2:])
        response.end()


class BodyLimitTests(_Prober):
    """``_cluster/health``'s full run: a probe's body is read up to 4 MiB, no further."""

    def test_a_metrics_page_of_4_mib_is_read(self) -> None:
        backend = self.build(LEARNED)
        self.answer(b"/health")
        self.answer(b"/v1/models", MODELS)
        self.answer(b"/metrics", padded(VLLM, FOUR_MIB))
        self.assertEqual(backend.engine.name, "vllm")

    def test_one_byte_more_is_a_failed_read(self) -> None:
        """Not an ``unknown`` engine either: a failed read, so it is looked for again."""
        backend = self.build(LEARNED)
        self.answer(b"/health")
        self.answer(b"/v1/models", MODELS)
        self.answer(b"/metrics", padded(VLLM, FOUR_MIB + 1))
        self.assertIsNone(backend.engine.name)
        self.clock.advance(2)
        self.answer(b"/health")
        self.answer(b"/metrics", VLLM)
        self.assertEqual(backend.engine.name, "vllm")


class MetricsStatusTests(_Prober):
    """
    ``_cluster/health``'s full run: only a 5xx from ``/metrics`` other than 501 is a
    failure (looked for again at the next probe); any other answer, 4xx and llama.cpp's
    501 included, is the engine's answer: ``unknown``, never scraped again.
    """

    def test_a_5xx_is_asked_again(self) -> None:
        for code in (500, 502, 503):
            backend = self.build(CONFIGURED, queue_depth=True)
            self.answer(b"/health")
            self.answer(b"/metrics", "busy", code=code)
            self.assertIsNone(backend.engine.name, code)
            self.clock.advance(2)
            self.answer(b"/health")
            self.answer(b"/metrics", VLLM)
            self.assertEqual((backend.engine.name, backend.engine.depth), ("vllm", 3.0), code)
            self.checker.stopService()

    def test_other_answers_are_an_unknown_engine(self) -> None:
        for code in (404, 499, 501):
            backend = self.build(CONFIGURED, queue_depth=True)
            self.answer(b"/health")
            self.answer(b"/metrics", "no", code=code)
            self.assertEqual(backend.engine.name, UNKNOWN, code)
            self.assertEqual(len(self.warnings), 1, code)
            self.assertIn(f"(HTTP {code})", self.warnings[0])
            for _ in range(2):
                self.clock.advance(2)
                self.answer(b"/health")
                self.nothing_pending(b"/metrics")
            self.assertEqual(len(self.calls(b"/metrics")), 1, code)
            self.checker.stopService()


class QueueDepthTests(_Prober):
    """``_cluster/health``'s full run: what ``--policy queue-depth`` reads and warns of."""

    def test_the_queue_is_read_at_every_probe(self) -> None:
        backend = self.build(CONFIGURED, queue_depth=True)
        self.answer(b"/health")
        self.answer(b"/metrics", VLLM)
        self.assertEqual((backend.engine.name, backend.engine.depth), ("vllm", 3.0))
        self.clock.advance(2)
        self.answer(b"/health")
        self.answer(b"/metrics", "vllm:num_requests_running 4\nvllm:num_requests_waiting 6\n")
        self.assertEqual(backend.engine.depth, 10.0)
        self.assertEqual(self.warnings, [])

    def test_half_a_queue_is_no_queue(self) -> None:
        """Running but no waiting (or the other way): local counts, and one warning why."""
        for text in ("vllm:num_requests_running 4\n", "vllm:num_requests_waiting 4\n"):
            backend = self.build(CONFIGURED, queue_depth=True)
            self.answer(b"/health")
            self.answer(b"/metrics", VLLM)
            self.clock.advance(2)
            self.answer(b"/health")
            self.answer(b"/metrics", text)
            self.assertIsNone(backend.engine_depth, text)
            self.assertEqual(backend.engine.name, "vllm")
            self.assertEqual(len(self.warnings), 1, text)
            self.assertIn("(vllm:num_requests_running or vllm:num_requests_waiting missing)",
                          self.warnings[0])
            self.checker.stopService()

    def test_no_known_name_is_an_unknown_engine_warned_about_once(self) -> None:
        backend = self.build(CONFIGURED, queue_depth=True)
        self.answer(b"/health")
        self.answer(b"/metrics", "process_cpu_seconds_total 3\nup 1\n")
        self.assertEqual(backend.engine.name, UNKNOWN)
        self.assertEqual(self.pool.status()["backends"][0]["engine"], UNKNOWN)  # type: ignore[index]
        self.assertEqual(len(self.warnings), 1)
        self.assertIn("(no metric name txlb knows)", self.warnings[0])

    def test_a_first_scrape_that_fails_is_warned_about_once_with_its_error(self) -> None:
        backend = self.build(CONFIGURED, queue_depth=True)
        error = neterror.ConnectionRefusedError()
        for _ in range(3):
            self.answer(b"/health")
            self.pending(b"/metrics").fail(error)
            self.assertIsNone(backend.engine.depth)
            self.clock.advance(2)
        self.assertEqual(len(self.calls(b"/metrics")), 3)  # never read: looked for again
        self.assertEqual(len(self.warnings), 1)
        self.assertIn(f"(reading it failed: {error})", self.warnings[0])

    def test_a_known_engine_whose_scrape_fails_is_not_warned_about(self) -> None:
        """Its queue is forgotten (local counts for now), but it does export one."""
        backend = self.build(CONFIGURED, queue_depth=True)
        self.answer(b"/health")
        self.answer(b"/metrics", VLLM)
        self.clock.advance(2)
        self.answer(b"/health")
        self.pending(b"/metrics").fail(neterror.ConnectionRefusedError())
        self.assertIsNone(backend.engine.depth)
        self.assertEqual(self.warnings, [])
        self.clock.advance(2)
        self.answer(b"/health")
        self.answer(b"/metrics", VLLM)
        self.assertEqual(backend.engine.depth, 3.0)


class RecognitionTests(_Prober):
    """``_cluster/health``'s full run: when the models and the engine are looked for."""

    def test_looked_for_until_recognised_then_left_alone(self) -> None:
        backend = self.build(LEARNED)
        self.answer(b"/health")
        self.answer(b"/v1/models", MODELS)
        self.answer(b"/metrics", "busy", code=503)
        self.assertIsNone(backend.engine.name)
        self.clock.advance(2)
        self.answer(b"/health")
        self.nothing_pending(b"/v1/models")  # learned: not asked again while it stays up
        self.answer(b"/metrics", VLLM)
        self.assertEqual(backend.engine.name, "vllm")
        self.clock.advance(2)
        self.answer(b"/health")
        self.nothing_pending(b"/v1/models")
        self.nothing_pending(b"/metrics")

    def test_both_again_when_it_comes_back_up(self) -> None:
        backend = self.build(LEARNED)
        self.answer(b"/health")
        self.answer(b"/v1/models", MODELS)
        self.answer(b"/metrics", VLLM)
        self.pool.mark_down(backend, "test")
        self.clock.advance(2)
        self.answer(b"/health")  # rise=1: up again, perhaps restarted as something else
        self.assertTrue(backend.health.healthy)
        self.answer(b"/v1/models", MODELS.replace('"m"', '"n"'))
        self.answer(b"/metrics", LLAMACPP)
        self.assertEqual(backend.engine.name, "llamacpp")
        self.assertEqual(backend.models, ("n",))

    def test_the_next_probe_waits_for_the_scrape(self) -> None:
        """One backend is never read twice at once: /health waits for /metrics."""
        self.build(CONFIGURED, queue_depth=True, timeout=5)
        self.answer(b"/health")
        self.clock.advance(2)
        self.assertEqual(len(self.calls(b"/health")), 1)
        self.answer(b"/metrics", VLLM)
        self.clock.advance(2)
        self.assertEqual(len(self.calls(b"/health")), 2)


class FailedProbeTests(_Prober):
    """``_cluster/health``'s full run: which failed probes count towards --fall."""

    def test_stopping_the_prober_counts_no_failure(self) -> None:
        backend = self.build(CONFIGURED, fall=1)
        self.checker.stopService()  # cancels the probe under way
        self.assertTrue(backend.health.healthy)
        self.assertIsNone(backend.health.last_probe_error)

    def test_a_timeout_while_its_streams_flow_is_not_counted(self) -> None:
        """A byte heard the very moment the probe went out counts as flowing."""
        backend = self.build(CONFIGURED, fall=1)
        backend.pace.heard(self.clock.seconds())
        self.clock.advance(1)  # the probe's timeout
        self.assertTrue(backend.health.healthy)
        self.assertIsNone(backend.health.last_probe_error)

    def test_a_refusal_while_its_streams_flow_is_counted(self) -> None:
        backend = self.build(CONFIGURED, fall=3)
        backend.pace.heard(self.clock.seconds())
        self.pending(b"/health").fail(neterror.ConnectionRefusedError())
        self.assertFalse(backend.health.healthy)

    def test_a_backend_whose_probe_cannot_be_built_stops_no_other(self) -> None:
        """
        A host the Python API lets through but no URL can hold (the config refuses it):
        the error is logged, and the other backends are probed on.
        """
        self.build(BackendSpec("b\u00fccher.example", 80), OTHER)
        for _ in range(3):
            self.answer(b":8003/health")
            self.clock.advance(2)
        self.assertEqual(len(self.calls(b":8003/health")), 4)
        self.assertTrue(self.flushLoggedErrors(UnicodeEncodeError))


class RetuneTests(_Prober):
    def test_a_new_interval_after_the_prober_stopped_starts_nothing(self) -> None:
        """A reload while shutting down: the stopped loop stays stopped, and nothing raises."""
        self.build(LEARNED)
        self.checker.stopService()
        probes = len(self.agent.calls)
        self.checker.retune(interval=5, timeout=1, path="/health", rise=1, fall=3,
                            scrape_engine_queue=False)
        self.clock.advance(20)
        self.assertEqual(len(self.agent.calls), probes)
        self.assertEqual(self.checker.interval, 5)
