"""
The counts a ``--workers`` supervisor shares through ``--shared-state``: its host's.

Under ``--workers N`` the supervisor is the host's one replica in Redis (it already owns
the host's membership, marks, probes and admin port).  Its workers count their requests in
the shared-memory table (:class:`~txlb._cluster.shared_counts.SharedCounts`), exactly and
under a lock; the supervisor publishes the sum of their rows as its replica row, and writes
the other replicas' rows, as each poll reads them, into the table's remote row -- which
every worker adds to its own totals.  A worker's least-connections and ``max_conns`` then
see the fleet: exact for the host, at most a poll old for the other hosts.

:class:`HostCounts` is what :class:`~txlb._shared.store.RedisStore` takes in place of its
own :class:`~txlb._shared.counts.FleetCounts`: the same role (this replica's row, the
others' counts), read from and written to the table.  The supervisor takes no slot itself,
so the host's counts change in the workers, unseen: :meth:`HostCounts.scan` (run every
:data:`SCAN_INTERVAL` by :class:`HostScan`) compares the table with what was published and
tells the store when it moved, which writes it within its flush delay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall

from txlb._cluster.shared_counts import SharedCounts
from txlb._shared.counts import MAX_REMOTE_COUNT, FleetCounts

#: Seconds between two looks at the workers' rows: how late, at most, a stream a worker
#: started is written to Redis (plus the store's flush delay).  A look sums a few cells.
SCAN_INTERVAL = 0.01


class HostCounts(FleetCounts):
    """The host's in-flight counts (all its workers') and the other replicas', in the table."""

    def __init__(self, table: SharedCounts) -> None:
        super().__init__()
        self.table = table
        #: the host's counts as last published (what :meth:`changed_row` compares with)
        self._published: dict[str, int] = {}
        #: told ``(backend, slots)`` when a published count fell: the host's workers freed
        #: that many (the supervisor announces them to the other replicas' queues)
        self.on_fell: Callable[[str, int], object] = lambda key, slots: None

    def tell_fell(self, told: Callable[[str, int], object]) -> None:
        """Tell ``told`` ``(backend, slots)`` whenever a published count fell."""
        self.on_fell = told

    # -- slots: the table's --------------------------------------------------------------

    def register(self, key: str) -> int:
        return self.table.register(key)

    def assign(self, key: str, slot: int) -> None:
        self.table.assign(key, slot)

    def slot(self, key: str) -> int:
        return self.table.slot(key)

    # -- the host: its workers take and give back, never the supervisor --------------------

    def take(self, key: str) -> None:
        raise RuntimeError("the supervisor holds no requests of its own")

    def give_back(self, key: str) -> None:
        raise RuntimeError("the supervisor holds no requests of its own")

    def untake(self, key: str) -> None:
        raise RuntimeError("the supervisor holds no requests of its own")

    def mine(self, key: str) -> int:
        """In flight on ``key`` from this host's workers."""
        return self.table.host_total(key)

    def started(self, key: str) -> int:
        return self.table.started(key)

    def row(self) -> dict[str, int]:
        """The host's nonzero counts: its row in Redis."""
        counts = self._host()
        self._publish(counts)
        return dict(counts)

    def changed_row(self) -> dict[str, int]:
        """The host's counts that changed since last published, zero included."""
        counts = self._host()
        changed = {key: counts.get(key, 0) for key in {*counts, *self._published}
                   if counts.get(key, 0) != self._published.get(key, 0)}
        self._publish(counts)
        return dict(sorted(changed.items()))

    def _publish(self, counts: dict[str, int]) -> None:
        before, self._published = self._published, counts
        for key, count in sorted(before.items()):
            if counts.get(key, 0) < count:
                self.on_fell(key, count - counts.get(key, 0))

    def scan(self) -> None:
        """Look at the workers' rows: if the host's counts moved, the store writes them."""
        if self._host() != self._published:
            self.on_change()

    def _host(self) -> dict[str, int]:
        table = self.table
        return {key: count for key in table.backends()
                if (count := table.host_total(key)) > 0}

    # -- the fleet ----------------------------------------------------------------------

    def total(self, key: str) -> int:
        return self.table.total(key)

    def totals(self) -> list[int]:
        return self.table.totals()

    def others(self) -> Mapping[str, int]:
        return self.table.remote()

    def read_others(self, pairs: Iterable[tuple[str, str]]) -> bool:
        """
        The other replicas' rows as the poll read them, summed into the table's remote row
        (the same checks as :meth:`FleetCounts.read_others`).  ``True`` if a count fell.
        """
        known = set(self.table.backends())
        sums: dict[str, int] = {}
        for key, text in pairs:
            if key not in known or not text.isdigit() or len(text) > 7:
                continue
            sums[key] = min(MAX_REMOTE_COUNT, sums.get(key, 0) + int(text))
        before = self.table.remote()
        self.table.set_remote(sums)
        return any(sums.get(key, 0) < count for key, count in before.items())

    def note_others(self, key: str, count: int) -> None:
        """The other replicas' count of ``key`` as a slot script just read it."""
        if key in self.table.backends():
            others = dict(self.table.remote())
            others[key] = max(0, min(MAX_REMOTE_COUNT, count))
            self.table.set_remote(others)

    def other_freed(self, key: str) -> bool:
        """Another replica announced a freed slot of ``key``: one fewer of theirs."""
        others = dict(self.table.remote())
        if others.get(key, 0) <= 0:
            return False
        others[key] -= 1
        self.table.set_remote(others)
        return True

    def forget_others(self) -> bool:
        """Redis is gone: the host's own view.  ``True`` if that freed any slot."""
        fell = bool(self.table.remote())
        self.table.set_remote({})
        return fell

    def lock(self) -> None:
        self.table.lock()

    def unlock(self) -> None:
        self.table.unlock()


class HostScan(Service):
    """:meth:`HostCounts.scan` every :data:`SCAN_INTERVAL` while the supervisor runs."""

    def __init__(self, counts: HostCounts, clock: IReactorTime,
                 interval: float = SCAN_INTERVAL) -> None:
        self.counts = counts
        self.clock = clock
        self.interval = interval
        self._loop: LoopingCall | None = None

    def startService(self) -> None:
        super().startService()
        loop = self._loop = LoopingCall(self.counts.scan)
        loop.clock = self.clock
        loop.start(self.interval, now=False)

    def stopService(self) -> None:
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
