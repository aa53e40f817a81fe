"""
Which engine a backend runs, its queue and KV-cache usage, from its ``/metrics``: the
parsing on fixtures (llama.cpp's recorded from the real server, the others written after
each engine's metric definitions: see tests/fixtures/engines/README.md), and the prober
recognising the engine once, at first sight, through the pool.
"""

from __future__ import annotations

import json
from pathlib import Path

from twisted.internet.task import Clock
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from txlb import BackendSpec, Pool
from txlb._cluster.engines import BY_NAME, UNKNOWN, prometheus_sum, read, recognise
from txlb._cluster.health import HealthChecker

from ..helpers import FakeResponse, FakeUpstream, UpstreamCall

FIXTURES = Path(__file__).parents[1] / "fixtures"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


class ParsingTests(SynchronousTestCase):
    def test_each_engine_is_recognised_by_its_names(self) -> None:
        for name, engine in [("engines/vllm-metrics.txt", "vllm"),
                             ("engines/vllm-old-metrics.txt", "vllm"),
                             ("engines/sglang-metrics.txt", "sglang"),
                             ("engines/tgi-metrics.txt", "tgi"),
                             ("llamacpp/metrics.txt", "llamacpp")]:
            found = recognise(fixture(name))
            self.assertEqual(None if found is None else found.name, engine, name)

    def test_queue_and_kv_cache_of_each_engine(self) -> None:
        cases = [
            # two engine cores: queues add up, KV usage is their mean
            ("engines/vllm-metrics.txt", "vllm", 5.0, 4.0, 0.5),
            ("engines/vllm-old-metrics.txt", "vllm", 1.0, 2.0, 0.5),
            ("engines/sglang-metrics.txt", "sglang", 6.0, 2.0, 0.42),
            ("engines/tgi-metrics.txt", "tgi", 4.0, 7.0, None),
            # this llama-server build exports no KV-cache gauge
            ("llamacpp/metrics.txt", "llamacpp", 0.0, 0.0, None),
        ]
        for name, engine, running, waiting, kv in cases:
            reading = read(fixture(name), BY_NAME[engine])
            self.assertEqual((reading.running, reading.waiting, reading.kv_cache),
                             (running, waiting, kv), name)

    def test_older_llamacpp_kv_ratio_is_read(self) -> None:
        text = fixture("llamacpp/metrics.txt") + "llamacpp:kv_cache_usage_ratio 0.63\n"
        self.assertEqual(read(text, BY_NAME["llamacpp"]).kv_cache, 0.63)

    def test_nothing_known_is_none(self) -> None:
        self.assertIsNone(recognise("# HELP x\nprocess_cpu_seconds_total 3\nup 1\n"))
        self.assertIsNone(recognise(""))

    def test_hostile_values_are_ignored_or_bounded(self) -> None:
        text = ("vllm:num_requests_running NaN\nvllm:num_requests_running +Inf\n"
                "vllm:num_requests_running{a=\"} 9\"} 2\nvllm:num_requests_waiting -5\n"
                "vllm:kv_cache_usage_perc 7\nvllm:num_requests_waiting{broken 3\n")
        reading = read(text, BY_NAME["vllm"])
        self.assertEqual((reading.running, reading.waiting, reading.kv_cache), (2.0, 0.0, 1.0))

    def test_values_too_big_to_add_up_are_no_reading(self) -> None:
        """
        Finite but huge values sum to infinity: that is no queue (and an ``Infinity`` in
        ``/status`` is not JSON -- the dashboard and any strict client would choke on it).
        """
        many = "".join(f'vllm:num_requests_running{{e="{i}"}} 1e308\n' for i in range(3))
        for text in (many + "vllm:num_requests_waiting 0\n",
                     "vllm:num_requests_running 1e308\nvllm:num_requests_waiting 1e308\n"):
            reading = read(text, BY_NAME["vllm"])
            self.assertEqual((reading.running, reading.waiting), (None, None), text)

    def test_prometheus_sum_matches_whole_names_only(self) -> None:
        text = "vllm:num_requests_running_x 7\nvllm:num_requests_running{e=\"0\"} 1\n"
        self.assertEqual(prometheus_sum(text, "vllm:num_requests_running"), 1.0)


A = BackendSpec("127.0.0.1", 8002)
A_MODELS = BackendSpec("127.0.0.1", 8002, models=("m",))


