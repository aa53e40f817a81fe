"""
Per-request warnings in the service log: one line per kind a minute, then a summary.

A backend killed with many streams in flight is one event, not a line per stream, and a
client opening connections it never completes must not write a line per connection.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import error as neterror
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.web.client import ResponseFailed

from ..helpers import FakeResponse
from .test_failover import FailoverTestCase


class RepeatedWarningTests(FailoverTestCase):
    def lines(self, text: str) -> list[str]:
        return [line for line in (formatEvent(e) for e in self.events) if text in line]

    def setUp(self) -> None:
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def test_a_flood_of_slow_heads_is_one_line_then_a_summary(self) -> None:
        self.build(header_timeout=10)
        clients = [self.client(peer=f"10.9.0.{n}") for n in range(50)]
        for client in clients:
            client.send(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never finished
        self.clock.advance(11)
        self.assertTrue(all(c.transport.value().startswith(b"HTTP/1.1 408 ") for c in clients))
        [line] = self.lines("sent no complete request head")
        self.assertIn("client 10.9.0.0:40000 sent no", line)  # in words, not an address repr
        for client in clients:
            client.disconnect()  # the 408s closed them
        self.clock.advance(60)
        [first, summary] = self.lines("sent no complete request head")
        self.assertIn("49 more like this in the last 60s", summary)

    def test_a_backend_killed_mid_stream_is_one_line_per_backend(self) -> None:
        self.build()
        clients = [self.client(peer=f"10.9.1.{n}") for n in range(9)]
        for client in clients:
            client.request(b"GET", b"/stream")
        for call in self.upstream.calls:
            response = call.respond(FakeResponse(200))
            response.send(b"partial")
            response.end(Failure(ResponseFailed([Failure(neterror.ConnectionDone())])))
        lines = self.lines("stopped part-way")
        backends = {call.uri.split(b"/")[2] for call in self.upstream.calls}
        self.assertEqual(len(lines), len(backends), lines)  # one per backend, not per stream
        self.clock.advance(60)
        self.assertEqual(sum("more like this" in line
                             for line in self.lines("stopped part-way")), len(backends))


class FlushTests(FailoverTestCase):
    def test_stopping_writes_the_open_summaries_and_leaves_no_timer(self) -> None:
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        self.build(header_timeout=10)
        service = self.lb.service(health_checks=False)
        service.startService()
        clients = [self.client(peer=f"10.9.2.{n}") for n in range(3)]
        for client in clients:
            client.send(b"GET / HTTP/1.1\r\n")
        self.clock.advance(11)
        for client in clients:
            client.disconnect()
        stopped = service.stopService()
        self.clock.advance(0)  # the release runs on the next turn
        self.successResultOf(stopped)
        lines = [formatEvent(e) for e in events]
        self.assertTrue(any("2 more like this" in line for line in lines), lines)
        self.assertEqual([c for c in self.clock.getDelayedCalls()
                          if "RepeatSummary" in repr(c)], [])
