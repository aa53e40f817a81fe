"""
Weighted tie-breaking, shared by the built-in policies: among equally good backends, each
gets its weight's share of the choices, in a smooth order (nginx's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from txlb._cluster.backend import Backend


class WeightedTies:
    """
    Breaks ties between equally good backends by smooth weighted round-robin, as nginx's
    ``least_conn`` does.  On an idle fleet of equal weights that is plain rotation (a
    sequence of short requests visits every GPU, not the first one each time); with
    weights -- including a weight still ramping up after recovery (slow start) -- each
    backend gets its weight's share of the ties.
    """

    def __init__(self) -> None:
        self._current: dict[str, float] = {}

    def pick(self, tied: Sequence[Backend]) -> Backend:
        if len(tied) == 1:
            return tied[0]
        total = 0.0
        best: Backend | None = None
        for backend in tied:
            weight = backend.effective_weight
            current = self._current.get(backend.key, 0.0) + weight
            self._current[backend.key] = current
            total += weight
            if best is None or current > self._current[best.key]:
                best = backend
        assert best is not None
        self._current[best.key] -= total
        return best

    def best(self, candidates: Sequence[Backend],
             score: Callable[[Backend], float]) -> Backend:
        scores = [score(b) for b in candidates]
        lowest = min(scores)
        return self.pick([b for b, s in zip(candidates, scores, strict=True)
                          if s <= lowest * (1 + 1e-9) + 1e-12])
