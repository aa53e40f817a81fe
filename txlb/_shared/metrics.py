"""The shared state's metrics, read at scrape time from the store."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from txlb._shared.link import RedisLink


class ReportedStore(Protocol):
    """
    What the metrics read of their store (:class:`~txlb._shared.store.RedisStore`, which
    builds the collector: named here, so this module need not import it).
    """

    link: RedisLink
    replicas: int

    def unshared(self) -> int: ...


class SharedStateCollector:
    """``txlb_shared_state_up``, ``..._fallbacks_total``, ``..._replicas`` and more."""

    def __init__(self, store: ReportedStore) -> None:
        self.store = store

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        store = self.store
        yield GaugeMetricFamily(
            "txlb_shared_state_up",
            "1 while the --shared-state Redis answers, 0 while this replica uses its "
            "local view.", value=1 if store.link.connected else 0)
        yield CounterMetricFamily(
            "txlb_shared_state_fallbacks",
            "Times this replica fell back to its local view (Redis slow or gone).",
            value=store.link.fallbacks)
        yield GaugeMetricFamily(
            "txlb_shared_state_replicas",
            "Live replicas sharing the state, this one included, as last polled.",
            value=store.replicas)
        yield CounterMetricFamily(
            "txlb_shared_state_unshared",
            "Rate-limit takes and token-budget moves the shared buckets did not count "
            "(Redis slow or gone).",
            value=store.unshared())
