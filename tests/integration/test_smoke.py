"""
Paths a user takes that no other test ran: the README's first command, the embedding with
a real ``Agent``, and the engine-queue scrape behind ``--policy queue-depth``.  Real
processes and loopback sockets on free ports; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from txlb import LoadBalancer, __version__

from ..processes import ROOT, Client, chat_body, clean_environment, header, wait_until
from .test_integration import JSON, Fleet


class DemoTests(TestCase):
    """``python -m txlb.demo``: starts, streams one completion, serves, stops on Ctrl-C."""

    timeout = 90

    @defer.inlineCallbacks
    def test_demo_starts_streams_serves_and_stops(self) -> Any:
        handle, name = tempfile.mkstemp(prefix="txlb-demo-", suffix=".log")
        output_path = Path(name)
        self.addCleanup(output_path.unlink)
        with os.fdopen(handle, "wb") as output:
            process = subprocess.Popen(
                [sys.executable, "-u", "-m", "txlb.demo",
                 "--listen", "tcp:0:interface=127.0.0.1",
                 "--admin", "tcp:0:interface=127.0.0.1"],
                stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=clean_environment(), cwd=ROOT)

        def stop() -> None:
            if process.poll() is None:
                process.kill()
                process.wait(10)

        self.addCleanup(stop)

        def text() -> str:
            return output_path.read_text(errors="replace")

        def streamed() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"the demo exited early:\n{text()}")
            return "Try it yourself" in text()

        yield defer.ensureDeferred(wait_until(streamed, timeout=45, what="the demo's stream"))
        shown = text()
        url = re.search(r"balancer listening on (http://127\.0\.0\.1:\d+)", shown)
        admin = re.search(r"admin API on (http://127\.0\.0\.1:\d+)/", shown)
        self.assertIsNotNone(url, shown)
        self.assertIsNotNone(admin, shown)
        self.assertIn("8 simulated vLLM backends", shown)
        assert url is not None and admin is not None
        # the streamed answer was printed between the banner and the invitation
        answer = shown.split("admin API on", 1)[1].split("Try it yourself", 1)[0]
        self.assertGreater(len(answer.split("\n", 1)[1].strip()), 0, shown)

        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)
        response, chunks = yield defer.ensureDeferred(client.fetch(
            url.group(1) + "/v1/chat/completions", b"POST", chat_body(), JSON))
        self.assertEqual(response.code, 200)
        self.assertTrue(chunks.clean)
        self.assertIsNotNone(header(response, b"x-backend"))
        self.assertTrue(chunks.body.rstrip().endswith(b"data: [DONE]"))
        status, body = yield defer.ensureDeferred(client.fetch(url.group(1) + "/__lb_status"))
        self.assertEqual(json.loads(body.body)["total"], 8)
        page, _ = yield defer.ensureDeferred(client.fetch(admin.group(1) + "/status"))
        self.assertEqual(page.code, 200)

        process.send_signal(signal.SIGINT)  # Ctrl-C
        yield defer.ensureDeferred(wait_until(lambda: process.poll() is not None, timeout=20,
                                              what="the demo to stop on Ctrl-C"))
        self.assertNotIn("Traceback", text())


class TwistRunnerTests(TestCase):
    """``twist llmlb``, Twisted's newer runner, writing to a file as under a supervisor."""

    timeout = 60

    @defer.inlineCallbacks
    def test_twist_with_text_logs_writes_the_lines_twistd_writes(self) -> Any:
        """
        twist logs JSON events whenever its output is not a terminal; ``--log-format text``
        (what docs/usage.md gives) makes it write twistd's lines.
        """
        handle, name = tempfile.mkstemp(prefix="txlb-twist-", suffix=".log")
        output_path = Path(name)
        self.addCleanup(output_path.unlink)
        twist = os.path.join(os.path.dirname(sys.executable), "twist")
        with os.fdopen(handle, "wb") as output:
            process = subprocess.Popen(
                [twist, "--log-format", "text", "llmlb", "--listen",
                 "tcp:0:interface=127.0.0.1", "--admin", "none", "--log-file", "none",
                 "--backends", "127.0.0.1:9"],
                stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(clean_environment(), PYTHONPATH=str(ROOT)), cwd=ROOT)

        def stop() -> None:
            if process.poll() is None:
                process.kill()
                process.wait(10)

        self.addCleanup(stop)

        def listening() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"twist exited early:\n{output_path.read_text()}")
            return "ProxySite starting on" in output_path.read_text(errors="replace")

        yield defer.ensureDeferred(wait_until(listening, timeout=30, what="twist to listen"))
        lines = output_path.read_text(errors="replace").splitlines()
        self.assertEqual([line for line in lines if line.startswith("{")], [])
        said = f"txlb {__version__} runs on reactor txlb-epoll"
        self.assertTrue(any(said in line for line in lines), lines)
        usage = (ROOT / "docs" / "usage.md").read_text()
        self.assertIn("twist --log-format text llmlb", usage)


