"""
The tenants of ``--auth keys`` shared by a ``--shared-state`` fleet: the fair queue's
counters (``--fairness vtc``) and the keys revoked.

**Counters.** Every change this host makes to a tenant's counter (a charge, a settlement,
a lift; its workers' too) is added up here and sent, twice a second, by one script
(:data:`SYNC`) that adds each to the fleet's hash and answers the whole hash.  Each counter
here then becomes the fleet's plus what this host changed since that sync was sent.  Every
change is an addition, so every replica converges on the same counters.  While Redis is
unreachable each goes on with its own and sends nothing; once it answers again, the fleet's
counters replace them (what a replica served meanwhile is counted by no one).

**Revocations.** A key revoked through one replica's admin API is added (by its digest) to
the fleet's revoked set, which the same script answers: every replica refuses it within a
sync, half a second, before its own keys file is reloaded without it.  The set keeps a
digest for :data:`REVOKED_DAYS` days after its last revocation.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Protocol

from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

from txlb._cluster.store_capabilities import FairCounters
from txlb._config.config import Config
from txlb._config.keys import TENANT_NAME
from txlb._shared.link import RedisLink, Script
from txlb._shared.replies import INTEGER, texts

#: Polls of the store (:data:`txlb._shared.store.POLL_INTERVAL`, 0.1 s) between syncs.
SYNC_EVERY = 5
#: Days a revoked digest stays in the fleet's set after its last revocation.
REVOKED_DAYS = 30
#: The most counters and revoked digests an answer may carry (the keys file's bounds).
MAX_TENANTS = 10_000
MAX_REVOKED = 100_000
_DIGEST = re.compile(r"[0-9a-f]{64}")

#: Add each (tenant, amount) pair of ARGV to the hash KEYS[1]; answer the number of its
#: fields, then its fields and values, then the members of the revoked set KEYS[2].
SYNC = Script("""
for i = 1, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
end
if #ARGV > 0 then redis.call('PEXPIRE', KEYS[1], 86400000) end
local counters = redis.call('HGETALL', KEYS[1])
local out = {tostring(#counters / 2)}
for _, value in ipairs(counters) do out[#out + 1] = value end
for _, digest in ipairs(redis.call('SMEMBERS', KEYS[2])) do out[#out + 1] = digest end
return out
""", "the fair-share script", texts(1))


class Fleet(Protocol):
    """What the sync needs of its store: the link, the prefix, and a hook on its poll."""

    link: RedisLink
    on_poll: list[Callable[[], object]]

    @property
    def prefix(self) -> str: ...


class SharedTenants:
    """This host's part in the fleet's counters and revoked keys."""

    def __init__(self, store: Fleet, fairness: FairCounters) -> None:
        self.store = store
        self.fairness = fairness
        self.counters_key = f"{store.prefix}:vtc"
        self.revoked_key = f"{store.prefix}:revoked"
        #: changes not sent yet, by tenant
        self._unsent: dict[str, float] = {}
        self._syncing = False
        self._polls = 0
        #: the fleet's revoked digests, as last answered
        self.revoked: frozenset[str] = frozenset()
        #: told the revoked digests whenever they change (the tenants; a supervisor's
        #: workers through it)
        self.on_revoked: list[Callable[[frozenset[str]], object]] = []
        #: changes the fleet never counted (Redis gone, or a sync failed)
        self.unshared = 0
        #: ``--auth keys`` is on: without tenants there is nothing to sync
        self.enabled = False
        fairness.on_host_change.append(self.add)
        store.on_poll.append(self.poll)

    def reconfigure(self, config: Config) -> None:
        """Sync while ``config`` has ``--auth keys``; its tenants are the fair queue's."""
        self.enabled = config.auth == "keys"
        if not self.enabled:
            self._unsent.clear()

    def add(self, tenant: str, amount: float) -> None:
        """This host changed ``tenant``'s counter by ``amount``: sent at the next sync."""
        if not self.enabled:
            return
        self._unsent[tenant] = self._unsent.get(tenant, 0.0) + amount

    def poll(self) -> None:
        """Every :data:`SYNC_EVERY` polls: one sync, unless the last is still out."""
        self._polls += 1
        if not self.enabled or self._polls % SYNC_EVERY or self._syncing:
            return
        self.sync()

    def sync(self) -> Deferred[None]:
        link = self.store.link
        if not link.connected:
            self.unshared += len(self._unsent)
            self._unsent.clear()
            return succeed(None)
        sent, self._unsent = self._unsent, {}
        args: list[str] = []
        for tenant, amount in sent.items():
            args += [tenant, repr(amount)]
        self._syncing = True
        result = link.run(SYNC, [self.counters_key, self.revoked_key], args)

        def answered(reply: object) -> None:
            self._syncing = False
            if isinstance(reply, list):
                self._take(reply)

        def failed(failure: Failure) -> None:
            self._syncing = False
            self.unshared += len(sent)  # maybe counted, maybe not: never twice

        return result.addCallbacks(answered, failed)

    def _take(self, reply: list[object]) -> None:
        """The script's answer: the fleet's counters, then its revoked digests."""
        try:
            count = int(str(reply[0]))
        except ValueError:
            return
        if not 0 <= count <= MAX_TENANTS or len(reply) < 1 + 2 * count:
            return
        fleet: dict[str, float] = {}
        for index in range(count):
            name, text = str(reply[1 + 2 * index]), str(reply[2 + 2 * index])
            try:
                value = float(text)
            except ValueError:
                continue
            if TENANT_NAME.fullmatch(name) and math.isfinite(value):
                fleet[name] = value
        self.fairness.take_fleet(fleet, self._unsent)
        revoked = frozenset(str(digest) for digest in reply[1 + 2 * count:][:MAX_REVOKED]
                            if _DIGEST.fullmatch(str(digest)))
        if revoked != self.revoked:
            self.revoked = revoked
            for listener in self.on_revoked:
                listener(revoked)

    def revoke(self, digest: str) -> Deferred[object]:
        """Tell the fleet ``digest`` is revoked (the admin API revoked it here)."""
        link = self.store.link
        if not link.connected:
            return succeed(None)
        added = link.call("SADD", self.revoked_key, digest, expect=INTEGER)
        added.addCallback(lambda _: link.call("EXPIRE", self.revoked_key,
                                              REVOKED_DAYS * 86400, expect=INTEGER))
        return added.addErrback(lambda failure: None)

    def status(self) -> dict[str, object]:
        return {"revoked_keys": len(self.revoked), "unshared_changes": self.unshared}
