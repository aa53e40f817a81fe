"""
The parity suite: the same client-visible scenarios against txlb and against nginx running
the configuration ``python -m txlb.nginx`` generates, in front of the same simulated
backends.  It proves the promise that nginx can replace txlb with zero client changes --
and pins down each deliberate difference (docs/migration.md lists them).

Debian's nginx is installed by ``.ci/run``; without it these tests are skipped with a
message saying so, never silently.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor, task, threads
from twisted.trial.unittest import TestCase

from txlb import build_config
from txlb.nginx import render

from ..parts import missing
from ..processes import (
    Client,
    TwistdProcess,
    chat_body,
    header,
    throwaway_certificate,
    wait_until,
)
from .test_integration import JSON, Fleet

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx")
                                  else None)
#: Headers that are connection management or per-server, compared by neither side.
IGNORED = {b"date", b"server", b"connection", b"keep-alive", b"transfer-encoding",
           b"x-backend", b"x-backend-port"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class NginxProcess:
    """nginx in the foreground, unprivileged paths only, with txlb's generated config."""

    def __init__(self, args: list[str], listen: str = "tcp:{port}:interface=127.0.0.1",
                 scheme: str = "http") -> None:
        self.scheme = scheme
        self.prefix = Path(tempfile.mkdtemp(prefix="txlb-nginx-"))
        for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.prefix / sub).mkdir()
        os.chmod(self.prefix, 0o777)  # workers drop to nobody when the master runs as root
        self.port = free_port()
        config = build_config({"listen": listen.format(port=self.port),
                               **dict(zip(args[::2], args[1::2], strict=True))}, {})
        (self.prefix / "nginx.conf").write_text(render(config, str(self.prefix)))
        self.process = subprocess.Popen(
            [NGINX or "nginx", "-p", str(self.prefix), "-c", str(self.prefix / "nginx.conf"),
             "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    async def started(self) -> None:
        def accepting() -> bool:
            if self.process.poll() is not None:
                raise AssertionError("nginx exited: " + self.process.stderr.read().decode()
                                     if self.process.stderr else "")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            except OSError:
                return False
            return True

        await wait_until(accepting, timeout=20, what="nginx to listen")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=10)
        if self.process.stderr:
            self.process.stderr.close()
        shutil.rmtree(self.prefix, ignore_errors=True)


def normalized(body: bytes) -> Any:
    """A JSON or SSE body with the per-request ids and timestamps taken out."""
    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if k not in ("id", "created")}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    text = body.strip()
    if text.startswith(b"data:"):
        return [clean(json.loads(e[5:])) if e[5:].strip() != b"[DONE]" else "[DONE]"
                for e in text.split(b"\n\n")]
    return clean(json.loads(text))


def comparable_headers(response: Any) -> dict[bytes, list[bytes]]:
    return {name.lower(): values for name, values in response.headers.getAllRawHeaders()
            if name.lower() not in IGNORED}


class ParityTestCase(TestCase):
    timeout = 120
    lb_args: list[str] = []

    @defer.inlineCallbacks
    def setUp(self) -> Any:
        if NGINX is None:
            missing("nginx", "nginx is not installed (apt-get install nginx); "
                             "the nginx parity suite needs it")
        self.fleet = Fleet(self, 2, tokens_per_second=200)
        args = ["backends", ",".join(self.fleet.keys), *self.lb_args]
        self.nginx = NginxProcess(args)
        self.addCleanup(self.nginx.stop)
        self.txlb = TwistdProcess(*(f"--{a}" if i % 2 == 0 else a for i, a in enumerate(args)))
        self.addCleanup(lambda: defer.ensureDeferred(self.txlb.stop()))
        yield defer.ensureDeferred(self.nginx.started())
        yield defer.ensureDeferred(self.txlb.started())
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)

    @property
    def urls(self) -> dict[str, str]:
        return {"txlb": self.txlb.url, "nginx": self.nginx.url}

    async def both(self, path: str, method: bytes = b"GET", body: bytes | None = None,
                   headers: dict[bytes, list[bytes]] | None = None) -> dict[str, Any]:
        results = {}
        for name, url in self.urls.items():
            response, chunks = await self.client.fetch(url + path, method, body, headers)
            results[name] = (response, chunks)
        return results


