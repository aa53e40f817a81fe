"""
A policy that raises never fails a request: the router logs it and falls back to
least-conn, for the first choice, a queued request's dispatch and a retry alike.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.server import Site

from txlb import LoadBalancer, Policy, RoutingRequest
from txlb._cluster.backend import Backend
from txlb._config import build_config
from txlb._scheduling.request import ANY_REQUEST

from ..helpers import ClientConnection, FakeResponse, FakeUpstream


class Broken(Policy):
    """Raises on every choice after the first ``good`` (a bug, or a body it chokes on)."""

    name = "broken"

    def __init__(self, good: int = 0) -> None:
        self.good = good
        self.calls = 0

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        self.calls += 1
        if self.calls > self.good:
            raise RuntimeError("the policy broke")
        return candidates[0]


class RaisingPolicyTests(SynchronousTestCase):
    def build(self, policy: Policy, config: str) -> None:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write(config)
        self.lb = LoadBalancer(config=build_config({"config": path, "log_file": "none"}, {}),
                               reactor=self.clock, agent=self.upstream,
                               probe_agent=FakeUpstream(), rng=random.Random(5),
                               policy=policy)
        self.site = Site(self.lb.resource(), reactor=self.clock)

    def post(self, n: int) -> ClientConnection:
        client = ClientConnection(self.site)
        client.request(b"POST", b"/v1/chat/completions",
                       body=json.dumps({"model": "m", "n": n}).encode())
        return client

    def test_the_first_choice_falls_back_to_least_conn(self) -> None:
        self.build(Broken(), '[[backends]]\nurl = "127.0.0.1:8002"\n'
                             '[[backends]]\nurl = "127.0.0.1:8003"\n')
        self.post(0)
        self.post(1)
        self.assertEqual(len(self.upstream.calls), 2)
        ports = sorted(call.uri.split(b"/")[2] for call in self.upstream.calls)
        self.assertEqual(ports, [b"127.0.0.1:8002", b"127.0.0.1:8003"])  # least-conn
        # one traceback for a burst of failures, not one per request
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.clock.advance(60)
        self.post(2)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual(len(self.upstream.calls), 3)

    def test_a_queued_request_is_still_dispatched(self) -> None:
        # (before: the release's dispatch raised, the waiter stayed queued until its 503)
        self.build(Broken(good=1), 'queue-timeout = 5\n'
                                   '[[backends]]\nurl = "127.0.0.1:8002"\nmax_conns = 1\n')
        first = self.post(0)
        second = self.post(1)  # queued: the only slot is taken
        self.assertEqual(len(self.upstream.calls), 1)
        self.upstream.calls[0].respond(FakeResponse(200, length=0)).end()
        self.assertEqual(first.response().status, 200)
        # the slot freed: the waiter is dispatched although the policy raised
        self.assertEqual(len(self.upstream.calls), 2)
        self.upstream.calls[1].respond(FakeResponse(200, length=0)).end()
        self.assertEqual(second.response().status, 200)
        self.assertEqual(self.lb.pool.get("127.0.0.1:8002").counts.active, 0)
        self.flushLoggedErrors(RuntimeError)
