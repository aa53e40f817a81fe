"""
``--workers`` with ``--shared-state``: a worker's ``--rate-limit`` takes, made by its supervisor.

The supervisor is the host's one replica in the shared state and holds the host's one
connection to it; a worker never connects to it.  The in-flight counts cross between them
through the shared-memory table (:mod:`txlb._shared.host`).  What else a worker shares is its
``--rate-limit`` takes: the worker admits on a local copy of the client's bucket at once, as
a single replica does (:class:`~txlb._shared.rate.SharedRateBuckets`), and the take goes to
the supervisor as a :class:`~txlb._workers.wire.Take` message -- the bucket's name, rate and
burst, nothing of how a store keeps it; the supervisor asks its store for it
(:class:`TakeRelay`, through the store's
:class:`~txlb._cluster.store_capabilities.ISharedRateTakes`) and sends the answer back as
:class:`~txlb._workers.wire.Taken`, which sets the worker's copy to the fleet's level.
Nothing on a request's path waits for either message.

Token budgets (``[[budgets]]``) go as without shared state: a worker reserves and
reconciles on its own levels and tells the supervisor (:class:`~txlb._workers.wire.Spent`),
whose shared levels move the fleet's buckets by each; each answer's levels (the fleet's)
come back to every worker as :class:`~txlb._workers.wire.Levels` (:func:`take_levels`).

While the supervisor says the shared state is unreachable
(:class:`~txlb._workers.wire.Shared`), the worker sends nothing and its copies go on alone at
their share of the rate: the host's view.

A question that must be answered *before* a request may go on (an exact fleet-wide slot)
would make this a round trip on the request's path -- worker, supervisor, store and back;
such a question would be a message of its own beside :class:`~txlb._workers.wire.Take`,
answered through the store's capability, and its caller would wait on
:class:`WorkerRelay`'s Deferred.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from txlb._cluster.local_store import TokenLevels
from txlb._cluster.store import (
    DEBT_WINDOWS,
    IBackendMarks,
    IBackendStore,
    IInFlightCounts,
    IRateBuckets,
    ITokenLevels,
    OwnMarks,
)
from txlb._cluster.store_capabilities import ISharedRateTakes
from txlb._shared.link import LinkDown
from txlb._shared.rate import SharedRateBuckets
from txlb._workers.wire import Levels, Message, Take, Taken

log = Logger()

#: Seconds a worker's takes wait to go to the supervisor together: one wake-up of the
#: supervisor (and one pipelined write to the store) for a burst of requests, not one each
#: -- on a busy host the extra process woken per request is what a take would cost.
RELAY_DELAY = 0.005
#: Seconds a worker waits for a :class:`Taken` before counting the take as unshared (the
#: supervisor's own link gives up after its command timeout, well within this).
RELAY_TIMEOUT = 2.0
#: Takes a worker keeps waiting for at most; beyond, a take is decided alone (unshared).
MAX_PENDING = 10_000

#: What a bucket's name must be: the digest :func:`txlb._shared.rate.bucket_name` makes.
_BUCKET_NAME = re.compile(r"[0-9a-f]{32}")


class RelayRefused(Exception):
    """The supervisor could not take for a worker (its store gone, or a take it refuses)."""


class WorkerRelay:
    """
    A worker's side: the :class:`~txlb._shared.rate.RateTakes` of its shared buckets, each
    take sent to the supervisor and its answer awaited without blocking anything.
    """

    def __init__(self, send: Callable[[Message], object], clock: IReactorTime,
                 workers: int, timeout: float = RELAY_TIMEOUT,
                 max_pending: int = MAX_PENDING, delay: float = RELAY_DELAY) -> None:
        self._send = send
        self._clock = clock
        self.delay = delay
        self._queued: list[Take] = []
        self._flush_call: IDelayedCall | None = None
        self.workers = max(1, workers)
        self.timeout = timeout
        self.max_pending = max_pending
        #: whether the supervisor's shared state answers, as it last said
        self.connected = False
        #: replicas (hosts) sharing the state, as the supervisor last said
        self.replicas = 1
        self._next = 0
        self._pending: dict[int, tuple[Deferred[float | None], IDelayedCall]] = {}

    def deciders(self) -> int:
        """Processes admitting on their own copy of a bucket: every worker of every host."""
        return max(1, self.replicas) * self.workers

    def update(self, connected: bool, replicas: int) -> None:
        """The supervisor's :class:`~txlb._workers.wire.Shared`."""
        self.connected = connected
        self.replicas = max(1, min(100_000, replicas))

    def take(self, bucket: str, rate: float, burst: int) -> Deferred[float | None]:
        if not self.connected:
            return fail(LinkDown("shared state unreachable"))
        if len(self._pending) >= self.max_pending:
            return fail(RelayRefused(f"{self.max_pending} takes unanswered"))
        ident, self._next = self._next, self._next + 1
        result: Deferred[float | None] = Deferred()
        timer = self._clock.callLater(self.timeout, self._expired, ident)
        self._pending[ident] = (result, timer)
        self._queued.append(Take(ident, bucket, rate, burst))
        if self._flush_call is None:
            self._flush_call = self._clock.callLater(self.delay, self._flush)
        return result

    def _flush(self) -> None:
        """The takes queued over :data:`RELAY_DELAY`, to the supervisor in one write."""
        self._flush_call = None
        queued, self._queued = self._queued, []
        for message in queued:
            if message.id in self._pending:  # not given up on meanwhile
                self._send(message)

    def answered(self, message: Taken) -> None:
        """The supervisor's :class:`Taken`: fire the take it answers (an unknown id: ignored)."""
        waiting = self._pending.pop(message.id, None)
        if waiting is None:
            return
        result, timer = waiting
        if timer.active():
            timer.cancel()
        if not message.answered:
            result.errback(RelayRefused("the supervisor's shared state did not answer"))
        else:
            result.callback(message.level)

    def _expired(self, ident: int) -> None:
        waiting = self._pending.pop(ident, None)
        if waiting is not None:
            waiting[0].errback(RelayRefused(f"no answer within {self.timeout:g}s"))

    def pending(self) -> int:
        return len(self._pending)


