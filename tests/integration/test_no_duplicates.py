"""
A request is sent to a second backend only when it provably never started -- on real
sockets, with backends that reset the connection at the two moments that matter.

For an LLM a re-sent request is a second generation: a backend that had the whole request
and then reset (an engine killed mid-prefill) may have done the work, so the client gets 502
and no other backend sees the request.  A backend that resets while part of the request is
still unsent never had it, so another backend gets it.  The same holds on a reused
keep-alive connection: a POST the backend held and then reset is not sent again on a new
connection either (only a close within 50 ms of the request, the idle-close race, is).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from txlb import LoadBalancer
from txlb.testing import SimulatedVLLM, listen_simulated

from ..processes import Client, TwistdProcess, chat_body, header, wait_until

JSON = {b"content-type": [b"application/json"]}


class _ResetAfterWholeRequest(Resource):
    """Answers probes; takes every other request whole, then resets without answering."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.taken: list[bytes] = []
        self.probes = 0

    def render(self, request: Request) -> Any:
        if request.path == b"/health":
            self.probes += 1
            return b"ok"
        if request.path == b"/v1/models":
            return json.dumps({"data": [{"id": "sim-model"}]}).encode()
        if request.path == b"/metrics":  # the engine scrape at first sight: not a generation
            request.setResponseCode(404)
            return b""
        self.taken.append(request.content.read() if request.content else b"")
        request.channel.transport.abortConnection()  # type: ignore[union-attr]
        return NOT_DONE_YET


class _ResetOnHead(Protocol):
    """Answers ``GET /health``; resets any other request as soon as its head arrives."""

    def __init__(self, heads: list[bytes]) -> None:
        self.heads = heads
        self.buffer = b""

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        if b"\r\n\r\n" not in self.buffer:
            return
        head = self.buffer.split(b"\r\n\r\n", 1)[0]
        assert self.transport is not None
        if head.startswith((b"GET /health ", b"GET /v1/models ", b"GET /metrics ")):
            body = b'{"data": [{"id": "sim-model"}]}'
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n"
                                 b"Connection: close\r\n\r\n%s" % (len(body), body))
            self.transport.loseConnection()
            return
        self.heads.append(head)
        self.transport.abortConnection()  # type: ignore[attr-defined]


class _HoldingBackend(Factory):
    """The backend's side of :class:`_HoldsTheSecondPost`: what every connection saw."""

    def __init__(self) -> None:
        #: each POST received, as the number of the connection it came on (1, 2, ...)
        self.posts: list[int] = []
        self.connections = 0

    def buildProtocol(self, addr: object) -> _HoldsTheSecondPost:
        self.connections += 1
        return _HoldsTheSecondPost(self, self.connections)


class _HoldsTheSecondPost(Protocol):
    """
    A keep-alive HTTP/1.1 backend: answers every ``GET`` (probes, models) and the first
    ``POST``; holds any later ``POST`` for :attr:`HOLD` seconds, as an engine in its
    prefill does, then resets the connection without a byte of answer (the engine crashed).
    """

    HOLD = 0.8

    def __init__(self, backend: _HoldingBackend, number: int) -> None:
        self.backend = backend
        self.number = number
        self.buffer = b""
        self.held: Any = None

    def connectionLost(self, reason: Any = None) -> None:
        if self.held is not None and self.held.active():
            self.held.cancel()

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head, separator, rest = self.buffer.partition(b"\r\n\r\n")
            if not separator:
                return
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            self.buffer = rest[length:]
            self.answer(head.split(b" ", 2)[:2])

    def answer(self, line: list[bytes]) -> None:
        assert self.transport is not None
        method, path = line
        if method == b"POST":
            self.backend.posts.append(self.number)
            if len(self.backend.posts) > 1:
                abort = self.transport.abortConnection  # type: ignore[attr-defined]
                self.held = reactor.callLater(self.HOLD, abort)
                return
            body = json.dumps({"object": "chat.completion", "model": "sim-model", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi"},
                 "finish_reason": "stop"}]}).encode()
        elif path == b"/metrics":
            self.transport.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            return
        else:
            body = b'{"object": "list", "data": [{"id": "sim-model", "object": "model"}]}'
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


