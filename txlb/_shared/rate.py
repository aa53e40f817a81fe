"""
``--rate-limit`` buckets shared by the fleet, without a round trip on the request's path.

Redis holds each client key's bucket, taken from by one atomic script per admitted request
(:data:`TAKE`, run by its SHA1).  The request does not wait for it: admission reads a local
copy of the bucket, and each script's answer (the shared level after the take) replaces the
copy's level.  Between answers the copy refills at ``rate / N`` (``N`` the live replicas),
so replicas that all see an empty shared bucket refill it, together, at about ``rate``; a
replica alone in a key's traffic is set back to the shared level by every answer and so
lets through about ``rate`` itself.  The shared bucket may fall to ``-burst`` (a debt the
fleet pays back before anyone is admitted again), which bounds what replicas admitting at
the same instant can overshoot.  docs/scale-out.md gives the measured figure.

While Redis is unreachable the copies go on alone, each at ``rate / N`` with the last known
``N``: the fleet's limit holds as long as its traffic is spread evenly, and nothing waits.

The copies take from the shared buckets through a :class:`RateTakes`, in the bucket's own
terms (its name, rate and burst): the replica's :class:`RedisRateTakes`, or a ``--workers``
worker's relay to its supervisor (txlb._workers.relay), which asks its store the same.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from zope.interface import implementer

from txlb._cluster.store import IRateBuckets
from txlb._shared.link import RedisLink, Script
from txlb._shared.replies import TEXT


class RateTakes(Protocol):
    """
    Where the copies take from the fleet's buckets: the replica's :class:`RedisRateTakes`,
    or a ``--workers`` worker's relay through its supervisor (txlb._workers.relay).
    """

    @property
    def connected(self) -> bool: ...

    def take(self, bucket: str, rate: float, burst: int) -> Deferred[float | None]:
        """
        One token from the fleet's ``bucket``: its level after (``None``: an answer that
        is no level); fails when the fleet's bucket did not answer.
        """


#: Buckets kept at most per replica (as :data:`txlb._scheduling.ratelimit.MAX_KEYS`).
MAX_KEYS = 100_000

#: Take one token from KEYS[1] (ARGV: rate per second, burst) on the server's clock; the
#: level after, as text (a Lua number would come back truncated to an integer).
TAKE = Script("""
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local b = redis.call('HMGET', KEYS[1], 't', 's')
local tokens = tonumber(b[1]) or burst
local stamp = tonumber(b[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - stamp) * rate) - 1
if tokens < -burst then tokens = -burst end
redis.call('HSET', KEYS[1], 't', tostring(tokens), 's', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
return tostring(tokens)
""", "the rate-limit script", TEXT)


def level_of(reply: object) -> float | None:
    """The level a :data:`TAKE` answered, as a number (``None`` for anything else)."""
    if isinstance(reply, bytes):
        reply = reply.decode("utf-8", "replace")
    try:
        return float(str(reply))
    except ValueError:
        return None


class RedisRateTakes:
    """The :class:`RateTakes` of a replica: :data:`TAKE` on its own link, under its prefix."""

    def __init__(self, link: RedisLink, prefix: str) -> None:
        self.link = link
        self.prefix = prefix

    @property
    def connected(self) -> bool:
        return self.link.connected

    def take(self, bucket: str, rate: float, burst: int) -> Deferred[float | None]:
        result = self.link.run(TAKE, [f"{self.prefix}:rate:{bucket}"], [repr(rate), str(burst)])
        return result.addCallback(level_of)


def bucket_name(key: str) -> str:
    """The fleet's name of a client key's bucket: a digest (the key itself is not shared)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


@implementer(IRateBuckets)
class SharedRateBuckets:
    """Every client key's bucket: a local copy admitting at once, the shared one in Redis."""

    def __init__(self, takes: RateTakes, rate: float, burst: int,
                 clock: IReactorTime, replicas: Callable[[], int],
                 max_keys: int = MAX_KEYS) -> None:
        self.takes = takes
        self.rate = rate
        self.burst = burst
        self._now = clock.seconds
        self._replicas = replicas
        self.max_keys = max_keys
        # key -> (tokens, time of last update), least recently used first
        self._copies: OrderedDict[str, tuple[float, float]] = OrderedDict()
        # key -> takes sent to Redis and not answered yet
        self._unanswered: dict[str, int] = {}
        #: scripts that failed (Redis slow or gone): the copy alone decided
        self.unshared = 0

    def __len__(self) -> int:
        return len(self._copies)

    def _share(self) -> float:
        return self.rate / max(1, self._replicas())

    def take(self, key: str) -> float:
        now = self._now()
        share = self._share()
        self._evict(now, share)
        tokens, stamp = self._copies.pop(key, (self.burst / max(1, self._replicas()), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - stamp) * share)
        if tokens < 1:
            self._copies[key] = (tokens, now)
            return (1 - tokens) / share
        self._copies[key] = (tokens - 1, now)
        if self.takes.connected:
            self._send(key)
        return 0.0

    def _send(self, key: str) -> None:
        self._unanswered[key] = self._unanswered.get(key, 0) + 1
        result = self.takes.take(bucket_name(key), self.rate, self.burst)

        def answered(shared: float | None) -> None:
            left = self._settle(key)
            if shared is None:
                return
            if key in self._copies and -self.burst <= shared <= self.burst:
                # the shared level, less the takes of ours it has not counted yet
                self._copies[key] = (shared - left, self._now())

        def failed(failure: Failure) -> None:
            # Redis slow or gone: the copy alone decided (the link logged it once)
            self._settle(key)
            self.unshared += 1

        result.addCallbacks(answered, failed)

    def _settle(self, key: str) -> int:
        left = self._unanswered.get(key, 1) - 1
        if left > 0:
            self._unanswered[key] = left
        else:
            self._unanswered.pop(key, None)
        return max(0, left)

    def _evict(self, now: float, share: float) -> None:
        copies = self._copies
        refill = self.burst / share
        while copies:
            key, (_, stamp) = next(iter(copies.items()))
            if now - stamp < refill and len(copies) < self.max_keys:
                break
            del copies[key]
