"""
Hostile input against the main port's lean server (:mod:`txlb._server.lean`), as properties:
however a client splits its bytes across reads, valid pipelined requests get exactly the
answers they get in one read; and whatever bytes arrive -- garbage, or valid requests with
bytes flipped, cut or spliced in -- the server never raises, never renders a request twice,
answers each request it rendered exactly once, and after a refusal answers nothing more.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase

from txlb._server.lean import LeanSite

from ..integration.test_framing import split_responses

VALID = (
    b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /b?q=1 HTTP/1.1\r\nHost: x\r\nX-A: one\r\nX-A: two\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 14\r\n\r\n{\"model\": \"m\"}",
    b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\nT: v\r\n\r\n",
    b"HEAD /d HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    b"GET /f HTTP/1.1\r\nHost: [::1]:80\r\nConnection: keep-alive\r\n\r\n",
)


class _Echo:
    """Answers at once with what it was asked: method, target and body."""

    def __init__(self) -> None:
        self.rendered: list[Any] = []

    def render(self, request: Any) -> bytes:
        if any(seen is request for seen in self.rendered):
            raise AssertionError("rendered twice")
        self.rendered.append(request)
        request.content.seek(0)
        body = b"%s %s %s" % (request.method, request.uri, request.content.read())
        if request.method != b"HEAD":  # (its length would describe a body never sent)
            request.setHeader(b"content-length", b"%d" % len(body))
        return body


def _serve(chunks: list[bytes]) -> tuple[bytes, _Echo, StringTransport]:
    resource = _Echo()
    site = LeanSite(resource, max_body=4096, header_timeout=5,  # type: ignore[arg-type]
                    reactor=Clock())
    peer = IPv4Address("TCP", "10.0.0.1", 4000)
    transport = StringTransport(peerAddress=peer)
    channel = site.buildProtocol(peer)
    channel.makeConnection(transport)
    for chunk in chunks:
        channel.dataReceived(chunk)
    return transport.value(), resource, transport


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


_settings = settings(max_examples=150, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


class SplitTests(SynchronousTestCase):
    @_settings
    @given(st.lists(st.sampled_from(VALID), min_size=1, max_size=5),
           st.lists(st.integers(min_value=0), max_size=12))
    def test_any_split_answers_as_one_read(self, requests: list[bytes],
                                           cuts: list[int]) -> None:
        data = b"".join(requests)
        whole, whole_seen, _ = _serve([data])
        split, split_seen, transport = _serve(_split(data, cuts))
        self.assertEqual(split, whole)
        self.assertEqual(len(split_seen.rendered), len(requests))
        self.assertFalse(transport.disconnecting)
        responses, rest = split_responses(split)
        self.assertEqual((len(responses), rest), (len(requests), b""))


_mutations = st.one_of(
    st.tuples(st.just("flip"), st.integers(min_value=0), st.integers(0, 255)),
    st.tuples(st.just("cut"), st.integers(min_value=0), st.integers(0, 64)),
    st.tuples(st.just("splice"), st.integers(min_value=0), st.binary(max_size=24)),
)


def _mutate(data: bytes, mutation: tuple[str, int, Any]) -> bytes:
    kind, where, what = mutation
    at = where % (len(data) + 1)
    if kind == "flip":
        return data[:at] + bytes([what]) + data[at + 1:]
    if kind == "cut":
        return data[:at] + data[at + what:]
    return data[:at] + what + data[at:]


class HostileInputTests(SynchronousTestCase):
    def check(self, chunks: list[bytes]) -> None:
        raw, seen, transport = _serve(chunks)  # raising fails the test
        responses, _ = split_responses(raw)
        refusals = [status for status, headers, _ in responses
                    if headers.get(b"connection") == b"close" and status >= 400]
        self.assertLessEqual(len(refusals), 1)
        # every rendered request answered once, plus at most one refusal at the end
        self.assertLessEqual(len(responses), len(seen.rendered) + 1)
        self.assertGreaterEqual(len(responses), len(seen.rendered)
                                - (1 if not transport.disconnecting else 0))
        if refusals:
            self.assertEqual(responses[-1][0], refusals[0])
            self.assertTrue(transport.disconnecting)

    @_settings
    @given(st.binary(max_size=600), st.lists(st.integers(min_value=0), max_size=8))
    def test_garbage(self, data: bytes, cuts: list[int]) -> None:
        self.check(_split(data, cuts))

    @_settings
    @given(st.lists(st.sampled_from(VALID), min_size=1, max_size=4),
           st.lists(_mutations, min_size=1, max_size=4),
           st.lists(st.integers(min_value=0), max_size=8))
    def test_damaged_requests(self, requests: list[bytes],
                              mutations: list[tuple[str, int, Any]],
                              cuts: list[int]) -> None:
        data = b"".join(requests)
        for mutation in mutations:
            data = _mutate(data, mutation)
        self.check(_split(data, cuts))