class ClientViewParityTests(ParityTestCase):
    @defer.inlineCallbacks
    def test_non_streaming_completion(self) -> Any:
        results = yield defer.ensureDeferred(self.both(
            "/v1/chat/completions", b"POST", chat_body(stream=False, max_tokens=7), JSON))
        (t, tc), (n, nc) = results["txlb"], results["nginx"]
        self.assertEqual((t.code, t.phrase), (n.code, n.phrase))
        self.assertEqual(comparable_headers(t), comparable_headers(n))
        self.assertEqual(t.length, n.length)  # Content-Length kept by both, not chunked
        self.assertEqual(t.length, len(tc.body))
        self.assertEqual(normalized(tc.body), normalized(nc.body))
        for response, _ in results.values():
            self.assertIn(header(response, b"x-backend"), self.fleet.keys)
            self.assertEqual(header(response, b"x-backend-port"),
                             header(response, b"x-backend").split(":")[1])  # type: ignore

    @defer.inlineCallbacks
    def test_streamed_sse(self) -> Any:
        body = chat_body(stream=True, stream_options={"include_usage": True},
                         chat_template_kwargs={"enable_thinking": True})
        results = yield defer.ensureDeferred(self.both("/v1/chat/completions", b"POST",
                                                       body, JSON))
        (t, tc), (n, nc) = results["txlb"], results["nginx"]
        self.assertEqual(t.code, n.code)
        self.assertEqual(comparable_headers(t), comparable_headers(n))
        self.assertEqual(normalized(tc.body), normalized(nc.body))
        self.assertTrue(tc.clean and nc.clean)
        self.assertGreater(len(tc.chunks), 3)  # streamed, not buffered
        self.assertGreater(len(nc.chunks), 3)

    @defer.inlineCallbacks
    def test_backend_errors_pass_unchanged(self) -> Any:
        for path, body in (("/v1/chat/completions", chat_body(max_tokens=10**6)),
                           ("/no/such/path", b"{}")):
            results = yield defer.ensureDeferred(self.both(path, b"POST", body, JSON))
            (t, tc), (n, nc) = results["txlb"], results["nginx"]
            self.assertEqual(t.code, n.code)
            self.assertEqual(tc.body, nc.body)
            self.assertEqual(comparable_headers(t), comparable_headers(n))

    @defer.inlineCallbacks
    def test_forwarded_headers_reach_the_backend_alike(self) -> Any:
        yield defer.ensureDeferred(self.both(
            "/v1/completions", b"POST", b'{"prompt": "x", "max_tokens": 1}',
            {**JSON, b"x-forwarded-for": [b"203.0.113.9"], b"x-custom": [b"a", b"b"],
             b"x-orid": [b"parity"]}))
        seen = [r for sim in self.fleet.sims for r in sim.requests
                if r.path == b"/v1/completions"]
        self.assertEqual(len(seen), 2)
        for request in seen:
            self.assertEqual(request.header("x-forwarded-for"), [b"203.0.113.9, 127.0.0.1"])
            self.assertEqual(request.header("x-forwarded-proto"), [b"http"])
            self.assertEqual(request.header("x-custom"), [b"a", b"b"])
            self.assertEqual(request.header("connection"), [])
            self.assertEqual(request.body, b'{"prompt": "x", "max_tokens": 1}')

    @defer.inlineCallbacks
    def test_oversized_body_is_413_json(self) -> Any:
        results = yield defer.ensureDeferred(self.both(
            "/v1/completions", b"POST", b"x" * (64 * 1024**2 + 10), JSON))
        for name, (response, chunks) in results.items():
            self.assertEqual(response.code, 413, name)
            self.assertEqual(json.loads(chunks.body)["error"]["code"], 413, name)

    @defer.inlineCallbacks
    def test_the_official_openai_client_gets_the_same_results(self) -> Any:
        try:
            import openai  # noqa: F401
        except ImportError:
            missing("openai", "the openai package is not installed")
        via_txlb = yield threads.deferToThread(ask_openai, self.txlb.url)
        via_nginx = yield threads.deferToThread(ask_openai, self.nginx.url)
        self.assertEqual(via_txlb, via_nginx)
        self.assertEqual(via_txlb[1], "length")


