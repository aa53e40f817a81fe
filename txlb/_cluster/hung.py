"""
Hung-backend detection from the traffic itself: a backend that accepts connections and
never answers (a stopped process, a wedged engine) leaves rotation within seconds.

Why passive: the active prober needs ``--health-timeout`` x ``--fall`` plus an interval
(about 17 s at the defaults) to call a silent backend down, and a short probe timeout alone
would eject an engine that is merely busy (SGLang's ``/health`` times out during a long
prefill).  What tells a hung engine from a slow one is whether its *other* streams still
flow: a prefill stalls one request, a stopped process stalls them all.  So the detector
looks, every :data:`TICK` seconds, at this process's requests in flight on each backend:

1. **quiet**: no byte (response head or body) from the backend for ``stall`` seconds while
   it has requests in flight, counted from the last byte or from when the oldest of those
   requests was sent, whichever is later -- and longer than ``factor`` times the backend's
   own time-to-first-byte average, so a backend whose answers always take long is judged by
   its own pace.  A request whose client left before any byte came counts too
   (:meth:`HangDetector.left_unanswered`): clients that give up after a second never keep
   a request in flight for ``stall``, yet a run of them, one after another, is as long a
   silence.  Such evidence is weighed so that leaving never makes a backend look more
   silent than staying would have (a client chooses when it leaves, where least-conn puts
   its request, and what the other backends answer):

   - a request counts only if it waited past its due time, ``factor`` times the backend's
     own usual time to a successful head (before it ever answered here, the fastest other
     backend's): a client that left sooner left before an answer was due;
   - the silence is the time the backend had at least one such request waiting (the union
     of their waits), not the span from the first to the last: a gap in which it was asked
     nothing is not silence; and the run ends when they covered less than
     :data:`DENSITY` of the time since the first, so a request now and then never adds up;
   - another healthy backend must have answered (a successful head) since the run began,
     its successful heads taking ``factor`` times less than the run's requests waited on
     average, so a fleet where everything is slow, or clients that leave sooner than
     anyone answers, accuse nobody.  Only 2xx heads set a pace: a 400 in 2 ms says nothing
     of how fast an engine answers a request it generates for (any head is still a byte);
2. **not everyone**: some other healthy backend is not quiet in the same way (if all are,
   the cause is shared -- the network, or txlb itself -- and ejecting would help nothing);
3. **confirmed**: an immediate probe of the health path gets no 200 within
   ``probe_timeout`` seconds, and still no byte came from the backend meanwhile.

Then the backend is marked down (at most half the fleet, like outlier ejection); the
active prober brings it back once its ``/health`` answers again.  A probe that answers
clears the suspicion, and the backend is not suspected again before another ``stall`` of
silence.  Requests the backend already has are left alone: it may resume (a stopped process
continued, a wedged engine recovering) and finish them, and failing them early would turn a
false alarm into lost work; they end as any request does, at the latest with 504 after
``--read-timeout``.

The per-chunk cost on the data path is one method call (``Lease.heard``); a client that
leaves unanswered costs one look at the other backends; the rest runs on the timer, only
while requests are in flight or such a run of silence is recent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import attrs
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet import error as neterror
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseFailed, ResponseNeverReceived

from txlb._cluster.backend import Backend
from txlb._cluster.pool import Pool
from txlb._config.config import Config

log = Logger()

#: Seconds between two looks at the requests in flight.
TICK = 0.25
#: Seconds without a byte from any request in flight that make a backend suspect.
STALL = 1.25
#: Seconds the confirming probe may take.
PROBE_TIMEOUT = 1.0
#: A backend is quiet only after this many times its own time-to-first-byte average.
TTFB_FACTOR = 4.0
#: Requests left unanswered add up to one silence only while at least one of them was
#: waiting this fraction of the time since the first: not a request now and then.
DENSITY = 0.5


class InFlight(Protocol):
    """What the detector reads of one request in flight (:class:`txlb._proxy.exchange.Exchange`)."""

    @property
    def backend_waited_since(self) -> float | None:
        """When this request's try was sent or last got a byte; ``None`` when it is not
        waiting on its backend (ended, between tries, or paused by a slow client)."""

    @property
    def backend(self) -> Backend: ...

    def backend_hung(self) -> None:
        """Its backend was judged hung: a stream may leave it (``--resume``)."""


@attrs.define
class _Unanswered:
    """
    One backend's run of requests whose clients left with no byte from it, one following
    another within ``stall``: ``requests`` of them, waiting between ``start`` and ``end``,
    for ``waited`` seconds in all.  ``silent`` is how long it had at least one of them
    waiting -- the union of their waits, the gaps between them left out: a gap is time
    nobody asked the backend anything, not silence.  ``since`` is the backend's last byte
    (or cleared suspicion) the run was counted from: a byte after it ends the run.
    """

    since: float | None
    start: float
    end: float
    waited: float
    silent: float
    requests: int = 1

    def covers(self, start: float, end: float) -> bool:
        """
        Whether, with one more request silent from ``start`` to ``end``, the run still had
        one waiting at least half the time since it began (:data:`DENSITY`): a silence
        spread thin -- a request now and then, asked nothing in between -- is not one.
        """
        silent = joined(self.silent, self.end, start, end)
        return silent >= DENSITY * (max(self.end, end) - min(self.start, start))

    def add(self, start: float, end: float, waited: float) -> None:
        """One more request, silent from ``start`` to ``end``, which waited ``waited``."""
        self.silent = joined(self.silent, self.end, start, end)
        self.start = min(self.start, start)
        self.end = max(self.end, end)
        self.waited += waited
        self.requests += 1


def joined(silent: float, until: float, start: float, end: float) -> float:
    """
    The length of a union of intervals, ``silent`` long and ending at ``until``, with one
    more, ``start`` to ``end``: exact when the new one begins after the others end or covers
    them, never more than the truth otherwise (gaps before ``until`` that it fills are not
    known here) -- too little silence accuses nobody, too much would.
    """
    return max(silent + max(0.0, end - max(start, until)), end - start)


class HangDetector(Service):
    """
    Marks down a backend that stopped answering every request it has (see the module's
    docstring).  ``live`` is the proxy's set of requests in flight; ``probe(backend)``
    fires with the status of one ``GET`` of the health path or fails.
    """

    def __init__(self, pool: Pool, live: Iterable[InFlight], clock: IReactorTime,
                 probe: Callable[[Backend], Deferred[int]], stall: float = STALL,
                 probe_timeout: float = PROBE_TIMEOUT, factor: float = TTFB_FACTOR,
                 tick: float = TICK) -> None:
        self.pool = pool
        self.live = live
        self.clock = clock
        self.probe = probe
        self.stall = stall
        self.probe_timeout = probe_timeout
        self.factor = factor
        self.tick = tick
        self._loop: LoopingCall | None = None
        self._last_tick: float | None = None
        #: backends being probed now, and when their suspicion began
        self._probing: dict[Backend, Deferred[Any]] = {}
        #: a probe answered at this time: quiet is counted again from here
        self._cleared: dict[Backend, float] = {}
        #: each backend's latest run of requests left unanswered by their clients
        self._unanswered: dict[Backend, _Unanswered] = {}

    @property
    def watching(self) -> bool:
        """Whether it judges now: its service runs and ``--hung-after`` is not ``0``."""
        return bool(self.running) and bool(self.stall)

    def reconfigure(self, config: Config) -> None:
        """
        ``config``'s ``--hung-after``, judged from the next tick on; ``0`` turns detection
        off (its probes under way are called off) and another value back on.
        """
        self.stall = config.hung_after
        if self.running:
            self._watch()

    def startService(self) -> None:
        super().startService()
        self._watch()

    def stopService(self) -> None:
        super().stopService()
        self._watch()

    def _watch(self) -> None:
        """Tick while :attr:`watching`; otherwise stop, calling off the probes under way."""
        ticking = self._loop is not None and self._loop.running
        if self.watching and not ticking:
            loop = self._loop = LoopingCall(self._check_safely)
            loop.clock = self.clock
            loop.start(self.tick, now=False).addErrback(
                lambda failure: log.failure("the hung-backend check stopped", failure))
        elif not self.watching:
            if ticking:
                assert self._loop is not None
                self._loop.stop()
            for pending in list(self._probing.values()):
                pending.cancel()

    # -- what clients that left say -----------------------------------------------------

    def _quiet_since(self, backend: Backend) -> float | None:
        """Since when silence counts: the backend's last byte, or the last time a probe
        cleared it, whichever is later."""
        last, cleared = backend.pace.last_byte, self._cleared.get(backend)
        if last is None or cleared is None:
            return cleared if last is None else last
        return max(last, cleared)

    def due(self, backend: Backend) -> float | None:
        """
        How long a request may wait for ``backend``'s first byte before its silence is
        evidence: ``factor`` times the backend's own usual time to a successful head -- a
        client that leaves sooner left before an answer was due -- or, before it answered
        any here, ``factor`` times the fastest other healthy backend's.  ``None`` with no
        pace to judge by (nothing answered yet, or no other backend).
        """
        pace = backend.pace.head_wait
        if pace is None:
            paces = [other.pace.head_wait for other in self.pool if other is not backend
                     and other.health.healthy and other.pace.head_wait is not None]
            if not paces:
                return None
            pace = min(paces)
        return self.factor * pace

    def left_unanswered(self, backend: Backend, sent: float, left: float) -> None:
        """
        A client left at ``left`` with no byte from ``backend`` for its request, sent at
        ``sent``: a silence of ``backend``'s as long as the request waited, if it waited
        past :meth:`due`, counted once some other backend answered faster (see the module's
        docstring).
        """
        if not self.watching:
            return  # off (--hung-after 0), or stopping
        due = self.due(backend)
        if due is None or left - sent < due:
            return  # it left before an answer was due: says nothing of the backend
        since = self._quiet_since(backend)
        start = sent if since is None else max(sent, since)
        if start >= left:
            return  # a byte came from it meanwhile (another request's): alive
        run = self._unanswered.get(backend)
        if run is not None and run.since == since and start <= run.end + self.stall \
                and run.covers(start, left):
            run.add(start, left, left - sent)
        else:
            self._unanswered[backend] = _Unanswered(since, start, left, left - sent,
                                                    left - start)

    def _answered_faster(self, backend: Backend, run: _Unanswered) -> bool:
        """
        Whether some other healthy backend's successful response head came during ``run``
        (since its start), and its successful heads take ``factor`` times less than the
        run's requests waited on average: they were left unanswered where an answer was
        due.  Error heads do not count: a fast 400 says nothing of how fast an engine
        answers a request it generates for.
        """
        waited = run.waited / run.requests
        for other in self.pool:
            if other is backend or not other.health.healthy:
                continue
            head, pace = other.pace.last_head, other.pace.head_wait
            if head is not None and pace is not None and head >= run.start \
                    and pace * self.factor <= waited:
                return True
        return False

    def _recent_run(self, backend: Backend, now: float) -> _Unanswered | None:
        """``backend``'s run of requests left unanswered, if it still counts: no byte since
        it began, and its last request left within ``stall``."""
        run = self._unanswered.get(backend)
        if run is None:
            return None
        if run.since != self._quiet_since(backend) or now - run.end > self.stall:
            del self._unanswered[backend]
            return None
        return run

    # -- the look ---------------------------------------------------------------------------

    def quiet_for(self) -> dict[Backend, tuple[float, int]]:
        """
        Per backend with requests in flight here, or a recent run of requests their
        clients left unanswered: how long it has sent no byte while it had requests
        waiting, and how many requests that silence spans.
        """
        oldest: dict[Backend, float] = {}
        count: dict[Backend, int] = {}
        for request in list(self.live):
            since = request.backend_waited_since
            if since is None:
                continue
            backend = request.backend
            count[backend] = count.get(backend, 0) + 1
            if since < oldest.get(backend, since + 1):
                oldest[backend] = since
        now = self.clock.seconds()
        quiet = {}
        for backend, since in oldest.items():
            quiet_since = self._quiet_since(backend)
            start = since if quiet_since is None else max(since, quiet_since)
            silent, requests = now - start, count[backend]
            run = self._recent_run(backend, now)
            if run is not None and run.end + self.stall >= start \
                    and run.covers(start, now) and self._answered_faster(backend, run):
                # the requests waiting now continue the run: the time it had one waiting
                silent = joined(run.silent, run.end, start, now)
                requests += run.requests
            quiet[backend] = (silent, requests)
        for backend in list(self._unanswered):
            if backend in quiet:
                continue
            run = self._recent_run(backend, now)
            if run is not None and self._answered_faster(backend, run):
                quiet[backend] = (run.silent, run.requests)
        return quiet

    def threshold(self, backend: Backend) -> float:
        """The silence after which ``backend`` is suspect: ``stall``, or longer for a
        backend whose first bytes always take long."""
        return max(self.stall, self.factor * (backend.pace.ewma_ttft or 0.0))

    def _check_safely(self) -> None:
        """A LoopingCall stops for good on an exception: none may escape a look."""
        try:
            self.check()
        except Exception:
            log.failure("looking for hung backends failed")

    def check(self) -> None:
        """One look: suspect and probe each backend that is quiet while others are not."""
        now = self.clock.seconds()
        late = self._last_tick is not None and now - self._last_tick > 3 * self.tick
        self._last_tick = now
        if late:
            # txlb itself was stalled (a long GC, a stopped process): what the backends
            # sent meanwhile is still unread in the sockets, so silence says nothing yet,
            # and neither do the clients that gave up meanwhile
            self._unanswered.clear()
            return
        if len(self._cleared) > len(self.pool) or len(self._unanswered) > len(self.pool):
            # forget backends removed since
            current = set(self.pool)
            self._cleared = {b: t for b, t in self._cleared.items() if b in current}
            self._unanswered = {b: r for b, r in self._unanswered.items() if b in current}
        quiet = self.quiet_for()
        suspects = [b for b, (silent, _) in quiet.items()
                    if silent >= self.threshold(b) and b.health.healthy]
        if not suspects:
            return
        for backend in suspects:
            if backend in self._probing:
                continue
            if not any(other.health.healthy and other not in suspects
                       and quiet.get(other, (0.0, 0))[0] < self.threshold(other)
                       for other in self.pool if other is not backend):
                continue  # every backend is silent at once: not this one's fault
            self._confirm(backend, *quiet[backend])

    # -- the confirming probe ---------------------------------------------------------------

    def _confirm(self, backend: Backend, silent: float, requests: int) -> None:
        last_byte = backend.pace.last_byte
        try:
            probe = self.probe(backend)
        except Exception:
            probe = defer.fail()
        # the probe's time runs out one reactor turn after probe_timeout: a reactor held up
        # past it (a long collection, a heavy request) has the answer unread in its socket
        # yet, and the turn's reads take it before the verdict (as ``check`` ignores a late
        # tick); on a Clock the turn is the same advance
        clock = self.clock
        pending: list[Any] = []

        def give_up() -> None:
            pending.clear()
            probe.cancel()  # a head that came with no body end is cancelled too (chained)

        pending.append(clock.callLater(
            self.probe_timeout,
            lambda: pending.__setitem__(0, clock.callLater(0, give_up))))

        def stop_timer(result: object) -> object:
            for call in pending:
                if call.active():
                    call.cancel()
            return result

        probe.addBoth(stop_timer)
        self._probing[backend] = probe
        started = self.clock.seconds()

        def answered(code: int) -> None:
            if code == 200:
                self._cleared[backend] = self.clock.seconds()
                log.info("backend {backend}: no byte from {requests} requests for "
                         "{silent:.1f}s, but /health answers: slow, not hung",
                         backend=backend.key, requests=requests, silent=silent)
                return
            judge(f"/health answered {code}")

        def failed(failure: Failure) -> None:
            if not self.watching:
                return
            if timed_out(failure):
                judge(f"/health did not answer in {self.probe_timeout:g}s")
            else:
                judge(f"/health failed: {failure.getErrorMessage()}")

        def judge(probe_result: str) -> None:
            if backend.pace.last_byte != last_byte:
                self._cleared[backend] = self.clock.seconds()
                return  # it sent something while we probed: alive
            if self.pool.get(backend.key) is not backend or not backend.health.healthy:
                return
            waited = silent + self.clock.seconds() - started
            # should it stay in (half the fleet out), suspect it again only after
            # another stall, not at every tick
            self._cleared[backend] = self.clock.seconds()
            self.pool.mark_hung(backend, f"hung: no byte from any of {requests} requests "
                                         f"for {waited:.1f}s and {probe_result}")
            if not backend.health.healthy:  # out: its streams may resume elsewhere
                for request in list(self.live):
                    if request.backend is backend:
                        request.backend_hung()

        probe.addCallbacks(answered, failed)
        probe.addErrback(lambda failure: log.failure("judging {backend}", failure,
                                                     backend=backend.key))
        probe.addBoth(lambda _: self._probing.pop(backend, None))


def timed_out(failure: Failure) -> bool:
    """
    Whether a probe failed by running out of time (cancelled when it did, see
    :meth:`HangDetector._confirm`).  Twisted's Agent turns the cancellation into
    ``ResponseNeverReceived([CancelledError])`` (or ``ResponseFailed`` once the head came).
    """
    if failure.check(defer.TimeoutError, neterror.TimeoutError, defer.CancelledError):
        return True
    if failure.check(ResponseNeverReceived, ResponseFailed):
        reasons = getattr(failure.value, "reasons", [])
        return any(isinstance(reason, Failure) and reason.check(defer.CancelledError)
                   for reason in reasons)
    return False
