"""``--policy p2c``: the power of two choices."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from txlb._scheduling.policies import Policy, PolicyFactory
from txlb._scheduling.policies.least_conn import load
from txlb._scheduling.request import ANY_REQUEST, RoutingRequest

if TYPE_CHECKING:
    from txlb._cluster.backend import Backend


class PowerOfTwoChoices(Policy):
    """
    Two backends drawn at random (by weight), the less loaded of the two wins.

    Nearly as good as least-connections at spreading load, without every balancer
    replica stampeding to the same "least loaded" backend at once.
    """

    name = "p2c"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        if len(candidates) == 1:
            return candidates[0]
        pool = list(candidates)
        weights = [b.effective_weight for b in pool]
        first = self._rng.choices(pool, weights=weights)[0]
        index = pool.index(first)
        del pool[index], weights[index]
        second = self._rng.choices(pool, weights=weights)[0]
        return first if load(first) <= load(second) else second


factory = PolicyFactory(
    PowerOfTwoChoices.name, lambda clock, rng: PowerOfTwoChoices(rng),
    "the less loaded of two backends drawn by weight", nginx="random two least_conn;", rank=40)
