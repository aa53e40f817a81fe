"""
Session affinity by consistent hashing with bounded loads.

Requests of one session (same header value, or same ``user``) go to the same backend, so
its prefix cache (the conversation so far) is reused.  Plain hash affinity is known to pin
hot sessions onto one saturated engine; with *bounded loads* (Mirrokni, Thorup and
Zadimoghaddam, 2018; used by HAProxy's ``hash-balance-factor``) a backend already above
``(1 + epsilon)`` times the average in-flight share passes the session on to the next
backend on the ring, so no backend ever holds more than that bound.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

from txlb._cluster.backend import Backend

#: Points per backend on the ring: enough to spread keys evenly across a dozen backends.
VIRTUAL_NODES = 100


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


class BoundedLoadRing:
    """Maps a session key to a backend; rings are cached per candidate set."""

    def __init__(self, epsilon: float = 0.25) -> None:
        self.epsilon = epsilon
        self._rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}

    def _ring(self, candidates: Sequence[Backend]) -> tuple[list[int], list[str]]:
        keys = tuple(sorted(b.key for b in candidates))
        ring = self._rings.get(keys)
        if ring is None:
            points = sorted((_hash(f"{key}#{i}"), key)
                            for key in keys for i in range(VIRTUAL_NODES))
            ring = ([p for p, _ in points], [k for _, k in points])
            if len(self._rings) > 64:  # membership churn: keep the cache small
                self._rings.clear()
            self._rings[keys] = ring
        return ring

    def capacity(self, backend: Backend, candidates: Sequence[Backend]) -> int:
        """The most in-flight requests ``backend`` may hold before passing sessions on."""
        total_weight = sum(b.effective_weight for b in candidates)
        in_flight = sum(b.counts.active for b in candidates) + 1  # counting the new request
        share = in_flight * backend.effective_weight / total_weight
        return math.ceil((1 + self.epsilon) * share)

    def choose(self, session: str, candidates: Sequence[Backend]) -> Backend:
        """The session's backend: its home on the ring, or the next one with room."""
        points, owners = self._ring(candidates)
        by_key = {b.key: b for b in candidates}
        start = bisect.bisect(points, _hash(session)) % len(points)
        seen: set[str] = set()
        for offset in range(len(points)):
            key = owners[(start + offset) % len(points)]
            if key in seen:
                continue
            seen.add(key)
            backend = by_key[key]
            if backend.counts.active < self.capacity(backend, candidates):
                return backend
            if len(seen) == len(by_key):
                break
        # unreachable in practice (someone is always under ceil((1+e)*avg)); be safe
        return min(candidates, key=lambda b: b.counts.active / b.effective_weight)
