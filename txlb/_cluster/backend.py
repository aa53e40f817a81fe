"""
One backend: :class:`Backend`, its identity and the parts that say what is known of it.

What the balancer knows of a backend comes in parts, each with one job and its own rules:
its health and operator marks (:mod:`~txlb._cluster.backend_health`), the passive
detectors' verdicts (:mod:`~txlb._cluster.backend_verdicts`), its counters
(:mod:`~txlb._cluster.backend_counts`), its pace (:mod:`~txlb._cluster.backend_pace`), its
engine's own figures (:mod:`~txlb._cluster.backend_engine`), the models it listed
(:mod:`~txlb._cluster.backend_models`) and its weight ramp (:mod:`~txlb._cluster.slow_start`).
Each part's fields are private and read through properties, and each change is a method
named for the event that causes it, called by the :class:`~txlb._cluster.pool.Pool` that
owns the backend, or by a lease.  No other module writes a backend's state
(``tests/unit/test_state_ownership.py`` checks it).  The Backend itself keeps what needs
several parts at once: whether it may take a request, the events that change more than one
part (back up, ejected, scraped), its status entry, and what worker processes mirror.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from txlb._cluster.backend_counts import Counts
from txlb._cluster.backend_engine import EngineReading
from txlb._cluster.backend_health import Health
from txlb._cluster.backend_models import ModelListing
from txlb._cluster.backend_pace import Pace
from txlb._cluster.backend_verdicts import Verdicts
from txlb._cluster.slow_start import SlowStart
from txlb._config.backends import BackendSpec

#: Backend state a supervisor shares with its worker processes (see
#: :meth:`txlb._cluster.pool.Pool.mirror`): what routing decisions and ``/__lb_status``
#: read, and the prober or operator changes.
SHARED_FIELDS = ("healthy", "draining", "removing", "last_probe_error", "learned_models",
                 "model_entries", "engine_depth", "engine_scrapes", "up_since",
                 "ejected_until", "engine", "kv_cache_usage", "prefix_cache_counts")

#: a part is made with its backend and stays its for good
_PART = attrs.setters.frozen


@attrs.define(eq=False)
class Backend:
    """
    One upstream server and what the balancer knows about it right now.

    ``eq=False``: two backends are the same only if they are the same object, which keeps
    them usable as dict keys while their counters change.  The constructor takes each part
    (``Backend(spec, health=Health(healthy=False))``), for tests and tools that build a
    backend in a given state; a part is never replaced, only changed by its methods.
    """

    spec: BackendSpec
    health: Health = attrs.field(factory=Health, on_setattr=_PART)
    verdicts: Verdicts = attrs.field(factory=Verdicts, on_setattr=_PART)
    counts: Counts = attrs.field(factory=Counts, on_setattr=_PART)
    pace: Pace = attrs.field(factory=Pace, on_setattr=_PART)
    engine: EngineReading = attrs.field(factory=EngineReading, on_setattr=_PART)
    listing: ModelListing = attrs.field(factory=ModelListing, on_setattr=_PART)
    #: set by the pool: its clock and slow-start length, for :attr:`effective_weight`
    slow_start: SlowStart = attrs.field(factory=SlowStart, on_setattr=_PART)

    # -- events that change more than one part ---------------------------------------

    def came_up(self, now: float) -> bool:
        """Back in rotation at ``now`` (slow start counts from here); ``True`` if it was out."""
        if not self.health.came_up():
            return False
        self.slow_start.restart(now)
        self.verdicts.streak_over()
        return True

    def ejected(self, until: float) -> None:
        """Ejected as an outlier until ``until``: the streak that did it is over."""
        self.verdicts.ejected()
        self.health.sits_out(until)

    def engine_scraped(self, depth: float, kv_cache: float | None,
                       prefix_cache: tuple[float, float] | None = None) -> None:
        """The engine's own queue: a new scrape restarts the local count since the last."""
        self.engine.scraped(depth, kv_cache, prefix_cache)
        self.counts.scrape_restarts()

    def respecified(self, spec: BackendSpec) -> None:
        """
        A reloaded config gives it another weight, ``max_conns`` or model list (same
        address).  Its in-flight requests keep their slots: a lowered ``max_conns`` only
        stops new ones until enough have finished.
        """
        if spec.key != self.spec.key:
            raise ValueError(f"backend {self.spec.key} cannot become {spec.key}")
        self.spec = spec

    # -- replication between processes (--workers) -----------------------------------

    def shared_state(self) -> dict[str, Any]:
        """:data:`SHARED_FIELDS`, JSON-ready."""
        parts = {**self.health.shared(), **self.listing.shared(), **self.engine.shared(),
                 **self.slow_start.shared()}
        return {name: parts[name] for name in SHARED_FIELDS}

    def mirror(self, state: Mapping[str, Any]) -> None:
        """Take the supervisor's :meth:`shared_state` of this backend."""
        if state["engine_scrapes"] != self.engine.scrapes:
            # a new scrape counts what this worker sent before it: start again
            self.counts.scrape_restarts()
        self.health.mirror(state)
        self.listing.mirror(state)
        self.engine.mirror(state)
        self.slow_start.mirror(state)

    # -- views -----------------------------------------------------------------------

    @property
    def key(self) -> str:
        return self.spec.key

    @property
    def base_url(self) -> bytes:
        return f"http://{self.spec.key}".encode("ascii")

    @property
    def effective_weight(self) -> float:
        """The weight policies use: the configured weight, scaled during slow start."""
        return self.spec.weight * self.slow_start.ramp

    @property
    def models(self) -> tuple[str, ...] | None:
        """
        The models this backend serves: configured, else learned from its ``/v1/models``;
        ``None`` while unknown (not configured and not learned yet).
        """
        return self.spec.models or self.listing.names

    def serves(self, model: str) -> bool:
        """Whether a request for ``model`` may go here (an unknown list may hold it)."""
        models = self.models
        return models is None or model in models

    @property
    def eligible(self) -> bool:
        """May receive a new request: healthy, not draining, below its cap."""
        health = self.health
        return (
            health.healthy
            and not health.draining
            and (self.spec.max_conns == 0 or self.counts.active < self.spec.max_conns)
        )

    # -- what docs/scheduling.md promises a third-party policy can read ----------------
    # (txlb's own code reads these through the parts; a plugin written against the
    # documented names keeps working)

    @property
    def active(self) -> int:
        """Requests in flight here, as :attr:`counts` has them."""
        return self.counts.active

    @property
    def engine_depth(self) -> float | None:
        """The engine's queue as :attr:`engine` last scraped it."""
        return self.engine.depth

    @property
    def kv_cache_usage(self) -> float | None:
        """The engine's KV-cache usage as last scraped, a fraction."""
        return self.engine.kv_cache_usage

    @property
    def responses(self) -> dict[str, int]:
        """Answers so far by status class (``"2xx"``...)."""
        return self.counts.responses

    def status(self) -> dict[str, object]:
        """The backend's entry in ``/__lb_status``."""
        return {
            "backend": self.key,
            "healthy": self.health.healthy,
            "active": self.counts.active,
            "draining": self.health.draining,
            "weight": self.spec.weight,
            "max_conns": self.spec.max_conns,
            "requests": self.counts.requests,
            "last_probe_error": self.health.last_probe_error,
            "engine": self.engine.name,
        }

    def detailed_status(self) -> dict[str, object]:
        """The admin port's fuller view: adds models, counters and latency."""
        health, counts, pace = self.health, self.counts, self.pace
        return {
            **self.status(),
            "removing": health.removing,
            "models": list(self.models or ()),
            "engine_depth": self.engine.depth,
            "kv_cache_usage": _rounded(self.engine.kv_cache_usage),
            # the latency policy's estimate (IPolicy.describe fills it in the admin API);
            # kept null for other policies so /status keeps one shape
            "latency_peak_ewma_s": None,
            # what --policy cache-aware believes this engine's prefix cache holds (filled
            # the same way; null under other policies)
            "prefix_cache": None,
            "responses": dict(sorted(counts.responses.items())),
            "ejections": health.ejections,
            "probes_ok": health.probes_ok,
            "probes_failed": health.probes_failed,
            "latency_ewma_s": _rounded(pace.ewma_duration),
            "outlier_ejections": self.verdicts.outlier_ejections,
            "ejected_until": health.ejected_until,
            "ttft_ewma_s": _rounded(pace.ewma_ttft),
            "hung_ejections": self.verdicts.hung_ejections,
            "prompt_tokens": counts.prompt_tokens,
            "cached_prompt_tokens": counts.cached_prompt_tokens,
            "prefix_cache_hit_rate": _rounded(counts.prefix_cache_hit_rate),
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