class RecognitionTests(SynchronousTestCase):
    """The prober recognises the engine as models are learned and reads its own names."""

    def build(self, spec: BackendSpec, queue_depth: bool) -> None:
        self.clock = Clock()
        self.agent = FakeUpstream()
        self.pool = Pool((spec,))
        backend = self.pool.get(spec.key)
        assert backend is not None
        self.backend = backend
        self.checker = HealthChecker(self.pool, self.agent, self.clock, interval=2,
                                     timeout=1, path="/health", rise=1, fall=3,
                                     scrape_engine_queue=queue_depth)
        self.warnings: list[str] = []

        def observe(event: dict[str, object]) -> None:
            if event.get("log_level") is LogLevel.warn:
                self.warnings.append(str(event.get("log_format")))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        self.checker.startService()
        self.addCleanup(self.checker.stopService)

    def pending(self, path: bytes) -> UpstreamCall:
        calls = [c for c in self.agent.calls if c.uri.endswith(path) and not c.deferred.called]
        self.assertEqual(len(calls), 1, f"expected one pending GET {path!r}")
        return calls[0]

    def answer(self, path: bytes, body: str, code: int = 200) -> None:
        response = self.pending(path).respond(FakeResponse(code))
        response.send(body.encode())
        response.end()

    def probe(self, metrics: str | None, code: int = 200, models: bool = True) -> None:
        self.answer(b"/health", "")
        if models:
            self.answer(b"/v1/models", fixture("llamacpp/models.json"))
        if metrics is not None:
            self.answer(b"/metrics", metrics, code)

    def test_recognised_at_first_sight_and_shown_in_status(self) -> None:
        self.build(A, queue_depth=False)
        self.probe(fixture("engines/sglang-metrics.txt"))
        self.assertEqual(self.backend.engine.name, "sglang")
        self.assertEqual(self.backend.engine.kv_cache_usage, 0.42)
        self.assertEqual(self.pool.status()["backends"][0]["engine"], "sglang")  # type: ignore[index]
        self.assertEqual(self.backend.detailed_status()["kv_cache_usage"], 0.42)
        self.clock.advance(2)
        self.probe(None, models=False)  # not again while it stays up
        self.assertEqual([c for c in self.agent.calls if c.uri.endswith(b"/metrics")][1:], [])

    def test_again_when_it_comes_back_up(self) -> None:
        self.build(A, queue_depth=False)
        self.probe(fixture("engines/vllm-metrics.txt"))
        self.pool.mark_down(self.backend, "test")
        self.clock.advance(2)
        self.probe(fixture("llamacpp/metrics.txt"))  # restarted as another engine
        self.assertEqual(self.backend.engine.name, "llamacpp")

    def test_queue_depth_reads_each_engines_own_names(self) -> None:
        for name, depth, later in [
                ("engines/tgi-metrics.txt", 11.0, ("tgi_queue_size 7", "tgi_queue_size 17")),
                ("engines/sglang-metrics.txt", 8.0, ("} 6.0", "} 16.0")),
                ("engines/vllm-metrics.txt", 9.0, ("} 4.0", "} 14.0"))]:
            self.build(A_MODELS, queue_depth=True)
            self.answer(b"/health", "")
            self.answer(b"/metrics", fixture(name))
            self.assertEqual(self.backend.engine.depth, depth, name)
            self.clock.advance(2)  # the next probes read the queue by the engine's names
            self.answer(b"/health", "")
            self.answer(b"/metrics", fixture(name).replace(*later))
            self.assertEqual(self.backend.engine.depth, depth + 10, name)
            self.assertEqual(self.warnings, [])
            self.checker.stopService()

    def test_no_known_queue_warns_once_and_falls_back(self) -> None:
        self.build(A_MODELS, queue_depth=True)
        self.answer(b"/health", "")
        self.answer(b"/metrics", json.dumps({"error": {"code": 501}}), code=501)
        self.assertEqual(self.backend.engine.name, UNKNOWN)
        self.assertIsNone(self.backend.engine.depth)
        self.assertEqual(len(self.warnings), 1)
        self.assertIn("queue", self.warnings[0])
        for _ in range(3):
            self.clock.advance(2)
            self.answer(b"/health", "")
        # an unknown engine is not scraped on every probe, nor warned about again
        self.assertEqual(len([c for c in self.agent.calls if c.uri.endswith(b"/metrics")]), 1)
        self.assertEqual(len(self.warnings), 1)

    def test_a_queue_too_big_to_count_stays_out_of_status(self) -> None:
        self.build(A_MODELS, queue_depth=True)
        self.answer(b"/health", "")
        self.answer(b"/metrics", "vllm:num_requests_running 1e308\n"
                                 "vllm:num_requests_waiting 1e308\n")
        self.assertEqual(self.backend.engine.name, "vllm")
        self.assertIsNone(self.backend.engine.depth)  # local counts, not an infinite queue
        status = json.dumps(self.backend.detailed_status())
        json.loads(status, parse_constant=lambda name: self.fail(f"{name} in /status"))

    def test_a_failing_metrics_page_is_asked_again(self) -> None:
        """
        A 5xx from ``/metrics`` (an engine between restarts, a sidecar hiccup) says nothing
        of the engine: it is not taken for ``unknown`` -- which would stop the queue reads
        for good -- but recognised at a later probe.  Without ``--policy queue-depth`` too.
        """
        for queue_depth, spec in ((True, A_MODELS), (False, A)):
            self.build(spec, queue_depth=queue_depth)
            self.probe("busy", code=503, models=not spec.models)
            self.assertIsNone(self.backend.engine.name)
            # queue-depth cannot read this queue: said once, not at debug level
            self.assertEqual(len(self.warnings), queue_depth)
            self.clock.advance(2)
            self.probe(fixture("engines/vllm-metrics.txt"), models=False)
            self.assertEqual(self.backend.engine.name, "vllm")
            if queue_depth:
                self.assertEqual(self.backend.engine.depth, 9.0)
            self.checker.stopService()

    def test_without_queue_depth_nothing_is_warned(self) -> None:
        self.build(A, queue_depth=False)
        self.probe("up 1\n")
        self.assertEqual(self.backend.engine.name, UNKNOWN)
        self.assertEqual(self.warnings, [])

    def test_configured_models_and_no_queue_depth_scrape_nothing(self) -> None:
        self.build(A_MODELS, queue_depth=False)
        self.answer(b"/health", "")
        self.assertEqual([c.uri for c in self.agent.calls], [b"http://127.0.0.1:8002/health"])
        self.assertIsNone(self.backend.status()["engine"])

    def test_the_engine_reaches_worker_processes(self) -> None:
        self.build(A, queue_depth=False)
        updates: list[int] = []
        self.pool.on_update.append(lambda: updates.append(1))
        self.probe(fixture("engines/tgi-metrics.txt"), models=False)
        self.assertTrue(updates)
        worker = Pool()
        worker.mirror(self.pool.shared_state())
        mirrored = worker.get(A.key)
        assert mirrored is not None
        self.assertEqual(mirrored.engine.name, "tgi")
