"""
Request -> an in-flight slot on one eligible backend: model-aware, queueing at the caps.

The choice and the slot are taken in one synchronous step (:meth:`Router._take`), so no
other request can run between "this backend has the fewest in flight" and "it now has one
more" -- the property that keeps a burst of N requests on B backends at ceil(N/B) each.

When every backend that could serve a request is at its ``max_conns``, the request waits
in the queue of its priority class (:mod:`txlb._scheduling.classes`): one FIFO deque per
class.  Nothing polls: the pool tells the router whenever capacity appears (a slot
released, a backend up, undrained or added) and the queues are served in order -- first
the waiters past their class's starvation age (every second slot at most), then the
classes by precedence, FIFO within each (or, with ``--fairness vtc``, the tenant that has
received the least first: :mod:`txlb._scheduling.fairness`) -- every waiter the moment a
backend it may use has room.  A waiter whose backends are all full is passed over, so it
never holds up one (of any class) whose backends have room.
"""

from __future__ import annotations

import functools
import math
import random
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from txlb._cluster.backend import Backend
from txlb._cluster.pool import Pool
from txlb._cluster.slots import Lease
from txlb._config.config import Config
from txlb._scheduling.affinity import BoundedLoadRing
from txlb._scheduling.classes import PriorityClasses, QueueClass
from txlb._scheduling.fairness import FairShares
from txlb._scheduling.handoff import SlotHandoff
from txlb._scheduling.model_list import model_list
from txlb._scheduling.policies import IPolicy, IPreparesRequests
from txlb._scheduling.policies.least_conn import LeastConnections
from txlb._scheduling.request import ANY_REQUEST, RoutingRequest

log = Logger()

#: Seconds between two logged failures of the policy's ``choose`` (each request it fails
#: on falls back to least-conn; one traceback a minute says enough of a broken policy)
POLICY_FAILURE_LOG_INTERVAL = 60.0
#: Refused confirmations (``--shared-state``'s ``max_conns``) after which a request stops
#: choosing again and queues: each refusal marks its backend full, so more only happen
#: when other replicas' slots free in between
MAX_REFUSALS = 4


