"""Failures reach the service log in words, never as Python reprs."""

from __future__ import annotations

from typing import Any

from twisted.internet import defer
from twisted.internet import error as neterror
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import RequestTransmissionFailed, ResponseFailed, ResponseNeverReceived

from txlb._http.words import describe_failure

from ..helpers import FakeResponse
from .test_proxy import ProxyTestCase


class DescribeFailureTests(SynchronousTestCase):
    def test_wrappers_are_unwrapped_and_named(self) -> None:
        cases = [
            (ResponseFailed([Failure(neterror.ConnectionDone())]),
             "the backend closed the connection"),
            (ResponseNeverReceived([Failure(neterror.ConnectionLost())]),
             "the connection to the backend was lost or reset"),
            (RequestTransmissionFailed([Failure(neterror.ConnectionRefusedError())]),
             "connection refused (nothing listens on that port)"),
            (defer.TimeoutError(), "timed out"),
            (neterror.DNSLookupError("gpu-9"), "the host name does not resolve"),
            (ValueError("no 'data' list"), "no 'data' list"),
        ]
        for error, words in cases:
            self.assertEqual(describe_failure(Failure(error)), words)

    def test_never_a_repr(self) -> None:
        for error in [ResponseFailed([]), ResponseFailed(["<odd>"]), RuntimeError()]:
            words = describe_failure(Failure(error))
            self.assertNotIn("<", words)
            self.assertTrue(words)


class ProxyLogWordsTests(ProxyTestCase):
    def test_backend_killed_mid_response(self) -> None:
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        client = self.client()
        client.request(b"GET", b"/stream")
        response = self.upstream.last.respond(FakeResponse(200))
        response.send(b"partial")
        response.end(Failure(ResponseFailed([Failure(neterror.ConnectionDone())])))
        lines = [formatEvent(e) for e in events if e.get("log_namespace") == "txlb._proxy.resource"]
        self.assertEqual(len(lines), 1, lines)
        self.assertIn("stopped part-way through a response (the backend closed the "
                      "connection); the client got a truncated response", lines[0])
        self.assertNotIn("<", lines[0])
        self.assertNotIn("cleanly", lines[0])
