"""
The store of one process: everything the store seam names, kept in this process's memory.

:class:`LocalStore` is what a balancer uses without ``--shared-state``: no marks to share
(:class:`~txlb._cluster.store.OwnMarks`), in-flight counts in each backend or (``--workers``)
in the shared-memory table, and the in-memory :class:`TokenBuckets` (``--rate-limit``) and
:class:`TokenLevels` (``[[budgets]]``).  They live here, below the scheduling that uses
them, so that the store can build them and scheduling can name them with no import going
back up.

Memory stays bounded however many distinct client keys arrive.  A rate bucket untouched
long enough to be full again is indistinguishable from a new one, so it is dropped (checked
from the least recently used end, O(1) per request), and beyond :data:`MAX_RATE_KEYS` live
buckets the least recently used is dropped too (which only ever errs on the lenient side).
The token levels' eviction is :class:`TokenLevels`' own (a spent bucket is never dropped
before those nearly full).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence

import attrs
from twisted.internet.interfaces import IReactorTime
from zope.interface import implementer

from txlb._cluster.store import (
    DEBT_WINDOWS,
    Bucket,
    IBackendMarks,
    IBackendStore,
    IInFlightCounts,
    IRateBuckets,
    ITokenLevels,
    OwnMarks,
)

#: Live rate buckets kept at most; a bucket costs roughly 100 bytes.
MAX_RATE_KEYS = 100_000

#: Token-budget buckets kept at most (one per budget, window and client key; ~200 bytes
#: each).
MAX_LEVEL_KEYS = 100_000


@implementer(IRateBuckets)
class TokenBuckets:
    """The buckets of all client keys, on an injected clock: the local rate store."""

    def __init__(self, rate: float, burst: int, clock: IReactorTime,
                 max_keys: int = MAX_RATE_KEYS) -> None:
        self.rate = rate
        self.burst = burst
        self._now = clock.seconds
        self.max_keys = max_keys
        # key -> (tokens, time of last update), least recently used first
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._refill_time = burst / rate

    def __len__(self) -> int:
        return len(self._buckets)

    def retune(self, rate: float, burst: int) -> None:
        """
        A reload's ``--rate-limit`` and ``--rate-burst``: every client keeps the tokens it
        has (at most the new burst), refilled at the new rate from now on.
        """
        now = self._now()
        for key, (tokens, stamp) in list(self._buckets.items()):
            tokens = min(float(self.burst), tokens + max(0.0, now - stamp) * self.rate)
            self._buckets[key] = (min(float(burst), tokens), now)
        self.rate = rate
        self.burst = burst
        self._refill_time = burst / rate

    def take(self, key: str) -> float:
        """
        Take a token for ``key``.  Returns 0 if allowed, else the seconds until a token
        will be available.
        """
        now = self._now()
        self._evict(now)
        tokens, stamp = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - stamp) * self.rate)
        if tokens >= 1:
            self._buckets[key] = (tokens - 1, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1 - tokens) / self.rate

    def _evict(self, now: float) -> None:
        buckets = self._buckets
        while buckets:
            key, (_, stamp) = next(iter(buckets.items()))
            if now - stamp < self._refill_time and len(buckets) < self.max_keys:
                break
            del buckets[key]


@implementer(ITokenLevels)
class TokenLevels:
    """
    Every token bucket of this process, on an injected clock.

    Memory stays bounded: a bucket that has refilled to its capacity is indistinguishable
    from a new one and is dropped, and beyond ``max_keys`` buckets the one that will be full
    again **soonest** is dropped -- never a spent one before those that are nearly full, so
    a client cannot have its spent day forgotten by sending requests under many made-up
    keys (each of those buckets is full again as soon as its request is settled; pushing a
    spent bucket out would take ``max_keys`` keys that each spent more).  A min-heap of the
    times buckets are full again finds both in O(log n) per change.
    """

    def __init__(self, clock: IReactorTime, max_keys: int = MAX_LEVEL_KEYS) -> None:
        self._now = clock.seconds
        self.max_keys = max_keys
        # key -> (level, time of that level, time it is full again)
        self._levels: dict[str, tuple[float, float, float]] = {}
        # (time it is full again, key): one entry per store; an entry whose time is not
        # its key's current one is stale, skipped when met and swept when they pile up
        self._full_at: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._levels)

    def _current(self, bucket: Bucket, now: float) -> float:
        key, capacity, rate = bucket
        entry = self._levels.get(key)
        if entry is None:
            return capacity
        level, stamp, _ = entry
        return min(capacity, level + max(0.0, now - stamp) * rate)

    def _store(self, bucket: Bucket, level: float, now: float) -> None:
        key, capacity, rate = bucket
        full_at = now + (capacity - level) / rate
        self._levels[key] = (level, now, full_at)
        heap = self._full_at
        heapq.heappush(heap, (full_at, key))
        if len(heap) > 2 * len(self._levels) + 64:
            self._full_at = [(entry[2], name) for name, entry in self._levels.items()]
            heapq.heapify(self._full_at)

    def _evict(self, now: float) -> None:
        levels, heap = self._levels, self._full_at
        while heap:
            full_at, key = heap[0]
            entry = levels.get(key)
            if entry is None or entry[2] != full_at:
                heapq.heappop(heap)  # stale
            elif full_at <= now or len(levels) >= self.max_keys:
                heapq.heappop(heap)
                del levels[key]
            else:
                break

    def reserve(self, buckets: Sequence[Bucket], amount: float) -> float:
        now = self._now()
        self._evict(now)
        levels = [self._current(bucket, now) for bucket in buckets]
        wait = max(((amount - level) / bucket[2]
                    for bucket, level in zip(buckets, levels, strict=True) if level < amount),
                   default=0.0)
        if wait > 0:
            return wait
        for bucket, level in zip(buckets, levels, strict=True):
            self._store(bucket, level - amount, now)
        return 0.0

    def adjust(self, buckets: Sequence[Bucket], amount: float) -> None:
        now = self._now()
        self._evict(now)
        for bucket in buckets:
            # a debt is at most DEBT_WINDOWS windows' tokens: what a request really cost
            # is paid in full (a one-window cap let a client whose requests each cost ten
            # windows spend five times its budget), while a backend's absurd usage (2**62)
            # does not lock a client out for years
            capacity = bucket[1]
            level = self._current(bucket, now) + amount
            self._store(bucket, max(-DEBT_WINDOWS * capacity, min(capacity, level)), now)

    def level(self, bucket: Bucket) -> float:
        return self._current(bucket, self._now())

    def held(self) -> list[str]:
        """The keys of the buckets held (each below its capacity when last stored)."""
        return list(self._levels)

    def set_level(self, bucket: Bucket, level: float) -> None:
        """
        ``bucket`` holds ``level`` now (kept between minus :data:`DEBT_WINDOWS` capacities
        and its capacity): a shared store's answer replacing this copy's level.
        """
        capacity = bucket[1]
        self._store(bucket, max(-DEBT_WINDOWS * capacity, min(capacity, level)),
                    self._now())

    def forget(self, keep: Callable[[str], bool]) -> None:
        for key in [key for key in self._levels if not keep(key)]:
            del self._levels[key]  # its heap entries are stale now


@implementer(IBackendStore)
@attrs.define
class LocalStore:
    """
    The store of one machine: marks and rate buckets in this process, in-flight counts in
    this process or (``--workers``) in the shared-memory table given as ``counts``.
    """

    counts: IInFlightCounts | None = None
    marks: IBackendMarks = attrs.field(factory=OwnMarks)

    def rate_buckets(self, rate: float, burst: int, clock: IReactorTime) -> IRateBuckets:
        return TokenBuckets(rate, burst, clock)

    def token_levels(self, clock: IReactorTime) -> ITokenLevels:
        return TokenLevels(clock)
