"""
Request framing on every server path -- the lean main port (:mod:`txlb._server.lean`) and
twisted.web's (``lb.site()``, the embedding path): every case of :mod:`tests.framing`, with
the same expected answers for both, in memory (each server over a ``StringTransport``, a
fake upstream, a Clock) and over loopback sockets (the real ``twistd -n llmlb``; ``lb.site()``
listening in process).
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from twisted.internet import defer, threads
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from txlb import LoadBalancer

from ..framing import BACKEND, CASES, Case, Sent
from ..helpers import ClientConnection, FakeResponse, FakeUpstream, keep_records
from ..processes import TwistdProcess
from .test_integration import Fleet

HEADER_TIMEOUT = 5.0


def split_responses(raw: bytes) -> tuple[list[tuple[int, dict[bytes, bytes], bytes]], bytes]:
    """
    Every complete response in ``raw`` as (status, lowercase headers, body), and what is
    left over.  Responses here have a Content-Length, are chunked, or are interim (1xx).
    """
    responses = []
    while b"\r\n\r\n" in raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if 100 <= status < 200:
            responses.append((status, headers, b""))
            raw = rest
            continue
        if headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while True:
                size_line, sep, after = rest.partition(b"\r\n")
                if not sep:
                    return responses, raw
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    if not after.startswith(b"\r\n"):
                        return responses, raw
                    rest = after[2:]
                    break
                if len(after) < size + 2:
                    return responses, raw
                body += after[:size]
                rest = after[size + 2:]
        else:
            length = int(headers.get(b"content-length", b"0"))
            if len(rest) < length:
                return responses, raw
            body, rest = rest[:length], rest[length:]
        responses.append((status, headers, body))
        raw = rest
    return responses, raw


def describe(responses: list[tuple[int, dict[bytes, bytes], bytes]]) -> tuple[int, ...]:
    """Statuses as a :class:`Case` states them: the backend's answers as ``BACKEND``."""
    return tuple(BACKEND if b"x-backend" in headers else status
                 for status, headers, _ in responses)


def check_refusal_bodies(test: Any, case: Case,
                         responses: list[tuple[int, dict[bytes, bytes], bytes]]) -> None:
    """
    txlb's own errors are OpenAI-style JSON, and a refusal that closes the connection (the
    last answer of a case that closes) says so.
    """
    for index, (status, headers, body) in enumerate(responses):
        if b"x-backend" in headers or status < 400:
            continue
        error = json.loads(body)["error"]
        test.assertEqual(error["code"], status, case.name)
        if case.closed and index == len(responses) - 1:
            test.assertEqual(headers.get(b"connection"), b"close", case.name)


