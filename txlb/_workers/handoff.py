"""
The fair handoff of ``--workers``: a freed slot goes to the least served tenant waiting in
*any* worker, not only in the one whose slot it is.

Each worker publishes, in its row of the shared in-flight table, which tenants wait in its
highest class that has waiters (a bitmap of their numbers: the keys file's tenants in name
order, the same in every worker, which all run one config).  Before a waiter takes a free
slot, its worker looks at the other workers' bitmaps: if one of them holds a tenant of the
same class whose counter is lower than the waiter's tenant's (the counters are the same in
every worker: :class:`~txlb._workers.wire.Served`), the slot is left to that worker, which
the supervisor has kicked (:mod:`txlb._scheduling.handoff` has the grace that keeps a slot
from being lost).  A tenant that starts to wait is lifted to the lowest counter waiting in
any worker, the other workers' waiters read the same way.  The classes' precedence stays
each worker's own, as does a request that arrives to a free slot: it takes it.  Tenants
past the first :data:`~txlb._cluster.shared_counts.FAIR_TENANTS` of the keys file are
served by their own worker's order only.
"""

from __future__ import annotations

from collections.abc import Iterator

from txlb._cluster.shared_counts import FAIR_TENANTS, SharedCounts
from txlb._config.config import Config
from txlb._scheduling.classes import PriorityClasses, QueueClass
from txlb._scheduling.fairness import FairShares

#: Counters closer than this are a tie: the waiter keeps the slot (no handoff for nothing)
TIE = 1e-6


class FairHandoff:
    """One worker's side: its waiting tenants published, the others' read."""

    def __init__(self, shared: SharedCounts, classes: PriorityClasses,
                 fairness: FairShares) -> None:
        self._shared = shared
        self._classes = classes
        self._fairness = fairness
        self._numbers: dict[str, int] = {}
        self._names: list[str] = []

    def reconfigure(self, config: Config) -> None:
        """The keys file's tenants, numbered in name order (as every worker numbers them)."""
        names = sorted(t.name for t in config.keys.tenants) if config.keys is not None else []
        self._names = names[:FAIR_TENANTS]
        self._numbers = {name: number for number, name in enumerate(self._names)}
        row = self._shared.row
        if row is not None:  # published again with the new numbers
            self.queue_changed(self._shared.waiters(row))

    def queue_changed(self, length: int) -> None:
        """
        The router's queue changed (``length`` waiters): the waiter count and the highest
        waiting class's tenants, published.
        """
        shared = self._shared
        shared.set_waiters(length)
        if length:
            for klass in self._classes.order:
                tenants = self._fairness.waiting_in(klass.name)
                if tenants:
                    bits = 0
                    for tenant in tenants:
                        number = self._numbers.get(tenant)
                        if number is not None:
                            bits |= 1 << number
                    shared.set_fair_waiting(klass.rank, bits)
                    return
        shared.set_fair_waiting(-1, 0)

    def _elsewhere(self, rank: int) -> Iterator[str]:
        """The tenants waiting in the class of ``rank`` in the other workers."""
        names = self._names
        for published, bits in self._shared.others_fair_waiting():
            if published != rank:
                continue
            while bits:
                low = bits & -bits
                number = low.bit_length() - 1
                bits ^= low
                if number < len(names):
                    yield names[number]

    def waiting_elsewhere(self, klass: str) -> Iterator[str]:
        """The tenants waiting in class ``klass`` in the other workers: an arrival's lift."""
        return self._elsewhere(self._classes.get(klass).rank)

    def defers(self, klass: QueueClass, tenant: str | None) -> bool:
        """
        Whether a waiter of ``klass`` and ``tenant`` should leave a free slot: another
        worker has a tenant waiting in the same class whose counter is lower.
        """
        fairness = self._fairness
        if not fairness.enabled or tenant is None:
            return False
        counters = fairness.counters
        own = counters.get(tenant, 0.0) - TIE
        return any(counters.get(name, 0.0) < own for name in self._elsewhere(klass.rank))
