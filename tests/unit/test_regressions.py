"""
Behaviours the docs promise that once had no test able to notice them break.

Each test here was checked against a deliberate bug in the production code (the list is in
``bench/mutation_known.py`` as ``KNOWN_BUGS``; ``python -m bench.mutation --known`` replays them):
it fails with the bug and passes without it.  Coverage said these lines ran; these tests
say they do what they should.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from twisted.internet import error as neterror
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.server import Site

from txlb import BackendSpec, LoadBalancer, Pool
from txlb._cluster.health import HealthChecker
from txlb._records.resultlog import ResultLog
from txlb._records.summary import RequestRecord, summarize
from txlb._upstream.client import UpstreamClient
from txlb._upstream.connection import UpstreamConnection

from ..helpers import ClientConnection, FakeResponse, FakeUpstream, keep_records

THREE = ["127.0.0.1:8002", "127.0.0.1:8003", "127.0.0.1:8004"]


class LeaseTests(SynchronousTestCase):
    """Bug 1: a lease released twice must lower its backend's in-flight count once."""

    def test_release_is_exactly_once(self) -> None:
        changes: list[None] = []
        pool = Pool((BackendSpec("127.0.0.1", 8002),))
        pool.on_change.append(lambda: changes.append(None))
        backend = pool.get("127.0.0.1:8002")
        first = pool.slots.acquire(backend)
        second = pool.slots.acquire(backend)
        self.assertEqual(backend.counts.active, 2)
        first.release()
        seen = len(changes)
        first.release()
        first.release()
        self.assertEqual(backend.counts.active, 1)
        self.assertEqual(backend.counts.finished_since_scrape, 1)
        self.assertEqual(len(changes), seen)  # nobody is told twice of one freed slot
        second.release()
        self.assertEqual(backend.counts.active, 0)


class ProxyCase(SynchronousTestCase):
    """A balancer in memory with a fake upstream (the suite's usual arrangement)."""

    def build(self, backends: list[str] | None = THREE, **options: Any) -> None:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        options.setdefault("log_file", "none")
        self.lb = LoadBalancer(backends, reactor=self.clock, agent=self.upstream,
                               probe_agent=FakeUpstream(), rng=random.Random(5), **options)
        self.records: list[Any] = keep_records(self.lb)

    def post(self, site: Site, body: bytes = b'{"prompt": "x"}') -> ClientConnection:
        client = ClientConnection(site)
        client.request(b"POST", b"/v1/completions", body=body)
        return client


class MaxBodyTests(ProxyCase):
    def test_embedded_resource_enforces_max_body(self) -> None:
        """Bug 2: ``lb.resource()`` mounted in the embedder's own ``Site`` refuses 413 too."""
        self.build(max_body="1KiB")
        site = Site(self.lb.resource(), reactor=self.clock)
        client = self.post(site, b"x" * 1025)
        response = client.response()
        self.assertEqual(response.status, 413)
        self.assertIn(b"1024", response.body)
        self.assertEqual(self.upstream.calls, [])
        self.assertEqual(self.records[-1].status, 413)
        at_limit = self.post(site, b"x" * 1024)
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertEqual(at_limit.transport.value(), b"")  # forwarded, waiting for a backend

    def test_chunked_body_refused_while_it_arrives(self) -> None:
        """
        Bug 3: the main port answers 413 as soon as a chunked body passes the limit, not
        once it has all arrived (by then it was buffered whole, the limit's point lost).
        """
        self.build(max_body="1KiB")
        client = ClientConnection(self.lb.site())
        client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
        client.send(b"401\r\n" + b"a" * 0x401 + b"\r\n")  # one byte over; no last chunk
        raw = client.transport.value()
        self.assertTrue(raw.startswith(b"HTTP/1.1 413 "), raw)
        self.assertTrue(client.transport.disconnecting)
        self.assertEqual(self.upstream.calls, [])