class RoutingError(Exception):
    """A request no backend will take: answered with ``status`` and ``message``."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


@attrs.frozen
class ModelRoute:
    """A client-facing model name split by weight over target models (``[[routes]]``)."""

    model: str
    targets: tuple[tuple[str, int], ...]


@attrs.define(eq=False)
class _Waiter:
    #: the model the choice filters on (see Router._routed): not always request.model
    model: str | None
    request: RoutingRequest
    exclude: frozenset[str]
    since: float
    #: the class it waits in: the request's, or the default class when a reload removed it
    klass: QueueClass
    deferred: Deferred[Lease] | None = None
    timer: IDelayedCall | None = None
    #: in a queue now (an O(1) answer to "was it served by a nested dispatch?")
    queued: bool = False
    #: its slot is being confirmed by the pool's gate (--shared-state's max_conns)
    confirming: bool = False


def retry_after_of(config: Config) -> int:
    """
    ``Retry-After`` of a 503 that no backend could take: the next round of health
    probes, in whole seconds, at least one -- when a backend may be back.
    """
    return max(1, math.ceil(config.health_interval))


class Router:
    """Filters the pool down to what may serve a request and lets the policy choose."""

    def __init__(
        self,
        pool: Pool,
        policy: IPolicy,
        clock: IReactorTime,
        queue_timeout: float = 30.0,
        retry_after: int = 1,
        routes: Mapping[str, ModelRoute] | None = None,
        affinity: BoundedLoadRing | None = None,
        rng: random.Random | None = None,
        forward_unknown_models: bool = False,
        classes: PriorityClasses | None = None,
        fairness: FairShares | None = None,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.clock = clock
        self.queue_timeout = queue_timeout
        self.retry_after = retry_after
        self.routes = dict(routes or {})
        self.affinity = affinity
        #: ``--unknown-model forward``: a model no backend lists goes to any backend
        self.forward_unknown_models = forward_unknown_models
        self._rng = rng or random.Random()
        #: the priority classes (their order, timeouts, guards); without any given, the
        #: built-in three with ``queue_timeout``
        self.classes = classes if classes is not None else PriorityClasses(
            Config(backends=(), queue_timeout=queue_timeout))
        #: the order within a class: arrival, or the tenants' fair shares (VTC)
        self.fairness = fairness if fairness is not None else FairShares()
        #: one queue per class in arrival order, highest class first
        self._queues: dict[str, deque[_Waiter]] = {}
        self._length = 0
        #: the last slot went to a starving waiter: the next goes by precedence, so that
        #: under a sustained overload the guard shares the fleet instead of inverting the
        #: classes (every batch request starving would otherwise take every slot)
        self._starved_last = False
        #: Told the queue's length whenever it changes (a worker process publishes it so
        #: that slots freed in other workers wake this queue; see txlb._workers.supervisor).
        self.on_queue_length: Callable[[int], object] = lambda length: None
        self._regroup()
        self.classes.on_change.append(self._regroup)
        #: what a request is routed by when the policy raises: a bug (or a body it chokes
        #: on) in a policy must cost the balance, never the request or the queue
        self._fallback = LeastConnections()
        self._policy_failure_logged: float | None = None
        #: the policy hashes (or otherwise reads) each request before the lock is taken
        self._prepares = IPreparesRequests.providedBy(policy)
        self.on_queue_wait: Callable[[float], object] = lambda seconds: None
        #: ``--workers``' fair handoff: a free slot left to another worker's waiter
        self.handoff = SlotHandoff(clock, self._dispatch)
        pool.on_change.append(self._dispatch)

    def tell_waits(self, told: Callable[[float], object]) -> None:
        """Tell ``told`` each queued request's wait, when it ends (served or expired)."""
        self.on_queue_wait = told

    def tell_queue_length(self, told: Callable[[int], object]) -> None:
        """Tell ``told`` the queue's length whenever it changes (a worker publishes it)."""
        self.on_queue_length = told

    # -- models ---------------------------------------------------------------------------

    def resolve(self, model: str) -> str:
        """An alias's target, drawn by weight; any other model name as it is."""
        route = self.routes.get(model)
        if route is None:
            return model
        names = [name for name, _ in route.targets]
        weights = [weight for _, weight in route.targets]
        return self._rng.choices(names, weights=weights)[0]

    def _routed(self, model: str | None) -> str | None:
        """
        The model the choice filters on.  With ``--unknown-model forward`` a model no
        known backend lists routes like a request without one (engines such as
        llama.cpp's answer any model name); a model some backend lists, even a down one,
        still goes only to its backends.
        """
        if (model is None or not self.forward_unknown_models
                or any(b.serves(model) for b in self.pool)):
            return model
        return None

    def served_models(self) -> list[str]:
        """Every model some known backend serves (healthy or not), and the aliases."""
        models: set[str] = set(self.routes)
        for backend in self.pool:
            models.update(backend.models or ())
        return sorted(models)

    def model_list(self, only: Sequence[str] | None = None) -> dict[str, object]:
        """``GET /v1/models`` (of the models in ``only``, when given: a tenant's)."""
        return model_list(self.pool, self.routes, only)

    # -- taking a slot ------------------------------------------------------------------

    def acquire(self, request: RoutingRequest = ANY_REQUEST,
                exclude: frozenset[str] = frozenset()) -> Deferred[Lease]:
        """
        A slot on a backend that serves ``request.model`` (any backend for ``None``), now
        or once one frees up; the session key picks by affinity, else the policy chooses,
        seeing ``request``.  Fails with :class:`RoutingError`: 404 when no backend serves
        the model, 503 when none can take it (all down or draining, or the queue wait ran
        out).  Cancelling the Deferred (the client left) takes the request out of the queue.
        """
        model = self._routed(request.model)
        serving = self._serving(model, exclude)
        if model is not None and not serving and not any(
                b.serves(model) for b in self.pool):
            served = ", ".join(self.served_models()) or "none"
            return fail(RoutingError(
                404, f"The model `{model}` does not exist. Served models: {served}"))
        self.fairness.arrived(self.classes.get(request.priority).name, request)
        self._prepare(request)
        lease = self._take(serving, request)
        if lease is not None:
            if self._unconfirmed(lease):
                return self._confirm_then(lease, request, exclude)
            return succeed(lease)
        return self._wait(model, serving, request, exclude)

    def _wait(self, model: str | None, serving: Sequence[Backend], request: RoutingRequest,
              exclude: frozenset[str]) -> Deferred[Lease]:
        """No slot now: queue the request (or refuse it when queueing cannot help)."""
        if not self._queue_worthy(serving):
            what = f"model `{model}`" if model is not None else "this request"
            return fail(RoutingError(503, f"no backend is available for {what}",
                                     self.retry_after))
        klass = self.classes.get(request.priority)
        if klass.shed_at is not None and self._length >= klass.shed_at:
            # shed first: this class does not queue behind this many waiters
            return fail(RoutingError(
                503, f"every backend is at its max_conns and {self._length} requests wait: "
                     f"class `{klass.name}` is not queued", self.retry_after))
        waiter = _Waiter(model, request, exclude, self.clock.seconds(), klass)
        waiting = self._enqueue(waiter)
        if self.pool.shared is not None and self.pool.slots.gate is None:
            # With --workers, a slot freed in another worker wakes this queue only if the
            # supervisor sees it non-empty (published by _enqueue).  A slot freed between
            # the failed take above and that publication would wake nobody: so try once
            # more now that the waiter is visible; a slot freed after this try is
            # announced to us.  (With --shared-state's gate, the poll and the freed
            # channel wake the queue whatever its length: no second try, no second script.)
            lease = self._take(serving, request)
            if lease is not None:
                self._leave(waiter)
                return succeed(lease)
        return waiting

    # -- slots the fleet confirms (--shared-state's max_conns: txlb._shared.slots) -------

    def _unconfirmed(self, lease: Lease) -> bool:
        """Whether ``lease`` is tentative until the pool's gate confirms it."""
        gate = self.pool.slots.gate
        return gate is not None and gate.needs(lease.backend)

    def _confirm_then(self, lease: Lease, request: RoutingRequest,
                      exclude: frozenset[str], refusals: int = 0) -> Deferred[Lease]:
        """
        ``lease`` once the gate confirms it; on a refusal, another choice (the refused
        backend now reads as full), or the queue -- after :data:`MAX_REFUSALS` refusals
        in a row, the queue in any case.  Cancelling (the client left) gives back the
        slot whichever way the answer goes.
        """
        assert self.pool.slots.gate is not None
        current: list[Deferred[Lease]] = []

        def cancel(_: Deferred[Lease]) -> None:
            if current:
                current[0].cancel()

        result: Deferred[Lease] = Deferred(cancel)

        def answered(admitted: bool) -> None:
            if result.called:  # cancelled meanwhile
                if admitted:
                    lease.release()
                else:
                    self.pool.slots.withdraw(lease)
                return
            if admitted:
                result.callback(lease)
                return
            self.pool.slots.withdraw(lease)
            again = self._choose_again(request, exclude, refusals + 1)
            current.append(again)
            again.chainDeferred(result)

        self.pool.slots.gate.confirm(lease.backend).addCallback(answered)
        return result

    def _choose_again(self, request: RoutingRequest, exclude: frozenset[str],
                      refusals: int) -> Deferred[Lease]:
        model = self._routed(request.model)
        serving = self._serving(model, exclude)
        if refusals < MAX_REFUSALS:
            lease = self._take(serving, request)
            if lease is not None:
                if self._unconfirmed(lease):
                    return self._confirm_then(lease, request, exclude, refusals)
                return succeed(lease)
        return self._wait(model, serving, request, exclude)

    def _hand_over(self, waiter: _Waiter, lease: Lease, starving: bool) -> None:
        """
        Give a queued request its slot once the gate confirms it; while it asks, the
        waiter keeps its place (passed over by dispatches); refused, the slot goes back
        and the queue is served again.
        """
        assert self.pool.slots.gate is not None
        waiter.confirming = True

        def answered(admitted: bool) -> None:
            waiter.confirming = False
            assert waiter.deferred is not None
            if waiter.deferred.called:  # expired or cancelled meanwhile
                if admitted:
                    lease.release()
                else:
                    self.pool.slots.withdraw(lease)
                return
            if admitted:
                self._serve(waiter, lease, starving)
                return
            self.pool.slots.withdraw(lease)
            self._dispatch()

        self.pool.slots.gate.confirm(lease.backend).addCallback(answered)

    def _serve(self, waiter: _Waiter, lease: Lease, starving: bool) -> None:
        """A queued request gets its slot."""
        self._leave(waiter)
        self._starved_last = starving
        waited = self.clock.seconds() - waiter.since
        lease.queued_for(waited)
        self.on_queue_wait(waited)
        assert waiter.deferred is not None
        waiter.deferred.callback(lease)

    def can_serve_now(self, model: str | None, exclude: frozenset[str]) -> bool:
        """
        Whether a backend not in ``exclude`` could take this request right now.  Retries
        ask this: a try that would have to queue is not made -- the answer at hand (a
        502/503) goes to the client as it came instead of waiting behind the queue.
        """
        # With --workers a backend's ``active`` is fresh only under the shared lock (other
        # workers take and release slots meanwhile): read the totals there, or a retry
        # would be made into a queue, or refused although a backend is free.
        return self._has_room(self._serving(self._routed(model), exclude))

    def _has_room(self, serving: Sequence[Backend]) -> bool:
        return self.pool.slots.exclusive(lambda: any(b.eligible for b in serving))

    def _serving(self, model: str | None, exclude: frozenset[str]) -> list[Backend]:
        return [b for b in self.pool
                if b.key not in exclude and not b.health.removing
                and (model is None or b.serves(model))]

    @staticmethod
    def _queue_worthy(serving: Sequence[Backend]) -> bool:
        """Worth waiting for: some backend is up and in rotation, only full."""
        return any(b.health.healthy and not b.health.draining and b.spec.max_conns for b in serving)

    def _take(self, serving: Sequence[Backend], request: RoutingRequest) -> Lease | None:
        # With --workers the pool reads the shared counts and holds the lock across
        # processes for the choice and the slot; in one process this is a plain call.
        return self.pool.slots.exclusive(self._choose, serving, request)

    def _choose(self, serving: Sequence[Backend], request: RoutingRequest) -> Lease | None:
        candidates = [b for b in serving if b.eligible]
        if not candidates:
            return None
        if request.session is not None and self.affinity is not None:
            chosen = self.affinity.choose(request.session, candidates)
        else:
            chosen = self._policy_choice(candidates, request)
        return self.pool.slots.acquire(chosen)

    def _prepare(self, request: RoutingRequest) -> None:
        """The policy's per-request work (:class:`IPreparesRequests`), outside the lock."""
        if not self._prepares or (request.session is not None and self.affinity is not None):
            return
        try:
            IPreparesRequests(self.policy).prepare(request)
        except Exception:
            self._policy_failed("policy {policy} failed to prepare a request; it chose "
                                "without")

    def _policy_failed(self, message: str) -> None:
        """Log a policy's failure: with its traceback, at most once a minute."""
        now = self.clock.seconds()
        last = self._policy_failure_logged
        if last is None or now - last >= POLICY_FAILURE_LOG_INTERVAL:
            self._policy_failure_logged = now
            log.failure(message, policy=getattr(self.policy, "name", self.policy))

    def _policy_choice(self, candidates: Sequence[Backend], request: RoutingRequest) -> Backend:
        """
        The policy's choice; least-conn's when the policy raises.  Raising here would fail
        the request (a 500 from twisted.web), or, in :meth:`_dispatch` on a released slot,
        stop the queue's dispatch and leave every later waiter to time out.
        """
        try:
            return self.policy.choose(candidates, request)
        except Exception:
            self._policy_failed("policy {policy} failed to choose a backend; least-conn chose")
            return self._fallback.choose(candidates, request)

    # -- the queue ----------------------------------------------------------------------

    def _enqueue(self, waiter: _Waiter) -> Deferred[Lease]:
        def cancel(_: Deferred[Lease]) -> None:
            self._leave(waiter)

        waiter.deferred = Deferred(cancel)
        waiter.timer = self.clock.callLater(waiter.klass.queue_timeout, self._expire, waiter)
        self._queues[waiter.klass.name].append(waiter)
        self.fairness.joined(waiter.klass.name, waiter.request)
        waiter.queued = True
        self._length += 1
        self.on_queue_length(self._length)
        return waiter.deferred

    def _leave(self, waiter: _Waiter) -> None:
        if waiter.queued:
            waiter.queued = False
            self._queues[waiter.klass.name].remove(waiter)
            self.fairness.left(waiter.klass.name, waiter.request)
            self._length -= 1
            self.on_queue_length(self._length)
        if waiter.timer is not None and waiter.timer.active():
            waiter.timer.cancel()

    def _expire(self, waiter: _Waiter) -> None:
        waiter.timer = None
        self._leave(waiter)
        waited = self.clock.seconds() - waiter.since
        self.on_queue_wait(waited)
        assert waiter.deferred is not None
        waiter.deferred.errback(RoutingError(
            503, f"every backend stayed at its max_conns for {waited:g}s", self.retry_after))

    def _in_order(self) -> Iterator[tuple[_Waiter, bool]]:
        """
        The waiters in the order slots go to them, each with whether it comes as a starving
        one: first, class by class, those past their class's starvation age (the head of
        each queue) while a higher class has waiters -- unless the last slot went to a
        starving waiter -- then every class
        by precedence, in its fair order (:meth:`FairShares.order`).  A snapshot, walked
        lazily: a dispatch that fills the last free slot early looks at no more waiters
        than it must try.
        """
        now = self.clock.seconds()
        snapshots = [(queue[0].klass, list(queue)) for queue in self._queues.values()
                     if queue]
        skip = [0] * len(snapshots)
        for number, (klass, waiters) in enumerate(snapshots):
            if klass.starvation_age is None or number == 0:
                continue  # starving matters behind a higher class only: here, the fair order
            for waiter in waiters:
                if self._starved_last or now - waiter.since < klass.starvation_age:
                    break
                skip[number] += 1
                yield waiter, True
        for (_, waiters), starved in zip(snapshots, skip, strict=True):
            for waiter in self.fairness.order(waiters[starved:]):
                yield waiter, False

    def _dispatch(self) -> None:
        """
        The pool changed: serve waiters in their order (:meth:`_in_order`), each as soon as
        it fits, and answer at once those that nothing can serve any more (their backends
        went down, were drained or removed) instead of leaving them to time out.
        """
        if not self._length:
            return
        #: what failed to take a slot in this dispatch, by (model, exclude): a later waiter
        #: with the same ones would fail too (slots only get fewer while we serve), so it is
        #: passed over -- or answered, when nothing can serve it -- without a second look
        #: at the pool: a release behind a long queue costs a dict lookup per waiter
        failed: dict[tuple[str | None, frozenset[str]], bool] = {}
        for waiter, starving in self._in_order():
            if not waiter.queued or waiter.confirming:
                continue  # served by a nested dispatch (a release while we were serving)
            key = (waiter.model, waiter.exclude)
            worthy = failed.get(key)
            if worthy is True:
                continue
            lease = None
            if worthy is None:
                serving = self._serving(waiter.model, waiter.exclude)
                if not starving and self.handoff.leaves(
                        waiter.klass, waiter.request.tenant,
                        functools.partial(self._has_room, serving)):
                    failed[key] = True  # nor do the later ones of its (model, exclude)
                    continue
                lease = self._take(serving, waiter.request)
                if lease is None:
                    worthy = failed[key] = self._queue_worthy(serving)
            if lease is None:
                if not worthy:
                    self._leave(waiter)
                    assert waiter.deferred is not None
                    what = (f"model `{waiter.model}`" if waiter.model is not None
                            else "this request")
                    waiter.deferred.errback(RoutingError(
                        503, f"no backend is available for {what}", self.retry_after))
                continue
            if self._unconfirmed(lease):
                self._hand_over(waiter, lease, starving)
                continue
            self._serve(waiter, lease, starving)

    def reconfigure(self, config: Config) -> None:
        """
        ``config``'s routing: model routes, ``--unknown-model``, ``--affinity``, the queue
        timeout and ``Retry-After``.  Requests already queued keep their place; their
        deadlines are the priority classes' to recompute (:meth:`_regroup`).  An affinity
        ring kept on keeps what it has placed.
        """
        self.routes = {route.model: ModelRoute(route.model, route.targets)
                       for route in config.routes}
        self.retry_after = retry_after_of(config)
        self.forward_unknown_models = config.unknown_model == "forward"
        if not config.affinity:
            self.affinity = None
        elif self.affinity is None:
            self.affinity = BoundedLoadRing()
        # the queued requests' deadlines follow when the priority classes take the same
        # config (PriorityClasses.reconfigure, one of lb.reconfigurable): each class's
        # timeout falls back to --queue-timeout, and the classes' change regroups the queue
        self.queue_timeout = config.queue_timeout

    def use_policy(self, policy: IPolicy) -> None:
        """Choose with ``policy`` from the next request on (a reload's new ``--policy``)."""
        self.policy = policy
        self._prepares = IPreparesRequests.providedBy(policy)

    def _regroup(self) -> None:
        """
        The classes changed (a reload): one queue per class in the new order.  Waiters keep
        their place in their class (a waiter whose class is gone joins the default class in
        arrival order) and their arrival time; their deadlines are their arrival plus their
        class's queue timeout now (one already past expires at once, on the next turn).
        """
        waiting = [waiter for queue in self._queues.values() for waiter in queue]
        self._queues = {klass.name: deque() for klass in self.classes.order}
        now = self.clock.seconds()
        for waiter in sorted(waiting, key=lambda w: w.since):  # a reload's cost only
            waiter.klass = self.classes.get(waiter.klass.name)
            self._queues[waiter.klass.name].append(waiter)
            if waiter.timer is not None and waiter.timer.active():
                waiter.timer.cancel()
            left = max(0.0, waiter.since + waiter.klass.queue_timeout - now)
            waiter.timer = self.clock.callLater(left, self._expire, waiter)
        self.fairness.regroup((w.klass.name, w.request) for w in waiting if w.queued)
        self.on_queue_length(self._length)  # a reload: the classes' ranks may change

    def abandon_queue(self, message: str) -> None:
        """Refuse every queued request with 503 (the balancer is shutting down)."""
        self.handoff.stop()
        for waiter in [w for queue in self._queues.values() for w in queue]:
            self._leave(waiter)
            if waiter.deferred is not None and not waiter.deferred.called:
                waiter.deferred.errback(RoutingError(503, message, self.retry_after))

    @property
    def queue_length(self) -> int:
        """Requests waiting for a slot now."""
        return self._length

    def queue_lengths(self) -> dict[str, int]:
        """Requests waiting for a slot now, per class (highest first)."""
        return {name: len(queue) for name, queue in self._queues.items()}

    def queue_status(self) -> dict[str, object]:
        """``/__lb_status``'s ``queue``: in all, and per class."""
        now = self.clock.seconds()
        classes: dict[str, object] = {}
        oldest = 0.0
        for klass in self.classes.order:
            queue = self._queues[klass.name]
            wait = round(now - queue[0].since, 3) if queue else 0.0
            oldest = max(oldest, wait)
            classes[klass.name] = {"length": len(queue), "oldest_wait_s": wait,
                                   "timeout_s": klass.queue_timeout}
        return {
            "length": self._length,
            "oldest_wait_s": oldest,
            "timeout_s": self.classes.queue_timeout,
            "classes": classes,
        }
