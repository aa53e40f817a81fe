"""
The :class:`Pool`: the ordered set of backends, and the one door to their state.

Everything that changes a backend -- the prober marking it up or down, an operator
draining, adding or removing it, the proxy's answers -- goes through the Pool's methods, so
the rules (a drained backend stays drained whatever its health, a removed backend leaves
only once idle) live in one place, and every change reaches the listeners (the router's
queue, the worker processes) that must hear of it.  The in-flight slots the proxy takes and
gives back are the pool's :attr:`Pool.slots` (:mod:`txlb._cluster.slots`); what one backend
is lives in :mod:`txlb._cluster.backend`; when its own answers eject it, in
:mod:`txlb._cluster.outlier`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import Clock
from twisted.logger import Logger

from txlb._cluster.backend import Backend
from txlb._cluster.local_store import LocalStore
from txlb._cluster.models import MAX_MODEL_NAME, MAX_MODEL_NAMES, learn
from txlb._cluster.outlier import OutlierRule, fleet_can_spare, judge_answer
from txlb._cluster.slots import Slots
from txlb._cluster.slow_start import SlowStart
from txlb._cluster.store import IBackendStore, IInFlightCounts
from txlb._config.backends import BackendSpec
from txlb._config.config import Config
from txlb._log.escape import escape

log = Logger()

class Pool:
    """The ordered set of backends, keyed by ``host:port``."""

    def __init__(self, specs: tuple[BackendSpec, ...] = (),
                 clock: IReactorTime | None = None,
                 outliers: OutlierRule | None = None, slow_start: float = 0.0,
                 shared: IInFlightCounts | None = None,
                 store: IBackendStore | None = None) -> None:
        #: the time every verdict and slow start is measured on (a stopped clock at 0 if
        #: none is given: a pool built for a test or a tool that never waits)
        self.clock: IReactorTime = clock if clock is not None else Clock()
        self._now = self.clock.seconds
        self.slow_start = slow_start
        #: where the state several balancers agree on lives (txlb._cluster.store); by
        #: default this process, with ``shared`` as its in-flight counts
        self.store: IBackendStore = store if store is not None else LocalStore(counts=shared)
        #: the counts shared with other worker processes, if any (``--workers``)
        self.shared: IInFlightCounts | None = self.store.counts
        self.outliers = outliers or OutlierRule()
        self._backends: dict[str, Backend] = {}
        #: the in-flight slots on these backends (the router takes them, leases give them
        #: back); a slot given back may let a removed backend go, and wakes waiting requests
        self.slots = Slots(lambda: self._backends.values(), self.shared,
                           self._forget_if_idle, self._changed)
        #: Called whenever backends change in a way that matters to waiting requests: a
        #: slot released, a backend up or down, drained, undrained, added or removed (the
        #: router's queue listens here instead of polling).
        self.on_change: list[Callable[[], object]] = []
        #: Called on every change a worker process must mirror: those of ``on_change``
        #: plus what the prober learns (probe errors, models, engine queue depth).
        self.on_update: list[Callable[[], object]] = []
        #: Called with (backend, reason) when this process marks a backend down itself.
        self.on_down: list[Callable[[Backend, str], object]] = []
        #: the backends the shared store added here (another replica's): DNS membership
        #: adopts one that its own names yield, so its own DNS removes it later
        self.learned: set[str] = set()
        #: asked when the shared store removes a backend and the removal is not marked as
        #: an operator's: ``True`` keeps it here and says so in the store (this replica's
        #: own DNS still yields it; another replica's DNS letting it go is no reason)
        self._keeps: Callable[[Backend], bool] = lambda backend: False
        #: Called with a backend another balancer found refusing connections: probe it now
        #: (its own probe refused too takes it out here).  With no listener, the shared
        #: refusal takes it out at once.
        self.on_suspect: list[Callable[[Backend], object]] = []
        #: where each backend came from, when its adder said ("config", "admin",
        #: "dns:NAME"): the store keeps it with its marks
        self._origins: dict[str, str | None] = {}
        for spec in specs:
            self.add(spec, origin="config")
        # the configured fleet is in; any later save (a drain, a reload) is a change
        self.store.marks.configured()

    def __iter__(self) -> Iterator[Backend]:
        return iter(list(self._backends.values()))

    def __len__(self) -> int:
        return len(self._backends)

    def get(self, key: str) -> Backend | None:
        return self._backends.get(key)

    # -- membership ---------------------------------------------------------------------

    def add(self, spec: BackendSpec, ramp: bool = False,
            origin: str | None = None) -> Backend:
        """
        A new backend, in rotation at once; ``ramp``: its share starts at the bottom of
        ``--slow-start``'s ramp, as a recovered backend's does (a reload adds it so);
        ``origin``: who added it (``"config"``, ``"admin"``, ``"dns:NAME"``), kept with
        its entry in a shared store (:meth:`origin`).
        """
        if spec.key in self._backends:
            raise ValueError(f"backend {spec.key} already exists")
        self.learned.discard(spec.key)
        if self.shared is not None:
            self.shared.register(spec.key)  # raises ValueError when no slot is left
        up_since = self._now() if ramp and self.slow_start else None
        backend = self._backends[spec.key] = self._new(spec, up_since)
        self._origins[spec.key] = origin
        self._marked(backend)
        self._changed()
        return backend

    def _new(self, spec: BackendSpec, up_since: float | None = None) -> Backend:
        """A backend on this pool's clock and ``--slow-start``."""
        return Backend(spec, slow_start=SlowStart(self.clock, self.slow_start, up_since))

    def ask_before_store_removal(self, keeps: Callable[[Backend], bool]) -> None:
        """
        Ask ``keeps`` before a removal the shared store made (not an operator's) applies
        here: ``True`` keeps the backend (DNS membership: this replica's names still yield
        it).
        """
        self._keeps = keeps

    def _changed(self) -> None:
        for listener in list(self.on_change):
            try:
                listener()
            except Exception:
                log.failure("a pool listener failed")
        if self.on_update:
            self._updated()

    def _updated(self) -> None:
        for listener in list(self.on_update):
            try:
                listener()
            except Exception:
                log.failure("a pool listener failed")

    def remove(self, backend: Backend) -> None:
        """
        Drain ``backend`` and forget it once its last in-flight request ends (at once if
        idle), so removing a GPU never cuts a running generation.
        """
        backend.health.leaving()
        self._marked(backend)
        self._forget_if_idle(backend)
        self._changed()

    def _forget_if_idle(self, backend: Backend) -> None:
        if (backend.health.removing and self.slots.held(backend) == 0
                and self.get(backend.key) is backend):
            del self._backends[backend.key]
            self.learned.discard(backend.key)
            self._origins.pop(backend.key, None)
            self.store.marks.forget(backend.key)
            log.info("backend {backend} removed", backend=backend.key)

    def origin(self, key: str) -> str | None:
        """
        Who added the backend of ``key``: this balancer's adder, or (a backend another
        balancer added) the one the store names.
        """
        origin = self._origins.get(key)
        return origin if origin is not None else self.store.marks.origin(key)

    def _marked(self, backend: Backend, reason: str = "") -> None:
        """Added here or its marks changed here: the store keeps them for other balancers."""
        self.store.marks.save(backend.spec, backend.health.marks, reason,
                              origin=self._origins.get(backend.key))

    def _take_marks(self) -> bool:
        """
        Take the backends and marks other balancers saved in the store (:meth:`refresh`),
        through the same transitions as our own verdicts (a backend coming back starts its
        slow start); ``True`` if anything changed.
        """
        changed = False
        suspects: list[Backend] = []
        for spec, stored in self.store.marks.members():
            backend = self._backends.get(spec.key)
            if backend is None:
                if stored.removing:
                    self.store.marks.forget(spec.key)  # nothing here to let go
                    continue
                if self.shared is not None:
                    self.shared.register(spec.key)
                backend = self._backends[spec.key] = self._new(spec)
                log.info("backend {backend} added (from the shared store)",
                         backend=spec.key)
                self.learned.add(spec.key)
                changed = True
            kept = False
            if stored.removing and not backend.health.removing:
                if self._operators(spec.key):
                    self.learned.discard(spec.key)  # an operator's: not DNS's to adopt
                elif self._keeps(backend):  # not removed here (nor drained, as removing
                    # implies): its own drain and the entry's health apply
                    stored = attrs.evolve(stored, removing=False, draining=backend.health.draining)
                    kept = True
            if stored == backend.health.marks:
                if kept:
                    self._marked(backend)  # and it stays in the store too
                continue
            changed = True
            if stored.removing and not backend.health.removing:
                backend.health.leaving()
            elif stored.draining and not backend.health.removing:
                backend.health.drain()
            elif not backend.health.removing:
                backend.health.undrain()
            if stored.healthy is True and not backend.health.healthy:
                backend.came_up(self._now())
            elif backend.health.healthy and stored.healthy is False:
                if self.on_suspect:
                    # one replica's refusal may be its own network's (a firewall on its
                    # host): each replica's own probe decides, or a refused replica and
                    # a reaching one would take the engine out and back everywhere in turn
                    suspects.append(backend)
                else:
                    backend.health.went_down()
            log.info("backend {backend} is now {marks} (from the shared store)",
                     backend=backend.key, marks=stored)
            if kept:
                self._marked(backend)
        for backend in suspects:
            for listener in list(self.on_suspect):
                try:
                    listener(backend)
                except Exception:
                    log.failure("a pool listener failed")
        return changed

    def _operators(self, key: str) -> bool:
        """Whether the store's last entry for ``key`` was an operator's (the admin API's)."""
        return self.store.marks.origin(key) == "admin"

    # -- configuration (a reload) ---------------------------------------------------------

    def respecify(self, backend: Backend, spec: BackendSpec) -> None:
        """
        Another weight, ``max_conns`` or model list for ``backend``, in place: its counts,
        health, drain mark and in-flight requests stay.  Waiting requests look again (a
        raised ``max_conns`` has room for them now).
        """
        if spec == backend.spec:
            return
        backend.respecified(spec)
        log.info("backend {backend} is now weight {weight}, max_conns {max_conns}, models "
                 "{models}", backend=backend.key, weight=spec.weight,
                 max_conns=spec.max_conns,
                 models=escape(", ".join(spec.models), "text") or "learned")
        self._changed()

    def keep(self, backend: Backend, why: str = "the new config lists it") -> None:
        """Call off the removal of ``backend`` (a reloaded config lists it again)."""
        if backend.health.stays():
            log.info("backend {backend} stays: {why}", backend=backend.key, why=why)
            self._marked(backend)
            self._changed()

    def reconfigure(self, config: Config) -> None:
        """``config``'s outlier rule (``--outlier-5xx``, ``--outlier-cooldown``) and slow start."""
        self.retune(OutlierRule(consecutive_5xx=config.outlier_5xx,
                                base_cooldown=config.outlier_cooldown), config.slow_start)

    def retune(self, outliers: OutlierRule, slow_start: float) -> None:
        """
        New outlier rules and slow-start length: streaks and ejections under way are
        kept and judged by the new rule from the next answer on.
        """
        self.outliers = outliers
        if slow_start != self.slow_start:
            self.slow_start = slow_start
            for backend in self._backends.values():
                backend.slow_start.ramps_over(slow_start)
            self._changed()

    # -- operator state -----------------------------------------------------------------

    def drain(self, backend: Backend) -> None:
        """No new requests; in-flight ones finish.  Survives health changes."""
        if backend.health.drain():
            log.info("backend {backend} draining ({active} in flight)",
                     backend=backend.key, active=backend.counts.active)
            self._marked(backend)
            self._changed()

    def undrain(self, backend: Backend) -> None:
        if backend.health.removing:
            raise ValueError(f"backend {backend.key} is being removed")
        if backend.health.undrain():
            log.info("backend {backend} undrained", backend=backend.key)
            self._marked(backend)
            self._changed()

    # -- what answers teach -------------------------------------------------------------

    def refresh(self) -> None:
        """
        Read what other processes changed: the shared counts into each backend's
        ``active`` and ``requests``, and the marks other balancers saved in the store;
        then forget removed backends that have gone idle meanwhile.  A no-op in a single
        process with the local store.
        """
        changed = self._take_marks()
        self.slots.recount()
        if self.shared is not None or changed:
            for backend in list(self._backends.values()):
                if backend.health.removing:
                    self._forget_if_idle(backend)
        if changed:
            self._changed()

    def record_result(self, backend: Backend, status: int, duration: float,
                      ttft: float | None) -> None:
        """Count a finished request's status class and fold its timings into the averages."""
        backend.counts.finished(status)
        backend.pace.timed(duration, ttft)

    def record_prompt(self, backend: Backend, prompt_tokens: int,
                      cached_prompt_tokens: int | None) -> None:
        """An answer's prompt tokens, and those its engine served from its prefix cache."""
        backend.counts.prompt_counted(prompt_tokens, cached_prompt_tokens)

    def record_answer(self, backend: Backend, status: int, client: str | None = "") -> None:
        """
        A status the backend itself answered (not one txlb made up): feeds the passive
        outlier detection (:func:`txlb._cluster.outlier.judge_answer`).  ``client`` is the
        key of the client who sent the request, or ``None`` when the request provoked the
        5xx itself (see :meth:`txlb._proxy.exchange.Exchange._blamed`).
        """
        reason = judge_answer(self.outliers, backend, status, client,
                              self._backends.values(), self._now())
        if reason is not None:
            self.mark_down(backend, reason)

    def mark_hung(self, backend: Backend, reason: str) -> None:
        """
        The hung-backend detector's verdict (txlb._cluster.hung): out of rotation now, unless that
        would take more than half the fleet out -- the detector judges from silence, and a
        silence shared by so many is more likely txlb's or the network's than theirs.
        """
        if not backend.health.healthy:
            return
        if not fleet_can_spare(self._backends.values()):
            log.warn("backend {backend} looks hung but stays in: half the fleet is "
                     "already out ({reason})", backend=backend.key, reason=reason)
            return
        backend.verdicts.judged_hung()
        self.mark_down(backend, reason)

    # -- what the prober learns ---------------------------------------------------------

    def set_models(self, backend: Backend, entries: list[dict[str, object]]) -> None:
        """
        The backend's ``/v1/models`` answer: the names it serves -- each model's id and its
        ``aliases`` (llama.cpp lists them; a client may ask for any) -- and the entries.
        """
        learned = learn(entries)
        if learned.dropped:
            log.warn("backend {backend} lists {dropped} more model names than txlb learns "
                     "(at most {most}, of {longest} characters or fewer); requests for "
                     "those get --unknown-model's answer", backend=backend.key,
                     dropped=learned.dropped, most=MAX_MODEL_NAMES, longest=MAX_MODEL_NAME)
        ids = learned.names
        if ids != backend.listing.names:
            # the names are the backend's to choose: escaped, so none can forge a log line
            log.info("backend {backend} serves {models}", backend=backend.key,
                     models=escape(", ".join(ids), "text") or "no model")
        backend.listing.learned(learned.entries, ids)
        self._updated()

    def set_engine(self, backend: Backend, engine: str,
                   kv_cache: float | None = None) -> None:
        """The engine recognised from the backend's ``/metrics``, and its KV-cache usage."""
        if engine != backend.engine.name:
            log.info("backend {backend} runs {engine}", backend=backend.key, engine=engine)
        backend.engine.seen(engine, kv_cache)
        self._updated()

    def set_engine_depth(self, backend: Backend, running: float, waiting: float,
                         kv_cache: float | None = None,
                         prefix_cache: tuple[float, float] | None = None) -> None:
        """
        The engine's own queue, scraped from its ``/metrics`` (with its KV-cache usage and
        prefix-cache counters); restarts the local count.
        """
        backend.engine_scraped(running + waiting, kv_cache, prefix_cache)
        self._updated()

    def forget_engine_depth(self, backend: Backend) -> None:
        """
        The engine's queue could not be scraped: policies fall back to local counts
        rather than act on a stale figure.  Through the pool (not by writing the attribute)
        so that worker processes mirror the fallback too.
        """
        if backend.engine.depth_lost():
            self._updated()

    # -- health -------------------------------------------------------------------------

    def mark_down(self, backend: Backend, reason: str) -> None:
        """Take a backend out of rotation now (definitive failure or passive ejection)."""
        if backend.health.went_down():
            log.warn("backend {backend} marked down: {reason}", backend=backend.key,
                     reason=reason)
            self._marked(backend, reason)
            for listener in list(self.on_down):
                listener(backend, reason)
            self._changed()

    def mark_up(self, backend: Backend) -> None:
        if backend.came_up(self._now()):
            log.info("backend {backend} is back up", backend=backend.key)
            self._marked(backend)
            self._changed()

    def probe_succeeded(self, backend: Backend, rise: int) -> None:
        """
        A 200 from the health path: ``rise`` of these in a row bring a backend back --
        once the cool-down of an outlier ejection, if any, is over.
        """
        passed = backend.health.probe_passed(self._now(), rise)
        if passed:
            self.mark_up(backend)
        self._updated()

    def probe_failed(self, backend: Backend, reason: str, definitive: bool, fall: int) -> None:
        """
        A failed probe.  Definitive failures (refused, a non-200 answer) mark the backend
        down at once; ambiguous ones (timeout, reset) only after ``fall`` in a row, so one
        lost packet does not take a GPU out of rotation.
        """
        failures = backend.health.probe_failed(reason)
        if definitive or failures >= fall:
            self.mark_down(backend, reason)
        self._updated()

    # -- views --------------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        """The body of ``GET /__lb_status``."""
        self.refresh()
        backends = list(self)
        return {
            "healthy": sum(1 for b in backends if b.health.healthy),
            "total": len(backends),
            "backends": [b.status() for b in backends],
        }

    # -- replication between processes (--workers) --------------------------------------

    def shared_state(self) -> list[dict[str, Any]]:
        """
        What a worker process needs to know of every backend, in order: its spec, its slot
        in the shared counts and :data:`~txlb._cluster.backend.SHARED_FIELDS` (JSON-ready).
        """
        states = []
        for backend in self._backends.values():
            spec = backend.spec
            state: dict[str, Any] = {
                "spec": [spec.host, spec.port, spec.weight, spec.max_conns, list(spec.models)],
                "slot": None if self.shared is None else self.shared.register(spec.key),
                **backend.shared_state(),
            }
            states.append(state)
        return states

    def mirror(self, states: Sequence[dict[str, Any]]) -> None:
        """
        Make this pool a copy of the supervisor's (:meth:`shared_state`): add the backends
        it has, take its health, drain and model state, and remove (once idle here) those
        it no longer has.  In-flight counts are not copied: they are shared already.
        """
        order = []
        for state in states:
            host, port, weight, max_conns, models = state["spec"]
            spec = BackendSpec(host, port, weight, max_conns, tuple(models))
            if self.shared is not None and state.get("slot") is not None:
                self.shared.assign(spec.key, state["slot"])
            backend = self._backends.get(spec.key)
            if backend is None:
                backend = self._new(spec)
                self._backends[spec.key] = backend
            elif backend.spec != spec:
                # reconfigured in the supervisor: in place, so the requests this worker
                # has in flight there release the same backend they took
                backend.respecified(spec)
            backend.mirror(state)
            self._marked(backend)
            order.append(spec.key)
        known = set(order)
        for key, backend in list(self._backends.items()):
            if key not in known:
                backend.health.leaving()
                self._marked(backend)
                order.append(key)
        self._backends = {key: self._backends[key] for key in order}
        for backend in list(self._backends.values()):
            if backend.health.removing:
                self._forget_if_idle(backend)
        self._changed()
