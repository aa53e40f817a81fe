"""
Per-client token buckets (``--rate-limit``, ``--rate-burst``, ``--rate-key``).

Each client key has a bucket of ``burst`` tokens refilled at ``rate`` per second; a request
takes one token or is refused with 429 and a ``Retry-After`` saying when one will be there.

The buckets live behind :class:`~txlb._cluster.store.IRateBuckets`: the in-memory ones
(:class:`~txlb._cluster.local_store.TokenBuckets`, bounded in memory however many distinct
keys arrive) or a store's shared between balancers.  What is here is the limiter itself
and how a request names its client.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
from typing import TYPE_CHECKING

from twisted.internet.interfaces import IReactorTime
from twisted.web.server import Request

from txlb._cluster.local_store import TokenBuckets
from txlb._cluster.store import IRateBuckets

if TYPE_CHECKING:
    from txlb._cluster.store import IBackendStore
    from txlb._config.config import Config


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

    def check(self, request: Request, client: str | None = None) -> int | None:
        """
        ``None`` if the request may go, else the whole seconds for ``Retry-After``.
        ``client`` is its key when the caller knows it better than ``--rate-key`` (the
        tenant of ``--auth keys``).
        """
        wait = self.buckets.take(client if client is not None else self.client_key(request))
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
