"""
The metrics of ``--auth keys``: requests and tokens by tenant, and the requests refused for
their key.

Counted from each finished request's summary -- which carries its tenant's name, never its
key -- so under ``--workers`` the supervisor, where every worker's summaries arrive, counts
the fleet's.  Read at scrape time from plain dicts: counting is a dict increment, with no
metrics lock.  The tenants are the keys file's (at most
:data:`~txlb._config.keys.MAX_TENANTS`), so the label sets stay bounded.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from txlb._records.summary import Summary


class TenantCounts(Collector):
    """Requests by tenant and status class, tokens by tenant and kind, and 401s."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}
        self.tokens: dict[tuple[str, str], int] = {}
        #: requests txlb refused itself with 401 (no key, a wrong or malformed one)
        self.refused = 0

    def observe(self, summary: Summary) -> None:
        """Count one finished request."""
        tenant = summary.tenant
        if tenant is None:
            if summary.status == 401 and summary.outcome == "proxy_error":
                self.refused += 1
            return
        key = (tenant, f"{summary.status // 100}xx")
        self.requests[key] = self.requests.get(key, 0) + 1
        for kind, count in (("prompt", summary.prompt_tokens),
                            ("completion", summary.completion_tokens)):
            if count:
                self.tokens[(tenant, kind)] = self.tokens.get((tenant, kind), 0) + count

    def collect(self) -> Iterable[Metric]:
        requests = CounterMetricFamily(
            "txlb_tenant_requests", "Finished requests by tenant (--auth keys) and status "
            "class.", labels=["tenant", "status_class"])
        tokens = CounterMetricFamily(
            "txlb_tenant_tokens", "Tokens the engines reported (usage) by tenant, prompt "
            "and completion.", labels=["tenant", "kind"])
        refused = CounterMetricFamily(
            "txlb_auth_refused", "Requests refused with 401: no API key, or one the keys "
            "file does not have.")
        for (tenant, status), count in sorted(self.requests.items()):
            requests.add_metric([tenant, status], count)
        for (tenant, kind), count in sorted(self.tokens.items()):
            tokens.add_metric([tenant, kind], count)
        refused.add_metric([], self.refused)
        return [requests, tokens, refused]
