"""
Who a request is, with ``--auth keys``: its API key looked up in the keys file, giving its
tenant -- or a 401.

The key is read from ``Authorization: Bearer KEY`` (the OpenAI API's) or ``x-api-key:
KEY`` (Anthropic's Messages API), digested with SHA-256 at once, and the digest looked up
in a dictionary: no comparison of a guess against a stored key is ever made, so the time a
refusal takes tells an attacker nothing about how close a guess came.  Nothing here keeps
or logs a key; a tenant is known by its name from then on (the result log, the metrics,
the budgets, the fair queue).

A tenant's own ``rate_limit`` has buckets of its own here, kept across reloads while its
rate and burst stay the same; ``--rate-limit`` (every other tenant's) is the proxy's
limiter, keyed by the tenant.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.web.server import Request

from txlb._cluster.store import IBackendStore, IRateBuckets
from txlb._config.config import Config
from txlb._config.keys import KeysFile, TenantSpec

log = Logger()

#: A key longer than this is no key of txlb's (``python -m txlb.keys`` makes 51
#: characters): refused before it is digested, so a huge header costs nothing.
MAX_KEY_LENGTH = 512

#: What the 401 says.  The same words for a missing key and a wrong one, of any length:
#: the answer tells a guesser nothing.
NO_KEY = ("This endpoint needs an API key: send it as 'Authorization: Bearer KEY' "
          "(or 'x-api-key: KEY')")
WRONG_KEY = "Incorrect API key provided"


@attrs.frozen
class Refusal:
    """A request without a valid key: what its 401 says, and why (for the metrics)."""

    message: str
    #: ``missing``, ``malformed`` or ``unknown``
    reason: str


def presented_key(request: Request) -> bytes | Refusal:
    """
    The key ``request`` presents, or why it presents none.  Two keys (both headers, or
    one twice) are refused: which of them the tenant would be is not for txlb to guess.
    """
    headers = request.requestHeaders
    bearer = headers.getRawHeaders(b"authorization", [])
    other = headers.getRawHeaders(b"x-api-key", [])
    if len(bearer) + len(other) == 0:
        return Refusal(NO_KEY, "missing")
    if len(bearer) + len(other) > 1:
        return Refusal("send one API key, in one header", "malformed")
    if bearer:
        scheme, _, key = bearer[0].strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return Refusal(NO_KEY, "malformed")
    else:
        key = other[0]
    key = key.strip()
    if not key or len(key) > MAX_KEY_LENGTH:
        return Refusal(WRONG_KEY, "malformed" if not key else "unknown")
    return key


def key_digest(key: bytes) -> str:
    """The SHA-256 of ``key`` in hex: what the keys file holds and requests are matched by."""
    return hashlib.sha256(key).hexdigest()


class Tenants:
    """
    The keys and tenants in force (``--auth keys``), from the config's keys file;
    :meth:`reconfigure` takes a reload's, from the next request on.  A request admitted
    before keeps its tenant: a revoked key's stream finishes, its next request is refused.
    """

    def __init__(self, config: Config, store: IBackendStore, clock: IReactorTime) -> None:
        self.store = store
        self.clock = clock
        self.keys: KeysFile | None = None
        #: requests refused for their key, by reason (the metrics' counter)
        self.refused: dict[str, int] = {"missing": 0, "malformed": 0, "unknown": 0}
        self._buckets: dict[str, tuple[float, int, IRateBuckets]] = {}
        #: the digests a ``--shared-state`` fleet revoked: refused whatever the keys file
        #: says, until it is reloaded without them
        self.revoked: frozenset[str] = frozenset()
        self.reconfigure(config)

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def reconfigure(self, config: Config) -> None:
        """
        ``config``'s ``--auth`` and keys file (read when the config was built: every reload
        reads it again).  A world-readable keys file is warned of each time it is taken.
        """
        keys = config.keys if config.auth == "keys" else None
        if keys is not None and keys.world_readable:
            log.warn("--keys-file {path} may be read by other users of this host: its "
                     "digests let anyone test guessed keys offline (chmod 600 it)",
                     path=keys.path)
        self.keys = keys
        kept: dict[str, tuple[float, int, IRateBuckets]] = {}
        for tenant in keys.tenants if keys is not None else ():
            if tenant.rate_limit is None:
                continue
            burst = tenant.rate_burst or max(1, math.ceil(tenant.rate_limit))
            old = self._buckets.get(tenant.name)
            if old is not None and old[:2] == (tenant.rate_limit, burst):
                kept[tenant.name] = old
            else:
                kept[tenant.name] = (tenant.rate_limit, burst,
                                     self.store.rate_buckets(tenant.rate_limit, burst,
                                                             self.clock))
        self._buckets = kept

    def identify(self, request: Request) -> TenantSpec | Refusal:
        """The tenant of ``request``'s key, or its refusal (counted)."""
        assert self.keys is not None
        presented = presented_key(request)
        if isinstance(presented, Refusal):
            self.refused[presented.reason] += 1
            return presented
        digest = key_digest(presented)
        tenant = None if digest in self.revoked else self.keys.tenant(digest)
        if tenant is None:
            self.refused["unknown"] += 1
            return Refusal(WRONG_KEY, "unknown")
        return tenant

    def take_revoked(self, digests: frozenset[str]) -> None:
        """The keys the fleet revoked, as the shared state answered (or a supervisor told)."""
        self.revoked = digests

    def rate_wait(self, tenant: TenantSpec) -> int | None:
        """
        With its own ``rate_limit``: ``None`` if the tenant's request may go, else the whole
        seconds for ``Retry-After``.  Without: ``None`` (``--rate-limit`` decides).
        """
        held = self._buckets.get(tenant.name)
        if held is None:
            return None
        wait = held[2].take("tenant:" + tenant.name)
        return None if wait <= 0 else max(1, math.ceil(wait))

    def has_own_rate(self, tenant: TenantSpec) -> bool:
        return tenant.name in self._buckets

    def names(self) -> Sequence[str]:
        return [t.name for t in self.keys.tenants] if self.keys is not None else []

    def status(self) -> list[dict[str, object]]:
        """The tenants as the admin API lists them: never a key, a digest's first 8 digits."""
        if self.keys is None:
            return []
        labels: dict[str, list[dict[str, str]]] = {}
        for entry in self.keys.keys:
            labels.setdefault(entry.tenant, []).append(
                {"id": entry.digest[:8], "label": entry.label})
        return [{"name": t.name, "weight": t.weight, "class": t.priority,
                 "models": list(t.models), "rate_limit": t.rate_limit,
                 "keys": labels.get(t.name, [])} for t in self.keys.tenants]
