"""
IPv6 backends for real, on ``[::1]``: probed and proxied like any other, and one backend the
prober cannot handle never stops the probes of the rest.

Skipped with NOT RUN on a machine whose loopback has no IPv6.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.interfaces import IListeningPort
from twisted.trial.unittest import TestCase
from twisted.web.server import Site

from txlb import LoadBalancer
from txlb.testing import SimulatedVLLM, listen_simulated

from ..parts import missing
from ..processes import Client, chat_body, header, wait_until

JSON = {b"content-type": [b"application/json"]}


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


class IPv6BackendTests(TestCase):
    timeout = 60

    def setUp(self) -> None:
        if not _has_ipv6_loopback():
            missing("ipv6", "this machine's loopback has no IPv6 (::1)")
        self.v4 = SimulatedVLLM(reactor)
        self.v6 = SimulatedVLLM(reactor)
        v4_port = self.listen(self.v4, "127.0.0.1")
        self.v6_port = self.listen(self.v6, "::1")
        self.v4_key = f"127.0.0.1:{v4_port.getHost().port}"
        self.v6_key = f"[::1]:{self.v6_port.getHost().port}"

    def listen(self, sim: SimulatedVLLM, interface: str, port: int = 0) -> IListeningPort:
        listening = listen_simulated(reactor, sim, port=port, interface=interface)
        self.addCleanup(listening.stopListening)
        return listening

    def start(self, **options: Any) -> str:
        self.lb = LoadBalancer([self.v4_key, self.v6_key], reactor=reactor,
                               log_file="none", health_interval=0.2, **options)
        service = self.lb.service()
        service.startService()
        self.addCleanup(service.stopService)
        port = reactor.listenTCP(0, Site(self.lb.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)
        return f"http://127.0.0.1:{port.getHost().port}"

    def backend(self, key: str) -> Any:
        found = self.lb.pool.get(key)
        assert found is not None
        return found

    def probes_of(self, sim: SimulatedVLLM) -> int:
        return sum(1 for r in sim.requests if r.path == b"/health")

    @defer.inlineCallbacks
    def test_ipv6_backend_is_probed_learned_and_proxied(self) -> Any:
        url = self.start()
        yield defer.ensureDeferred(wait_until(
            lambda: self.probes_of(self.v6) >= 2 and self.probes_of(self.v4) >= 2,
            what="two probes of each backend"))
        v6 = self.backend(self.v6_key)
        self.assertTrue(v6.health.healthy)
        self.assertIsNone(v6.health.last_probe_error)
        yield defer.ensureDeferred(wait_until(lambda: v6.listing.names is not None,
                                              what="the IPv6 backend's models learned"))
        self.assertEqual(v6.listing.names, ("sim-model",))
        # drain the IPv4 one: every request must now reach [::1]
        self.lb.pool.drain(self.backend(self.v4_key))
        for _ in range(3):
            response, chunks = yield defer.ensureDeferred(self.client.fetch(
                url + "/v1/chat/completions", b"POST", chat_body(stream=False), JSON))
            self.assertEqual(response.code, 200)
            self.assertEqual(header(response, b"x-backend"), self.v6_key)
            self.assertEqual(json.loads(chunks.body)["object"], "chat.completion")
        received = [r for r in self.v6.requests if r.path == b"/v1/chat/completions"]
        self.assertEqual(len(received), 3)
        self.assertEqual(received[0].header(b"host"), [self.v6_key.encode()])

    @defer.inlineCallbacks
    def test_ipv6_backend_that_dies_and_returns_is_seen_both_times(self) -> Any:
        """The probe loop keeps running: a dead [::1] backend goes down and comes back."""
        self.start()
        v6 = self.backend(self.v6_key)
        yield defer.ensureDeferred(wait_until(lambda: self.probes_of(self.v6) >= 1,
                                              what="a first probe of [::1]"))
        port_number = self.v6_port.getHost().port
        yield self.v6_port.stopListening()
        yield defer.ensureDeferred(wait_until(lambda: not v6.health.healthy,
                                              what="the stopped [::1] backend marked down"))
        revived = SimulatedVLLM(reactor)
        self.listen(revived, "::1", port=port_number)
        yield defer.ensureDeferred(wait_until(lambda: v6.health.healthy,
                                              what="the restarted [::1] backend marked up"))
        self.assertTrue(self.backend(self.v4_key).health.healthy)
        self.assertTrue(self.lb.health._loop is not None and self.lb.health._loop.running)
