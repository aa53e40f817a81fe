"""
The in-memory proxy suites of :mod:`tests.unit.test_proxy`, run a second time through txlb's
production upstream client (:mod:`tests.wire`) instead of the fake ``IAgent``: each
behaviour is checked through both.
"""

from __future__ import annotations

import random
from typing import Any

from twisted.internet.testing import MemoryReactorClock
from twisted.web.server import Site

from txlb import LoadBalancer

from ..helpers import FakeUpstream, keep_records
from ..wire import WireUpstream
from . import test_failover, test_proxy

#: Tests that are about the ``agent=`` path only, so have no wire form.
AGENT_ONLY = {
    "test_agent_raising_synchronously_is_502":
        "an IAgent that raises from request() exists only on the agent= path",
    "test_already_failed_request_is_502":
        "replaces the IAgent's request(): the agent= path only",
    "test_reset_triggers_an_immediate_probe":
        "builds its own balancer with agent=; the reset itself is covered over the wire by "
        "ErrorTests",
    "test_retry_window_counts_from_the_first_try":
        "answers 'connection refused' to a request the real client sends on a pooled "
        "keep-alive connection, which no socket can do",
}


class WireMixin:
    """``build`` with the real upstream client on a MemoryReactorClock."""

    def build(self, backends: list[str], **options: object) -> None:
        self.clock = MemoryReactorClock()
        self.upstream = WireUpstream(self.clock)  # type: ignore[assignment]
        self.lb = LoadBalancer(backends, reactor=self.clock, probe_agent=FakeUpstream(),
                               **options)  # type: ignore[arg-type]
        self.site = Site(self.lb.resource(), reactor=self.clock)


class FailoverWireMixin:
    """:class:`tests.unit.test_failover.FailoverTestCase`'s ``build``, over the wire."""

    def build(self, backends: list[str] | None = test_failover.THREE,
              **options: Any) -> None:
        self.clock = MemoryReactorClock()
        self.upstream = WireUpstream(self.clock)
        self.probes = FakeUpstream()
        if options.get("config") is None:
            options.pop("config", None)
            options.setdefault("log_file", "none")
        self.lb = LoadBalancer(backends, reactor=self.clock, probe_agent=self.probes,
                               rng=random.Random(11), **options)
        self.records: list[Any] = keep_records(self.lb)
        self.site = self.lb.site()


def _over_the_wire(suite: type, mixin: type = WireMixin) -> type:
    cls = type(suite.__name__ + "OverTheWire", (mixin, suite), {
        "__doc__": f"{suite.__name__}, through the production upstream client.",
        "__module__": __name__,
    })
    for name, reason in AGENT_ONLY.items():
        if hasattr(cls, name):
            setattr(cls, name, _skipped(getattr(cls, name), reason))
    return cls


def _skipped(method: object, reason: str) -> object:
    def test(self: object) -> None:
        pass

    test.skip = reason  # type: ignore[attr-defined]
    return test


for _suite in (test_proxy.ForwardingTests, test_proxy.StreamingTests,
               test_proxy.DisconnectTests, test_proxy.ErrorTests, test_proxy.StatusTests,
               test_proxy.LeastConnectionsTests, test_proxy.EdgeCaseTests):
    globals()[_suite.__name__ + "OverTheWire"] = _over_the_wire(_suite)
for _suite in (test_failover.RetryTests, test_failover.OutlierTests,
               test_failover.SlowStartTests, test_failover.RateLimitTests,
               test_failover.ClientLimitTests):
    globals()[_suite.__name__ + "OverTheWire"] = _over_the_wire(_suite, FailoverWireMixin)
del _suite
