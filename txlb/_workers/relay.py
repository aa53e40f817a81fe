"""
``--workers`` with ``--shared-state``: the shared scripts a worker needs, run by its supervisor.

The supervisor is the host's one replica in Redis and holds the host's one connection to
it; a worker never connects to Redis.  The in-flight counts cross between them through the
shared-memory table (:mod:`txlb._shared.host`).  What else a worker shares is its
``--rate-limit`` takes: the worker admits on a local copy of the client's bucket at once, as
a single replica does (:class:`~txlb._shared.rate.SharedRateBuckets`), and the take's
script goes to the supervisor as a :class:`~txlb._workers.wire.Run` message; the supervisor
runs it on its link (:class:`ScriptRelay`) and sends Redis's answer back as
:class:`~txlb._workers.wire.Ran`, which sets the worker's copy to the fleet's level.
Nothing on a request's path waits for either message.

Token budgets (``[[budgets]]``) go as without shared state: a worker reserves and
reconciles on its own levels and tells the supervisor (:class:`~txlb._workers.wire.Spent`),
whose shared levels move the fleet's buckets by each; each answer's levels (the fleet's)
come back to every worker as :class:`~txlb._workers.wire.Levels` (:func:`take_levels`).

While the supervisor says Redis is unreachable (:class:`~txlb._workers.wire.Shared`), the
worker sends nothing and its copies go on alone at their share of the rate: the host's view.

A script that must answer *before* a request may go on (an exact fleet-wide slot) would make
this a round trip on the request's path -- worker, supervisor, Redis and back; such a script
would be registered in :data:`RELAYED` like the take, and its caller would wait on
:meth:`WorkerRelay.run`'s Deferred.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
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
from txlb._shared.link import LinkDown, RedisLink, Script
from txlb._shared.rate import TAKE, SharedRateBuckets
from txlb._workers.wire import MAX_RUN_TEXT, Levels, Message, Ran, Run

log = Logger()

#: Scripts a worker may have its supervisor run, by SHA1: the script, and the part of the
#: key space (after the prefix) each of its keys must be in, the number of keys and of
#: arguments it takes.  Anything else a worker asks for is refused.
RELAYED: dict[str, tuple[Script, str, int, int]] = {
    TAKE.sha: (TAKE, ":rate:", 1, 2),
}
#: Seconds a worker's takes wait to go to the supervisor together: one wake-up of the
#: supervisor (and one pipelined write to Redis) for a burst of requests, not one each --
#: on a busy host the extra process woken per request is what a take would cost.
RELAY_DELAY = 0.005
#: Seconds a worker waits for a :class:`Ran` before counting the take as unshared (the
#: supervisor's own link gives up after its command timeout, well within this).
RELAY_TIMEOUT = 2.0
#: Runs a worker keeps waiting for at most; beyond, a take is decided alone (unshared).
MAX_PENDING = 10_000


class RelayRefused(Exception):
    """The supervisor could not run a worker's script (Redis gone, or not one it runs)."""