class TakeRelay:
    """
    The supervisor's side: a worker's :class:`Take`, made through its store's shared rate
    takes if it is one txlb makes (a digest's name, a rate and a burst above 0), answered as
    a :class:`Taken`.  Without a store that shares rate buckets, every take is unanswered.
    """

    def __init__(self, takes: ISharedRateTakes | None) -> None:
        self.takes = takes
        #: takes refused as not one of ours (a broken or hostile worker)
        self.refused = 0

    def take(self, message: Take) -> Deferred[Taken]:
        if self.takes is None:
            return succeed(Taken(message.id, False, None))
        if not self._fits(message):
            self.refused += 1
            if self.refused == 1:
                log.warn("a worker asked for a rate-limit take txlb does not make, refused "
                         "(logged once)")
            return succeed(Taken(message.id, False, None))
        answered = self.takes.take_shared(message.bucket, float(message.rate), message.burst)
        return answered.addCallbacks(lambda level: Taken(message.id, True, _finite(level)),
                                     lambda failure: _unanswered(message, failure))

    @staticmethod
    def _fits(message: Take) -> bool:
        return (_BUCKET_NAME.fullmatch(message.bucket) is not None
                and math.isfinite(message.rate) and message.rate > 0 and message.burst > 0)


def _finite(level: float | None) -> float | None:
    """A level the wire carries: a finite number, else ``None`` (no level)."""
    return level if level is not None and math.isfinite(level) else None


def _unanswered(message: Take, failure: Failure) -> Taken:
    return Taken(message.id, False, None)


def take_levels(levels: ITokenLevels, message: Levels) -> int:
    """
    The fleet's levels the supervisor passed on, into a worker's own token levels; entries
    that are no bucket (a capacity or rate not above 0, a level outside minus the debt
    bound and the capacity) are ignored.  How many were taken.
    """
    if not isinstance(levels, TokenLevels):
        return 0
    taken = 0
    for key, capacity, rate, level in message.levels:
        if capacity > 0 and rate > 0 and -DEBT_WINDOWS * capacity <= level <= capacity:
            levels.set_level((key, float(capacity), float(rate)), float(level))
            taken += 1
    return taken


@implementer(IBackendStore)
@attrs.define
class WorkerStore:
    """
    A ``--workers`` worker's store under ``--shared-state``: its counts are the host's
    table (the other replicas' in its remote row), its marks the supervisor's (mirrored),
    its rate buckets shared through :class:`WorkerRelay`; its token levels its own, kept
    in step by the supervisor (:func:`take_levels`).  It provides none of a store's optional
    parts (txlb._cluster.store_capabilities): the supervisor's store does, for the host.
    """

    counts: IInFlightCounts
    relay: WorkerRelay
    marks: IBackendMarks = attrs.field(factory=OwnMarks)

    def rate_buckets(self, rate: float, burst: int, clock: IReactorTime) -> IRateBuckets:
        return SharedRateBuckets(self.relay, rate, burst, clock, self.relay.deciders)

    def token_levels(self, clock: IReactorTime) -> ITokenLevels:
        return TokenLevels(clock)
