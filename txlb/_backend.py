"""
Backend state and the :class:`Pool` that owns it.

Everything that changes a backend -- the proxy taking and releasing in-flight slots, the
prober marking it up or down -- goes through the Pool's methods, so the rules (a slot is
released exactly once, a passive ejection resets the rise counter) live in one place.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
from twisted.logger import Logger

from ._config import BackendSpec

log = Logger()


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
    active: int = 0
    successes_in_a_row: int = 0
    failures_in_a_row: int = 0
    last_probe_error: str | None = None
    requests: int = 0

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
        }


@attrs.define(eq=False)
class Lease:
    """
    One in-flight slot on a backend, taken by the proxy for the life of one request.

    :meth:`release` is idempotent: the request's many ways out (success, error, timeout,
    client abort, and their overlaps) can each call it and the count falls exactly once.
    """

    backend: Backend
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.backend.active -= 1


class Pool:
    """The ordered set of backends, keyed by ``host:port``."""

    def __init__(self, specs: tuple[BackendSpec, ...] = ()) -> None:
        self._backends: dict[str, Backend] = {}
        for spec in specs:
            self.add(spec)

    def __iter__(self) -> Iterator[Backend]:
        return iter(list(self._backends.values()))

    def __len__(self) -> int:
        return len(self._backends)

    def get(self, key: str) -> Backend | None:
        return self._backends.get(key)

    def add(self, spec: BackendSpec) -> Backend:
        if spec.key in self._backends:
            raise ValueError(f"backend {spec.key} already exists")
        backend = self._backends[spec.key] = Backend(spec)
        return backend

    def acquire(self, backend: Backend) -> Lease:
        """
        Take an in-flight slot.  Synchronous on purpose: the count rises at the moment of
        choice, before anything else can run, so a burst cannot all see the same idle
        backend.
        """
        backend.active += 1
        backend.requests += 1
        return Lease(backend)

    def mark_down(self, backend: Backend, reason: str) -> None:
        """Take a backend out of rotation now (definitive failure or passive ejection)."""
        backend.successes_in_a_row = 0
        if backend.healthy:
            backend.healthy = False
            log.warn("backend {backend} marked down: {reason}", backend=backend.key,
                     reason=reason)

    def mark_up(self, backend: Backend) -> None:
        if not backend.healthy:
            backend.healthy = True
            log.info("backend {backend} is back up", backend=backend.key)

    def probe_succeeded(self, backend: Backend, rise: int) -> None:
        """A 200 from the health path: ``rise`` of these in a row bring a backend back."""
        backend.failures_in_a_row = 0
        backend.successes_in_a_row += 1
        backend.last_probe_error = None
        if backend.successes_in_a_row >= rise:
            self.mark_up(backend)

    def probe_failed(self, backend: Backend, reason: str, definitive: bool, fall: int) -> None:
        """
        A failed probe.  Definitive failures (refused, a non-200 answer) mark the backend
        down at once; ambiguous ones (timeout, reset) only after ``fall`` in a row, so one
        lost packet does not take a GPU out of rotation.
        """
        backend.successes_in_a_row = 0
        backend.failures_in_a_row += 1
        backend.last_probe_error = reason
        if definitive or backend.failures_in_a_row >= fall:
            self.mark_down(backend, reason)

    def status(self) -> dict[str, object]:
        """The body of ``GET /__lb_status``."""
        backends = list(self)
        return {
            "healthy": sum(1 for b in backends if b.healthy),
            "total": len(backends),
            "backends": [b.status() for b in backends],
        }
