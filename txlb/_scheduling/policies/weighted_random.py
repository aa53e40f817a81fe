"""``--policy random``: a random backend, in proportion to its weight."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from txlb._scheduling.policies import Policy, PolicyFactory
from txlb._scheduling.request import ANY_REQUEST, RoutingRequest

if TYPE_CHECKING:
    from txlb._cluster.backend import Backend


class WeightedRandom(Policy):
    """A random backend, with probability proportional to its weight."""

    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        weights = [b.effective_weight for b in candidates]
        return self._rng.choices(list(candidates), weights=weights)[0]


factory = PolicyFactory(
    WeightedRandom.name, lambda clock, rng: WeightedRandom(rng),
    "a random backend, in proportion to its weight", nginx="random;", rank=30)