class NoDuplicateGenerationTests(TestCase):
    timeout = 60

    def start(self, keys: list[str], **options: Any) -> str:
        self.lb = LoadBalancer(keys, reactor=reactor, log_file="none", **options)
        service = self.lb.service()
        service.startService()
        self.addCleanup(service.stopService)
        port = reactor.listenTCP(0, Site(self.lb.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)
        return f"http://127.0.0.1:{port.getHost().port}"

    def listen_site(self, resource: Resource) -> str:
        port = reactor.listenTCP(0, Site(resource), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return f"127.0.0.1:{port.getHost().port}"

    @defer.inlineCallbacks
    def test_reset_after_the_whole_request_is_502_and_never_sent_again(self) -> Any:
        first, second = _ResetAfterWholeRequest(), _ResetAfterWholeRequest()
        keys = [self.listen_site(first), self.listen_site(second)]
        url = self.start(keys)  # --retries 2, the default
        yield defer.ensureDeferred(wait_until(lambda: first.probes and second.probes,
                                              what="the first probes"))
        response, chunks = yield defer.ensureDeferred(self.client.fetch(
            url + "/v1/chat/completions", b"POST", chat_body(stream=False), JSON))
        self.assertEqual(response.code, 502)
        self.assertIn(b"closed the connection without answering", chunks.body)
        self.assertEqual(len(first.taken) + len(second.taken), 1)
        # it was probed at once, answered, and so stays in rotation
        probed = first if first.taken else second
        probes_before = probed.probes
        yield defer.ensureDeferred(wait_until(lambda: probed.probes > probes_before,
                                              what="an immediate probe of that backend"))
        self.assertTrue(all(b.health.healthy for b in self.lb.pool))
        self.assertEqual(sum(b.counts.active for b in self.lb.pool), 0)

    @defer.inlineCallbacks
    def test_a_post_held_on_a_reused_connection_then_reset_is_502_and_sent_once(
            self) -> Any:
        """
        ``twistd -n llmlb`` with its upstream pool warm: the backend answers a first POST
        (its connection is pooled), holds the next one, which txlb writes on that pooled
        connection, for 0.8 s and resets.  The client gets 502 and the backend saw that
        POST once: past 50 ms, a close is not the idle-close race.
        """
        backend = _HoldingBackend()
        port = reactor.listenTCP(0, backend, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        lb = TwistdProcess("--backends", f"127.0.0.1:{port.getHost().port}",
                           "--health-interval", "3600")
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        yield defer.ensureDeferred(lb.started())
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)
        url = lb.url + "/v1/chat/completions"
        response, chunks = yield defer.ensureDeferred(
            client.fetch(url, b"POST", chat_body(stream=False), JSON))
        self.assertEqual(response.code, 200, chunks.body[:300])
        started = reactor.seconds()
        response, chunks = yield defer.ensureDeferred(
            client.fetch(url, b"POST", chat_body(stream=False), JSON))
        self.assertEqual(response.code, 502, chunks.body[:300])
        self.assertIn(b"closed the connection without answering", chunks.body)
        self.assertGreaterEqual(reactor.seconds() - started, _HoldsTheSecondPost.HOLD)
        # both POSTs on one connection (the pool was warm), and the held one only once
        self.assertEqual(len(backend.posts), 2, backend.posts)
        self.assertEqual(backend.posts[0], backend.posts[1])

    @defer.inlineCallbacks
    def test_reset_while_the_request_is_being_sent_goes_elsewhere(self) -> Any:
        heads: list[bytes] = []
        factory = Factory.forProtocol(lambda: _ResetOnHead(heads))
        resetting = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(resetting.stopListening)
        sim = SimulatedVLLM(reactor)
        good = listen_simulated(reactor, sim)
        self.addCleanup(good.stopListening)
        reset_key = f"127.0.0.1:{resetting.getHost().port}"
        good_key = f"127.0.0.1:{good.getHost().port}"
        url = self.start([reset_key, good_key], health_interval=3600)
        # 16 MiB: more than the kernel's socket buffers take, so most of it is still in
        # txlb's own buffer when the reset arrives
        body = chat_body(stream=False, padding="x" * (16 * 1024 * 1024))
        for _ in range(2):  # rotation may start with either backend
            response, chunks = yield defer.ensureDeferred(self.client.fetch(
                url + "/v1/chat/completions", b"POST", body, JSON))
            self.assertEqual(response.code, 200, chunks.body[:300])
            self.assertEqual(header(response, b"x-backend"), good_key)
            if heads:
                break
        self.assertEqual(len(heads), 1)
        received = [r for r in sim.requests if r.path == b"/v1/chat/completions"]
        self.assertEqual([len(r.body) for r in received][-1], len(body))
        self.assertEqual(sum(b.counts.active for b in self.lb.pool), 0)
