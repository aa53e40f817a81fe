"""The admin API in memory: drain, membership, errors, tokens, and metrics after traffic."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from unittest.mock import patch

from treq.testing import StubTreq
from twisted.internet import error as neterror
from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.server import Site

from txlb import LoadBalancer
from txlb._admin.app import Admin
from txlb._config import ConfigError, build_config, parse_backends
from txlb.tap import _AdminSite

from ..helpers import ClientConnection, FakeResponse, FakeUpstream

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
        sent = {"Content-Type": "application/json"} if data is not None else {}
        sent.update(headers or {})
        response = self.successResultOf(self.admin.request(
            method, "http://127.0.0.1" + path, data=data, headers=sent))
        content = self.successResultOf(response.content())
        if response.headers.getRawHeaders(b"content-type", [b""])[0].startswith(
                b"application/json"):
            return response.code, json.loads(content)
        return response.code, content

    def proxy(self, path: bytes = b"/") -> ClientConnection:
        client = ClientConnection(self.site)
        client.request(b"GET", path)
        return client


class StatusDocsTests(AdminTestCase):
    def test_every_status_field_is_documented(self) -> None:
        """What /status says, docs/operations.md (or /__lb_status's, in usage.md) names."""
        status, body = self.call("GET", "/status")
        self.assertEqual(status, 200)
        root = Path(__file__).resolve().parents[2] / "docs"
        docs = (root / "operations.md").read_text() + (root / "usage.md").read_text()
        fields = set(body) | {key for backend in body["backends"] for key in backend}
        self.assertEqual(sorted(f for f in fields if f"`{f}`" not in docs), [])

    def test_status_says_txlbs_version(self) -> None:
        import txlb

        self.assertEqual(self.call("GET", "/status")[1]["version"], txlb.__version__)


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

    def test_status_has_the_queue_per_class(self) -> None:
        _, status = self.call("GET", "/status")
        self.assertEqual(status["queue"]["length"], 0)
        self.assertEqual(list(status["queue"]["classes"]), ["interactive", "default", "batch"])
        self.assertEqual(status["queue"]["classes"]["batch"],
                         {"length": 0, "oldest_wait_s": 0.0, "timeout_s": 30.0})

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
        self.assertTrue(backend.health.healthy)
        self.assertTrue(backend.health.draining)
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

    def test_an_added_backend_is_in_the_service_log(self) -> None:
        """Removing one is logged; adding one through the API must be too (what changed)."""
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        self.call("POST", "/backends", {"backend": "127.0.0.1:9100", "weight": 2})
        lines = [formatEvent(e) for e in events]
        self.assertIn("backend 127.0.0.1:9100 added through the admin API (weight 2, "
                      "max_conns 0)", lines)

    def test_remove_waits_for_in_flight(self) -> None:
        client = self.proxy()  # on A
        code, state = self.call("DELETE", f"/backends/{A}")
        self.assertEqual((code, state["removed"], state["draining"]), (202, False, True))
        self.assertIsNotNone(self.lb.pool.get(A))
        self.upstream.last.respond(FakeResponse(200, length=0)).end()
        self.assertTrue(client.response().complete)
        self.assertIsNone(self.lb.pool.get(A))
        self.assertEqual(self.lb.pool.slots.in_flight, 0)
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
        self.assertFalse(self.lb.pool.get(A).health.draining)  # type: ignore[union-attr]
        code, _ = self.call("GET", "/metrics")
        self.assertEqual(code, 401)
        code, _ = self.call("GET", "/status", headers={"Authorization": "Bearer s3cret-token"})
        self.assertEqual(code, 200)

    def test_every_route_of_the_app_is_behind_the_token(self) -> None:
        """
        Enumerated from the app itself, so a route added tomorrow is checked too: each
        answers 401 without the token and changes nothing, and something else with it --
        but the dashboard page, which asks for the token itself.
        """
        rules = list(Admin.app.url_map.iter_rules())
        self.assertGreaterEqual(len(rules), 9)
        checked = []
        for rule in rules:
            path = re.sub(r"<[^>]*>", A, rule.rule)
            for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
                before = [(b.key, b.health.draining) for b in self.lb.pool]
                body = {"backend": "127.0.0.1:9999"} if method == "POST" else None
                code, _ = self.call(method, path, body)
                if (method, rule.rule) == ("GET", "/"):
                    self.assertEqual(code, 200)
                    continue
                self.assertEqual(code, 401, (method, path))
                self.assertEqual([(b.key, b.health.draining) for b in self.lb.pool], before)
                code, _ = self.call(method, path, body,
                                    headers={"Authorization": f"Bearer {self.token}"})
                self.assertNotEqual(code, 401, (method, path))
                checked.append((method, rule.rule))
        self.assertIn(("POST", "/reload"), checked)
        self.assertIn(("DELETE", "/backends/<string:key>"), checked)

    def test_two_authorization_headers_are_400_even_if_one_is_right(self) -> None:
        """As on the main port: which of two would be the token?"""
        for values in (["Bearer wrong", "Bearer s3cret-token"],
                       ["Bearer s3cret-token", "Bearer s3cret-token"]):
            code, error = self.call("GET", "/status", headers={"Authorization": values})
            self.assertEqual((code, error["error"]["code"]), (400, 400), values)
            code, _ = self.call("POST", f"/backends/{A}/drain",
                                headers={"Authorization": values})
            self.assertEqual(code, 400)
        self.assertFalse(self.lb.pool.get(A).health.draining)  # type: ignore[union-attr]

    def test_without_the_token_every_path_is_401_known_or_not(self) -> None:
        """
        No 404 or 405 before the token: they would tell whoever has none which routes
        exist.  The dashboard's page alone is served (it asks for the token itself).
        """
        for method, path in [("GET", "/nothing-here"), ("POST", "/nothing-here"),
                             ("GET", f"/backends/{A}/drain"), ("PUT", "/status"),
                             ("DELETE", "/backends/127.0.0.1:1"), ("POST", "/")]:
            code, error = self.call(method, path)
            self.assertEqual((code, error["error"]["code"]), (401, 401), (method, path))
        token = {"Authorization": "Bearer s3cret-token"}
        self.assertEqual(self.call("GET", "/nothing-here", headers=token)[0], 404)
        self.assertEqual(self.call("PUT", "/status", headers=token)[0], 405)
        self.assertEqual(self.call("GET", "/")[0], 200)


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


class BrowserRequestTests(AdminTestCase):
    """
    What a web page in the operator's browser can send is refused before anything changes:
    form content types (415), a foreign Origin (403), a Host that DNS rebinding could have
    pointed here (403).  What operators send with curl keeps working.
    """

    def assertUnchanged(self) -> None:
        self.assertEqual(sorted(b.key for b in self.lb.pool), [A, B])
        self.assertEqual([b.key for b in self.lb.pool if b.health.draining], [])

    def test_form_content_types_get_415(self) -> None:
        for content_type in ("application/x-www-form-urlencoded", "multipart/form-data; "
                             "boundary=x", "text/plain", "Text/Plain ; charset=UTF-8"):
            headers = {"Content-Type": content_type}
            for body in (b"", b"a=b") if "multipart" not in content_type else (b"",):
                code, error = self.call("POST", f"/backends/{A}/drain", body, headers)
                self.assertEqual((code, error["error"]["code"]), (415, 415), content_type)
            # (under treq's Site a malformed multipart body is twisted.web's own 400; the
            # admin port's Site does not parse forms: see test_malformed_form_bodies...)
            form = b'{"backend": "127.0.0.1:9", "models": ["="]}'
            code, _ = self.call("POST", "/backends",
                                form if "multipart" not in content_type else b"", headers)
            self.assertEqual(code, 415)
            code, _ = self.call("DELETE", f"/backends/{B}", b"", headers)
            self.assertEqual(code, 415)
        self.assertUnchanged()

    def test_a_body_must_say_it_is_json(self) -> None:
        body = b'{"backend": "127.0.0.1:9"}'
        for headers in ({"Content-Type": ""}, {"Content-Type": "application/octet-stream"}):
            code, _ = self.call("POST", "/backends", body, headers)
            self.assertEqual(code, 415, headers)
        self.assertUnchanged()
        code, _ = self.call("POST", "/backends", body,
                            {"Content-Type": "application/json; charset=utf-8"})
        self.assertEqual(code, 201)

    def test_what_curl_sends_works(self) -> None:
        code, state = self.call("POST", f"/backends/{A}/drain")  # curl -X POST, no body
        self.assertEqual((code, state["draining"]), (200, True))
        code, state = self.call("POST", f"/backends/{A}/undrain", {})  # -d '{}' + JSON type
        self.assertEqual((code, state["draining"]), (200, False))
        code, _ = self.call("DELETE", f"/backends/{B}")
        self.assertEqual(code, 200)

    def test_foreign_origin_gets_403(self) -> None:
        # treq's Host here is "127.0.0.1" (port 80)
        for origin in ("http://evil.example", "http://127.0.0.1:9999", "null",
                       "http://127.0.0.1.evil.example", "http://localhost", "file://",
                       "http://127.0.0.1/x", "http://user@127.0.0.1"):
            headers = {"Origin": origin}
            code, error = self.call("POST", f"/backends/{A}/drain", headers=headers)
            self.assertEqual((code, error["error"]["code"]), (403, 403), origin)
            code, _ = self.call("POST", "/backends", {"backend": "127.0.0.1:9"}, headers)
            self.assertEqual(code, 403, origin)
            code, _ = self.call("GET", "/status", headers=headers)
            self.assertEqual(code, 403, origin)
        self.assertUnchanged()
        for origin in ("http://127.0.0.1", "http://127.0.0.1:80", "HTTP://127.0.0.1"):
            code, _ = self.call("POST", f"/backends/{A}/undrain", headers={"Origin": origin})
            self.assertEqual(code, 200, origin)

    def test_origin_is_compared_with_the_host_it_came_to(self) -> None:
        # ssh -L 9001:127.0.0.1:8001: the browser's Host and Origin both say localhost:9001
        headers = {"Host": "localhost:9001", "Origin": "http://localhost:9001"}
        code, state = self.call("POST", f"/backends/{A}/drain", headers=headers)
        self.assertEqual((code, state["draining"]), (200, True))
        code, _ = self.call("POST", f"/backends/{A}/undrain",
                            headers={**headers, "Origin": "http://localhost:8001"})
        self.assertEqual(code, 403)

    def test_ipv6_hosts_and_origins(self) -> None:
        for origin, status in (("http://[::1]:8001", 200), ("http://[0:0::1]:8001", 200),
                               ("http://[::1]:8002", 403), ("http://[::1", 403)):
            code, _ = self.call("GET", "/status",
                                headers={"Host": "[::1]:8001", "Origin": origin})
            self.assertEqual(code, status, origin)

    def test_foreign_host_gets_403_everywhere(self) -> None:
        for host in ("evil.example", "evil.example:8001", "127.0.0.1.nip.io",
                     "localhost.evil.example", "[::2]:8001", "0x7f.0.0.1", "127.1", "a b",
                     "user@127.0.0.1", "[::1", "127.0.0.1:99999", ""):
            headers = {"Host": host}
            for method, path in (("GET", "/status"), ("GET", "/"), ("GET", "/metrics"),
                                 ("GET", "/nothing-here"), ("POST", f"/backends/{A}/drain")):
                code, error = self.call(method, path, headers=headers)
                self.assertEqual((code, error["error"]["code"]), (403, 403), (host, path))
        self.assertUnchanged()
        for host in ("localhost", "LOCALHOST:9001", "127.0.0.1:8001", "127.42.0.9",
                     "[::1]:8001", "[0:0::1]"):
            code, _ = self.call("GET", "/status", headers={"Host": host})
            self.assertEqual(code, 200, host)

    def test_the_dashboard_cannot_be_framed(self) -> None:
        response = self.successResultOf(self.admin.get("http://127.0.0.1/"))
        self.assertEqual(response.headers.getRawHeaders(b"x-frame-options"), [b"DENY"])
        self.assertEqual(response.headers.getRawHeaders(b"content-security-policy"),
                         [b"frame-ancestors 'none'"])


class HostAllowlistTests(SynchronousTestCase):
    """The endpoint's own address is always answered; --admin-hosts adds names."""

    def raw(self, host: bytes, admin_hosts: tuple[str, ...] = ()) -> int:
        lb = LoadBalancer([A], reactor=Clock(), agent=FakeUpstream(),
                          probe_agent=FakeUpstream(), log_file="none", admin_hosts=admin_hosts)
        client = ClientConnection(Site(lb.admin_resource(), reactor=Clock()))
        # a StringTransport's own address is 10.0.0.1
        client.send(b"GET /status HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        return client.response().status

    def test_own_address(self) -> None:
        self.assertEqual(self.raw(b"10.0.0.1:8001"), 200)
        self.assertEqual(self.raw(b"10.0.0.2:8001"), 403)
        self.assertEqual(self.raw(b"lb.internal:8001"), 403)

    def test_listed_names(self) -> None:
        self.assertEqual(self.raw(b"LB.internal:8001", ("lb.internal",)), 200)
        self.assertEqual(self.raw(b"lb.internal.evil.example", ("lb.internal",)), 403)
        self.assertEqual(self.raw(b"anything.example", ("*",)), 200)

    def test_the_option(self) -> None:
        self.assertEqual(build_config({"admin-hosts": "LB.internal, [::1],10.0.0.5"}
                                      ).admin_hosts, ("lb.internal", "[::1]", "10.0.0.5"))
        self.assertEqual(build_config({}, {"LB_ADMIN_HOSTS": "a.example"}).admin_hosts,
                         ("a.example",))
        self.assertEqual(build_config({}, {}).admin_hosts, ())
        for bad in ("lb:8001", "a b", "[lb]", "a..b", "http://lb"):
            with self.assertRaises(ConfigError, msg=bad):
                build_config({"admin-hosts": bad})


class ValidationTests(AdminTestCase):
    """Every request is validated whole before anything changes; every error is JSON."""

    def test_deeply_nested_json_is_400(self) -> None:
        for body in (b"[" * 20000 + b"]" * 20000, b'{"backend": ' + b"[" * 20000):
            code, error = self.call("POST", "/backends", body)
            self.assertEqual((code, error["error"]["code"]), (400, 400))
        self.assertEqual(len(self.lb.pool), 2)

    def test_bad_hosts_are_400_and_nothing_is_added(self) -> None:
        for address in ("a" * 300 + ":8004", "[::1:8004", "[zz]:8004", "a..b:8004",
                        "[fe80::1%25eth0]:8004", "h:99999"):
            code, error = self.call("POST", "/backends", {"backend": address})
            self.assertEqual((code, error["error"]["code"]), (400, 400), address)
        self.assertEqual(len(self.lb.pool), 2)

    def test_added_models_and_names_are_bounded_as_learned_ones_are(self) -> None:
        """
        A backend's own /v1/models is held to 1,000 names of 512 characters; one added
        through the API is held to the same, and its address to 300 characters.
        """
        too_long = " " * 400 + "127.0.0.1:8004"  # a host:port once stripped
        for fields in ({"backend": "127.0.0.1:8004",
                        "models": [f"m{i}" for i in range(1001)]},
                       {"backend": "127.0.0.1:8004", "models": ["m" * 513]},
                       {"backend": too_long}):
            code, error = self.call("POST", "/backends", fields)
            self.assertEqual((code, error["error"]["code"]), (400, 400), str(fields)[:80])
        self.assertEqual(len(self.lb.pool), 2)
        code, _ = self.call("POST", "/backends", {
            "backend": "127.0.0.1:8004", "models": ["m" * 512, *(f"m{i}" for i in range(999))]})
        self.assertEqual(code, 201)

    def test_no_answer_names_the_admin_ports_software(self) -> None:
        """No Server: TwistedWeb/... (the main port names none either), under any Site."""
        for site in (_AdminSite(self.lb.admin_resource(), reactor=self.clock),
                     Site(self.lb.admin_resource(), reactor=self.clock)):
            for raw in (b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                        b"GET /nothing HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                        b"GET / HTTP/1.1\r\nHost: evil.example\r\n\r\n"):
                client = ClientConnection(site)
                client.send(raw)
                response = client.response()
                self.assertEqual(response.header(b"server"), [], (site, raw))
                self.assertNotEqual(response.header(b"date"), [])

    def test_ipv6_literal_is_added(self) -> None:
        code, state = self.call("POST", "/backends", {"backend": "[::1]:8004"})
        self.assertEqual((code, state["backend"]), (201, "[::1]:8004"))
        self.assertIsNotNone(self.lb.pool.get("[::1]:8004"))
        code, state = self.call("POST", "/backends/%5B::1%5D:8004/drain")  # curl -g: [::1]
        self.assertEqual((code, state["draining"]), (200, True))
        self.flushLoggedErrors()  # a prober that cannot yet probe IPv6 logs why

    def test_body_over_the_cap_is_413(self) -> None:
        body = json.dumps({"backend": "127.0.0.1:9", "models": ["m" * (64 * 1024)]})
        code, error = self.call("POST", "/backends", body.encode())
        self.assertEqual((code, error["error"]["code"]), (413, 413))
        self.assertEqual(len(self.lb.pool), 2)

    def test_body_over_the_cap_is_refused_as_it_arrives(self) -> None:
        client = ClientConnection(_AdminSite(self.lb.admin_resource(), reactor=self.clock))
        client.send(b"POST /backends HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n")
        response = client.response()
        self.assertEqual(response.status, 413)
        self.assertEqual(json.loads(response.body)["error"]["code"], 413)

    def test_malformed_form_bodies_get_json_too(self) -> None:
        client = ClientConnection(_AdminSite(self.lb.admin_resource(), reactor=self.clock))
        client.send(b"POST /backends/127.0.0.1:8002/drain HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: multipart/form-data; boundary=x\r\n"
                    b"Content-Length: 3\r\n\r\na=b")
        response = client.response()
        self.assertEqual(response.status, 415)
        self.assertEqual(json.loads(response.body)["error"]["code"], 415)
        self.assertFalse(self.lb.pool.get(A).health.draining)  # type: ignore[union-attr]

    def test_an_ipv6_backend_is_found_however_its_key_is_spelt(self) -> None:
        """Added as ``[0:0::1]:8004`` it is ``[::1]:8004``; drain and remove find it by either."""
        code, added = self.call("POST", "/backends", {"backend": "[0:0::1]:8004"})
        self.assertEqual((code, added["backend"]), (201, "[::1]:8004"))
        code, state = self.call("POST", "/backends/[0:0::1]:8004/drain")
        self.assertEqual((code, state["backend"], state["draining"]), (200, "[::1]:8004", True))
        code, state = self.call("DELETE", "/backends/[0::1]:8004")
        self.assertEqual((code, state["removed"]), (200, True))
        code, _ = self.call("POST", "/backends/[zz::1]:8004/drain")
        self.assertEqual(code, 404)

    def test_the_admin_port_refuses_ambiguous_framing_too(self) -> None:
        """
        ``Transfer-Encoding: identity`` was read as "no body" by twisted.web, so the bytes
        after a harmless ``GET /status`` were parsed as a ``POST .../drain`` -- through a
        reverse proxy that allows only reads (``--admin-hosts``), a smuggled write.  The
        admin port frames requests as strictly as the main port: 400, closed.
        """
        client = ClientConnection(_AdminSite(self.lb.admin_resource(), reactor=self.clock))
        client.send(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Transfer-Encoding: identity\r\n\r\n"
                    b"POST /backends/" + A.encode() + b"/drain HTTP/1.1\r\n"
                    b"Host: 127.0.0.1\r\n\r\n")
        response = client.response()
        self.assertEqual(response.status, 400)
        self.assertEqual(json.loads(response.body)["error"]["code"], 400)
        self.assertTrue(client.transport.disconnecting)
        self.assertFalse(self.lb.pool.get(A).health.draining)  # type: ignore[union-attr]

    def test_a_path_that_is_not_utf8_gets_json_too(self) -> None:
        """Klein answered ``%ff`` in the path with a text/html 400 of its own."""
        client = ClientConnection(_AdminSite(self.lb.admin_resource(), reactor=self.clock))
        client.send(b"POST /backends/%ff%fe/drain HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        response = client.response()
        self.assertEqual(response.status, 400)
        self.assertEqual(response.header(b"content-type"), [b"application/json"])
        self.assertEqual(json.loads(response.body)["error"]["code"], 400)
        self.assertEqual(self.flushLoggedErrors(), [])

    def test_an_unexpected_error_is_a_json_500(self) -> None:
        def broken() -> dict[str, object]:
            raise RuntimeError("a bug")

        self.lb.pool.status = broken  # type: ignore[method-assign]
        code, error = self.call("GET", "/status")
        self.assertEqual((code, error["error"]["code"]), (500, 500))
        self.assertNotIn("a bug", json.dumps(error))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_a_bug_in_the_checks_is_a_json_500(self) -> None:
        def broken(request: object) -> str:
            raise RuntimeError("a bug")

        with patch("txlb._admin.app._own_address", broken):
            code, error = self.call("GET", "/status", headers={"Host": "lb.example"})
        self.assertEqual((code, error["error"]["code"]), (500, 500))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_a_failing_first_probe_does_not_hide_the_add(self) -> None:
        def on_added(backend: object) -> None:
            raise RuntimeError("probe could not start")

        admin = StubTreq(Admin(self.lb.pool, self.lb.metrics, None, on_added=on_added
                               ).resource())
        response = self.successResultOf(admin.post(
            "http://127.0.0.1/backends", data=b'{"backend": "127.0.0.1:9"}',
            headers={"Content-Type": "application/json"}))
        self.assertEqual(response.code, 201)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertIsNotNone(self.lb.pool.get("127.0.0.1:9"))


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


class PromptTokensStatusTests(AdminTestCase):
    """/status says, per backend, how much of the prompts its engine found cached."""

    def answer(self, usage: bytes) -> None:
        client = ClientConnection(self.site)
        client.request(b"POST", b"/v1/chat/completions", body=b'{"model": "m"}')
        response = self.upstream.last.respond(FakeResponse(200))
        response.send(b'{"choices": [{"message": {"content": "hi"}}], "usage": ' + usage + b"}")
        response.end()

    def entry(self, key: str) -> dict[str, Any]:
        _, status = self.call("GET", "/status")
        found: dict[str, Any] = next(b for b in status["backends"] if b["backend"] == key)
        return found

    def test_totals_and_hit_rate(self) -> None:
        self.assertEqual([self.entry(A)[k] for k in (
            "prompt_tokens", "cached_prompt_tokens", "prefix_cache_hit_rate")], [0, 0, None])
        self.answer(b'{"prompt_tokens": 300, "prompt_tokens_details": {"cached_tokens": 200}}')
        self.answer(b'{"prompt_tokens": 100}')  # on B: least-conn rotates
        self.answer(b'{"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 40}}')
        self.assertEqual([self.entry(A)[k] for k in (
            "prompt_tokens", "cached_prompt_tokens", "prefix_cache_hit_rate")], [400, 240, 0.6])
        self.assertEqual([self.entry(B)[k] for k in (
            "prompt_tokens", "cached_prompt_tokens", "prefix_cache_hit_rate")], [100, 0, 0.0])
