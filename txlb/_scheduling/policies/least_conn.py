"""``--policy least-conn`` (the default): fewest in-flight requests per unit of weight."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from txlb._scheduling.policies import Policy, PolicyFactory
from txlb._scheduling.policies._ties import WeightedTies
from txlb._scheduling.request import ANY_REQUEST, RoutingRequest

if TYPE_CHECKING:
    from txlb._cluster.backend import Backend


def load(backend: Backend) -> float:
    """In-flight requests per unit of weight: the quantity least-connections minimises."""
    return backend.counts.active / backend.effective_weight


class LeastConnections(Policy):
    """Fewest in-flight requests per unit of weight; ties by smooth weighted round-robin."""

    name = "least-conn"

    def __init__(self) -> None:
        self._ties = WeightedTies()

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        return self._ties.best(candidates, load)


factory = PolicyFactory(
    LeastConnections.name, lambda clock, rng: LeastConnections(),
    "fewest in-flight requests per unit of weight (the default)", nginx="least_conn;", rank=10)
