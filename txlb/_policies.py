"""
Selection policies: given the backends eligible for a request, pick one.

A policy only chooses; it never changes backend state.  The caller takes the in-flight slot
(:meth:`txlb._backend.Pool.acquire`) immediately after ``choose`` returns, in the same
synchronous step, which is what keeps a burst of simultaneous requests spread out.
"""

from __future__ import annotations

from collections.abc import Sequence

from zope.interface import Interface, implementer

from ._backend import Backend


class IPolicy(Interface):
    """Chooses one backend among eligible candidates."""

    def choose(candidates: Sequence[Backend]) -> Backend:
        """
        Return one of ``candidates`` (never empty, in pool order).
        """


@implementer(IPolicy)
class LeastConnections:
    """
    Fewest in-flight requests per unit of weight; ties are broken round-robin.

    The round-robin among ties matters for idle fleets: with every backend at zero, a
    policy that always took the first would send a sequence of short requests to one GPU.
    The rotation cursor remembers the last backend chosen (by key, so membership changes
    do not shift it) and ties go to the first tied backend after it in pool order.
    """

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, candidates: Sequence[Backend]) -> Backend:
        lowest = min(b.active / b.weight for b in candidates)
        tied = [b for b in candidates if b.active / b.weight == lowest]
        chosen = tied[0]
        if self._last is not None:
            keys = [b.key for b in candidates]
            start = keys.index(self._last) + 1 if self._last in keys else 0
            # the first tied backend at or after the cursor, wrapping around
            ordered = [*candidates[start:], *candidates[:start]]
            tied_keys = {b.key for b in tied}
            chosen = next(b for b in ordered if b.key in tied_keys)
        self._last = chosen.key
        return chosen
