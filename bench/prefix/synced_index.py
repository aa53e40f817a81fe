"""
A cache-aware index shared between replicas the way a store would share it cheaply: one
index for the fleet, every replica's sends and lessons written to it at once (pipelined),
and each replica's lookups made on a local copy refreshed every ``R`` seconds -- instead
of a store round trip per lookup.

:class:`SharedIndex` is the fleet's index (a :class:`~txlb._scheduling.prefix_index.
FleetIndex` that also remembers when, and by which replica, each block was first listed).
Each replica's :class:`~txlb._scheduling.policies.cache_aware.CacheAware` gets a
:class:`StaleView` of it as its ``index``: the view writes through, and its :meth:`match
<StaleView.match>` ignores the blocks other replicas listed since the view's last refresh
-- what a copy refreshed at that moment would lack.  (Evictions reach the views at once:
a real copy would still list evicted blocks until its refresh, a slightly optimistic
difference the refresh interval's own figures bound.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from twisted.internet.interfaces import IReactorTime

from txlb._cluster.backend import Backend
from txlb._scheduling.prefix_index import BackendIndex, FleetIndex


class SharedIndex(FleetIndex):
    """The fleet's one index, plus when and by whom each listed block was first sent."""

    def __init__(self, clock: IReactorTime, max_entries: int, capacity: int) -> None:
        super().__init__(max_entries, capacity)
        self.clock = clock
        #: (backend key, block) -> (time first listed, replica that listed it)
        self.listed: dict[tuple[str, int], tuple[float, int]] = {}

    def sent_by(self, replica: int, backend: Backend, chain: Sequence[int]) -> None:
        index = self.get(backend)
        before = index.entries if index is not None else {}
        now = self.clock.seconds()
        for block in chain:
            if block not in before:
                self.listed[(backend.key, block)] = (now, replica)
        super().sent(backend, chain)


class StaleView:
    """
    One replica's view of the :class:`SharedIndex`: writes go through at once, lookups
    see the other replicas' sends only up to the last :meth:`refresh`.
    """

    def __init__(self, shared: SharedIndex, replica: int) -> None:
        self.shared = shared
        self.replica = replica
        self.refreshed_at = shared.clock.seconds()
        self.max_entries = shared.max_entries
        self.default_capacity = shared.default_capacity

    def refresh(self) -> None:
        """The copy is read again: everything listed until now becomes visible."""
        self.refreshed_at = self.shared.clock.seconds()

    def match(self, backend: Backend, chain: Sequence[int]) -> int:
        full = self.shared.match(backend, chain)
        listed = self.shared.listed
        key = backend.key
        for matched, block in enumerate(chain[:full]):
            first = listed.get((key, block))
            if first is not None and first[1] != self.replica and first[0] > self.refreshed_at:
                return matched
        return full

    def sent(self, backend: Backend, chain: Sequence[int]) -> None:
        self.shared.sent_by(self.replica, backend, chain)

    def get(self, backend: Backend) -> BackendIndex | None:
        return self.shared.get(backend)

    def of(self, backend: Backend) -> BackendIndex:
        return self.shared.of(backend)

    def withdraw(self, index: BackendIndex, blocks: Iterable[int], tokens: float) -> None:
        self.shared.withdraw(index, blocks, tokens)

    @property
    def entries(self) -> int:
        return self.shared.entries

    def indexes(self) -> Iterable[BackendIndex]:
        return self.shared.indexes()