def ask_openai(base: str, **client_options: Any) -> tuple[Any, ...]:
    """A plain and a streamed chat completion through the official client: what it saw."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0,
                           **client_options)
    plain = client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    stream = client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "hi"}],
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return (plain.choices[0].message.content, plain.choices[0].finish_reason,
            plain.usage.completion_tokens if plain.usage else None,
            streamed, finish, chunks[-1].usage.completion_tokens if chunks[-1].usage else None)


class TlsParityTests(TestCase):
    """
    ``--listen ssl:...`` on both sides, one throwaway certificate: nginx accepts the
    generated TLS server, and the official openai client, verifying that certificate over
    https, gets the same answers from each.
    """

    timeout = 120

    @defer.inlineCallbacks
    def test_openai_client_over_https_gets_the_same_results(self) -> Any:
        if NGINX is None:
            missing("nginx", "nginx is not installed (apt-get install nginx); the nginx "
                    "parity suite needs it")
        try:
            import openai
        except ImportError:
            missing("openai", "the openai package is not installed")
        directory = Path(self.mktemp()).resolve()
        directory.mkdir()
        key, cert = throwaway_certificate(directory)
        fleet = Fleet(self, 2, tokens_per_second=200)
        tls = f"interface=127.0.0.1:privateKey={key}:certKey={cert}"
        nginx = NginxProcess(["backends", ",".join(fleet.keys)], listen="ssl:{port}:" + tls,
                             scheme="https")
        self.addCleanup(nginx.stop)
        txlb = TwistdProcess("--backends", ",".join(fleet.keys), "--listen", "ssl:0:" + tls)
        self.addCleanup(lambda: defer.ensureDeferred(txlb.stop()))
        yield defer.ensureDeferred(nginx.started())
        yield defer.ensureDeferred(txlb.started())
        self.assertIn("(TLS)", txlb.output())

        def over_https(base: str) -> tuple[Any, ...]:
            http_client = openai.DefaultHttpx2Client(verify=str(cert))
            try:
                return ask_openai(base, http_client=http_client)
            finally:
                http_client.close()

        via_txlb = yield threads.deferToThread(
            over_https, txlb.url.replace("http://", "https://"))
        via_nginx = yield threads.deferToThread(over_https, nginx.url)
        self.assertTrue(nginx.url.startswith("https://"))
        self.assertEqual(via_txlb, via_nginx)
        self.assertEqual(via_txlb[1], "length")


class FailureParityTests(ParityTestCase):
    lb_args = ["read-timeout", "1", "health-interval", "30"]

    @defer.inlineCallbacks
    def test_one_dead_backend_costs_nothing(self) -> Any:
        yield self.fleet.ports[0].stopListening()
        for _ in range(4):
            results = yield defer.ensureDeferred(self.both(
                "/v1/chat/completions", b"POST", chat_body(stream=False), JSON))
            for name, (response, _) in results.items():
                self.assertEqual(response.code, 200, name)
                self.assertEqual(header(response, b"x-backend"), self.fleet.keys[1], name)

    @defer.inlineCallbacks
    def test_all_dead_is_a_json_5xx(self) -> Any:
        for port in self.fleet.ports:
            yield port.stopListening()
        results = yield defer.ensureDeferred(self.both(
            "/v1/chat/completions", b"POST", chat_body(stream=False), JSON))
        nginx_response, nginx_body = results["nginx"]
        self.assertEqual(nginx_response.code, 502)
        self.assertEqual(json.loads(nginx_body.body)["error"]["code"], 502)
        # txlb: 502 while it discovers the failures, 503 once it knows none is up
        # (a documented difference: it can say so, with Retry-After)
        txlb_response, txlb_body = results["txlb"]
        self.assertIn(txlb_response.code, (502, 503))
        self.assertEqual(json.loads(txlb_body.body)["error"]["code"], txlb_response.code)

    @defer.inlineCallbacks
    def test_silent_backend_is_504_json(self) -> Any:
        for sim in self.fleet.sims:
            sim.hang = True
        started = time.monotonic()
        results = yield defer.ensureDeferred(self.both(
            "/v1/chat/completions", b"POST", chat_body(stream=False), JSON))
        for name, (response, chunks) in results.items():
            self.assertEqual(response.code, 504, name)
            self.assertEqual(json.loads(chunks.body)["error"]["code"], 504, name)
        self.assertLess(time.monotonic() - started, 20)
        yield task.deferLater(reactor, 0, lambda: None)
