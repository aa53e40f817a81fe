"""
What the active prober reads, refuses, marks and warns about -- the behaviour the survivors
of ``_cluster/health``'s full mutation run showed no test pinned down.  Every probe is
answered (or not) by the test, on an injected clock.
"""

from __future__ import annotations

from twisted.internet import error as neterror
from twisted.internet.task import Clock
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from txlb import BackendSpec, Pool
from txlb._cluster.backend import Backend
from txlb._cluster.engines import UNKNOWN
from txlb._cluster.health import HealthChecker

from ..helpers import FakeResponse, FakeUpstream, UpstreamCall

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
            self.assertIsNone(backend.engine.depth, text)
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
