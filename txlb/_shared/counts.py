"""
Fleet-wide in-flight counts: this replica's own, exact, plus the other replicas' as last read.

Least-connections, ``max_conns`` and the queue read a backend's count on every pick, so the
count must be local: a Redis round trip per pick is what :mod:`txlb._shared` exists to avoid.
Each replica publishes its own row (the store writes it the moment a count changes, and
again on every poll as the heartbeat that keeps it alive) and reads the others' rows on
every poll.  A backend's count is then exact for this replica's requests and at most one
poll interval old for the others' -- the overshoot docs/scale-out.md measures.  While Redis
is unreachable the others' rows are dropped: the local view.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from zope.interface import implementer

from txlb._cluster.store import IInFlightCounts

#: Distinct backend addresses one replica can know over its lifetime.
MAX_SLOTS = 4096
#: Largest in-flight count taken from another replica's row (a hostile or corrupt row
#: cannot make a backend look busier than any real fleet could).
MAX_REMOTE_COUNT = 1_000_000


@implementer(IInFlightCounts)
class FleetCounts:
    """This replica's counts and a copy of the other replicas' totals."""

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}
        self._mine: dict[str, int] = {}
        self._started: dict[str, int] = {}
        self._others: dict[str, int] = {}
        #: backends whose own count changed since :meth:`changed_row` last took them, in
        #: the order they changed (a dict as an ordered set: the writes are reproducible)
        self._dirty: dict[str, None] = {}
        #: told once per change of this replica's counts (the store publishes the row)
        self.on_change: Callable[[], object] = lambda: None

    # -- slots --------------------------------------------------------------------------

    def tell_change(self, told: Callable[[], object]) -> None:
        """Tell ``told`` once per change of this replica's counts (a store publishes them)."""
        self.on_change = told

    def register(self, key: str) -> int:
        slot = self._slots.get(key)
        if slot is None:
            if len(self._slots) >= MAX_SLOTS:
                raise ValueError(f"no room for backend {key}: {MAX_SLOTS} distinct backends "
                                 "already known (restart txlb to reset)")
            slot = self._slots[key] = len(self._slots)
        return slot

    def assign(self, key: str, slot: int) -> None:
        self._slots[key] = slot

    def slot(self, key: str) -> int:
        return self._slots[key]

    # -- this replica -------------------------------------------------------------------

    def take(self, key: str) -> None:
        self._mine[key] = self._mine.get(key, 0) + 1
        self._started[key] = self._started.get(key, 0) + 1
        self._touched(key)

    def give_back(self, key: str) -> None:
        left = self._mine.get(key, 0) - 1
        if left > 0:
            self._mine[key] = left
        else:
            self._mine.pop(key, None)
        self._touched(key)

    def untake(self, key: str) -> None:
        """A tentative slot the fleet refused: never sent, so not started either."""
        left = self._started.get(key, 0) - 1
        if left > 0:
            self._started[key] = left
        else:
            self._started.pop(key, None)
        self.give_back(key)

    def _touched(self, key: str) -> None:
        first = not self._dirty
        self._dirty[key] = None
        if first:
            self.on_change()

    def mine(self, key: str) -> int:
        return self._mine.get(key, 0)

    def started(self, key: str) -> int:
        """Requests this replica sent to ``key`` (the fleet's are not shared)."""
        return self._started.get(key, 0)

    def row(self) -> dict[str, int]:
        """This replica's nonzero counts: its row in Redis."""
        return dict(self._mine)

    def changed_row(self) -> dict[str, int]:
        """The counts changed since the last call, zero included (a delta to publish)."""
        dirty, self._dirty = self._dirty, {}
        return {key: self._mine.get(key, 0) for key in dirty}

    # -- the fleet ----------------------------------------------------------------------

    def total(self, key: str) -> int:
        return self._mine.get(key, 0) + self._others.get(key, 0)

    def totals(self) -> list[int]:
        counts = [0] * (max(self._slots.values(), default=-1) + 1)
        for key, slot in self._slots.items():
            counts[slot] = self.total(key)
        return counts

    def others(self) -> Mapping[str, int]:
        """The other replicas' in-flight counts, per backend, as last read."""
        return dict(self._others)

    def read_others(self, pairs: Iterable[tuple[str, str]]) -> bool:
        """
        The other replicas' counts as the poll read them (backend key, count as text: the
        poll script sums them per backend, and pairs of one key are summed here too): they
        replace what was known.  Unknown
        backends and counts that are not small non-negative integers are ignored.
        ``True`` if any backend's count fell (a slot freed: waiting requests look again).
        """
        sums: dict[str, int] = {}
        for key, text in pairs:
            # isascii: "²" is a digit to isdigit, and int() refuses it
            if key not in self._slots or not (text.isascii() and text.isdigit()) \
                    or len(text) > 7:
                continue
            sums[key] = min(MAX_REMOTE_COUNT, sums.get(key, 0) + int(text))
        fell = any(sums.get(key, 0) < count for key, count in self._others.items())
        self._others = {key: count for key, count in sums.items() if count}
        return fell

    def note_others(self, key: str, count: int) -> None:
        """
        The other replicas' count of ``key`` as a slot script just read it (fresher than
        the last poll): a refused backend reads as full until the next read says more.
        """
        if key in self._slots:
            count = max(0, min(MAX_REMOTE_COUNT, count))
            if count:
                self._others[key] = count
            else:
                self._others.pop(key, None)

    def other_freed(self, key: str) -> bool:
        """
        Another replica announced it freed a slot of ``key``: one fewer of theirs, until
        the next poll reads the rows.  ``True`` if that lowered the count.
        """
        count = self._others.get(key, 0)
        if count <= 0:
            return False
        if count > 1:
            self._others[key] = count - 1
        else:
            del self._others[key]
        return True

    def forget_others(self) -> bool:
        """Redis is gone: the local view.  ``True`` if that freed any slot."""
        fell = bool(self._others)
        self._others = {}
        return fell

    # -- choosing: one replica's choice is atomic in its reactor; the fleet's is not ----

    def lock(self) -> None:
        pass

    def unlock(self) -> None:
        pass