class _InMemoryFraming:
    """
    Each case against a real main-port server over a ``StringTransport``, deterministically;
    one subclass per server path, each held to the same table.
    """

    def server(self, lb: LoadBalancer) -> Any:
        """The server factory under test, for ``lb``."""
        raise NotImplementedError

    def run_case(self, case: Case, read: int = 0) -> None:
        """``case``, its bytes in one read -- or, with ``read``, that many at a time."""
        clock = Clock()
        upstream = FakeUpstream()
        lb = LoadBalancer(["127.0.0.1:8002"], reactor=clock, agent=upstream,
                          probe_agent=FakeUpstream(), log_file="none", max_body="1KiB",
                          header_timeout=HEADER_TIMEOUT)
        client = ClientConnection(self.server(lb))
        for start in range(0, len(case.raw), read or len(case.raw)):
            client.send(case.raw[start:start + (read or len(case.raw))])
        answered = 0
        while answered < len(upstream.calls):  # answer each forwarded request in turn
            response = upstream.calls[answered].respond(
                FakeResponse(200, [(b"Content-Type", b"text/plain")], length=2))
            response.send(b"ok")
            response.end()
            answered += 1
        if case.wait:
            self.assertEqual(client.transport.value(), b"", case.name)
            clock.advance(HEADER_TIMEOUT)
        responses, rest = split_responses(client.transport.value())
        self.assertEqual(describe(responses), case.answers, case.name)
        self.assertEqual(rest, b"", case.name)
        self.assertEqual(bool(client.transport.disconnecting), case.closed, case.name)
        check_refusal_bodies(self, case, responses)
        sent = []
        for call, expected in zip(upstream.calls, case.forwarded, strict=False):
            path = b"/" + call.uri.split(b"/", 3)[3]
            sent.append(Sent(call.method, path, call.body or b"", expected.headers))
            for name, value in expected.headers:
                self.assertEqual(call.header(name), [value], case.name)
        self.assertEqual(len(upstream.calls), len(case.forwarded), case.name)
        self.assertEqual(tuple(sent), case.forwarded, case.name)

    def test_every_case(self) -> None:
        failures = []
        for case in CASES:
            try:
                self.run_case(case)
            except Exception as failure:  # every case reported, not only the first
                failures.append(f"{case.name}: {failure!r}"[:300])
        self.assertFalse(failures, "\n".join(failures))

    def test_trailers_one_byte_a_read(self) -> None:
        """
        A trailer section is checked as it arrives, not only once it ends: each trailer
        case gives the same answers with its bytes sent one at a time.
        """
        cases = [case for case in CASES if "trailer" in case.name]
        self.assertGreater(len(cases), 10)
        failures = []
        for case in cases:
            try:
                self.run_case(case, read=1)
            except Exception as failure:
                failures.append(f"{case.name}: {failure!r}"[:300])
        self.assertFalse(failures, "\n".join(failures))

    def test_refused_framing_is_logged_with_its_request_line(self) -> None:
        """A refusal gets a result-log line, like every request txlb answers itself."""
        clock = Clock()
        upstream = FakeUpstream()
        lb = LoadBalancer(["127.0.0.1:8002"], reactor=clock, agent=upstream,
                          probe_agent=FakeUpstream(), log_file="none")
        records = keep_records(lb)
        client = ClientConnection(self.server(lb))
        client.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Transfer-Encoding: identity\r\n\r\n")
        self.assertEqual([(r.method, r.path, r.status) for r in records],
                         [(b"POST", b"/v1/chat/completions", 400)])

    def test_a_refused_trailer_is_logged_with_its_request_line(self) -> None:
        """The refusal of a trailer is the refusal of its request: 400, logged, unsent."""
        _, upstream, records, client = self.balancer()
        client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-T: 1\n\r\n"
                    b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual([(r.method, r.path, r.status) for r in records],
                         [(b"POST", b"/v1/completions", 400)])
        self.assertEqual(upstream.calls, [])
        self.assertTrue(client.transport.disconnecting)

    def balancer(self) -> tuple[LoadBalancer, FakeUpstream, list[Any], ClientConnection]:
        """A balancer, its upstream, the records it keeps and a client of its server."""
        upstream = FakeUpstream()
        lb = LoadBalancer(["127.0.0.1:8002"], reactor=Clock(), agent=upstream,
                          probe_agent=FakeUpstream(), log_file="none")
        records = keep_records(lb)
        return lb, upstream, records, ClientConnection(self.server(lb))

    def test_connect_is_405_allowing_the_other_methods_and_logged(self) -> None:
        """A tunnel txlb never opens: 405 (as nginx), its Allow header, its log line."""
        _, upstream, records, client = self.balancer()
        client.send(b"CONNECT /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        (response,), rest = split_responses(client.transport.value())
        status, headers, body = response
        self.assertEqual(status, 405)
        allowed = {m.strip() for m in headers[b"allow"].split(b",")}
        self.assertIn(b"POST", allowed)
        self.assertNotIn(b"CONNECT", allowed)
        self.assertEqual(json.loads(body)["error"]["code"], 405)
        self.assertEqual([(r.method, r.path, r.status) for r in records],
                         [(b"CONNECT", b"/v1/models", 405)])
        self.assertEqual(upstream.calls, [])

    def test_the_asterisk_target_is_answered_and_logged(self) -> None:
        """
        ``OPTIONS *`` asks about the server: 200, answered here and logged like every
        request; another method with ``*`` is a 405 allowing OPTIONS.  Neither is
        forwarded, and the connection goes on.
        """
        _, upstream, records, client = self.balancer()
        client.send(b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n"
                    b"GET * HTTP/1.1\r\nHost: x\r\n\r\n")
        (options, get), rest = split_responses(client.transport.value())
        self.assertEqual((options[0], options[1][b"content-length"], options[2]),
                         (200, b"0", b""))
        self.assertEqual((get[0], get[1][b"allow"]), (405, b"OPTIONS"))
        self.assertEqual(json.loads(get[2])["error"]["code"], 405)
        self.assertEqual([(r.method, r.path, r.status, r.outcome) for r in records],
                         [(b"OPTIONS", b"*", 200, "ok"), (b"GET", b"*", 405, "proxy_error")])
        self.assertFalse(client.transport.disconnecting)
        self.assertEqual(upstream.calls, [])

    def test_no_answer_names_a_server_but_the_backends_own(self) -> None:
        """
        txlb adds no ``Server`` header (nginx's ``server_tokens off``) -- not to a
        backend's answer without one, not to its own answers and refusals; a backend's own
        is passed on.
        """
        _, upstream, _, client = self.balancer()
        client.send(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        first = upstream.calls[0].respond(FakeResponse(200, length=2))
        first.send(b"ok")
        first.end()
        client.send(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        second = upstream.calls[1].respond(
            FakeResponse(200, [(b"Server", b"vllm/0.9")], length=2))
        second.send(b"ok")
        second.end()
        client.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
                    b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n"
                    b"GET /c HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n")
        responses, _ = split_responses(client.transport.value())
        self.assertEqual([(status, headers.get(b"server")) for status, headers, _ in responses],
                         [(200, None), (200, b"vllm/0.9"), (200, None), (200, None),
                          (400, None)])

    def test_data_after_a_refusal_is_never_parsed(self) -> None:
        """Bytes arriving after the 400 (before the close completes) are dropped."""
        clock = Clock()
        upstream = FakeUpstream()
        lb = LoadBalancer(["127.0.0.1:8002"], reactor=clock, agent=upstream,
                          probe_agent=FakeUpstream(), log_file="none")
        client = ClientConnection(self.server(lb))
        client.send(b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\n\r\n")
        written = client.transport.value()
        client.send(b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(client.transport.value(), written)
        self.assertEqual(upstream.calls, [])

    def test_nothing_after_a_refusal_is_parsed_even_before_the_close(self) -> None:
        """
        The rest of the same read is dropped too, whether or not the transport already
        says it is disconnecting (twisted.web's line loop relies on that flag).
        """
        clock = Clock()
        upstream = FakeUpstream()
        lb = LoadBalancer(["127.0.0.1:8002"], reactor=clock, agent=upstream,
                          probe_agent=FakeUpstream(), log_file="none")
        client = ClientConnection(self.server(lb))
        client.transport.loseConnection = lambda: None  # type: ignore[method-assign]
        client.send(b"GET /t HTTP/1.1\r\nHost: a\r\nHost: b\r\nX-A: 1\r\n\r\n"
                    b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n")
        client.send(b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"zz\r\n" + b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n")
        responses, rest = split_responses(client.transport.value())
        self.assertEqual(describe(responses), (400,))
        self.assertEqual(rest, b"")
        self.assertEqual(upstream.calls, [])


class LeanInMemoryFramingTests(_InMemoryFraming, SynchronousTestCase):
    """The main port's lean server (what ``twistd llmlb`` listens with)."""

    def server(self, lb: LoadBalancer) -> Any:
        return lb.main_factory()


class TwistedWebInMemoryFramingTests(_InMemoryFraming, SynchronousTestCase):
    """twisted.web's server, as an embedder gets it from ``lb.site()``."""

    def server(self, lb: LoadBalancer) -> Any:
        return lb.site()


def exchange(port: int, case: Case, deadline: float) -> tuple[bytes, bool]:
    """
    Send ``case.raw`` on a fresh connection and read what comes back: until the server
    closes, or -- for a case that keeps the connection -- until its answers are in and a
    last request (``/probe``, ``Connection: close``) has been answered on it too.
    Returns the bytes before the probe's answer and whether the server closed by itself.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
        sock.sendall(case.raw)
        received = b""
        probed_at = None
        while time.monotonic() < deadline:
            responses, _ = split_responses(received)
            if not case.closed and probed_at is None and len(responses) >= len(case.answers):
                probed_at = len(received)
                sock.sendall(b"GET /probe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                data = b""
            if not data:
                if probed_at is None:
                    return received, True
                after, _ = split_responses(received[probed_at:])
                return received[:probed_at], not after
            received += data
        raise AssertionError(f"{case.name}: no end within the deadline: {received[:300]!r}")


class _OverSockets:
    """The whole table over real loopback sockets, against one server path."""

    timeout = 120

    def check_table(self, port: int, sim: Any) -> Any:
        """Every case on a fresh connection to ``port``, forwarded to ``sim``."""
        test: Any = self
        failures = []
        for case in CASES:
            before = len(sim.requests)
            try:
                raw, closed = yield threads.deferToThread(
                    exchange, port, case, time.monotonic() + 3)
            except AssertionError as error:
                failures.append(str(error))
                continue
            responses, _ = split_responses(raw)
            got = [r for r in sim.requests[before:]
                   if r.path not in (b"/health", b"/v1/models", b"/metrics", b"/probe")]
            forwarded = tuple(Sent(r.method, r.path, r.body) for r in got)
            expected = tuple(Sent(s.method, s.path, s.body) for s in case.forwarded)
            for name, value in (case.forwarded[0].headers if case.forwarded else ()):
                if got and got[0].header(name) != [value]:
                    failures.append(f"{case.name}: {name!r} arrived as {got[0].header(name)}")
            outcome = (describe(responses), closed, forwarded)
            if outcome != (case.answers, case.closed, expected):
                failures.append(f"{case.name}: {outcome} != "
                                f"{(case.answers, case.closed, expected)}")
            try:
                check_refusal_bodies(test, case, responses)
            except (test.failureException, ValueError, KeyError) as error:
                failures.append(f"{case.name}: {error!r}"[:300])
        test.assertFalse(failures, "\n".join(failures))
        test.assertNotIn(b"/smuggled", [r.path for r in sim.requests])


class RealProcessFramingTests(_OverSockets, TestCase):
    """The lean main port of the real ``twistd -n llmlb``."""

    @defer.inlineCallbacks
    def test_every_case_over_a_socket(self) -> Any:
        fleet = Fleet(self, 1)
        lb = TwistdProcess("--backends", ",".join(fleet.keys), "--max-body", "1KiB",
                           "--header-timeout", "1")
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        yield defer.ensureDeferred(lb.started())
        yield from self.check_table(lb.port, fleet.sims[0])
        self.assertIsNone(lb.process.poll(), "the balancer died")
        self.assertNotIn("Traceback", lb.output())


class TwistedWebFramingTests(_OverSockets, TestCase):
    """The embedding path: ``lb.site()`` (twisted.web over ``lb.resource()``) in process."""

    @defer.inlineCallbacks
    def test_every_case_over_a_socket(self) -> Any:
        from twisted.internet import reactor

        fleet = Fleet(self, 1)
        lb = LoadBalancer(fleet.keys, reactor=reactor, max_body="1KiB", header_timeout=1,
                          log_file="none")
        service = lb.service()
        service.startService()
        self.addCleanup(service.stopService)
        port = reactor.listenTCP(0, lb.site(), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        yield from self.check_table(port.getHost().port, fleet.sims[0])


class LeanTlsTests(TestCase):
    """The main port's server behind ``--listen ssl:``, to a client that offers ALPN."""

    timeout = 30

    @defer.inlineCallbacks
    def test_an_alpn_client_gets_http_1_1(self) -> Any:
        import ssl
        from pathlib import Path

        from twisted.internet import endpoints, reactor

        from ..processes import throwaway_certificate

        directory = Path(self.mktemp()).resolve()
        directory.mkdir(parents=True)
        key, cert = throwaway_certificate(directory)
        lb = LoadBalancer(["127.0.0.1:9"], reactor=reactor, log_file="none")
        port = yield endpoints.serverFromString(
            reactor, f"ssl:0:interface=127.0.0.1:privateKey={key}:certKey={cert}",
        ).listen(lb.main_factory())
        self.addCleanup(port.stopListening)

        def ask() -> tuple[str | None, bytes]:
            context = ssl.create_default_context(cafile=str(cert))
            context.set_alpn_protocols(["h2", "http/1.1"])  # as curl and httpx offer
            raw = socket.create_connection(("127.0.0.1", port.getHost().port), timeout=5)
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(b"GET /__lb_status HTTP/1.1\r\nHost: x\r\n"
                            b"Connection: close\r\n\r\n")
                received = b""
                while chunk := tls.recv(65536):
                    received += chunk
                return tls.selected_alpn_protocol(), received

        from txlb._compat import alpn_mutates_shared_context

        # where Twisted would set ALPN on the shared context per connection (25.5), the main
        # port names no protocol, and the client still gets its answer on HTTP/1.1
        agreed = None if alpn_mutates_shared_context() else "http/1.1"
        for _ in range(3):  # every connection, not only the first the context made
            protocol, answer = yield threads.deferToThread(ask)
            self.assertEqual(protocol, agreed)
            self.assertTrue(answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:100])
