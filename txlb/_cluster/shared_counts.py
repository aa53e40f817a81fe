"""
In-flight counts shared by the worker processes of ``--workers N``: txlb's version of
nginx's upstream ``zone``.

Least-connections is only exact if every process choosing a backend sees every other
process's requests in flight.  So the counts live in one shared memory segment (a
``memfd``, which leaves no file behind whatever way the processes end), laid out as a
table of 64-bit cells:

* one **row per worker**, written only by that worker (a single writer per cell, so no
  read-modify-write race between processes), plus one **retired row** owned by the
  supervisor, where the request counts of workers that exited are folded so the
  ``requests`` totals never go backwards;
* one **remote row**, also the supervisor's: with ``--shared-state``, the in-flight counts
  of the *other* replicas sharing the Redis, as its poll last read them (zero without
  shared state, and while Redis is unreachable: the host's own view);
* in each row a few header cells (the worker's pid, how many requests it has queued at
  ``max_conns``, and, for the fair handoff of ``--fairness vtc``, which tenants wait in its
  highest class that has waiters), then one **in-flight** cell and one **started** cell
  per backend slot.

A backend's in-flight count is the sum of its column over the workers' rows and the remote
row: exact for the host's requests, as old as the last poll for the other replicas'.  Each
address gets a slot from the supervisor the first time it is seen and keeps it for the life
of the process (so a backend removed and added again counts on, and a straggling request of the
old one is counted where it belongs); :data:`MAX_SLOTS` distinct addresses fit.

Choosing a backend and taking its slot happen under a POSIX record lock on the segment
(:meth:`SharedCounts.locked`): two workers can then never both see a backend as the least
loaded (or as below its ``max_conns``) and both take it.  The lock is held for a few
microseconds, is per process, and the kernel releases it if its holder dies.  Releasing a
slot takes no lock: a count only ever falls there, so a concurrent reader errs towards
"busier", as an in-process reader would a moment earlier.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import tempfile
from collections.abc import Iterable, Iterator

from zope.interface import implementer

from txlb._cluster.store import IInFlightCounts

#: Distinct backend addresses a multi-worker balancer can know over its lifetime.
MAX_SLOTS = 1024
#: Tenants a worker's fair-handoff cells can name (64 to a cell): see
#: :meth:`SharedCounts.set_fair_waiting`.
FAIR_TENANTS = 1024
_FAIR_CELLS = FAIR_TENANTS // 64
#: Header cells at the start of each row: the pid, the waiters, the class of the fair
#: handoff's waiting tenants, then their bitmap.
_PID, _WAITERS, _FAIR_CLASS, _FAIR_BITS = 0, 1, 2, 4
_HEADER = _FAIR_BITS + _FAIR_CELLS
_CELL = 8  # bytes: int64


def _anonymous_file(size: int) -> int:
    """A file descriptor on ``size`` zeroed bytes of memory with no name on disk."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("txlb-inflight", os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux
        fd, path = tempfile.mkstemp(prefix="txlb-inflight-")
        os.unlink(path)
    os.ftruncate(fd, size)
    return fd