class _ConnectionNamingBackend(Resource):
    """A backend whose answer names a header in ``Connection``: hop-by-hop for that hop."""

    isLeaf = True

    def render(self, request: Request) -> bytes:
        request.setHeader(b"connection", b"keep-alive, x-hop-secret")
        request.setHeader(b"x-hop-secret", b"for the proxy only")
        request.setHeader(b"x-end-to-end", b"kept")
        request.setHeader(b"content-type", b"application/json")
        return b'{"ok": true}'


class EmbeddedAgentTests(TestCase):
    """
    The embedding path with a real ``twisted.web.client.Agent`` (``agent=``): txlb finds the
    headers ``Connection`` names inside Agent's parser, private Twisted state that a Twisted
    release could move.  Should it move, this test fails rather than txlb silently leaking
    hop-by-hop headers to clients.
    """

    timeout = 30

    @defer.inlineCallbacks
    def test_headers_named_in_connection_are_stripped(self) -> Any:
        backend = reactor.listenTCP(0, Site(_ConnectionNamingBackend()),
                                    interface="127.0.0.1")
        self.addCleanup(backend.stopListening)
        pool = HTTPConnectionPool(reactor, persistent=True)
        self.addCleanup(pool.closeCachedConnections)
        key = f"127.0.0.1:{backend.getHost().port}"
        lb = LoadBalancer([key], reactor=reactor, agent=Agent(reactor, pool=pool),
                          log_file="none")
        site = reactor.listenTCP(0, Site(lb.resource()), interface="127.0.0.1")
        self.addCleanup(site.stopListening)
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)
        url = f"http://127.0.0.1:{site.getHost().port}/v1/anything"
        for _ in range(2):  # a fresh connection, then a pooled one
            response, chunks = yield defer.ensureDeferred(client.fetch(url))
            self.assertEqual(response.code, 200)
            self.assertEqual(chunks.body, b'{"ok": true}')
            self.assertEqual(header(response, b"x-end-to-end"), "kept")
            self.assertIsNone(header(response, b"x-hop-secret"))
            self.assertEqual(header(response, b"x-backend"), key)


class QueueDepthScrapeTests(TestCase):
    """
    ``--policy queue-depth`` end to end: the prober scrapes each simulated vLLM's
    ``/metrics`` (``vllm:num_requests_running`` + ``_waiting``) and new requests go to the
    backend whose engine queue is shorter, though txlb itself sent it nothing.
    """

    timeout = 60

    @defer.inlineCallbacks
    def test_requests_avoid_the_engine_with_the_deeper_queue(self) -> Any:
        fleet = Fleet(self, 2, tokens_per_second=500)
        busy, idle = fleet.sims
        busy.hang = True
        direct = Client()
        self.addCleanup(direct.pool.closeCachedConnections)
        held = [direct.agent.request(b"POST", f"http://{fleet.keys[0]}/v1/completions".encode(),
                                     None, None) for _ in range(3)]
        for request in held:
            request.addErrback(lambda _: None)  # cut when the test ends
        yield defer.ensureDeferred(wait_until(lambda: busy.running == 3, timeout=10,
                                              what="the busy engine to hold 3 requests"))
        lb = LoadBalancer(fleet.keys, reactor=reactor, policy="queue-depth",
                          health_interval=60, read_timeout=5, log_file="none")
        service = lb.service()
        service.startService()
        self.addCleanup(service.stopService)
        deep = lb.pool.get(fleet.keys[0])
        shallow = lb.pool.get(fleet.keys[1])
        yield defer.ensureDeferred(wait_until(
            lambda: deep.engine.depth is not None and shallow.engine.depth is not None,
            timeout=15, what="both engines scraped"))
        self.assertEqual((deep.engine.depth, shallow.engine.depth), (3, 0))
        site = reactor.listenTCP(0, Site(lb.resource()), interface="127.0.0.1")
        self.addCleanup(site.stopListening)
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)
        url = f"http://127.0.0.1:{site.getHost().port}/v1/chat/completions"
        # three at once: the idle engine's local count reaches 3 only with the third
        answers = yield defer.gatherResults([
            defer.ensureDeferred(client.fetch(url, b"POST", chat_body(), JSON))
            for _ in range(3)])
        self.assertEqual([header(r, b"x-backend") for r, _ in answers], [fleet.keys[1]] * 3)
        self.assertEqual(idle.completed, 3)
        for request in held:
            request.cancel()
