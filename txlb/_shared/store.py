"""
:class:`RedisStore`: the :class:`~txlb._cluster.store.IBackendStore` of ``--shared-state``.

One poll every :data:`POLL_INTERVAL` does the fleet's bookkeeping in one script
(:data:`POLL`): it writes this replica's in-flight row (the heartbeat: the row and the
replica's lease expire after :data:`LEASE` unless renewed, so a replica killed with SIGKILL
leaves nothing behind), drops expired replicas, and returns the live replicas' count, the
marks' version and the other replicas' rows.  When the version moved, the marks' hash is
read too.  Between polls, a change of this replica's counts is written at once (coalesced
over :data:`FLUSH_DELAY`), and marks saved by the pool are written with the version bump.

No request waits for any of it: the pool, the router and the rate limiter read local copies.
When a poll fails or does not answer within the link's timeout, the replica falls back to
its local view (the other replicas' counts forgotten) -- within ``POLL_INTERVAL`` plus the
timeout of Redis stalling -- and when a poll answers again it republishes its row and
unsent marks and rereads the whole hash.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from txlb._cluster.store import IBackendStore, IRateBuckets, ITokenLevels
from txlb._cluster.store_capabilities import (
    FairCounters,
    IFleetPresence,
    IFleetWake,
    IPrefixSharing,
    ISharedRateTakes,
    ISlotGates,
    IStoreReport,
    IStoreService,
    ITenantSharing,
)
from txlb._config.shared import SharedStateSpec
from txlb._shared.counts import FleetCounts
from txlb._shared.fair import SharedTenants
from txlb._shared.levels import SharedTokenLevels
from txlb._shared.link import Commands, RedisLink, Script
from txlb._shared.marks import SharedMarks
from txlb._shared.metrics import SharedStateCollector
from txlb._shared.prefixes import SharedPrefixIndex
from txlb._shared.rate import RedisRateTakes, SharedRateBuckets
from txlb._shared.replies import INTEGER, SCAN_REPLY, texts
from txlb._shared.slots import SharedSlots

if TYPE_CHECKING:
    from txlb._cluster.pool import Pool

log = Logger()

#: Seconds between polls: how old another replica's count or mark can be.
POLL_INTERVAL = 0.1
#: Seconds a change of this replica's counts or marks waits to be written with the others
#: made meanwhile: one write for a burst of requests, each still published within this.
FLUSH_DELAY = 0.005
#: Milliseconds a replica's row and lease live without a poll renewing them.
LEASE = 3000

#: ARGV: prefix, replica id, lease (ms), then this replica's row as key, count pairs.
#: Returns: live replicas, the marks' version, then the other live replicas' counts summed
#: per backend, as key, count pairs.  Summed here, not in the replica: the reply is one pair
#: a backend however many replicas there are (15 replicas over 128 backends sent 1,792 pairs
#: ten times a second to every replica, 18% of a core idle); a count that is not a decimal
#: number of at most 7 digits is left out, as the replica would, and a sum stops at 9999999.
POLL = Script("""
local p = ARGV[1]
local me = ARGV[2]
local lease = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local row = p .. ':inflight:' .. me
redis.call('DEL', row)
if #ARGV > 3 then
  redis.call('HSET', row, unpack(ARGV, 4))
  redis.call('PEXPIRE', row, lease)
