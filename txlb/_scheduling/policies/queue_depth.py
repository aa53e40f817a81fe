"""``--policy queue-depth``: fewest requests in the engine itself, by its own metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from txlb._scheduling.policies import Policy, PolicyFactory
from txlb._scheduling.policies._ties import WeightedTies
from txlb._scheduling.request import ANY_REQUEST, RoutingRequest

if TYPE_CHECKING:
    from txlb._cluster.backend import Backend


class QueueDepth(Policy):
    """
    Fewest requests in the engine itself: its own ``vllm:num_requests_running`` +
    ``vllm:num_requests_waiting`` (scraped from ``/metrics`` with each health probe), plus
    the requests this balancer sent since that scrape, minus those of its requests that
    ended since (without the minus, a busy balancer over-counts between scrapes and its
    tail latency suffers near saturation -- measured by ``bench/policies.py``).

    Because the engine's counts include every balancer's requests, several replicas in
    front of one fleet see the same load -- which local in-flight counts cannot give them.
    A backend not scraped yet counts its local in-flight requests instead.
    """

    name = "queue-depth"
    #: the health checker scrapes each engine's queue for this policy alone
    needs_engine_metrics = True

    def __init__(self) -> None:
        self._ties = WeightedTies()

    @staticmethod
    def depth(backend: Backend) -> float:
        if backend.engine.depth is None:
            return backend.counts.active / backend.effective_weight
        local = backend.counts.started_since_scrape - backend.counts.finished_since_scrape
        return max(0.0, backend.engine.depth + local) / backend.effective_weight

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        return self._ties.best(candidates, self.depth)


factory = PolicyFactory(
    QueueDepth.name, lambda clock, rng: QueueDepth(),
    "fewest requests queued and running in the engine (scraped from its /metrics)", rank=60)