class ResultLogLineTests(SynchronousTestCase):
    """Bug 4: no carriage return reaches the result log raw (it ends a line for many tools)."""

    def test_no_raw_carriage_return(self) -> None:
        path = Path(self.mktemp())
        path.parent.mkdir(parents=True, exist_ok=True)
        log = ResultLog(str(path), clock=Clock(), max_bytes=10_000_000, backups=1, fmt="text")
        self.addCleanup(log.close)
        other = RequestRecord(started=0.0, method=b"GET", path=b"/a\rb", orid_header=b"o\rr",
                              request_body=b"", backend="127.0.0.1:8002", status=200,
                              ended=0.5)
        error = RequestRecord(started=0.0, method=b"POST", path=b"/v1/chat/completions",
                              orid_header=b"x\r", request_body=b'{"model": "m"}',
                              backend="127.0.0.1:8002", ended=0.5)
        error.answered_by_proxy(400, b'{"error": "bad\rinput"}')
        completion = RequestRecord(started=0.0, method=b"POST", path=b"/v1/completions",
                                   orid_header=None, request_body=b"{}",
                                   backend="127.0.0.1:8002", status=200, ended=0.5,
                                   content_type=b"application/json")
        completion.capture(b'{"choices": [{"text": "one\\rtwo", "finish_reason": "stop"}]}')
        for record in (other, error, completion):
            log.write(summarize(record))
        data = path.read_bytes()
        self.assertNotIn(b"\r", data)
        self.assertEqual(data.count(b"\n"), 3, data)
        for part in (b"bad", b"input", b"one", b"two", b"/a"):
            self.assertIn(part, data)


class RetryRuleTests(ProxyCase):
    def setUp(self) -> None:
        self.build(retries=2)
        self.site = self.lb.site()

    def test_connect_timeout_is_never_retried(self) -> None:
        """Bug 5: a connect timeout may hide a backend still taking the request: 504, once."""
        client = self.post(self.site)
        self.upstream.calls[0].fail(neterror.TimeoutError())
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertEqual(client.response().status, 504)
        self.assertEqual(self.records[-1].tries, 1)

    def test_a_500_answer_is_relayed_not_retried(self) -> None:
        """Bug 9: only 502/503 mean "this backend cannot take it"; a 500 goes to the client."""
        client = self.post(self.site)
        body = b'{"error": "engine bug"}'
        response = self.upstream.calls[0].respond(
            FakeResponse(500, [(b"content-type", b"application/json")], length=len(body)))
        response.send(body)
        response.end()
        self.assertEqual(len(self.upstream.calls), 1)
        answer = client.response()
        self.assertEqual((answer.status, answer.body), (500, body))

    def test_a_retried_answer_is_discarded_not_read(self) -> None:
        """Bug 6 (Agent side): the 503's body is not read; its connection is closed."""
        client = self.post(self.site)
        response = self.upstream.calls[0].respond(FakeResponse(503, length=10**9))
        self.assertTrue(response.transport.stopped)
        self.assertEqual(len(self.upstream.calls), 2)
        self.assertEqual(client.transport.value(), b"")