class WorkerRelay:
    """
    A worker's side: the :class:`~txlb._shared.rate.ScriptLink` of its shared buckets,
    each script sent to the supervisor and its answer awaited without blocking anything.
    """

    def __init__(self, send: Callable[[Message], object], clock: IReactorTime,
                 workers: int, timeout: float = RELAY_TIMEOUT,
                 max_pending: int = MAX_PENDING, delay: float = RELAY_DELAY) -> None:
        self._send = send
        self._clock = clock
        self.delay = delay
        self._queued: list[Run] = []
        self._flush_call: IDelayedCall | None = None
        self.workers = max(1, workers)
        self.timeout = timeout
        self.max_pending = max_pending
        #: whether the supervisor's Redis answers, as it last said
        self.connected = False
        #: replicas (hosts) sharing the Redis, as the supervisor last said
        self.replicas = 1
        self._next = 0
        self._pending: dict[int, tuple[Deferred[Any], IDelayedCall]] = {}

    def deciders(self) -> int:
        """Processes admitting on their own copy of a bucket: every worker of every host."""
        return max(1, self.replicas) * self.workers

    def update(self, connected: bool, replicas: int) -> None:
        """The supervisor's :class:`~txlb._workers.wire.Shared`."""
        self.connected = connected
        self.replicas = max(1, min(100_000, replicas))

    def run(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Deferred[Any]:
        if not self.connected:
            return fail(LinkDown("shared state unreachable"))
        if len(self._pending) >= self.max_pending:
            return fail(RelayRefused(f"{self.max_pending} runs unanswered"))
        ident, self._next = self._next, self._next + 1
        result: Deferred[Any] = Deferred()
        timer = self._clock.callLater(self.timeout, self._expired, ident)
        self._pending[ident] = (result, timer)
        self._queued.append(Run(ident, script.sha, [str(key) for key in keys],
                                [str(arg) for arg in args]))
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

    def answered(self, message: Ran) -> None:
        """The supervisor's :class:`Ran`: fire the run it answers (an unknown id: ignored)."""
        waiting = self._pending.pop(message.id, None)
        if waiting is None:
            return
        result, timer = waiting
        if timer.active():
            timer.cancel()
        if message.reply is None:
            result.errback(RelayRefused("the supervisor's Redis did not answer"))
        else:
            result.callback(message.reply)

    def _expired(self, ident: int) -> None:
        waiting = self._pending.pop(ident, None)
        if waiting is not None:
            waiting[0].errback(RelayRefused(f"no answer within {self.timeout:g}s"))

    def pending(self) -> int:
        return len(self._pending)


class ScriptRelay:
    """
    The supervisor's side: a worker's :class:`Run`, run on the host's Redis link if it is
    one of :data:`RELAYED` on keys of this fleet's prefix, answered as a :class:`Ran`.
    """

    def __init__(self, link: RedisLink, prefix: str) -> None:
        self.link = link
        self.prefix = prefix
        #: runs refused as not one of ours (a broken or hostile worker)
        self.refused = 0

    def run(self, message: Run) -> Deferred[Ran]:
        known = RELAYED.get(message.script)
        if known is None or not self._fits(message, known):
            self.refused += 1
            if self.refused == 1:
                log.warn("a worker asked for a shared script txlb does not relay, refused "
                         "(logged once)")
            return succeed(Ran(message.id, None))
        script = known[0]
        answered = self.link.run(script, message.keys, message.args)
        return answered.addCallbacks(lambda reply: Ran(message.id, _reply(reply)),
                                     lambda failure: Ran(message.id, None))

    def _fits(self, message: Run, known: tuple[Script, str, int, int]) -> bool:
        _, space, keys, args = known
        start = self.prefix + space
        return (len(message.keys) == keys and len(message.args) == args
                and all(key.startswith(start) for key in message.keys))


def _reply(reply: object) -> str | list[str] | None:
    """Redis's answer as a :class:`Ran` carries it (text, or a list of texts), or ``None``."""
    if isinstance(reply, bytes):
        reply = reply.decode("utf-8", "replace")
    if isinstance(reply, list):
        texts = [item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)
                 for item in reply]
        return texts if all(len(text) <= MAX_RUN_TEXT for text in texts) else None
    text = str(reply)
    return text if len(text) <= MAX_RUN_TEXT else None


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
    in step by the supervisor (:func:`take_levels`).
    """

    counts: IInFlightCounts
    relay: WorkerRelay
    prefix: str
    marks: IBackendMarks = attrs.field(factory=OwnMarks)

    def rate_buckets(self, rate: float, burst: int, clock: IReactorTime) -> IRateBuckets:
        return SharedRateBuckets(self.relay, self.prefix, rate, burst, clock,
                                 self.relay.deciders)

    def token_levels(self, clock: IReactorTime) -> ITokenLevels:
        return TokenLevels(clock)
