"""
Backend state and the :class:`Pool` that owns it.

Everything that changes a backend -- the proxy taking and releasing in-flight slots, the
prober marking it up or down, an operator draining, adding or removing it -- goes through
the Pool's methods, so the rules (a slot is released exactly once, a drained backend stays
drained whatever its health, a removed backend leaves only once idle) live in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from txlb._config import BackendSpec
from txlb._records.escape import escape

log = Logger()

#: Weight of the newest sample in the latency averages shown in status.
EWMA_ALPHA = 0.2

_T = TypeVar("_T")


class InFlightStore(Protocol):
    """
    Where in-flight counts live when several processes share the backends
    (:class:`txlb._cluster.shared_counts.SharedCounts`).  Without one, a backend's ``active``
    attribute is the count; with one, ``active`` is a snapshot of the shared total refreshed before
    every choice (:meth:`Pool.exclusive`) and every status answer.
    """

    def register(self, key: str) -> int: ...

    def assign(self, key: str, slot: int) -> None: ...

    def take(self, key: str) -> None: ...

    def give_back(self, key: str) -> None: ...

    def total(self, key: str) -> int: ...

    def started(self, key: str) -> int: ...

    def mine(self, key: str) -> int: ...

    def totals(self) -> Sequence[int]: ...

    def slot(self, key: str) -> int: ...

    def lock(self) -> None: ...

    def unlock(self) -> None: ...


#: Backend state a supervisor shares with its worker processes (see :meth:`Pool.mirror`):
#: what routing decisions and ``/__lb_status`` read, and the prober or operator changes.
SHARED_FIELDS = ("healthy", "draining", "removing", "last_probe_error", "learned_models",
                 "model_entries", "engine_depth", "engine_scrapes", "up_since",
                 "ejected_until", "engine", "kv_cache_usage")


@attrs.define(eq=False)
class Backend:
    """
    One upstream server and what the balancer knows about it right now.

    ``eq=False``: two backends are the same only if they are the same object, which keeps
    them usable as dict keys while their counters change.
    """

    spec: BackendSpec
    healthy: bool = True
    draining: bool = False
    removing: bool = False
    active: int = 0
    successes_in_a_row: int = 0
    failures_in_a_row: int = 0
    last_probe_error: str | None = None
    requests: int = 0
    responses: dict[str, int] = attrs.field(factory=dict)
    ejections: int = 0
    probes_ok: int = 0
    probes_failed: int = 0
    ewma_duration: float | None = None
    ewma_ttft: float | None = None
    engine_depth: float | None = None
    #: the engine recognised from its ``/metrics`` ("vllm", "sglang", "llamacpp", "tgi",
    #: "unknown"); ``None`` until looked at
    engine: str | None = None
    #: the engine's KV-cache usage, a fraction (1 = full), when it exports one
    kv_cache_usage: float | None = None
    #: scrapes of the engine's queue so far (a worker process restarts its local count
    #: "since the scrape" when this changes)
    engine_scrapes: int = 0
    started_since_scrape: int = 0
    finished_since_scrape: int = 0
    learned_models: tuple[str, ...] | None = None
    model_entries: dict[str, dict[str, object]] = attrs.field(factory=dict)
    up_since: float | None = None
    #: set by the pool: its clock and slow-start length, for :attr:`effective_weight`
    clock: Callable[[], float] | None = attrs.field(default=None, repr=False)
    slow_start: float = 0.0
    errors_in_a_row: int = 0
    #: when the last byte (head or body) of a proxied response came from it, in this
    #: process: what the hung-backend detector (txlb._cluster.hung) and the prober read
    last_byte: float | None = None
    hung_ejections: int = 0
    #: the first two distinct client keys of the current 5xx streak (two are all it needs)
    streak_clients: tuple[str, ...] = ()
    outlier_ejections: int = 0
    ejected_until: float | None = None

    @property
    def key(self) -> str:
        return self.spec.key

    @property
    def host(self) -> str:
        return self.spec.host

    @property
    def port(self) -> int:
        return self.spec.port

    @property
    def weight(self) -> int:
        return self.spec.weight

    @property
    def ramp(self) -> float:
        """
        Slow start: how far a recovered backend's weight has ramped back up, from a
        hundredth (never zero: it must be choosable) to 1 over ``slow_start`` seconds.
        """
        if not self.slow_start or self.up_since is None or self.clock is None:
            return 1.0
        return max(0.01, min(1.0, (self.clock() - self.up_since) / self.slow_start))

    @property
    def effective_weight(self) -> float:
        """The weight policies use: the configured weight, scaled during slow start."""
        return self.spec.weight * self.ramp

    @property
    def models(self) -> tuple[str, ...] | None:
        """
        The models this backend serves: configured, else learned from its ``/v1/models``;
        ``None`` while unknown (not configured and not learned yet).
        """
        return self.spec.models or self.learned_models

    @property
    def aliases(self) -> frozenset[str]:
        """
        Names the backend's ``/v1/models`` lists as ``aliases`` of a model (llama.cpp's
        ``--alias``) that are not model ids themselves: served, but not entries of their own.
        """
        names = {alias for entry in self.model_entries.values()
                 for alias in _aliases_of(entry)}
        return frozenset(names - set(self.model_entries))

    def serves(self, model: str) -> bool:
        """Whether a request for ``model`` may go here (an unknown list may hold it)."""
        models = self.models
        return models is None or model in models

    @property
    def base_url(self) -> bytes:
        return f"http://{self.spec.key}".encode("ascii")

    @property
    def eligible(self) -> bool:
        """May receive a new request: healthy, not draining, below its cap."""
        return (
            self.healthy
            and not self.draining
            and (self.spec.max_conns == 0 or self.active < self.spec.max_conns)
        )

    def status(self) -> dict[str, object]:
        """The backend's entry in ``/__lb_status``."""
        return {
            "backend": self.key,
            "healthy": self.healthy,
            "active": self.active,
            "draining": self.draining,
            "weight": self.spec.weight,
            "max_conns": self.spec.max_conns,
            "requests": self.requests,
            "last_probe_error": self.last_probe_error,
            "engine": self.engine,
        }

    def detailed_status(self) -> dict[str, object]:
        """The admin port's fuller view: adds models, counters and latency."""
        return {
            **self.status(),
            "removing": self.removing,
            "models": list(self.models or ()),
            "engine_depth": self.engine_depth,
            "kv_cache_usage": _rounded(self.kv_cache_usage),
            # the latency policy's estimate (IPolicy.describe fills it in the admin API);
            # kept null for other policies so /status keeps one shape
            "latency_peak_ewma_s": None,
            "responses": dict(sorted(self.responses.items())),
            "ejections": self.ejections,
            "probes_ok": self.probes_ok,
            "probes_failed": self.probes_failed,
            "latency_ewma_s": _rounded(self.ewma_duration),
            "outlier_ejections": self.outlier_ejections,
            "ejected_until": self.ejected_until,
            "ttft_ewma_s": _rounded(self.ewma_ttft),
            "hung_ejections": self.hung_ejections,
        }


