"""
Per-client token buckets (``--rate-limit``, ``--rate-burst``, ``--rate-key``).

Each client key has a bucket of ``burst`` tokens refilled at ``rate`` per second; a request
takes one token or is refused with 429 and a ``Retry-After`` saying when one will be there.

Memory stays bounded however many distinct keys arrive: a bucket untouched long enough to
be full again is indistinguishable from a new one, so it is dropped (checked from the
least recently used end, O(1) per request), and beyond :data:`MAX_KEYS` live buckets the
least recently used is dropped too (which only ever errs on the lenient side).
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
from collections import OrderedDict
from typing import TYPE_CHECKING

from twisted.internet.interfaces import IReactorTime
from twisted.web.server import Request
from zope.interface import implementer

from txlb._cluster.store import IRateBuckets

if TYPE_CHECKING:
    from txlb._cluster.store import IBackendStore
    from txlb._config import Config

#: Live buckets kept at most; a bucket costs roughly 100 bytes.
MAX_KEYS = 100_000


@implementer(IRateBuckets)
class TokenBuckets:
    """The buckets of all client keys, on an injected clock: the local rate store."""

    def __init__(self, rate: float, burst: int, clock: IReactorTime,
                 max_keys: int = MAX_KEYS) -> None:
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


def bearer_digest(request: Request) -> str | None:
    """
    The sha256 of the request's bearer token, in hex, or ``None`` without one.  What
    txlb keeps of an API key (``--rate-key token``, ``[[classes]]`` ``keys``): the token
    itself is never stored or logged, and an operator can compute the same digest with
    ``printf %s "$KEY" | sha256sum``.
    """
    credentials = request.getHeader(b"authorization") or b""
    scheme, _, token = credentials.partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return hashlib.sha256(token.strip()).hexdigest()
    return None


def header_digest(value: bytes) -> str:
    """
    What a ``header:NAME`` client key keeps of the header's value: the first 32 hex digits
    of its SHA-256 -- a bounded size per bucket (and per ``--workers`` message) however
    long the value a client sends.
    """
    return hashlib.sha256(value).hexdigest()[:32]


def client_key(request: Request, kind: str = "ip") -> str:
    """
    Who sent ``request``, by ``--rate-key`` ``kind``.  ``ip``: the client's address;
    ``token``: a digest of the bearer token (the token itself is never kept);
    ``header:NAME``: a digest of that header's value (:func:`header_digest`).  A request
    without the header or token is keyed by its address.  Rate limiting and outlier
    ejection (a 5xx streak must span two clients) both use it.
    """
    if kind == "token":
        digest = bearer_digest(request)
        if digest is not None:
            return "token:" + digest[:32]
    elif kind.startswith("header:"):
        value = request.getHeader(kind[len("header:"):].encode("ascii"))
        if value:
            return "header:" + header_digest(value)
    address = request.getClientAddress()
    return "ip:" + normal_host(str(getattr(address, "host", address)))


def normal_host(host: str) -> str:
    """
    An address as a client key writes it: an IPv4 client of a dual-stack listener
    (``::ffff:10.0.0.7``) is its IPv4 address, so one budget (or rate limit) meets it
    however the listener took it; anything else as it is.
    """
    if host.startswith("::ffff:") or host.startswith("::FFFF:"):
        try:
            mapped = ipaddress.IPv6Address(host).ipv4_mapped
        except ValueError:
            return host
        if mapped is not None:
            return str(mapped)
    return host


class RateLimiter:
    """Maps a request to its client key and its key to a bucket."""

    def __init__(self, buckets: IRateBuckets, key: str) -> None:
        self.buckets = buckets
        self.key = key

    def client_key(self, request: Request) -> str:
        """The bucket's key for ``request`` (see :func:`client_key`)."""
        return client_key(request, self.key)

    def check(self, request: Request) -> int | None:
        """``None`` if the request may go, else the whole seconds for ``Retry-After``."""
        wait = self.buckets.take(self.client_key(request))
        return None if wait <= 0 else max(1, math.ceil(wait))


def rate_burst(config: Config) -> int:
    """``--rate-burst``, or by default the rate's own second's worth (at least one)."""
    return config.rate_burst or max(1, math.ceil(config.rate_limit or 1))


def rate_limiter_for(config: Config, store: IBackendStore, clock: IReactorTime,
                     running: RateLimiter | None = None, old: Config | None = None,
                     ) -> tuple[RateLimiter | None, bool]:
    """
    The rate limiter ``config`` asks for (``None`` without ``--rate-limit``), and whether
    its buckets are ``running``'s, to retune to the new rate and burst in place (what
    each client has taken is kept).  At start there is none running; a reload passes
    the running limiter and the ``old`` config.  A shared store's buckets are never
    retuned in place: new ones of the new parameters.
    """
    if config.rate_limit is None:
        return None, False
    burst = rate_burst(config)
    if running is None or old is None:
        return RateLimiter(store.rate_buckets(config.rate_limit, burst, clock),
                           config.rate_key), False
    buckets = running.buckets
    retune = (config.rate_limit, burst) != (old.rate_limit, rate_burst(old))
    if retune and not isinstance(buckets, TokenBuckets):
        buckets, retune = store.rate_buckets(config.rate_limit, burst, clock), False
    return RateLimiter(buckets, config.rate_key), retune
