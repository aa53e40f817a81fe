"""
The token budgets' buckets (``[[budgets]]``) shared by the fleet, the way
:mod:`txlb._shared.rate` shares ``--rate-limit``'s: admission reserves on a local copy and
never waits; each reservation and each reconciliation runs one atomic script (:data:`MOVE`)
on the shared buckets, and its answer (their levels after) replaces the copy's levels, less
what this replica sent that the answer has not counted yet.  Between answers a copy refills
at the bucket's rate divided by the live replicas.  While Redis is unreachable the copies go
on alone at that share.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from zope.interface import implementer

from txlb._cluster.local_store import TokenLevels
from txlb._cluster.store import Bucket, ITokenLevels
from txlb._shared.link import RedisLink, Script
from txlb._shared.replies import texts

#: The deepest debt a shared bucket may fall into, in capacities: the same bound as the local
#: buckets' (:data:`txlb._cluster.store.DEBT_WINDOWS`; a test holds them equal), so a
#: request that cost more than it reserved is paid in full across the fleet too.
DEBT = 60

#: Add ARGV[1] (negative: take) to every bucket of KEYS, each with its capacity and rate in
#: ARGV[2i], ARGV[2i+1], on the server's clock, each kept between minus DEBT capacities and
#: its capacity; the levels after, as text.
MOVE = Script(f"""
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local delta = tonumber(ARGV[1])
local out = {{}}
for i, key in ipairs(KEYS) do
  local cap = tonumber(ARGV[2 * i])
  local rate = tonumber(ARGV[2 * i + 1])
  local b = redis.call('HMGET', key, 'l', 's')
  local level = tonumber(b[1]) or cap
  local stamp = tonumber(b[2]) or now
  level = math.min(cap, level + math.max(0, now - stamp) * rate) + delta
  level = math.max(-cap * {DEBT}, math.min(cap, level))
  redis.call('HSET', key, 'l', tostring(level), 's', tostring(now))
  redis.call('PEXPIRE', key, math.ceil((cap - level) / rate * 1000) + 1000)
  out[i] = tostring(level)
end
return out
""", "the token-budget script", texts())


@implementer(ITokenLevels)
class SharedTokenLevels:
    """Local copies of the budgets' buckets, kept in step with the shared ones."""

    def __init__(self, link: RedisLink, prefix: str, clock: IReactorTime,
                 replicas: Callable[[], int]) -> None:
        self.link = link
        self.prefix = prefix
        self._replicas = replicas
        self._copies = TokenLevels(clock)
        #: per bucket key, the sum of the moves sent and not answered yet
        self._unanswered: dict[str, float] = {}
        #: moves the shared buckets did not count (Redis slow or gone)
        self.unshared = 0
        #: told each bucket's shared level as an answer brings it (a ``--workers``
        #: supervisor passes it on to its workers' copies)
        self.on_level: list[Callable[[Bucket, float], object]] = []

    def _share(self, buckets: Sequence[Bucket]) -> list[Bucket]:
        replicas = max(1, self._replicas())
        return [(key, capacity, rate / replicas) for key, capacity, rate in buckets]

    def __len__(self) -> int:
        return len(self._copies)

    def reserve(self, buckets: Sequence[Bucket], amount: float) -> float:
        wait = self._copies.reserve(self._share(buckets), amount)
        if wait <= 0:
            self._send(buckets, -amount)
        return wait

    def adjust(self, buckets: Sequence[Bucket], amount: float) -> None:
        self._copies.adjust(self._share(buckets), amount)
        if amount:
            self._send(buckets, amount)

    def level(self, bucket: Bucket) -> float:
        return self._copies.level(self._share([bucket])[0])

    def forget(self, keep: Callable[[str], bool]) -> None:
        self._copies.forget(keep)

    def _send(self, buckets: Sequence[Bucket], delta: float) -> None:
        if not self.link.connected or not buckets:
            return
        for key, _, _ in buckets:
            self._unanswered[key] = self._unanswered.get(key, 0.0) + delta
        names = [f"{self.prefix}:budget:" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]
                 for key, _, _ in buckets]
        args = [repr(float(delta))]
        for _, capacity, rate in buckets:
            args += [repr(float(capacity)), repr(float(rate))]
        result = self.link.run(MOVE, names, args, expect=texts(exactly=len(names)))

        def answered(levels: object) -> None:
            self._settle(buckets, delta)
            if not isinstance(levels, list) or len(levels) != len(buckets):
                return
            for whole, bucket, text in zip(buckets, self._share(buckets), levels, strict=True):
                try:
                    shared = float(str(text))
                except ValueError:
                    continue
                if -DEBT * bucket[1] <= shared <= bucket[1]:
                    self._copies.set_level(bucket, shared + self._unanswered.get(bucket[0], 0.0))
                    for listener in self.on_level:
                        listener(whole, shared)

        def failed(failure: Failure) -> None:
            self._settle(buckets, delta)
            self.unshared += 1

        result.addCallbacks(answered, failed)

    def _settle(self, buckets: Sequence[Bucket], delta: float) -> None:
        for key, _, _ in buckets:
            left = self._unanswered.get(key, 0.0) - delta
            if abs(left) < 1e-9:
                self._unanswered.pop(key, None)
            else:
                self._unanswered[key] = left
