"""
The in-memory proxy and failover suites of :mod:`tests.unit.test_proxy` and
:mod:`tests.unit.test_failover` (some also through the production upstream client, as
:mod:`tests.unit.test_proxy_wire` runs them), run again with the main port's lean server
(:mod:`txlb._server.lean`, what ``twistd llmlb`` listens with) in front of the proxy instead
of twisted.web's ``Site``: every behaviour a client sees is checked through both servers.
"""

from __future__ import annotations

import random
from typing import Any

from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock

from txlb import LoadBalancer

from ..helpers import FakeUpstream, keep_records
from ..wire import WireUpstream
from . import (
    test_exchange,
    test_failover,
    test_proxy,
    test_proxy_wire,
    test_resource,
    test_site,
)

#: Tests that build their own twisted.web ``Site`` and so have no lean form.
TWISTED_WEB_ONLY = {
    "test_mounted_below_a_prefix": "mounts the resource below a path of a twisted.web Site",
}


class LeanMixin:
    """:class:`tests.unit.test_proxy.ProxyTestCase`'s ``build``, behind the lean server."""

    def build(self, backends: list[str], **options: object) -> None:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.lb = LoadBalancer(backends, reactor=self.clock, agent=self.upstream,
                               probe_agent=FakeUpstream(), **options)  # type: ignore[arg-type]
        self.site = self.lb.main_factory()


class LeanWireMixin:
    """The same behind the lean server, through txlb's production upstream client."""

    def build(self, backends: list[str], **options: object) -> None:
        self.clock = MemoryReactorClock()
        self.upstream = WireUpstream(self.clock)  # type: ignore[assignment]
        self.lb = LoadBalancer(backends, reactor=self.clock, probe_agent=FakeUpstream(),
                               **options)  # type: ignore[arg-type]
        self.site = self.lb.main_factory()


class FailoverLeanMixin:
    """:class:`tests.unit.test_failover.FailoverTestCase`'s ``build``, behind the lean server."""

    def build(self, backends: list[str] | None = test_failover.THREE,
              **options: Any) -> None:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.probes = FakeUpstream()
        if options.get("config") is None:
            options.pop("config", None)
            options.setdefault("log_file", "none")
        self.lb = LoadBalancer(backends, reactor=self.clock, agent=self.upstream,
                               probe_agent=self.probes, rng=random.Random(11), **options)
        self.records: list[Any] = keep_records(self.lb)
        self.site = self.lb.main_factory()


class FailoverLeanWireMixin(test_proxy_wire.FailoverWireMixin):
    """The failover ``build`` over the wire, behind the lean server."""

    def build(self, backends: list[str] | None = test_failover.THREE,
              **options: Any) -> None:
        super().build(backends, **options)
        self.site = self.lb.main_factory()


def _lean(suite: type, mixin: type = LeanMixin, suffix: str = "Lean",
          skipped: dict[str, str] | None = None) -> type:
    cls = type(suite.__name__ + suffix, (mixin, suite), {
        "__doc__": f"{suite.__name__}, behind the lean main-port server.",
        "__module__": __name__,
    })
    for name, reason in {**TWISTED_WEB_ONLY, **(skipped or {})}.items():
        if hasattr(cls, name):
            setattr(cls, name, _skipped(reason))
    return cls


def _skipped(reason: str) -> object:
    def test(self: object) -> None:
        pass

    test.skip = reason  # type: ignore[attr-defined]
    return test


for _suite in (test_proxy.ForwardingTests, test_proxy.StreamingTests,
               test_proxy.DisconnectTests, test_proxy.ErrorTests, test_proxy.StatusTests,
               test_proxy.LeastConnectionsTests, test_proxy.EdgeCaseTests):
    globals()[_suite.__name__ + "Lean"] = _lean(_suite)
for _suite in (test_failover.RetryTests, test_failover.OutlierTests,
               test_failover.SlowStartTests, test_failover.RateLimitTests,
               test_failover.ClientLimitTests):
    globals()[_suite.__name__ + "Lean"] = _lean(_suite, FailoverLeanMixin)
# through the production upstream client: the backend's chunked framing passed through
for _suite in (test_proxy.ForwardingTests, test_proxy.StreamingTests,
               test_proxy.DisconnectTests, test_proxy.ErrorTests):
    globals()[_suite.__name__ + "LeanOverTheWire"] = _lean(
        _suite, LeanWireMixin, "LeanOverTheWire", test_proxy_wire.AGENT_ONLY)
# the main port's own channel rules and the resource's, behind the lean server
for _suite in (test_site.ChannelTests,
               test_resource.QueuedClientLeavesTests,
               test_resource.UserAffinityTests,
               test_resource.RefusedTargetTests,
               test_resource.ShutdownTimeoutTests,
               test_resource.ClassByModelTests):
    globals()[_suite.__name__ + "Lean"] = _lean(_suite, FailoverLeanMixin)
ChunkedPassThroughTestsLean = _lean(test_exchange.ChunkedPassThroughTests,
                                    FailoverLeanWireMixin)
del _suite