@implementer(IInFlightCounts)
class SharedCounts:
    """
    The in-flight table as one process sees it.

    ``row`` is the worker's own row; ``None`` for the supervisor, which writes nothing but
    the retired row (and zeroes the row of a worker that died).
    """

    def __init__(self, fd: int, workers: int, slots: int = MAX_SLOTS,
                 row: int | None = None) -> None:
        if row is not None and not 0 <= row < workers:
            raise ValueError(f"row {row} outside 0..{workers - 1}")
        self.fd = fd
        self.workers = workers
        self.slots_max = slots
        self.row = row
        self._stride = _HEADER + 2 * slots
        self._retired = workers  # the row after the workers' rows
        self._remote = workers + 1  # the other replicas' counts (--shared-state)
        self._map = mmap.mmap(fd, self.size(workers, slots))
        self._cells = memoryview(self._map).cast("q")
        self._slots: dict[str, int] = {}
        self._used = 0  # slots 0.._used-1 may hold counts
        self._lock_depth = 0

    @staticmethod
    def size(workers: int, slots: int = MAX_SLOTS) -> int:
        return (workers + 2) * (_HEADER + 2 * slots) * _CELL

    @classmethod
    def create(cls, workers: int, slots: int = MAX_SLOTS) -> SharedCounts:
        """A new zeroed table for ``workers`` rows (the supervisor's view)."""
        return cls(_anonymous_file(cls.size(workers, slots)), workers, slots)

    def close(self) -> None:
        self._cells.release()
        self._map.close()

    # -- slots ----------------------------------------------------------------------------

    def register(self, key: str) -> int:
        """
        The slot of ``key``, giving it the next free one if new (the supervisor does this;
        workers learn the same numbers through :meth:`assign`).
        """
        slot = self._slots.get(key)
        if slot is None:
            if len(self._slots) >= self.slots_max:
                raise ValueError(f"no room for backend {key}: {self.slots_max} distinct "
                                 "backends already known (restart txlb to reset)")
            slot = self._slots[key] = len(self._slots)
            self._used = max(self._used, slot + 1)
        return slot

    def fits(self, keys: Iterable[str]) -> bool:
        """Whether :meth:`register` has a slot for every one of ``keys`` (a reload asks)."""
        new = {key for key in keys if key not in self._slots}
        return len(self._slots) + len(new) <= self.slots_max

    def assign(self, key: str, slot: int) -> None:
        """Use the supervisor's slot number for ``key``."""
        if not 0 <= slot < self.slots_max:
            raise ValueError(f"slot {slot} of {key} outside 0..{self.slots_max - 1}")
        self._slots[key] = slot
        self._used = max(self._used, slot + 1)

    def slot(self, key: str) -> int:
        return self._slots[key]

    def backends(self) -> list[str]:
        """Every backend given a slot so far."""
        return list(self._slots)

    # -- this process's counts --------------------------------------------------------------

    def take(self, key: str) -> None:
        """One more request in flight on ``key``, counted in this worker's row."""
        cells, base = self._cells, self._own_base() + _HEADER + self._slots[key]
        cells[base] += 1
        cells[base + self.slots_max] += 1

    def give_back(self, key: str) -> None:
        cells, index = self._cells, self._own_base() + _HEADER + self._slots[key]
        cells[index] -= 1

    def untake(self, key: str) -> None:
        """Undo a :meth:`take` whose request was never sent."""
        cells, base = self._cells, self._own_base() + _HEADER + self._slots[key]
        cells[base] -= 1
        cells[base + self.slots_max] -= 1

    def mine(self, key: str) -> int:
        """In flight on ``key`` from this worker (from all of them, for the supervisor)."""
        if self.row is None:
            return self.host_total(key)
        slot = self._slots.get(key)
        return 0 if slot is None else self._cells[self._own_base() + _HEADER + slot]

    def set_waiters(self, count: int) -> None:
        """How many requests this worker has queued at ``max_conns`` (see supervisor)."""
        self._cells[self._own_base() + _WAITERS] = count

    def set_fair_waiting(self, rank: int, tenants: int) -> None:
        """
        The tenants waiting in this worker's highest class that has waiters: ``rank`` the
        class's (``-1``: none wait), ``tenants`` a bitmap of their numbers (below
        :data:`FAIR_TENANTS`; see :mod:`txlb._workers.handoff`).  Written a cell at a time:
        another worker may read a set half old, half new -- a wrong guess it makes at most
        once per grace (:mod:`txlb._scheduling.handoff`), never a lost slot.
        """
        cells, base = self._cells, self._own_base()
        for cell in range(_FAIR_CELLS):
            word = (tenants >> (64 * cell)) & 0xFFFF_FFFF_FFFF_FFFF
            cells[base + _FAIR_BITS + cell] = word - (1 << 64) if word >> 63 else word
        cells[base + _FAIR_CLASS] = rank

    def others_fair_waiting(self) -> Iterator[tuple[int, int]]:
        """Each other worker's :meth:`set_fair_waiting` (rank, bitmap), when it has waiters."""
        cells, stride = self._cells, self._stride
        for row in range(self.workers):
            base = row * stride
            if row == self.row or cells[base + _WAITERS] <= 0 or cells[base + _FAIR_CLASS] < 0:
                continue
            tenants = 0
            for cell in range(_FAIR_CELLS):
                tenants |= (cells[base + _FAIR_BITS + cell] & 0xFFFF_FFFF_FFFF_FFFF) << (64 * cell)
            if tenants:
                yield int(cells[base + _FAIR_CLASS]), tenants

    def set_pid(self, pid: int) -> None:
        self._cells[self._own_base() + _PID] = pid

    def _own_base(self) -> int:
        if self.row is None:
            raise RuntimeError("the supervisor holds no requests of its own")
        return self.row * self._stride

    # -- everyone's counts ------------------------------------------------------------------

    def host_total(self, key: str) -> int:
        """In flight on ``key`` across every worker of this host (the remote row left out)."""
        slot = self._slots.get(key)
        if slot is None:
            return 0
        cells, stride, index = self._cells, self._stride, _HEADER + slot
        return sum(cells[row * stride + index] for row in range(self.workers))

    def total(self, key: str) -> int:
        """In flight on ``key`` across every worker, and the other replicas' if shared."""
        slot = self._slots.get(key)
        if slot is None:
            return 0
        return self.host_total(key) + self._cells[self._remote * self._stride + _HEADER + slot]

    def totals(self) -> list[int]:
        """
        In flight per slot across every worker and the other replicas (index = slot), in
        one pass over the rows.
        """
        used = self._used
        cells, stride = self._cells, self._stride
        rows = [cells[row * stride + _HEADER: row * stride + _HEADER + used].tolist()
                for row in (*range(self.workers), self._remote)]
        return [sum(column) for column in zip(*rows, strict=True)]

    # -- the other replicas (--shared-state: the supervisor writes, every worker reads) --

    def remote(self) -> dict[str, int]:
        """The other replicas' nonzero in-flight counts, per backend, as last written."""
        base = self._remote * self._stride + _HEADER
        cells = self._cells
        return {key: cells[base + slot] for key, slot in self._slots.items()
                if cells[base + slot]}

    def set_remote(self, counts: dict[str, int]) -> None:
        """
        The other replicas' in-flight counts (backends not named: none).  Written by the
        supervisor only, one cell at a time: a worker choosing meanwhile reads each
        backend's count either before or after, never a torn one.
        """
        base = self._remote * self._stride + _HEADER
        cells = self._cells
        for key, slot in self._slots.items():
            count = counts.get(key, 0)
            if cells[base + slot] != count:
                cells[base + slot] = count

    def started(self, key: str) -> int:
        """Requests ever sent to ``key`` by any worker, past or present."""
        slot = self._slots.get(key)
        if slot is None:
            return 0
        cells, stride, index = self._cells, self._stride, _HEADER + self.slots_max + slot
        return sum(cells[row * stride + index] for row in range(self.workers + 1))

    def row_status(self, row: int) -> dict[str, int]:
        """One worker's pid, requests in flight, requests started and queued."""
        base = row * self._stride
        counts = self._cells[base + _HEADER: base + _HEADER + 2 * self.slots_max].tolist()
        return {
            "pid": self._cells[base + _PID],
            "in_flight": sum(counts[:self.slots_max]),
            "requests": sum(counts[self.slots_max:]),
            "queued": self._cells[base + _WAITERS],
        }

    def waiters(self, row: int) -> int:
        return int(self._cells[row * self._stride + _WAITERS])

    def retire(self, row: int) -> None:
        """
        Forget a worker that exited (or was killed): its in-flight counts go to zero and its
        request counts move to the retired row.  Only once the worker is gone -- its row
        then has no writer but this one.
        """
        cells, base = self._cells, row * self._stride
        retired = self._retired * self._stride + _HEADER + self.slots_max
        started = base + _HEADER + self.slots_max
        for slot in range(self.slots_max):
            cells[retired + slot] += cells[started + slot]
        cells[base: base + self._stride] = memoryview(bytes(self._stride * _CELL)).cast("q")

    # -- choosing ---------------------------------------------------------------------------

    def lock(self) -> None:
        """
        Take the table's lock (re-entrant within this process): between reading the counts
        and taking a slot, no other worker can take one.  Pair with :meth:`unlock`.
        """
        if not self._lock_depth:
            fcntl.lockf(self.fd, fcntl.LOCK_EX, 1)
        self._lock_depth += 1

    def unlock(self) -> None:
        self._lock_depth -= 1
        if not self._lock_depth:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, 1)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """:meth:`lock` ... :meth:`unlock` as a context manager."""
        self.lock()
        try:
            yield
        finally:
            self.unlock()
