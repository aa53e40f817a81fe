"""The admin API in memory: drain, membership, errors, tokens, and metrics after traffic."""

from __future__ import annotations

import json
import re
from typing import Any

from treq.testing import StubTreq
from twisted.internet import error as neterror
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.server import Site

from txlb import LoadBalancer
from txlb._config import ConfigError, parse_backends

from .helpers import ClientConnection, FakeResponse, FakeUpstream

A, B = "127.0.0.1:8002", "127.0.0.1:8003"


class AdminTestCase(SynchronousTestCase):
    token: str | None = None

    def setUp(self) -> None:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.probes = FakeUpstream()
        options: dict[str, Any] = {"log_file": "none", "retries": 0}
        if self.token:
            options["admin_token"] = self.token
        self.lb = LoadBalancer([A, B], reactor=self.clock, agent=self.upstream,
                               probe_agent=self.probes, **options)
        self.admin = StubTreq(self.lb.admin_resource())
        self.site = Site(self.lb.resource(), reactor=self.clock)

    def call(self, method: str, path: str, body: object = None,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else (
            None if body is None else json.dumps(body).encode())
        response = self.successResultOf(self.admin.request(
            method, "http://admin" + path, data=data, headers=headers or {}))
        content = self.successResultOf(response.content())
        if response.headers.getRawHeaders(b"content-type", [b""])[0].startswith(
                b"application/json"):
            return response.code, json.loads(content)
        return response.code, content

    def proxy(self, path: bytes = b"/") -> ClientConnection:
        client = ClientConnection(self.site)
        client.request(b"GET", path)
        return client


class DrainTests(AdminTestCase):
    def test_status_has_everything(self) -> None:
        code, status = self.call("GET", "/status")
        self.assertEqual(code, 200)
        self.assertEqual((status["healthy"], status["total"], status["in_flight"]), (2, 2, 0))
        entry = status["backends"][0]
        for key in ("backend", "healthy", "active", "draining", "weight", "max_conns",
                    "models", "requests", "responses", "ejections", "latency_ewma_s",
                    "ttft_ewma_s", "probes_ok", "probes_failed"):
            self.assertIn(key, entry)

    def test_drain_sends_no_new_requests_there(self) -> None:
        in_flight = self.proxy()  # one in flight on A (first in rotation)
        code, state = self.call("POST", f"/backends/{A}/drain")
        self.assertEqual(code, 200)
        self.assertEqual((state["draining"], state["active"]), (True, 1))
        for _ in range(4):
            self.proxy()
        self.assertEqual([c.uri.split(b"/")[2].decode() for c in self.upstream.calls],
                         [A, B, B, B, B])
        # the request in flight on A finishes normally
        response = self.upstream.calls[0].respond(FakeResponse(200, length=2))
        response.send(b"ok")
        response.end()
        self.assertEqual((in_flight.response().body, in_flight.response().complete),
                         (b"ok", True))
        code, status = self.call("GET", "/status")
        self.assertEqual(status["draining"], 1)

    def test_drain_survives_health_changes(self) -> None:
        self.call("POST", f"/backends/{A}/drain")
        backend = self.lb.pool.get(A)
        assert backend is not None
        self.lb.pool.mark_down(backend, "test")
        self.lb.pool.probe_succeeded(backend, rise=1)
        self.assertTrue(backend.healthy)
        self.assertTrue(backend.draining)
        code, state = self.call("POST", f"/backends/{A}/undrain")
        self.assertEqual((code, state["draining"]), (200, False))

    def test_add_probes_at_once_and_serves(self) -> None:
        code, state = self.call("POST", "/backends",
                                {"backend": "127.0.0.1:9100", "weight": 2, "max_conns": 4,
                                 "models": ["m"]})
        self.assertEqual(code, 201)
        self.assertEqual((state["backend"], state["weight"], state["max_conns"],
                          state["models"]), ("127.0.0.1:9100", 2, 4, ["m"]))
        self.assertEqual(self.probes.last.uri, b"http://127.0.0.1:9100/health")
        self.assertEqual(len(self.lb.pool), 3)
        code, error = self.call("POST", "/backends", {"backend": "127.0.0.1:9100"})
        self.assertEqual(code, 409)

    def test_remove_waits_for_in_flight(self) -> None:
        client = self.proxy()  # on A
        code, state = self.call("DELETE", f"/backends/{A}")
        self.assertEqual((code, state["removed"], state["draining"]), (202, False, True))
        self.assertIsNotNone(self.lb.pool.get(A))
        self.upstream.last.respond(FakeResponse(200, length=0)).end()
        self.assertTrue(client.response().complete)
        self.assertIsNone(self.lb.pool.get(A))
        self.assertEqual(self.lb.pool.in_flight, 0)
        code, state = self.call("DELETE", f"/backends/{B}")  # idle: removed at once
        self.assertEqual((code, state["removed"]), (200, True))
        self.assertEqual(self.proxy().response().status, 503)

    def test_errors_are_json(self) -> None:
        cases = [
            ("POST", "/backends/127.0.0.1:1/drain", None, 404),
            ("DELETE", "/backends/127.0.0.1:1", None, 404),
            ("GET", f"/backends/{A}/drain", None, 405),
            ("PUT", "/status", None, 405),
            ("GET", "/nothing-here", None, 404),
            ("POST", "/backends", b"{not json", 400),
            ("POST", "/backends", [1, 2], 400),
            ("POST", "/backends", {"backend": "no-port"}, 400),
            ("POST", "/backends", {"backend": "h:1", "weight": 0}, 400),
            ("POST", "/backends", {"backend": "h:1", "colour": "red"}, 400),
            ("POST", "/backends", {}, 400),
        ]
        for method, path, body, status in cases:
            code, error = self.call(method, path, body)
            self.assertEqual(code, status, (method, path, body))
            self.assertEqual(error["error"]["code"], status)
            self.assertIsInstance(error["error"]["message"], str)

    def test_dashboard_served(self) -> None:
        code, page = self.call("GET", "/")
        self.assertEqual(code, 200)
        self.assertIn(b"<title>txlb status</title>", page)
        self.assertNotIn(b"http://", page.replace(b"http://www.w3.org", b""))  # self-contained

    def test_main_port_exposes_no_admin_path(self) -> None:
        for path in (b"/status", b"/metrics", b"/backends"):
            self.proxy(path)
        self.assertEqual([c.uri.split(b"/", 3)[3] for c in self.upstream.calls],
                         [b"status", b"metrics", b"backends"])


class TokenTests(AdminTestCase):
    token = "s3cret-token"

    def test_token_required(self) -> None:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"},
                        {"Authorization": "Basic s3cret-token"}):
            code, error = self.call("GET", "/status", headers=headers)
            self.assertEqual(code, 401, headers)
            self.assertEqual(error["error"]["code"], 401)
        code, _ = self.call("POST", f"/backends/{A}/drain")
        self.assertEqual(code, 401)
        self.assertFalse(self.lb.pool.get(A).draining)  # type: ignore[union-attr]
        code, _ = self.call("GET", "/metrics")
        self.assertEqual(code, 401)
        code, _ = self.call("GET", "/status", headers={"Authorization": "Bearer s3cret-token"})
        self.assertEqual(code, 200)


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text, matched by name and labels."""
    for line in text.splitlines():
        match = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if found == labels:
            return float(match.group(3))
    raise AssertionError(f"no sample {name}{labels}")


class MetricsTests(AdminTestCase):
    def test_scrape_after_known_traffic(self) -> None:
        # two good answers with usage, from A and B
        for _ in range(2):
            client = ClientConnection(self.site)
            client.request(b"POST", b"/v1/chat/completions", body=b'{"model": "m"}')
            response = self.upstream.last.respond(FakeResponse(200))
            self.clock.advance(0.2)
            response.send(b'{"choices": [{"message": {"content": "hi"}}], '
                          b'"usage": {"completion_tokens": 7}}')
            self.clock.advance(0.3)
            response.end()
        # one refused (A ejected), one still in flight on B
        self.proxy()
        self.upstream.last.fail(neterror.ConnectionRefusedError())
        self.proxy()
        code, text = self.call("GET", "/metrics")
        self.assertEqual(code, 200)
        text = text.decode()
        self.assertEqual(sample(text, "txlb_requests_total", backend=A, method="POST",
                                status_class="2xx"), 1)
        self.assertEqual(sample(text, "txlb_requests_total", backend=B, method="POST",
                                status_class="2xx"), 1)
        self.assertEqual(sample(text, "txlb_requests_total", backend=A, method="GET",
                                status_class="5xx"), 1)
        self.assertEqual(sample(text, "txlb_completion_tokens_total", backend=A), 7)
        self.assertEqual(sample(text, "txlb_request_duration_seconds_count", backend=A), 2)
        self.assertEqual(sample(text, "txlb_request_duration_seconds_bucket", backend=B,
                                le="0.5"), 1)
        self.assertEqual(sample(text, "txlb_request_duration_seconds_bucket", backend=B,
                                le="0.25"), 0)
        self.assertEqual(sample(text, "txlb_time_to_first_byte_seconds_bucket", backend=B,
                                le="0.25"), 1)
        self.assertEqual(sample(text, "txlb_backend_in_flight", backend=B), 1)
        self.assertEqual(sample(text, "txlb_backend_in_flight", backend=A), 0)
        self.assertEqual(sample(text, "txlb_backend_healthy", backend=A), 0)
        self.assertEqual(sample(text, "txlb_backend_ejections_total", backend=A), 1)
        self.assertEqual(sample(text, "txlb_backends_healthy"), 1)
        self.assertEqual(sample(text, "txlb_retries_total"), 0)

    def test_separate_registries(self) -> None:
        other = LoadBalancer([A], reactor=self.clock, agent=FakeUpstream(),
                             probe_agent=FakeUpstream(), log_file="none")
        self.assertIsNot(other.metrics.registry, self.lb.metrics.registry)


class BackendHostTests(SynchronousTestCase):
    """
    The backend address parser (shared by --backends, the config file and ``POST
    /backends``) refuses hosts nothing could connect to, instead of letting them into the
    pool where the prober and the upstream client fail on them later.
    """

    def test_bad_hosts_are_config_errors(self) -> None:
        for address in ("a" * 300 + ":8004", "a..b:8004", "-a:8004", "a-.b:8004",
                        "x" * 64 + ".com:8004", "my_host:8004", "999.1.1.1:8004",
                        "[fe80::1%25eth0]:8004", "ex%41mple:8004", "h\u00e9:8004"):
            with self.assertRaises(ConfigError, msg=address):
                parse_backends("backends", address)

    def test_good_hosts_are_kept(self) -> None:
        specs = parse_backends("backends", "[::1]:8004,10.0.0.7:8002,gpu-3.example.com:8000,"
                                           + "a" * 63 + ":1")
        self.assertEqual([s.key for s in specs],
                         ["[::1]:8004", "10.0.0.7:8002", "gpu-3.example.com:8000",
                          "a" * 63 + ":1"])
