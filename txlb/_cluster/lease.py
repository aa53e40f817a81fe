"""
The :class:`Lease` on one in-flight slot of a backend, held by the proxy for one request.

A request has many ways out (success, error, timeout, client abort, and their overlaps);
the lease makes the slot's count fall exactly once whichever of them calls
:meth:`Lease.release`, and tells the pool that gave it.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from txlb._cluster.backend import Backend


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
        self.backend.pace.heard(at)

    def head_came(self, at: float, waited: float, status: int) -> None:
        """The response's head of ``status`` arrived, ``waited`` seconds after the request
        was sent (the hung detector reads them)."""
        self.backend.pace.head_came(at, waited, status)

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
            self.backend.counts.gave_slot()
            self._on_release(self.backend)
