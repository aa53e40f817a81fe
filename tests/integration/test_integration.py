"""
The balancer on real loopback sockets in front of simulated vLLM backends: in-process
(the resource and service as an embedder uses them) and as the real ``twistd -n llmlb``.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.interfaces import IListeningPort
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import LoopingCall
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site

from txlb import LoadBalancer, __version__
from txlb.testing import SimulatedVLLM, listen_simulated

from ..processes import (
    Chunks,
    Client,
    TwistdProcess,
    chat_body,
    clean_environment,
    header,
    twistd_command,
    wait_until,
)

JSON = {b"content-type": [b"application/json"]}


class Fleet:
    """Simulated backends listening on free loopback ports."""

    def __init__(self, test: TestCase, count: int, **sim_options: Any) -> None:
        self.sims = [SimulatedVLLM(reactor, **sim_options) for _ in range(count)]
        self.ports: list[IListeningPort] = []
        for sim in self.sims:
            port = listen_simulated(reactor, sim)
            self.ports.append(port)
            test.addCleanup(port.stopListening)
        self.keys = [f"127.0.0.1:{p.getHost().port}" for p in self.ports]

    def sim(self, key: str | None) -> SimulatedVLLM:
        return self.sims[self.keys.index(key or "")]


def proxied_paths(sim: SimulatedVLLM) -> list[bytes]:
    """What a simulator received from clients, without the prober's own requests."""
    return [r.path for r in sim.requests
            if r.path not in (b"/health", b"/v1/models", b"/metrics")]


