"""
One backend's state: :class:`Backend`, and the :class:`Lease` on one of its in-flight slots.

A backend's fields are private and read through properties; each change is a method named
for the event that causes it (a slot taken, a probe passed, an engine scraped...), called
by the :class:`~txlb._cluster.pool.Pool` that owns the backend, or by a lease.  No other
module writes a backend's state (``tests/unit/test_state_ownership.py`` checks it), so the
rules tying fields together -- a drained backend stays drained, a new scrape restarts the
local count, an ejection ends the 5xx streak -- each live in one method here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
from twisted.internet.interfaces import IReactorTime

from txlb._cluster.models import aliases_of
from txlb._cluster.store import Marks
from txlb._config.backends import BackendSpec

#: Weight of the newest sample in the latency averages shown in status.
EWMA_ALPHA = 0.2

#: Backend state a supervisor shares with its worker processes (see
#: :meth:`txlb._cluster.pool.Pool.mirror`): what routing decisions and ``/__lb_status``
#: read, and the prober or operator changes.
SHARED_FIELDS = ("healthy", "draining", "removing", "last_probe_error", "learned_models",
                 "model_entries", "engine_depth", "engine_scrapes", "up_since",
                 "ejected_until", "engine", "kv_cache_usage", "prefix_cache_counts")

#: shared fields that are tuples here and lists in JSON
_TUPLES = frozenset({"learned_models", "prefix_cache_counts"})


@attrs.define(eq=False)
class Backend:
    """
    One upstream server and what the balancer knows about it right now.

    ``eq=False``: two backends are the same only if they are the same object, which keeps
    them usable as dict keys while their counters change.  The constructor takes every
    field by its public name (``Backend(spec, healthy=False)``), for tests and tools that
    build a backend in a given state.
    """

    spec: BackendSpec
    _healthy: bool = True
    _draining: bool = False
    _removing: bool = False
    #: in-flight requests: this process's own count, or with shared counts the
    #: all-process total as last read (:meth:`Pool.refresh`)
    _active: int = 0
    _successes_in_a_row: int = 0
    _failures_in_a_row: int = 0
    _last_probe_error: str | None = None
    _requests: int = 0
    _responses: dict[str, int] = attrs.field(factory=dict)
    _ejections: int = 0
    _probes_ok: int = 0
    _probes_failed: int = 0
    _ewma_duration: float | None = None
    _ewma_ttft: float | None = None
    #: prompt tokens of the answers that said them, and of those the ones the engine
    #: served from its prefix cache (the admin's hit rate)
    _prompt_tokens: int = 0
    _cached_prompt_tokens: int = 0
    _engine_depth: float | None = None
    #: the engine recognised from its ``/metrics`` ("vllm", "sglang", "llamacpp", "tgi",
    #: "unknown"); ``None`` until looked at
    _engine: str | None = None
    #: the engine's KV-cache usage, a fraction (1 = full), when it exports one
    _kv_cache_usage: float | None = None
    #: the engine's prefix-cache counters at the last scrape: (hits, queries) in tokens
    _prefix_cache_counts: tuple[float, float] | None = None
    #: scrapes of the engine's queue so far (a worker process restarts its local count
    #: "since the scrape" when this changes)
    _engine_scrapes: int = 0
    _started_since_scrape: int = 0
    _finished_since_scrape: int = 0
    _learned_models: tuple[str, ...] | None = None
    _model_entries: dict[str, dict[str, object]] = attrs.field(factory=dict)
    _up_since: float | None = None
    _errors_in_a_row: int = 0
    #: when the last byte (head or body) of a proxied response came from it, in this
    #: process: what the hung-backend detector (txlb._cluster.hung) and the prober read
    _last_byte: float | None = None
    #: when the last successful (2xx) response head came from it in this process, and how
    #: long such heads take here (an average of send-to-head times): the hung-backend
    #: detector judges a client that left unanswered against these, its own and the
    #: other backends'.  An error head is a byte (``_last_byte``) but no pace: a 400 in
    #: 2 ms says nothing of how fast the engine answers a request it generates for.
    _last_head: float | None = None
    _head_wait: float | None = None
    _hung_ejections: int = 0
    #: the first two distinct client keys of the current 5xx streak (two are all it needs)
    _streak_clients: tuple[str, ...] = ()
    _outlier_ejections: int = 0
    _ejected_until: float | None = None
    #: set by the pool: its clock and slow-start length, for :attr:`effective_weight`
    clock: IReactorTime | None = attrs.field(default=None, repr=False)
    slow_start: float = 0.0


    # -- in-flight slots (the pool and leases) -------------------------------------------

    def took_slot(self) -> None:
        """A request was sent here: one more in flight, started, and since the scrape."""
        self._active += 1
        self._requests += 1
        self._started_since_scrape += 1

    def gave_slot(self) -> None:
        """A request sent here ended (its lease released)."""
        self._active -= 1
        self._finished_since_scrape += 1

    def untook_slot(self) -> None:
        """
        A slot taken for a choice the shared store refused (``--shared-state``'s
        ``max_conns``): as if never taken -- nothing was sent, nothing finished.
        """
        self._active -= 1
        self._requests = max(0, self._requests - 1)
        # a scrape since the take restarted the count: the take is not in it any more
        self._started_since_scrape = max(0, self._started_since_scrape - 1)

    def counted(self, active: int, requests: int | None = None) -> None:
        """The all-process counts, as the shared counts last read them (``--workers``)."""
        self._active = active
        if requests is not None:
            self._requests = requests

    def heard(self, at: float) -> None:
        """A byte of a proxied response (head or body) arrived from it at ``at``."""
        self._last_byte = at

    def head_came(self, at: float, waited: float, status: int) -> None:
        """
        A proxied response's head of ``status`` arrived at ``at``, ``waited`` seconds after
        its try was sent: a byte whatever the status; a successful one also sets the pace
        (:attr:`last_head`, :attr:`head_wait`).
        """
        self._last_byte = at
        if 200 <= status < 300:
            self._last_head = at
            self._head_wait = _ewma(self._head_wait, waited)

    # -- what the proxy's answers teach --------------------------------------------------

    def record_result(self, status: int, duration: float, ttft: float | None) -> None:
        """Count a finished request's status class and fold its timings into the averages."""
        status_class = f"{status // 100}xx"
        self._responses[status_class] = self._responses.get(status_class, 0) + 1
        self._ewma_duration = _ewma(self._ewma_duration, duration)
        if ttft is not None:
            self._ewma_ttft = _ewma(self._ewma_ttft, ttft)

    def prompt_counted(self, prompt_tokens: int, cached_prompt_tokens: int | None) -> None:
        """An answer said how many prompt tokens it had, and perhaps how many were cached."""
        self._prompt_tokens += prompt_tokens
        if cached_prompt_tokens:
            self._cached_prompt_tokens += cached_prompt_tokens

    def answered(self, status: int, client: str | None) -> int:
        """
        Extend or end the streak of 5xx answers (see
        :func:`txlb._cluster.outlier.judge_answer`); returns its length.  A ``None`` client
        (the request provoked the 5xx itself) neither counts nor resets it.
        """
        if status < 500:
            self._errors_in_a_row = 0
            self._streak_clients = ()
        elif client is not None:
            self._errors_in_a_row += 1
            clients = self._streak_clients
            if client not in clients and len(clients) < 2:
                self._streak_clients = (*clients, client)
        return self._errors_in_a_row

    def ejected(self, until: float) -> None:
        """Ejected as an outlier until ``until``: the streak that did it is over."""
        self._outlier_ejections += 1
        self._ejected_until = until
        self._errors_in_a_row = 0
        self._streak_clients = ()

    def judged_hung(self) -> None:
        self._hung_ejections += 1

    # -- health (the rise/fall state machine) --------------------------------------------

    def went_down(self) -> bool:
        """Out of rotation; ``True`` if it was in (a new ejection)."""
        self._successes_in_a_row = 0
        if not self._healthy:
            return False
        self._healthy = False
        self._ejections += 1
        return True

    def came_up(self, now: float) -> bool:
        """Back in rotation at ``now`` (slow start counts from here); ``True`` if it was out."""
        if self._healthy:
            return False
        self._healthy = True
        self._up_since = now
        self._errors_in_a_row = 0
        self._streak_clients = ()
        return True

    def probe_passed(self, now: float, rise: int) -> bool | None:
        """
        A 200 from the health path.  ``None`` while an outlier ejection's cool-down runs
        (the success does not count), else whether ``rise`` successes in a row are reached.
        """
        self._probes_ok += 1
        if self._ejected_until is not None:
            if now < self._ejected_until:
                self._last_probe_error = None
                return None
            self._ejected_until = None
        self._failures_in_a_row = 0
        self._successes_in_a_row += 1
        self._last_probe_error = None
        return self._successes_in_a_row >= rise

    def probe_failed(self, reason: str) -> int:
        """A failed probe; returns the failures in a row."""
        self._probes_failed += 1
        self._successes_in_a_row = 0
        self._failures_in_a_row += 1
        self._last_probe_error = reason
        return self._failures_in_a_row

    # -- operator state ------------------------------------------------------------------

    def drain(self) -> bool:
        """No new requests; ``True`` if it was not draining already."""
        changed = not self._draining
        self._draining = True
        return changed

    def undrain(self) -> bool:
        changed = self._draining
        self._draining = False
        return changed

    def leaving(self) -> None:
        """Being removed: drained, and forgotten once idle."""
        self._draining = self._removing = True

    def stays(self) -> bool:
        """
        Its removal is called off (a reloaded config lists it again): back in rotation
        unless its health says otherwise; ``True`` if it was being removed.
        """
        if not self._removing:
            return False
        self._draining = self._removing = False
        return True

    # -- configuration (a reload) --------------------------------------------------------

    def respecified(self, spec: BackendSpec) -> None:
        """
        A reloaded config gives it another weight, ``max_conns`` or model list (same
        address).  Its in-flight requests keep their slots: a lowered ``max_conns`` only
        stops new ones until enough have finished.
        """
        if spec.key != self.spec.key:
            raise ValueError(f"backend {self.spec.key} cannot become {spec.key}")
        self.spec = spec

    def ramps_over(self, slow_start: float) -> None:
        """A reloaded ``--slow-start``: a ramp under way continues at the new length."""
        self.slow_start = slow_start

    # -- what the prober learns ----------------------------------------------------------

    def learned(self, entries: dict[str, dict[str, object]], ids: tuple[str, ...]) -> None:
        """Its ``/v1/models`` answer: the entries kept and every name served."""
        self._model_entries = entries
        self._learned_models = ids

    def engine_seen(self, engine: str, kv_cache: float | None) -> None:
        self._engine = engine
        self._kv_cache_usage = kv_cache

    def engine_scraped(self, depth: float, kv_cache: float | None,
                       prefix_cache: tuple[float, float] | None = None) -> None:
        """The engine's own queue: a new scrape restarts the local count since the last."""
        self._kv_cache_usage = kv_cache
        self._prefix_cache_counts = prefix_cache
        self._engine_depth = depth
        self._engine_scrapes += 1
        self._started_since_scrape = 0
        self._finished_since_scrape = 0

    def engine_depth_lost(self) -> bool:
        """The queue could not be scraped; ``True`` if a figure was known (now forgotten)."""
        if self._engine_depth is None:
            return False
        self._engine_depth = None
        return True

    # -- replication between processes (--workers) ---------------------------------------

    def shared_state(self) -> dict[str, Any]:
        """:data:`SHARED_FIELDS`, JSON-ready."""
        state = {}
        for name in SHARED_FIELDS:
            value = getattr(self, name)
            state[name] = list(value) if isinstance(value, tuple) else value
        return state

    def mirror(self, state: Mapping[str, Any]) -> None:
        """Take the supervisor's :meth:`shared_state` of this backend."""
        if state["engine_scrapes"] != self._engine_scrapes:
            # a new scrape counts what this worker sent before it: start again
            self._started_since_scrape = self._finished_since_scrape = 0
        for name in SHARED_FIELDS:
            value = state[name]
            setattr(self, "_" + name, tuple(value) if name in _TUPLES
                    and value is not None else value)

    # -- views ---------------------------------------------------------------------------

    @property
    def marks(self) -> Marks:
        """Its health, drain and removal marks, as a store keeps them."""
        return Marks(self._healthy, self._draining, self._removing)

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def removing(self) -> bool:
        return self._removing

    @property
    def active(self) -> int:
        return self._active

    @property
    def successes_in_a_row(self) -> int:
        return self._successes_in_a_row

    @property
    def failures_in_a_row(self) -> int:
        return self._failures_in_a_row

    @property
    def last_probe_error(self) -> str | None:
        return self._last_probe_error

    @property
    def requests(self) -> int:
        return self._requests

    @property
    def responses(self) -> dict[str, int]:
        return self._responses

    @property
    def ejections(self) -> int:
        return self._ejections

    @property
    def probes_ok(self) -> int:
        return self._probes_ok

    @property
    def probes_failed(self) -> int:
        return self._probes_failed

    @property
    def ewma_duration(self) -> float | None:
        return self._ewma_duration

    @property
    def ewma_ttft(self) -> float | None:
        return self._ewma_ttft

    @property
    def prompt_tokens(self) -> int:
        return self._prompt_tokens

    @property
    def cached_prompt_tokens(self) -> int:
        return self._cached_prompt_tokens

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Cached over all prompt tokens reported; ``None`` before any was."""
        if not self._prompt_tokens:
            return None
        return self._cached_prompt_tokens / self._prompt_tokens

    @property
    def engine_depth(self) -> float | None:
        return self._engine_depth

    @property
    def engine(self) -> str | None:
        return self._engine

    @property
    def kv_cache_usage(self) -> float | None:
        return self._kv_cache_usage

    @property
    def engine_scrapes(self) -> int:
        return self._engine_scrapes

    @property
    def prefix_cache_counts(self) -> tuple[float, float] | None:
        """The engine's prefix-cache (hits, queries) in tokens, as last scraped."""
        return self._prefix_cache_counts

    @property
    def started_since_scrape(self) -> int:
        return self._started_since_scrape

    @property
    def finished_since_scrape(self) -> int:
        return self._finished_since_scrape

    @property
    def learned_models(self) -> tuple[str, ...] | None:
        return self._learned_models

    @property
    def model_entries(self) -> dict[str, dict[str, object]]:
        return self._model_entries

    @property
    def up_since(self) -> float | None:
        return self._up_since

    @property
    def errors_in_a_row(self) -> int:
        return self._errors_in_a_row

    @property
    def last_byte(self) -> float | None:
        return self._last_byte

    @property
    def last_head(self) -> float | None:
        """When its last successful (2xx) response head came, in this process."""
        return self._last_head

    @property
    def head_wait(self) -> float | None:
        """How long its successful (2xx) response heads take, on average, from sending."""
        return self._head_wait

    @property
    def hung_ejections(self) -> int:
        return self._hung_ejections

    @property
    def streak_clients(self) -> tuple[str, ...]:
        return self._streak_clients

    @property
    def outlier_ejections(self) -> int:
        return self._outlier_ejections

    @property
    def ejected_until(self) -> float | None:
        return self._ejected_until

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
        return max(0.01, min(1.0, (self.clock.seconds() - self.up_since) / self.slow_start))

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
                 for alias in aliases_of(entry)}
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
            self._healthy
            and not self._draining
            and (self.spec.max_conns == 0 or self._active < self.spec.max_conns)
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
            # what --policy cache-aware believes this engine's prefix cache holds (filled
            # the same way; null under other policies)
            "prefix_cache": None,
            "responses": dict(sorted(self.responses.items())),
            "ejections": self.ejections,
            "probes_ok": self.probes_ok,
            "probes_failed": self.probes_failed,
            "latency_ewma_s": _rounded(self.ewma_duration),
            "outlier_ejections": self.outlier_ejections,
            "ejected_until": self.ejected_until,
            "ttft_ewma_s": _rounded(self.ewma_ttft),
            "hung_ejections": self.hung_ejections,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefix_cache_hit_rate": _rounded(self.prefix_cache_hit_rate),
        }


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
    _released: bool = False
    _waited: float = 0.0

    @property
    def released(self) -> bool:
        return self._released

    @property
    def waited(self) -> float:
        """Seconds the request queued for this slot (0 if it was free at once)."""
        return self._waited

    def queued_for(self, seconds: float) -> None:
        """The router's queue held the request ``seconds`` before this slot came free."""
        self._waited = seconds

    def heard(self, at: float) -> None:
        """A byte of the response arrived from the backend (the hung detector reads it)."""
        self.backend.heard(at)

    def head_came(self, at: float, waited: float, status: int) -> None:
        """The response's head of ``status`` arrived, ``waited`` seconds after the request
        was sent (the hung detector reads them)."""
        self.backend.head_came(at, waited, status)

    def withdraw(self) -> bool:
        """
        Void the lease without a release: the slot was never used (its choice was refused
        before anything was sent).  ``True`` if it was live; a later :meth:`release` is a
        no-op.
        """
        if self._released:
            return False
        self._released = True
        return True

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.backend.gave_slot()
            self._on_release(self.backend)