class UpstreamGuardTests(SynchronousTestCase):
    """
    txlb's own upstream client, with the test as the backend: what it does with a backend
    that sends more, or other, than one well-framed answer (bugs 6, 7 and the smuggling
    guards no test ran before).
    """

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.client = UpstreamClient(self.reactor, connect_timeout=5)

    def send(self) -> list[Any]:
        result: list[Any] = []
        self.client.send("127.0.0.1", 8002, b"POST", b"/v1/completions", [], b"{}") \
            .addBoth(result.append)
        return result

    def connect(self) -> tuple[UpstreamConnection, StringTransport]:
        _, _, factory, _, _ = self.reactor.tcpClients[-1]
        protocol = factory.buildProtocol(None)
        transport = StringTransport()
        protocol.makeConnection(transport)
        return protocol, transport

    def answer(self, wire: bytes) -> tuple[Any, Any, StringTransport]:
        from .test_upstream import Owner

        result = self.send()
        connection, transport = self.connect()
        connection.dataReceived(wire)
        response = result[0]
        owner = Owner()
        if not isinstance(response, Exception) and hasattr(response, "deliver"):
            response.deliver(owner, raw=False)
        return response, owner, transport

    def assert_not_reused(self, transport: StringTransport) -> None:
        self.assertEqual(self.client.idle_count("127.0.0.1", 8002), 0)
        self.assertTrue(transport.disconnecting)

    def test_discard_closes_without_reading(self) -> None:
        """Bug 6 (own client): a discarded answer's connection is aborted, never pooled."""
        result = self.send()
        connection, transport = self.connect()
        connection.dataReceived(b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbu")
        result[0].discard()
        self.assertTrue(transport.disconnected)  # aborted, not a polite close
        connection.dataReceived(b"sy")
        self.assertEqual(self.client.idle_count("127.0.0.1", 8002), 0)

    def test_bytes_beyond_content_length_stop_reuse(self) -> None:
        """Bug 7: what follows a body may be a smuggled second answer: never reuse that."""
        _, owner, transport = self.answer(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\n\r\n")
        self.assertEqual((owner.data, owner.ended), (b"hello", [None]))
        self.assert_not_reused(transport)

    def test_bytes_beyond_content_length_in_a_later_read(self) -> None:
        result = self.send()
        connection, transport = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel")
        from .test_upstream import Owner

        owner = Owner()
        result[0].deliver(owner, raw=True)
        connection.dataReceived(b"lo!")
        self.assertEqual(owner.data, b"hello")
        self.assert_not_reused(transport)

    def test_extra_bytes_after_trailers_stop_reuse(self) -> None:
        _, owner, transport = self.answer(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2\r\nhi\r\n0\r\nx-t: 1\r\n\r\nHTTP/1.1 200 OK\r\n")
        self.assertEqual((owner.data, owner.ended), (b"hi", [None]))
        self.assert_not_reused(transport)

    def test_extra_bytes_after_the_last_chunk_stop_reuse(self) -> None:
        _, owner, transport = self.answer(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\nX")
        self.assertEqual(owner.ended, [None])
        self.assert_not_reused(transport)

    def test_a_clean_chunked_answer_is_reused(self) -> None:
        """The guard's other side: nothing extra, so the connection goes back to the pool."""
        _, owner, transport = self.answer(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\nx: 1\r\n\r\n")
        self.assertEqual(owner.ended, [None])
        self.assertEqual(self.client.idle_count("127.0.0.1", 8002), 1)
        self.assertFalse(transport.disconnecting)

    def test_oversized_trailers_fail_the_body(self) -> None:
        from txlb._upstream.heads import MAX_HEAD_BYTES

        _, owner, transport = self.answer(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n"
            + b"x-t: " + b"a" * MAX_HEAD_BYTES + b"\r\n")
        self.assertEqual(len(owner.ended), 1)
        self.assertIsNotNone(owner.ended[0])
        self.assertIn("trailers too large", str(owner.ended[0].value))
        self.assert_not_reused(transport)

    def test_trailers_just_under_the_limit_are_accepted(self) -> None:
        """Pins the limit's side: trailers may be large, just not without bound."""
        _, owner, _ = self.answer(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n"
            + b"x-t: " + b"a" * 1000 + b"\r\n\r\n")
        self.assertEqual(owner.ended, [None])

    def test_data_on_an_idle_connection_drops_it(self) -> None:
        connection, _, transport = self.answer(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        self.assertEqual(self.client.idle_count("127.0.0.1", 8002), 1)
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.assert_not_reused(transport)
        self.send()
        self.assertEqual(len(self.reactor.tcpClients), 2)  # the next request connects anew

    def test_101_answer_is_refused(self) -> None:
        result = self.send()
        connection, transport = self.connect()
        connection.dataReceived(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n")
        self.assertEqual(len(result), 1)
        failure = result[0]
        self.assertIn("101", str(failure.value.reasons[0].value))
        self.assertTrue(transport.disconnected)


class ProbeStatusTests(SynchronousTestCase):
    """Bug 8: any answer but 200 from the health path is a dead backend, 404 included."""

    def test_every_non_200_marks_down(self) -> None:
        for code in (404, 400, 301, 204, 201, 418, 500):
            clock = Clock()
            agent = FakeUpstream()
            pool = Pool((BackendSpec("127.0.0.1", 8002),))
            backend = pool.get("127.0.0.1:8002")
            checker = HealthChecker(pool, agent, clock, interval=2, timeout=1,
                                    path="/health", rise=1, fall=3)
            checker.startService()
            probe = [c for c in agent.calls if c.uri.endswith(b"/health")][0]
            probe.respond(FakeResponse(code, length=0)).end()
            self.assertFalse(backend.health.healthy, f"HTTP {code} counted as healthy")
            self.assertEqual(backend.health.last_probe_error, f"health: HTTP {code}")
            checker.stopService()

    def test_200_is_healthy(self) -> None:
        clock = Clock()
        agent = FakeUpstream()
        pool = Pool((BackendSpec("127.0.0.1", 8002),))
        backend = pool.get("127.0.0.1:8002")
        pool.mark_down(backend, "down before the first probe")
        checker = HealthChecker(pool, agent, clock, interval=2, timeout=1, path="/health",
                                rise=1, fall=3)
        checker.startService()
        self.addCleanup(checker.stopService)
        [c for c in agent.calls if c.uri.endswith(b"/health")][0].respond(
            FakeResponse(200, length=0)).end()
        self.assertTrue(backend.health.healthy)
