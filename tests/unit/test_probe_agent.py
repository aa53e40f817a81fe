"""
The health prober's connections: a backend given as an IP address is connected to at once,
never through the name resolver.

Twisted's ``Agent`` resolves every host, an IP literal included, with ``getaddrinfo`` in
the reactor's thread pool (10 threads).  Backends added by name whose lookups are slow (a
DNS server dropping a burst, a name that times out) then held every thread, and the probes
of the IP-literal backends queued behind them past ``--health-timeout``: the whole fleet was
marked down ("the host name does not resolve") for a minute after 300 names were added
through the admin API.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorPluggableNameResolver
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from txlb import build_config
from txlb._balancer import LoadBalancer


class _SilentResolver:
    """A name resolver that records what it is asked and never answers (a stuck DNS)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def resolveHostName(self, receiver: Any, hostName: str, portNumber: int = 0,
                        addressTypes: Any = None, transportSemantics: str = "TCP") -> Any:
        self.asked.append(hostName)
        receiver.resolutionBegan(Deferred())
        return receiver


@implementer(IReactorPluggableNameResolver)
class _Reactor(MemoryReactorClock):
    def __init__(self) -> None:
        super().__init__()
        self.nameResolver = _SilentResolver()

    def installNameResolver(self, resolver: Any) -> Any:  # pragma: no cover - unused
        previous, self.nameResolver = self.nameResolver, resolver
        return previous


class ProbeConnectionTests(SynchronousTestCase):
    def balancer(self, backends: str) -> tuple[LoadBalancer, _Reactor]:
        reactor = _Reactor()
        config = build_config({"backends": backends, "log-file": "none", "admin": "none"}, {})
        return LoadBalancer(config=config, reactor=reactor), reactor

    def test_ip_literal_backends_are_not_resolved(self) -> None:
        lb, reactor = self.balancer("127.0.0.1:8002,[::1]:8003")
        for backend in lb.pool:
            lb.health.probe(backend)
        self.assertEqual(reactor.nameResolver.asked, [])
        self.assertEqual(sorted((host, port) for host, port, *_ in reactor.tcpClients),
                         [("127.0.0.1", 8002), ("::1", 8003)])

    def test_names_still_go_to_the_resolver(self) -> None:
        lb, reactor = self.balancer("gpu1.example.internal:8002")
        for backend in lb.pool:
            lb.health.probe(backend)
        self.assertEqual(reactor.nameResolver.asked, ["gpu1.example.internal"])