end
local replicas = p .. ':replicas'
redis.call('ZADD', replicas, now + lease, me)
redis.call('ZREMRANGEBYSCORE', replicas, '-inf', now)
redis.call('PEXPIRE', replicas, lease * 10)
local ids = redis.call('ZRANGE', replicas, 0, -1)
local out = {tostring(#ids), redis.call('GET', p .. ':marks:version') or '0'}
local sums, order = {}, {}
for _, id in ipairs(ids) do
  if id ~= me then
    local h = redis.call('HGETALL', p .. ':inflight:' .. id)
    for i = 1, #h - 1, 2 do
      local key, text = h[i], h[i + 1]
      if #text <= 7 and string.match(text, '^%d+$') then
        if sums[key] == nil then
          sums[key] = 0
          order[#order + 1] = key
        end
        sums[key] = math.min(9999999, sums[key] + tonumber(text))
      end
    end
  end
end
for _, key in ipairs(order) do
  out[#out + 1] = key
  out[#out + 1] = string.format('%d', sums[key])
end
return out
""", "the poll script", texts(2, even=True))

#: Changes of the marks kept in the change log (``<prefix>:marks:changed``, field -> the
#: version that changed it last): a reader further behind reads the whole hash.
CHANGE_LOG = 4096
#: Changed fields one incremental read takes at most (more: the whole hash is read).
MAX_CHANGES = 1024
#: Fields asked for per page of a whole read (``HSCAN ... COUNT``).
SCAN_PAGE = 256
#: Fields a whole read collects at most (a hash grown beyond: the read is dropped).
MAX_SCANNED = 65_536

#: Bump the marks' version and log ``fields`` under it in the change log, trimmed to its
#: newest :data:`CHANGE_LOG` (the floor key: the newest version trimmed away).  A fragment
#: of the scripts that write the marks; ``fields`` is a Lua table of field names.
_LOG_CHANGES = f"""
local v = redis.call('INCR', KEYS[2])
for _, field in ipairs(fields) do redis.call('ZADD', KEYS[3], v, field) end
local n = redis.call('ZCARD', KEYS[3])
if n > {CHANGE_LOG} then
  local cut = n - {CHANGE_LOG}
  local last = redis.call('ZRANGE', KEYS[3], cut - 1, cut - 1, 'WITHSCORES')
  redis.call('SET', KEYS[4], last[2])
  redis.call('ZREMRANGEBYRANK', KEYS[3], 0, cut - 1)
end
"""

#: Add entries where the hash has none (KEYS: the hash, the version, the change log, its
#: floor; ARGV: field, value pairs): a replica's configured backends at its start, and
#: what a replica knows when Redis lost the hash -- a drain or removal stored stays.
CLAIM = Script("""
local fields = {}
for i = 1, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then
    fields[#fields + 1] = ARGV[i]
  end
end
if #fields == 0 then return 0 end
""" + _LOG_CHANGES + """
return #fields
""", "the marks' claim script", INTEGER)

#: Write this replica's changes (KEYS as :data:`CLAIM`'s; ARGV: field, value pairs, an
#: empty value deleting the field): the hash, the version and the change log at once.
WRITE = Script("""
local fields = {}
for i = 1, #ARGV, 2 do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', KEYS[1], ARGV[i])
  else
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
  fields[#fields + 1] = ARGV[i]
end
""" + _LOG_CHANGES + """
return v
""", "the marks' write script", INTEGER)

#: The fields changed since version ARGV[1] (KEYS as :data:`CLAIM`'s; ARGV[2]: most
#: fields): ``{version, 'some', field, value, ...}`` (an empty value: deleted), or
#: ``{version, 'whole'}`` when the log cannot say (too far behind, too many, a version
#: that went back, changes some writer did not log): read the whole hash then.
CHANGES = Script("""
local v = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local since = tonumber(ARGV[1])
local floor = tonumber(redis.call('GET', KEYS[4]) or '0') or 0
if since == nil or since > v or since < floor then return {tostring(v), 'whole'} end
local most = tonumber(ARGV[2])
local ids = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. since, '+inf', 'LIMIT', 0, most + 1)
if #ids > most or (#ids == 0 and v > since) then return {tostring(v), 'whole'} end
local out = {tostring(v), 'some'}
for _, id in ipairs(ids) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', KEYS[1], id) or ''
end
return out
""", "the marks' changes script", texts(2, even=True))


def replica_id() -> str:
    """This replica's name in Redis: host, pid and a random part (a restart is a new one)."""
    host = "".join(c for c in socket.gethostname() if c.isalnum() or c in "-.")[:40]
    return f"{host or 'host'}-{os.getpid()}-{secrets.token_hex(3)}"


def _went_back(version: str, before: str | None) -> bool:
    """Whether the marks' version is lower than the one read before: Redis lost them."""
    if before is None:
        return False
    try:
        return int(version) < int(before)
    except ValueError:
        return False


def _pairs(items: Sequence[Any]) -> list[tuple[str, str]]:
    texts = [str(item) for item in items]
    return list(zip(texts[0::2], texts[1::2], strict=False))


@implementer(IBackendStore, IStoreService, IStoreReport, IFleetWake, ISlotGates,
             IPrefixSharing, IFleetPresence, ISharedRateTakes, ITenantSharing)
class RedisStore:
    """
    Counts, marks, rate buckets and token budgets' levels shared through one Redis, and
    every optional part of a store (:mod:`txlb._cluster.store_capabilities`).
    """

    def __init__(self, spec: SharedStateSpec, clock: IReactorTime,
                 client: Commands | None = None, replica: str | None = None,
                 interval: float = POLL_INTERVAL, lease: int = LEASE,
                 counts: FleetCounts | None = None) -> None:
        self.spec = spec
        self.clock = clock
        self.replica = replica or replica_id()
        self.interval = interval
        self.lease = lease
        self.link = RedisLink(spec, clock, client)
        #: the ``--rate-limit`` takes on the shared buckets (this replica's, its workers')
        self.rate_takes = RedisRateTakes(self.link, spec.prefix)
        #: this replica's row and the others' counts (a ``--workers`` supervisor passes
        #: its host's: :class:`txlb._shared.host.HostCounts`)
        self.counts = counts if counts is not None else FleetCounts()
        self.marks = SharedMarks(self.replica)
        #: live replicas as last polled (1, this one, while Redis has not answered)
        self.replicas = 1
        self._version: str | None = None
        self._polling = False
        self._flush_due = False
        self._loop: LoopingCall | None = None
        self._buckets: list[SharedRateBuckets] = []
        self._levels: list[SharedTokenLevels] = []
        #: told when other replicas' marks arrived (the pool takes them: ``pool.refresh``)
        self.on_marks: Callable[[], object] = lambda: None
        #: told when another replica freed a slot (``pool.slots.capacity_changed``)
        self.on_freed: Callable[[], object] = lambda: None
        #: told after each poll that answered (a ``--workers`` supervisor tells its workers
        #: how many replicas there are)
        self.on_polled: list[Callable[[], object]] = []
        #: backends this replica freed a slot of since the last flush, one entry per
        #: release, announced on ``<prefix>:freed`` after the row (:meth:`publish_freed`)
        self._freed: list[str] = []
        #: told at each poll, right after its script is sent: their commands go on the same
        #: connection, pipelined with it (the shared cache-aware index's write and read)
        self.on_poll: list[Callable[[], object]] = []
        self.counts.tell_change(self._row_changed)
        self.marks.tell_saved(self.marks_saved)
        self.link.on_up.append(self._resync)
        self.link.on_down.append(self._fell_back)

    @property
    def prefix(self) -> str:
        return self.spec.prefix

    # -- IBackendStore ------------------------------------------------------------------

    def rate_buckets(self, rate: float, burst: int, clock: IReactorTime) -> IRateBuckets:
        buckets = SharedRateBuckets(self.rate_takes, rate, burst, clock,
                                    lambda: self.replicas)
        self._buckets.append(buckets)
        del self._buckets[:-2]  # a reload's new buckets replace the old ones
        return buckets

    def unshared(self) -> int:
        """Rate-limit takes and token-budget moves the shared buckets missed."""
        return (sum(buckets.unshared for buckets in self._buckets)
                + sum(levels.unshared for levels in self._levels))

    def token_levels(self, clock: IReactorTime) -> ITokenLevels:
        levels = SharedTokenLevels(self.link, self.prefix, clock, lambda: self.replicas)
        self._levels.append(levels)
        return levels

    # -- the optional parts (txlb._cluster.store_capabilities) ----------------------------

    def attach(self, refresh: Callable[[], object], freed: Callable[[], object]) -> None:
        """The pool this store serves: ``refresh`` takes marks, ``freed`` wakes the queue."""
        self.on_marks, self.on_freed = refresh, freed

    def service(self) -> Service:
        return _PollService(self)

    def collector(self) -> SharedStateCollector:
        return SharedStateCollector(self)

    def slot_gate(self, wake: Callable[[], object]) -> SharedSlots:
        return SharedSlots(self, wake)

    def prefix_index(self, pool: Pool, policy: Callable[[], object]) -> SharedPrefixIndex:
        return SharedPrefixIndex(self, pool, policy)

    def tenant_sharing(self, fairness: FairCounters) -> SharedTenants:
        return SharedTenants(self, fairness)

    def presence(self) -> tuple[bool, int]:
        return self.link.connected, self.replicas

    def watch(self, listener: Callable[[], object]) -> None:
        self.link.on_up.append(listener)
        self.link.on_down.append(listener)
        self.on_polled.append(listener)

    def take_shared(self, bucket: str, rate: float, burst: int) -> Deferred[float | None]:
        return self.rate_takes.take(bucket, rate, burst)

    def start(self) -> None:
        self.link.start()
        self._loop = LoopingCall(self.poll)
        self._loop.clock = self.clock
        self._loop.start(self.interval, now=True)

    def stop(self) -> Deferred[Any]:
        """Stop polling and take this replica's row out now (not after its lease)."""
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        if not self.link.connected:
            self.link.stop()
            return succeed(None)
        done = DeferredList([
            self.link.call("DEL", f"{self.prefix}:inflight:{self.replica}", expect=INTEGER),
            self.link.call("ZREM", f"{self.prefix}:replicas", self.replica, expect=INTEGER),
        ], consumeErrors=True)
        return done.addBoth(lambda _: self.link.stop())

    # -- the poll -----------------------------------------------------------------------

    def poll(self) -> None:
        """One heartbeat and read (skipped while the previous one has not answered)."""
        if self._polling:
            return
        self._polling = True
        row = [item for key, count in self.counts.row().items() for item in (key, count)]
        self.counts.changed_row()  # the whole row goes now
        result = self.link.run(POLL, [], [self.prefix, self.replica, self.lease, *row],
                               probe=True)
        result.addCallbacks(self._polled, self._poll_failed)
        for listener in list(self.on_poll):
            try:
                listener()
            except Exception:
                log.failure("a shared-state poll listener failed")

    def _polled(self, reply: object) -> None:
        self._polling = False
        if not isinstance(reply, list) or len(reply) < 2:
            return
        try:
            self.replicas = max(1, min(100_000, int(reply[0])))
        except (ValueError, TypeError):
            self.replicas = 1
        try:
            if self.counts.read_others(_pairs(reply[2:])):
                self.on_freed()
        except Exception:
            # a count no txlb wrote must not stop the marks below from being read
            self.marks.garbled("counts", "the other replicas' counts could not be read")
        version = str(reply[1])
        if _went_back(version, self._version):
            log.warn("shared state: the marks' version went back ({old} -> {new}): Redis "
                     "lost its data; this replica writes back what it knows",
                     old=self._version, new=version)
            self._resync()
        if version != self._version:
            self._read_marks(version, whole=self._version is None)
        for listener in list(self.on_polled):
            listener()

    def _poll_failed(self, failure: Failure) -> None:
        self._polling = False

    def _marks_keys(self) -> list[str]:
        p = self.prefix
        return [f"{p}:marks", f"{p}:marks:version", f"{p}:marks:changed",
                f"{p}:marks:floor"]

    #: whether a read of the marks is under way (polls meanwhile do not start another:
    #: reads piling up behind a slow one would make the link time out)
    _reading = False

    def _read_marks(self, version: str, whole: bool) -> None:
        """
        The marks changed since the version last read: only the changed fields (the change
        log), or the whole hash -- at start, after an outage, when the log cannot say -- in
        pages of :data:`SCAN_PAGE` (no one reply big enough to hold up the poll).
        """
        if self._reading:
            return
        self._reading = True

        def done(failure: Failure | None = None) -> None:
            self._reading = False

        def read(fields: list[tuple[str, str]], read_version: str, whole: bool) -> None:
            done()
            try:
                self._version = read_version
                if self.marks.read(fields, whole=whole):
                    self.on_marks()
            except Exception:
                self.marks.garbled("read", "a read of the shared marks failed")
                log.failure("shared state: the marks could not be applied")

        fields: list[tuple[str, str]] = []

        def scan(cursor: str) -> None:
            self.link.call("HSCAN", f"{self.prefix}:marks", cursor, "COUNT", SCAN_PAGE,
                           expect=SCAN_REPLY).addCallbacks(page, done)

        def page(reply: object) -> None:
            if not (isinstance(reply, list) and len(reply) == 2
                    and isinstance(reply[1], list)) or len(fields) > MAX_SCANNED:
                done()
                return
            fields.extend(_pairs(reply[1]))
            if str(reply[0]) == "0":
                read(fields, version, True)
            else:
                scan(str(reply[0]))

        def changes(reply: object) -> None:
            if not isinstance(reply, list) or len(reply) < 2:
                done()
            elif str(reply[1]) == "some":
                read(_pairs(reply[2:]), str(reply[0]), False)
            else:
                done()
                self._read_marks(str(reply[0]), whole=True)

        if whole or self._version is None:
            scan("0")
        else:
            self.link.run(CHANGES, self._marks_keys(), [self._version, MAX_CHANGES]
                          ).addCallbacks(changes, done)

    # -- this replica's writes ------------------------------------------------------------

    def _row_changed(self) -> None:
        """A count changed: write it within :data:`FLUSH_DELAY`, with the others changed."""
        if not self._flush_due:
            self._flush_due = True
            self.clock.callLater(FLUSH_DELAY, self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if not self.link.connected:
            self.counts.changed_row()  # the next poll republishes the whole row
            return
        row = f"{self.prefix}:inflight:{self.replica}"
        changed = self.counts.changed_row()
        if changed:
            # written back to back on one connection: pipelined, one round trip
            self.link.call("HSET", row, *[x for kv in changed.items() for x in kv],
                           expect=INTEGER).addErrback(lambda failure: None)
            self.link.call("PEXPIRE", row, self.lease, expect=INTEGER) \
                .addErrback(lambda failure: None)
        self._announce_freed()
        self._write_marks()

    # -- the queue's wake (txlb._shared.slots) --------------------------------------------

    @property
    def freed_channel(self) -> str:
        """Where a replica announces a freed ``max_conns`` slot: ``<prefix>:freed``."""
        return f"{self.prefix}:freed"

    def publish_freed(self, key: str) -> None:
        """
        A slot of ``key`` (a backend with ``max_conns``) was given back: announce it with
        the next flush, after the row that shows it, so a woken replica's slot script
        reads the freed count.
        """
        if not self.link.connected:
            return  # nobody to tell: the others' polls read the rows when it is back
        self._freed.append(key)
        if not self._flush_due:
            self._flush_due = True
            self.clock.callLater(FLUSH_DELAY, self._flush)

    def _announce_freed(self) -> None:
        freed, self._freed = self._freed, []
        if not self.link.connected:
            return
        for key in freed:
            self.link.call("PUBLISH", self.freed_channel, f"{self.replica} {key}",
                           expect=INTEGER).addErrback(lambda failure: None)

    def marks_saved(self) -> None:
        """The pool saved marks: write them within :data:`FLUSH_DELAY`."""
        if not self._flush_due:
            self._flush_due = True
            self.clock.callLater(FLUSH_DELAY, self._flush)

    def _write_marks(self) -> None:
        unsent = self.marks.take_unsent()
        if not unsent:
            return
        if not self.link.connected:
            self.marks.still_unsent(unsent)
            return
        fields = [x for kv in self.marks.entries(unsent) for x in kv]
        written = self.link.run(WRITE, self._marks_keys(), fields)

        def lost(failure: Failure) -> None:
            self.marks.still_unsent(unsent)

        written.addErrback(lost)

    # -- fallback and resync ------------------------------------------------------------

    def _fell_back(self) -> None:
        if self.counts.forget_others():
            self.on_freed()

    def _resync(self) -> None:
        """
        Redis answers (again), or lost its data: our claims and everything we know, both
        only where Redis has no entry (a Redis restarted empty gets back the drains and
        removals the replicas hold, and never loses one to a replica starting after it);
        then our unsent marks, which win; then the whole hash.
        """
        claims = self.marks.take_claims()
        fields = [x for kv in self.marks.entries({**self.marks.known(), **claims})
                  for x in kv]
        if fields:
            self.link.run(CLAIM, self._marks_keys(), fields).addErrback(lambda failure: None)
        self._write_marks()
        self._version = None  # the next poll reads the whole hash

    def status(self) -> dict[str, object]:
        """``/status``'s ``shared_state``: the link, this replica and what it shares."""
        return {**self.link.status(), "replica": self.replica, "replicas": self.replicas,
                **self.marks.status()}


class _PollService(Service):
    """The store's polling as a service of the balancer (started and stopped with it)."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store

    def startService(self) -> None:
        super().startService()
        self.store.start()

    def stopService(self) -> Deferred[Any]:
        super().stopService()
        return self.store.stop()