class InProcessTests(TestCase):
    timeout = 60

    def start(self, fleet: Fleet, mount: bytes | None = None, **options: Any) -> str:
        self.fleet = fleet
        self.lb = LoadBalancer(fleet.keys, reactor=reactor, **options)
        service = self.lb.service()
        service.startService()
        self.addCleanup(service.stopService)
        resource = self.lb.resource()
        if mount is not None:
            root = Resource()
            root.putChild(mount, resource)
            resource = root
        port = reactor.listenTCP(0, Site(resource), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)
        return f"http://127.0.0.1:{port.getHost().port}"

    def in_flight(self) -> int:
        return sum(b.counts.active for b in self.lb.pool)

    @defer.inlineCallbacks
    def test_streamed_chat_completion(self) -> Any:
        url = self.start(Fleet(self, 3, tokens_per_second=50))
        response, chunks = yield defer.ensureDeferred(self.client.fetch(
            url + "/v1/chat/completions", b"POST", chat_body(), JSON))
        self.assertEqual(response.code, 200)
        self.assertIn(header(response, b"x-backend"), self.fleet.keys)
        self.assertEqual(header(response, b"x-backend-port"),
                         header(response, b"x-backend").split(":")[1])  # type: ignore[union-attr]
        self.assertEqual(header(response, b"content-type"), "text/event-stream; charset=utf-8")
        self.assertTrue(chunks.clean)
        events = [e for e in chunks.body.split(b"\n\n") if e]
        self.assertEqual(events[-1], b"data: [DONE]")
        self.assertEqual(len(events), 16 + 3)  # role, 16 tokens, finish, [DONE]
        # streamed, not buffered: the reads are spread over the generation (16 tokens
        # at 50/s take 0.3 s), so the first arrived well before the last
        self.assertGreater(len(chunks.chunks), 3)
        self.assertGreater(chunks.chunks[-1][0] - chunks.chunks[0][0], 0.15)
        self.assertEqual(self.in_flight(), 0)

    @defer.inlineCallbacks
    def test_non_streaming_keeps_content_length(self) -> Any:
        url = self.start(Fleet(self, 2))
        response, chunks = yield defer.ensureDeferred(self.client.fetch(
            url + "/v1/completions", b"POST",
            json.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 5}).encode(), JSON))
        self.assertEqual(response.code, 200)
        self.assertEqual(response.length, len(chunks.body))
        completion = json.loads(chunks.body)
        self.assertEqual(completion["choices"][0]["finish_reason"], "length")
        sim = self.fleet.sim(header(response, b"x-backend"))
        self.assertEqual(proxied_paths(sim), [b"/v1/completions"])

    @defer.inlineCallbacks
    def test_backend_error_passed_through(self) -> Any:
        url = self.start(Fleet(self, 1))
        response, chunks = yield defer.ensureDeferred(self.client.fetch(
            url + "/v1/chat/completions", b"POST", chat_body(max_tokens=100000), JSON))
        self.assertEqual(response.code, 400)
        self.assertIn(b"maximum context length", chunks.body)
        self.assertTrue(all(b.health.healthy for b in self.lb.pool))

    @defer.inlineCallbacks
    def test_client_disconnect_mid_stream_aborts_generation(self) -> Any:
        url = self.start(Fleet(self, 2, tokens_per_second=20))
        response = yield defer.ensureDeferred(self.client.request(
            url + "/v1/chat/completions", b"POST", chat_body(),
            {**JSON, b"x-sim-tokens": [b"1000"]}))
        sim = self.fleet.sim(header(response, b"x-backend"))
        first: defer.Deferred[None] = defer.Deferred()

        class HangUpAfterFirstRead(Chunks):
            def dataReceived(self, data: bytes) -> None:
                super().dataReceived(data)
                if not first.called:
                    first.callback(None)
                    self.transport.stopProducing()  # type: ignore[union-attr]

        reader = HangUpAfterFirstRead()
        response.deliverBody(reader)
        yield first
        yield defer.ensureDeferred(wait_until(lambda: sim.aborted == 1, what="sim abort"))
        self.assertEqual(sim.running, 0)
        self.assertEqual(sim.completed, 0)
        yield defer.ensureDeferred(wait_until(lambda: self.in_flight() == 0, what="release"))

    @defer.inlineCallbacks
    def test_client_disconnect_before_headers_aborts_request(self) -> Any:
        url = self.start(Fleet(self, 2))
        for sim in self.fleet.sims:
            sim.hang = True
        pending = defer.ensureDeferred(self.client.request(
            url + "/v1/completions", b"POST", b'{"prompt": "x"}', JSON))
        yield defer.ensureDeferred(wait_until(
            lambda: sum(s.running for s in self.fleet.sims) == 1, what="request upstream"))
        self.assertEqual(self.in_flight(), 1)
        pending.cancel()
        yield self.assertFailure(pending, defer.CancelledError, Exception)
        yield defer.ensureDeferred(wait_until(
            lambda: sum(s.aborted for s in self.fleet.sims) == 1, what="sim abort"))
        yield defer.ensureDeferred(wait_until(lambda: self.in_flight() == 0, what="release"))

    @defer.inlineCallbacks
    def test_headers_named_in_the_backends_connection_header_are_dropped(self) -> Any:
        """A real backend's ``Connection: X-Secret`` keeps X-Secret from the client."""

        class RawBackend(Protocol):
            def dataReceived(self, data: bytes) -> None:
                if b"\r\n\r\n" in data:
                    assert self.transport is not None
                    self.transport.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                        b"Connection: X-Secret, keep-alive\r\nX-Secret: hop only\r\n"
                        b"Keep-Alive: timeout=5\r\nX-Kept: yes\r\n"
                        b"Set-Cookie: a=1\r\nSet-Cookie: b=2\r\nContent-Length: 2\r\n\r\nok")

        port = reactor.listenTCP(0, Factory.forProtocol(RawBackend), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        fleet = Fleet(self, 0)
        fleet.keys = [f"127.0.0.1:{port.getHost().port}"]
        url = self.start(fleet)
        response, chunks = yield defer.ensureDeferred(self.client.fetch(url + "/raw"))
        self.assertEqual((response.code, chunks.body), (200, b"ok"))
        self.assertIsNone(response.headers.getRawHeaders(b"x-secret"))
        self.assertIsNone(response.headers.getRawHeaders(b"keep-alive"))
        self.assertEqual(response.headers.getRawHeaders(b"x-kept"), [b"yes"])
        self.assertEqual(response.headers.getRawHeaders(b"set-cookie"), [b"a=1", b"b=2"])

    @defer.inlineCallbacks
    def test_mounted_in_another_site(self) -> Any:
        url = self.start(Fleet(self, 2), mount=b"llm")
        response, chunks = yield defer.ensureDeferred(self.client.fetch(
            url + "/llm/v1/chat/completions?trace=1", b"POST", chat_body(), JSON))
        self.assertEqual(response.code, 200)
        self.assertTrue(chunks.body.endswith(b"data: [DONE]\n\n"))
        sim = self.fleet.sim(header(response, b"x-backend"))
        self.assertEqual(proxied_paths(sim), [b"/v1/chat/completions?trace=1"])

    @defer.inlineCallbacks
    def test_dead_backend_502_ejected_then_back(self) -> Any:
        fleet = Fleet(self, 1)
        url = self.start(fleet, health_interval=0.2)
        port_number = fleet.ports[0].getHost().port
        yield fleet.ports[0].stopListening()
        response, chunks = yield defer.ensureDeferred(self.client.fetch(url + "/metrics"))
        self.assertEqual(response.code, 502)
        self.assertEqual(json.loads(chunks.body)["error"]["code"], 502)
        backend = next(iter(self.lb.pool))
        self.assertFalse(backend.health.healthy)
        response, _ = yield defer.ensureDeferred(self.client.fetch(url + "/metrics"))
        self.assertEqual(response.code, 503)
        self.assertIsNotNone(header(response, b"retry-after"))
        # restarted on the same port: the prober brings it back by itself
        port = listen_simulated(reactor, fleet.sims[0], port=port_number)
        self.addCleanup(port.stopListening)
        yield defer.ensureDeferred(wait_until(lambda: backend.health.healthy, what="recovery"))
        response, _ = yield defer.ensureDeferred(self.client.fetch(url + "/metrics"))
        self.assertEqual(response.code, 200)

    @defer.inlineCallbacks
    def test_dead_engine_behind_live_api_leaves_rotation(self) -> Any:
        fleet = Fleet(self, 2)
        url = self.start(fleet, health_interval=0.2)
        fleet.sims[0].engine_dead = True
        dead = self.lb.pool.get(fleet.keys[0])
        yield defer.ensureDeferred(wait_until(lambda: not dead.health.healthy,  # type: ignore[union-attr]
                                              what="dead engine marked down"))
        for _ in range(4):
            response, _ = yield defer.ensureDeferred(self.client.fetch(url + "/metrics"))
            self.assertEqual(header(response, b"x-backend"), fleet.keys[1])


class TwistdTests(TestCase):
    """The real ``twistd -n llmlb`` process."""

    timeout = 120

    @defer.inlineCallbacks
    def test_serves_a_stream_and_exits_cleanly(self) -> Any:
        fleet = Fleet(self, 2, tokens_per_second=100)
        lb = TwistdProcess("--backends", ",".join(fleet.keys), "--health-interval", "1")
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        yield defer.ensureDeferred(lb.started())
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)
        response, chunks = yield defer.ensureDeferred(client.fetch(
            lb.url + "/v1/chat/completions", b"POST", chat_body(), JSON))
        self.assertEqual(response.code, 200)
        self.assertIn(header(response, b"x-backend"), fleet.keys)
        self.assertTrue(chunks.body.endswith(b"data: [DONE]\n\n"))
        response, chunks = yield defer.ensureDeferred(client.fetch(lb.url + "/__lb_status"))
        status = json.loads(chunks.body)
        self.assertEqual((status["healthy"], status["total"]), (2, 2))
        code = yield defer.ensureDeferred(lb.stop())
        output = lb.final_output
        self.assertIn("Server Shut Down", output)
        self.assertEqual(code, 0, output)
        self.assertNotIn("Traceback", output)
        self.assertNotIn("Unhandled", output)

    @defer.inlineCallbacks
    def test_the_default_reactor_is_txlb_epoll(self) -> Any:
        """
        ``twistd -n llmlb`` without ``--reactor`` runs on txlb-epoll (direct dispatch, eager
        writes), says so at start-up, and serves streams.
        """
        yield self.assertServesStreamsOn(None, "DirectDispatchEPollReactor",
                                         f"txlb {__version__} runs on reactor txlb-epoll: "
                                         "direct dispatch")

    @defer.inlineCallbacks
    def test_a_chosen_stock_reactor_is_kept_and_named(self) -> Any:
        """
        ``--reactor epoll`` (Twisted's own) is the operator's choice: txlb runs on it with the
        stock transports and its start-up line says so.
        """
        yield self.assertServesStreamsOn(
            "epoll", "reactor class: twisted.internet.epollreactor.EPollReactor",
            f"txlb {__version__} runs on reactor twisted.internet.epollreactor.EPollReactor: "
            "Twisted's stock transports")

    @defer.inlineCallbacks
    def assertServesStreamsOn(self, reactor: str | None, *said: str) -> Any:
        fleet = Fleet(self, 2, tokens_per_second=200)
        lb = TwistdProcess("--backends", ",".join(fleet.keys), reactor=reactor)
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        yield defer.ensureDeferred(lb.started())
        for words in said:
            self.assertIn(words, lb.output())
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)
        response, chunks = yield defer.ensureDeferred(client.fetch(
            lb.url + "/v1/chat/completions", b"POST", chat_body(), JSON))
        self.assertEqual(response.code, 200)
        self.assertTrue(chunks.body.endswith(b"data: [DONE]\n\n"))
        self.assertGreater(len(chunks.chunks), 3)
        code = yield defer.ensureDeferred(lb.stop())
        self.assertEqual(code, 0, lb.final_output)

    def assertStartupRefused(self, args: list[str], env: dict[str, str], *words: str) -> None:
        result = subprocess.run(twistd_command(*args), env={**clean_environment(), **env},
                                capture_output=True, text=True, timeout=60)
        self.assertNotEqual(result.returncode, 0)
        lines = result.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, result.stderr)
        for word in words:
            self.assertIn(word, lines[0])

    def test_bad_option_stops_startup_with_one_line(self) -> None:
        self.assertStartupRefused(["--health-interval", "abc"], {},
                                  "--health-interval", "'abc'")
        self.assertStartupRefused(["--backends", "nohostport"], {},
                                  "--backends", "'nohostport'")

    def test_bad_environment_value_named(self) -> None:
        self.assertStartupRefused([], {"LB_HC_INTERVAL": "soon"}, "--health-interval", "'soon'")
        self.assertStartupRefused([], {"LB_CONFIG": "/nonexistent.toml"}, "--config")

    @defer.inlineCallbacks
    def test_slow_reader_keeps_proxy_memory_bounded(self) -> Any:
        """
        A 200 MB download read slowly through the real process: the proxy pauses the
        backend instead of buffering, so its RSS grows by far less than the body.
        """
        total = 200_000_000
        fleet = Fleet(self, 1)
        lb = TwistdProcess("--backends", fleet.keys[0])
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        yield defer.ensureDeferred(lb.started())
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)
        yield defer.ensureDeferred(client.fetch(lb.url + "/metrics"))  # warm up
        baseline = lb.rss_bytes()
        peak = [baseline]
        sampler = LoopingCall(lambda: peak.append(lb.rss_bytes()))
        sampler.start(0.05)
        self.addCleanup(lambda: sampler.running and sampler.stop())

        class SlowReader(Chunks):
            """Reads at most ~40 MB/s: pauses 25 ms after every MiB."""

            received = 0

            def dataReceived(self, data: bytes) -> None:
                before, self.received = self.received, self.received + len(data)
                if before // 2**20 != self.received // 2**20:
                    assert self.transport is not None
                    self.transport.pauseProducing()  # type: ignore[attr-defined]
                    reactor.callLater(0.025, self.transport.resumeProducing)  # type: ignore

        response = yield defer.ensureDeferred(
            client.request(lb.url + f"/sim/bytes?n={total}"))
        reader = SlowReader()
        response.deliverBody(reader)
        yield reader.done
        sampler.stop()
        self.assertTrue(reader.clean)
        self.assertEqual(reader.received, total)
        growth = max(peak) - baseline
        self.assertLess(growth, 64 * 2**20, f"proxy RSS grew by {growth / 2**20:.1f} MiB")
