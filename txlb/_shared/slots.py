"""
Exact ``max_conns`` across replicas: each slot of a capped backend confirmed by one script.

A replica picks on its local view (its own counts plus the others' as last read), which can
be a poll old: three replicas taking a burst at once would each admit ``max_conns``.  So
where a backend has ``max_conns`` and Redis answers, the slot the pool gave is tentative
until :data:`ACQUIRE` says yes:

1. the pool counts the slot at once (so every row this replica writes meanwhile -- the
   flush, the poll that deletes and rewrites the row -- already includes it);
2. the script, atomically in Redis, sums that backend's count over the other *live*
   replicas' rows (live: in ``<prefix>:replicas`` with a future score) and, if this
   replica's own count (the tentative slot included) plus theirs is within ``max_conns``,
   writes its own count into its row and answers yes;
3. on no, the pool gives the slot back as if never taken (:meth:`Slots.withdraw
   <txlb._cluster.slots.Slots.withdraw>`), the others' count the script read becomes the
   local view (the backend reads as full), and the router chooses again or queues.

Two replicas' scripts run one after the other, and a yes is only given when the sum, every
earlier yes included, is within the cap: no engine runs more than its ``max_conns`` while
the link is up.  Rows can only over-state (a tentative slot written by a flush before its
refusal), which errs towards "full" for a round trip.  Backends without ``max_conns`` take
no round trip.  When the script does not answer within the link's timeout, or the link is
down, the slot is admitted on the local view: a request never fails or waits longer because
Redis did, and what that admits beyond the cap is the overshoot docs/scale-out.md states.

A slot given back on a capped backend is announced on ``<prefix>:freed``
(:class:`txlb._shared.wake.FreedChannel`): the other replicas' queues look again at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from zope.interface import implementer

from txlb._cluster.backend import Backend
from txlb._cluster.store_capabilities import IFleetSlotGate
from txlb._config.shared import SharedStateSpec
from txlb._shared.counts import FleetCounts
from txlb._shared.link import RedisLink, Script
from txlb._shared.replies import integers
from txlb._shared.wake import FreedChannel

#: ARGV: prefix, replica id, lease (ms), backend key, this replica's count of it (the
#: tentative slot included), the backend's max_conns.
#: Returns: 1 (admitted) or 0 (refused), then the other live replicas' count of it.
ACQUIRE = Script("""
local p = ARGV[1]
local me = ARGV[2]
local lease = tonumber(ARGV[3])
local key = ARGV[4]
local mine = tonumber(ARGV[5])
local cap = tonumber(ARGV[6])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local replicas = p .. ':replicas'
local others = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', replicas, '(' .. now, '+inf')) do
  if id ~= me then
    local n = tonumber(redis.call('HGET', p .. ':inflight:' .. id, key) or '0')
    if n and n > 0 then others = others + n end
  end
end
if mine + others > cap then
  return {0, others}
end
local row = p .. ':inflight:' .. me
redis.call('HSET', row, key, mine)
redis.call('PEXPIRE', row, lease)
redis.call('ZADD', replicas, now + lease, me)
return {1, others}
""", "the max_conns slot script", integers(2))


def _answer(reply: object) -> tuple[bool, int] | None:
    """The script's (admitted, others' count), or None for anything else."""
    if not isinstance(reply, Sequence) or isinstance(reply, (str, bytes)) or len(reply) != 2:
        return None
    try:
        admitted, others = int(reply[0]), int(reply[1])
    except (TypeError, ValueError):
        return None
    if admitted not in (0, 1) or others < 0:
        return None
    return bool(admitted), others


class SlotStore(Protocol):
    """
    What the gate uses of its store (:class:`~txlb._shared.store.RedisStore`, which builds
    the gate: named here, so this module need not import it).
    """

    spec: SharedStateSpec
    link: RedisLink
    counts: FleetCounts
    replica: str
    lease: int

    @property
    def prefix(self) -> str: ...

    @property
    def freed_channel(self) -> str: ...

    def publish_freed(self, key: str) -> None: ...


@implementer(IFleetSlotGate)
class SharedSlots:
    """The pool's :class:`~txlb._cluster.slots.SlotGate` with ``--shared-state``."""

    def __init__(self, store: SlotStore, wake: Callable[[], object]) -> None:
        self.store = store
        self.link = store.link
        self.counts = store.counts
        #: runs the queue's dispatch (``pool.slots.capacity_changed``)
        self.wake = wake
        self.channel = FreedChannel(store.spec, store.freed_channel, store.replica,
                                    self.heard_freed)
        #: slots the script admitted, refused, and admitted unconfirmed (no answer in time)
        self.admitted = 0
        self.refused = 0
        self.unconfirmed = 0

    def wake_with(self, wake: Callable[[], object]) -> None:
        """Run ``wake`` when another replica freed a slot (a supervisor wakes its workers)."""
        self.wake = wake

    # -- SlotGate -----------------------------------------------------------------------

    def needs(self, backend: Backend) -> bool:
        return bool(backend.spec.max_conns) and self.link.connected

    def confirm(self, backend: Backend) -> Deferred[bool]:
        key = backend.key
        store = self.store
        result = self.link.run(ACQUIRE, [], [
            store.prefix, store.replica, store.lease, key, self.counts.mine(key),
            backend.spec.max_conns])

        def answered(reply: object) -> bool:
            answer = _answer(reply)
            if answer is None:
                self.unconfirmed += 1
                return True
            admitted, others = answer
            if admitted:
                self.admitted += 1
                return True
            self.refused += 1
            self.counts.note_others(key, others)
            return False

        def unanswered(failure: Failure) -> bool:
            self.unconfirmed += 1  # Redis slow or gone: the local view admitted it
            return True

        return result.addCallbacks(answered, unanswered)

    def released(self, backend: Backend) -> None:
        if backend.spec.max_conns:
            self.store.publish_freed(backend.key)

    # -- the wake -----------------------------------------------------------------------

    def heard_freed(self, key: str) -> None:
        """Another replica freed a slot of ``key``: count it, and let the queue look."""
        if self.counts.other_freed(key):
            self.wake()

    def service(self) -> Service:
        return _ChannelService(self.channel)

    def collector(self) -> SlotsCollector:
        return SlotsCollector(self)

    def status(self) -> dict[str, int]:
        return {"admitted": self.admitted, "refused": self.refused,
                "unconfirmed": self.unconfirmed, "wakes_heard": self.channel.heard}


class _ChannelService(Service):
    """The subscription as a service of the balancer (started and stopped with it)."""

    def __init__(self, channel: FreedChannel) -> None:
        self.channel = channel

    def startService(self) -> None:
        super().startService()
        self.channel.start()

    def stopService(self) -> Deferred[Any]:
        super().stopService()
        return self.channel.stop()


class SlotsCollector:
    """``txlb_shared_state_slots_total{answer}`` and ``..._wakes_total``."""

    def __init__(self, slots: SharedSlots) -> None:
        self.slots = slots

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        slots = self.slots
        answers = CounterMetricFamily(
            "txlb_shared_state_slots",
            "Slots of backends with max_conns, by the fleet-wide script's answer "
            "(unconfirmed: Redis did not answer in time and the local view admitted it).",
            labels=["answer"])
        answers.add_metric(["admitted"], slots.admitted)
        answers.add_metric(["refused"], slots.refused)
        answers.add_metric(["unconfirmed"], slots.unconfirmed)
        yield answers
        yield CounterMetricFamily(
            "txlb_shared_state_wakes",
            "Slots other replicas announced freed (the queue looked again at once).",
            value=slots.channel.heard)
