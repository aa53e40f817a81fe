"""``--policy round-robin``: nginx's smooth weighted round-robin."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from txlb._scheduling.policies import Policy, PolicyFactory
from txlb._scheduling.policies._ties import WeightedTies
from txlb._scheduling.request import ANY_REQUEST, RoutingRequest

if TYPE_CHECKING:
    from txlb._cluster.backend import Backend


class SmoothWeightedRoundRobin(Policy):
    """
    nginx's smooth weighted round-robin: weights 5,1,1 give a,a,b,a,c,a,a.

    Each choice adds every candidate's weight to its running score, picks the highest and
    subtracts the total from the winner, which interleaves the heavy backend with the
    light ones instead of sending it five in a row.
    """

    name = "round-robin"

    def __init__(self) -> None:
        self._order = WeightedTies()

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        return self._order.pick(candidates)


factory = PolicyFactory(
    SmoothWeightedRoundRobin.name, lambda clock, rng: SmoothWeightedRoundRobin(),
    "each backend in turn, as often as its weight",
    nginx="# round-robin: nginx's default (smooth weighted round-robin)", rank=20)