def _aliases_of(entry: dict[str, object]) -> list[str]:
    """The ``aliases`` of one ``/v1/models`` entry: its non-empty strings, nothing else."""
    aliases = entry.get("aliases")
    if not isinstance(aliases, list):
        return []
    return [alias for alias in aliases if isinstance(alias, str) and alias]


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _ewma(previous: float | None, sample: float) -> float:
    return sample if previous is None else previous + EWMA_ALPHA * (sample - previous)


@attrs.define(eq=False)
class Lease:
    """
    One in-flight slot on a backend, taken by the proxy for the life of one request.

    :meth:`release` is idempotent: the request's many ways out (success, error, timeout,
    client abort, and their overlaps) can each call it and the count falls exactly once.
    """

    backend: Backend
    _on_release: Callable[[Backend], None]
    released: bool = False
    waited: float = 0.0

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.backend.active -= 1
            self._on_release(self.backend)


@attrs.frozen
class OutlierRule:
    """
    Passive outlier detection, as Envoy does it: ``consecutive_5xx`` answers of 5xx in a
    row eject a backend for ``base_cooldown`` seconds times the number of times it was
    ejected (capped at :data:`MAX_COOLDOWN_FACTOR`), and never more than half the fleet
    is out for this reason at once.  ``consecutive_5xx`` 0 disables it.
    """

    consecutive_5xx: int = 5
    base_cooldown: float = 30.0


