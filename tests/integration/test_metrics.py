"""
The admin port's Prometheus exposition, read with prometheus_client's own parser and, when
Debian's prometheus package is installed, linted by ``promtool check metrics``.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ..helpers import FakeResponse
from ..parts import missing
from ..processes import ROOT
from ..unit.test_scheduling import BalancerTestCase

A, B = "127.0.0.1:8002", "127.0.0.1:8003"


class ExpositionTests(BalancerTestCase):
    def setUp(self) -> None:
        self.build(config_file=self.config_file(
            f'[[backends]]\nurl = "{A}"\nmax_conns = 1\n'
            f'[[backends]]\nurl = "{B}"\nmax_conns = 1\n'))

    def value(self, name: str, **labels: str) -> float:
        for family in text_string_to_metric_families(self.lb.metrics.exposition().decode()):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        raise AssertionError(f"no sample {name}{labels}")

    def traffic(self) -> None:
        """
        One finished completion (so the counters and histograms have series: its tokens,
        prompt and cached prompt, time per output token), two queued.
        """
        self.post({})
        response = self.upstream.last.respond(FakeResponse(
            200, headers=[(b"content-type", b"text/event-stream")]))
        self.clock.advance(0.1)
        response.send(b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n')
        self.clock.advance(0.2)
        response.send(b'data: {"choices": [], "usage": '
                      b'{"prompt_tokens": 30, "completion_tokens": 11, '
                      b'"prompt_tokens_details": {"cached_tokens": 16}}}\n\ndata: [DONE]\n\n')
        response.end()
        self.post({})
        self.post({})
        self.post({})
        self.post({})

    def test_parses_and_follows_the_naming_rules(self) -> None:
        self.traffic()
        text = self.lb.metrics.exposition().decode()
        families = list(text_string_to_metric_families(text))
        self.assertTrue(families)
        for family in families:
            self.assertTrue(family.name.startswith("txlb_"), family.name)
            if family.type != "counter":
                self.assertFalse(family.name.endswith("_total"), family.name)
            for sample in family.samples:
                self.assertFalse(sample.name.endswith("_created"), sample.name)

    def test_fleet_queue_build_and_outlier_state(self) -> None:
        self.traffic()
        self.assertEqual(self.value("txlb_backends"), 2)
        self.assertEqual(self.value("txlb_queue_length"), 2)
        self.assertEqual(self.value("txlb_queue_class_length", **{"class": "default"}), 2)
        self.assertEqual(self.value("txlb_queue_class_length", **{"class": "batch"}), 0)
        from txlb._records.metrics import _version
        self.assertEqual(self.value("txlb_build_info", version=_version()), 1)
        self.assertEqual(self.value("txlb_backend_outlier_ejected", backend=A), 0)
        backend = self.lb.pool.get(A)
        assert backend is not None
        for number in range(self.lb.config.outlier_5xx):  # from two clients: a streak
            self.lb.pool.record_answer(backend, 500, client=f"10.0.0.{number % 2}")
        self.assertEqual(self.value("txlb_backend_outlier_ejected", backend=A), 1)
        self.assertEqual(self.value("txlb_backend_outlier_ejected", backend=B), 0)
        self.assertEqual(self.value("txlb_backend_outlier_ejections_total", backend=A), 1)

    def test_prompt_tokens_and_time_per_output_token(self) -> None:
        self.traffic()
        self.assertEqual(self.value("txlb_prompt_tokens_total", backend=A), 30)
        self.assertEqual(self.value("txlb_cached_prompt_tokens_total", backend=A), 16)
        self.assertEqual(self.value("txlb_time_per_output_token_seconds_count", backend=A), 1)
        self.assertAlmostEqual(  # 0.2 s from the first byte to the end, over 10 tokens
            self.value("txlb_time_per_output_token_seconds_sum", backend=A), 0.02)

    def test_created_series_dropped_only_from_txlb(self) -> None:
        self.traffic()
        self.assertNotIn("_created", self.lb.metrics.exposition().decode())
        other = CollectorRegistry()
        Counter("embedder_things", "An embedding application's own counter.",
                registry=other).inc()
        self.assertIn(b"embedder_things_created", generate_latest(other))

    def test_promtool_check_metrics(self) -> None:
        promtool = shutil.which("promtool")
        if promtool is None:
            missing("promtool", "promtool is not installed (apt-get install prometheus)")
        self.traffic()
        done = subprocess.run([promtool, "check", "metrics"],
                              input=self.lb.metrics.exposition(), capture_output=True,
                              timeout=60)
        self.assertEqual((done.returncode, done.stdout + done.stderr), (0, b""))


class ExampleAlertsTests(BalancerTestCase):
    """docs/operations.md's example alerts are valid rules over metrics txlb exports."""

    def alerts(self) -> str:
        text = (ROOT / "docs" / "operations.md").read_text()
        section = text[text.index("### Example alerts"):]
        start = section.index("```yaml") + len("```yaml")
        return section[start:section.index("```", start)]

    def test_alerts_use_exported_metrics(self) -> None:
        self.build(["127.0.0.1:8002"])
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        exported = {family.name + suffix
                    for family in text_string_to_metric_families(
                        self.lb.metrics.exposition().decode())
                    for suffix in suffixes.get(family.type, [""])}
        used = set(re.findall(r"\btxlb_\w+", self.alerts()))
        self.assertTrue(used)
        self.assertEqual(sorted(used - exported), [])

    def test_promtool_check_rules(self) -> None:
        promtool = shutil.which("promtool")
        if promtool is None:
            missing("promtool", "promtool is not installed (apt-get install prometheus)")
        path = self.mktemp() + ".yml"
        with open(path, "w") as handle:
            handle.write(self.alerts())
        done = subprocess.run([promtool, "check", "rules", path], capture_output=True,
                              timeout=60)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