MAX_COOLDOWN_FACTOR = 10
#: The most model names (ids and aliases) learned from one backend, and their longest: a
#: backend's /v1/models may be 4 MiB, and every name is matched per request and listed in
#: every 404 (200,000 aliases made each 404 3 MB and each request 1 ms slower).
MAX_MODEL_NAMES = 1000
MAX_MODEL_NAME = 512


class Pool:
    """The ordered set of backends, keyed by ``host:port``."""

    def __init__(self, specs: tuple[BackendSpec, ...] = (),
                 clock: Callable[[], float] | None = None,
                 outliers: OutlierRule | None = None, slow_start: float = 0.0,
                 shared: InFlightStore | None = None) -> None:
        self._now = clock or (lambda: 0.0)
        self.slow_start = slow_start
        #: the counts shared with other worker processes, if any (``--workers``)
        self.shared = shared
        self.outliers = outliers or OutlierRule()
        self._backends: dict[str, Backend] = {}
        self._idle_waiters: list[Deferred[None]] = []
        #: Called whenever backends change in a way that matters to waiting requests: a
        #: slot released, a backend up or down, drained, undrained, added or removed (the
        #: router's queue listens here instead of polling).
        self.on_change: list[Callable[[], object]] = []
        #: Called on every change a worker process must mirror: those of ``on_change``
        #: plus what the prober learns (probe errors, models, engine queue depth).
        self.on_update: list[Callable[[], object]] = []
        #: Called with (backend, reason) when this process marks a backend down itself.
        self.on_down: list[Callable[[Backend, str], object]] = []
        for spec in specs:
            self.add(spec)

    def __iter__(self) -> Iterator[Backend]:
        return iter(list(self._backends.values()))

    def __len__(self) -> int:
        return len(self._backends)

    def get(self, key: str) -> Backend | None:
        return self._backends.get(key)

    # -- membership ---------------------------------------------------------------------

    def add(self, spec: BackendSpec) -> Backend:
        if spec.key in self._backends:
            raise ValueError(f"backend {spec.key} already exists")
        if self.shared is not None:
            self.shared.register(spec.key)  # raises ValueError when no slot is left
        backend = self._backends[spec.key] = Backend(spec, clock=self._now,
                                                     slow_start=self.slow_start)
        self._changed()
        return backend

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
        backend.draining = True
        backend.removing = True
        self._forget_if_idle(backend)
        self._changed()

    def _forget_if_idle(self, backend: Backend) -> None:
        if backend.removing and self._held(backend) == 0 and self.get(backend.key) is backend:
            del self._backends[backend.key]
            log.info("backend {backend} removed", backend=backend.key)

    # -- operator state -----------------------------------------------------------------

    def drain(self, backend: Backend) -> None:
        """No new requests; in-flight ones finish.  Survives health changes."""
        if not backend.draining:
            backend.draining = True
            log.info("backend {backend} draining ({active} in flight)",
                     backend=backend.key, active=backend.active)
            self._changed()

    def undrain(self, backend: Backend) -> None:
        if backend.removing:
            raise ValueError(f"backend {backend.key} is being removed")
        if backend.draining:
            backend.draining = False
            log.info("backend {backend} undrained", backend=backend.key)
            self._changed()

    # -- in-flight accounting -----------------------------------------------------------

    def acquire(self, backend: Backend) -> Lease:
        """
        Take an in-flight slot.  Synchronous on purpose: the count rises at the moment of
        choice, before anything else can run, so a burst cannot all see the same idle
        backend.
        """
        backend.active += 1
        backend.requests += 1
        backend.started_since_scrape += 1
        if self.shared is not None:
            self.shared.take(backend.key)
        return Lease(backend, self._released)

    def exclusive(self, choose: Callable[..., _T], *args: Any) -> _T:
        """
        Run ``choose`` (which reads the counts and takes a slot) so that no other process
        sharing the counts can take one in between, on fresh counts.  Without shared
        counts, just a call: one process's choice is already atomic.
        """
        shared = self.shared
        if shared is None:
            return choose(*args)
        shared.lock()
        try:
            totals, slot = shared.totals(), shared.slot
            for backend in self._backends.values():
                backend.active = totals[slot(backend.key)]
            return choose(*args)
        finally:
            shared.unlock()

    def refresh(self) -> None:
        """
        Read the shared counts into each backend's ``active`` and ``requests``, and forget
        removed backends that have gone idle meanwhile.  A no-op in a single process.
        """
        shared = self.shared
        if shared is None:
            return
        totals, slot = shared.totals(), shared.slot
        for backend in list(self._backends.values()):
            backend.active = totals[slot(backend.key)]
            backend.requests = shared.started(backend.key)
            if backend.removing:
                self._forget_if_idle(backend)

    def _held(self, backend: Backend) -> int:
        """Requests in flight on ``backend`` that this process must wait for."""
        return backend.active if self.shared is None else self.shared.mine(backend.key)

    def _released(self, backend: Backend) -> None:
        if self.shared is not None:
            self.shared.give_back(backend.key)
        backend.finished_since_scrape += 1
        self._forget_if_idle(backend)
        self._changed()
        if self._idle_waiters and self.in_flight == 0:
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                waiter.callback(None)

    def capacity_changed(self) -> None:
        """
        Another process sharing the counts freed a slot: let waiting requests look again
        (the router's queue listens on ``on_change``).
        """
        self._changed()

    def when_idle(self) -> Deferred[None]:
        """Fires once no request is in flight on any backend (at once if none is)."""
        if self.in_flight == 0:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._idle_waiters.append(waiter)
        return waiter

    def record_result(self, backend: Backend, status: int, duration: float,
                      ttft: float | None) -> None:
        """Count a finished request's status class and fold its timings into the averages."""
        status_class = f"{status // 100}xx"
        backend.responses[status_class] = backend.responses.get(status_class, 0) + 1
        backend.ewma_duration = _ewma(backend.ewma_duration, duration)
        if ttft is not None:
            backend.ewma_ttft = _ewma(backend.ewma_ttft, ttft)

    def record_answer(self, backend: Backend, status: int, client: str | None = "") -> None:
        """
        A status the backend itself answered (not one txlb made up): feeds the passive
        outlier detection.  ``client`` is the key of the client who sent the request, or
        ``None`` when the request provoked the 5xx itself (see
        :meth:`txlb._proxy.resource.Exchange._blamed`): such an answer neither counts nor resets
        the streak.  A streak ejects only once it spans two clients at least, so one
        client sending requests an engine chokes on cannot take a healthy backend out.
        """
        if status < 500:
            backend.errors_in_a_row = 0
            backend.streak_clients = ()
            return
        if client is None:
            return
        backend.errors_in_a_row += 1
        clients = backend.streak_clients
        if client not in clients and len(clients) < 2:
            backend.streak_clients = (*clients, client)
        rule = self.outliers
        if not rule.consecutive_5xx or backend.errors_in_a_row < rule.consecutive_5xx:
            return
        if len(backend.streak_clients) < 2 or not backend.healthy:
            return
        now = self._now()
        down = sum(1 for b in self._backends.values() if not b.healthy)
        if (down + 1) * 2 > len(self._backends):
            if backend.errors_in_a_row == rule.consecutive_5xx:  # once per run of 5xx
                log.warn("backend {backend} answered {count} 5xx in a row but stays in: "
                         "half the fleet is already out", backend=backend.key,
                         count=backend.errors_in_a_row)
            return
        backend.outlier_ejections += 1
        cooldown = rule.base_cooldown * min(backend.outlier_ejections, MAX_COOLDOWN_FACTOR)
        backend.ejected_until = now + cooldown
        count = backend.errors_in_a_row
        backend.errors_in_a_row = 0
        backend.streak_clients = ()
        self.mark_down(backend, f"outlier: {count} 5xx answers in a row from "
                                f"2 clients or more; ejected for {cooldown:g}s")

    def mark_hung(self, backend: Backend, reason: str) -> None:
        """
        The hung-backend detector's verdict (txlb._cluster.hung): out of rotation now, unless that
        would take more than half the fleet out -- the detector judges from silence, and a
        silence shared by so many is more likely txlb's or the network's than theirs.
        """
        if not backend.healthy:
            return
        down = sum(1 for b in self._backends.values() if not b.healthy)
        if (down + 1) * 2 > len(self._backends):
            log.warn("backend {backend} looks hung but stays in: half the fleet is "
                     "already out ({reason})", backend=backend.key, reason=reason)
            return
        backend.hung_ejections += 1
        self.mark_down(backend, reason)

    # -- what the prober learns ---------------------------------------------------------

    def set_models(self, backend: Backend, entries: list[dict[str, object]]) -> None:
        """
        The backend's ``/v1/models`` answer: the names it serves -- each model's id and its
        ``aliases`` (llama.cpp lists them; a client may ask for any) -- and the entries.
        """
        names: dict[str, None] = {}
        dropped = 0

        def keep(name: str) -> bool:
            nonlocal dropped
            if name in names:
                return True
            if len(name) > MAX_MODEL_NAME or len(names) >= MAX_MODEL_NAMES:
                dropped += 1
                return False
            names[name] = None
            return True

        kept = {}
        for entry in entries:
            if "id" in entry and keep(str(entry["id"])):
                kept[str(entry["id"])] = entry
        for model_id, entry in kept.items():
            aliases = _aliases_of(entry)
            listed = [alias for alias in aliases if keep(alias)]
            if len(listed) < len(aliases):
                kept[model_id] = {**entry, "aliases": listed}  # what GET /v1/models shows
        if dropped:
            log.warn("backend {backend} lists {dropped} more model names than txlb learns "
                     "(at most {most}, of {longest} characters or fewer); requests for "
                     "those get --unknown-model's answer", backend=backend.key,
                     dropped=dropped, most=MAX_MODEL_NAMES, longest=MAX_MODEL_NAME)
        backend.model_entries = kept
        ids = tuple(names)
        if ids != backend.learned_models:
            # the names are the backend's to choose: escaped, so none can forge a log line
            log.info("backend {backend} serves {models}", backend=backend.key,
                     models=escape(", ".join(ids), "text") or "no model")
        backend.learned_models = ids
        self._updated()

    def set_engine(self, backend: Backend, engine: str,
                   kv_cache: float | None = None) -> None:
        """The engine recognised from the backend's ``/metrics``, and its KV-cache usage."""
        if engine != backend.engine:
            log.info("backend {backend} runs {engine}", backend=backend.key, engine=engine)
        backend.engine = engine
        backend.kv_cache_usage = kv_cache
        self._updated()

    def set_engine_depth(self, backend: Backend, running: float, waiting: float,
                         kv_cache: float | None = None) -> None:
        """The engine's own queue, scraped from its ``/metrics``; restarts the local count."""
        backend.kv_cache_usage = kv_cache
        backend.engine_depth = running + waiting
        backend.engine_scrapes += 1
        backend.started_since_scrape = 0
        backend.finished_since_scrape = 0
        self._updated()

    def forget_engine_depth(self, backend: Backend) -> None:
        """
        The engine's queue could not be scraped: policies fall back to local counts
        rather than act on a stale figure.  Through the pool (not by writing the attribute)
        so that worker processes mirror the fallback too.
        """
        if backend.engine_depth is not None:
            backend.engine_depth = None
            self._updated()

    # -- health -------------------------------------------------------------------------

    def mark_down(self, backend: Backend, reason: str) -> None:
        """Take a backend out of rotation now (definitive failure or passive ejection)."""
        backend.successes_in_a_row = 0
        if backend.healthy:
            backend.healthy = False
            backend.ejections += 1
            log.warn("backend {backend} marked down: {reason}", backend=backend.key,
                     reason=reason)
            for listener in list(self.on_down):
                listener(backend, reason)
            self._changed()

    def mark_up(self, backend: Backend) -> None:
        if not backend.healthy:
            backend.healthy = True
            backend.up_since = self._now()
            backend.errors_in_a_row = 0
            backend.streak_clients = ()
            log.info("backend {backend} is back up", backend=backend.key)
            self._changed()

    def probe_succeeded(self, backend: Backend, rise: int) -> None:
        """
        A 200 from the health path: ``rise`` of these in a row bring a backend back --
        once the cool-down of an outlier ejection, if any, is over.
        """
        backend.probes_ok += 1
        if backend.ejected_until is not None:
            if self._now() < backend.ejected_until:
                backend.last_probe_error = None
                self._updated()
                return
            backend.ejected_until = None
        backend.failures_in_a_row = 0
        backend.successes_in_a_row += 1
        backend.last_probe_error = None
        if backend.successes_in_a_row >= rise:
            self.mark_up(backend)
        self._updated()

    def probe_failed(self, backend: Backend, reason: str, definitive: bool, fall: int) -> None:
        """
        A failed probe.  Definitive failures (refused, a non-200 answer) mark the backend
        down at once; ambiguous ones (timeout, reset) only after ``fall`` in a row, so one
        lost packet does not take a GPU out of rotation.
        """
        backend.probes_failed += 1
        backend.successes_in_a_row = 0
        backend.failures_in_a_row += 1
        backend.last_probe_error = reason
        if definitive or backend.failures_in_a_row >= fall:
            self.mark_down(backend, reason)
        self._updated()

    # -- views --------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests in flight that this process holds (its own, with shared counts)."""
        if self.shared is not None:
            return sum(self._held(backend) for backend in self._backends.values())
        return sum(backend.active for backend in self._backends.values())

    def status(self) -> dict[str, object]:
        """The body of ``GET /__lb_status``."""
        self.refresh()
        backends = list(self)
        return {
            "healthy": sum(1 for b in backends if b.healthy),
            "total": len(backends),
            "backends": [b.status() for b in backends],
        }

    # -- replication between processes (--workers) --------------------------------------

    def shared_state(self) -> list[dict[str, Any]]:
        """
        What a worker process needs to know of every backend, in order: its spec, its slot
        in the shared counts and :data:`SHARED_FIELDS` (JSON-ready).
        """
        states = []
        for backend in self._backends.values():
            spec = backend.spec
            state: dict[str, Any] = {
                "spec": [spec.host, spec.port, spec.weight, spec.max_conns, list(spec.models)],
                "slot": None if self.shared is None else self.shared.register(spec.key),
            }
            for name in SHARED_FIELDS:
                value = getattr(backend, name)
                state[name] = list(value) if isinstance(value, tuple) else value
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
            if backend is None or backend.spec != spec:
                backend = Backend(spec, clock=self._now, slow_start=self.slow_start)
                self._backends[spec.key] = backend
            if state["engine_scrapes"] != backend.engine_scrapes:
                # a new scrape counts what this worker sent before it: start again
                backend.started_since_scrape = backend.finished_since_scrape = 0
            for name in SHARED_FIELDS:
                value = state[name]
                setattr(backend, name, tuple(value) if name == "learned_models"
                        and value is not None else value)
            order.append(spec.key)
        known = set(order)
        for key, backend in list(self._backends.items()):
            if key not in known:
                backend.draining = backend.removing = True
                order.append(key)
        self._backends = {key: self._backends[key] for key in order}
        for backend in list(self._backends.values()):
            if backend.removing:
                self._forget_if_idle(backend)
        self._changed()
