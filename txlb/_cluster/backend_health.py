"""
A backend's health: :class:`Health`, the rise/fall verdicts and the operator's marks.

Whether a backend may be in rotation is decided by three hands -- the prober (probes in a
row, ``rise``/``fall``), the outlier rule's cool-down (``ejected_until``), and an operator
(drain, removal) -- and their rules tie together: a drained backend stays drained whatever
its health, a probe passed during a cool-down does not count, a removed backend is drained.
Those rules live here, next to the fields they tie, changed only by the
:class:`~txlb._cluster.pool.Pool` that owns the backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from txlb._cluster.store import Marks


@attrs.define(eq=False)
class Health:
    """One backend's health verdicts and marks; private fields behind read-only properties."""

    _healthy: bool = True
    _draining: bool = False
    _removing: bool = False
    _successes_in_a_row: int = 0
    _failures_in_a_row: int = 0
    _last_probe_error: str | None = None
    #: times the backend went out of rotation (whoever said so)
    _ejections: int = 0
    _probes_ok: int = 0
    _probes_failed: int = 0
    #: an outlier ejection's cool-down: probes passed before it ends do not count
    _ejected_until: float | None = None

    # -- the rise/fall state machine -------------------------------------------------

    def went_down(self) -> bool:
        """Out of rotation; ``True`` if it was in (a new ejection)."""
        self._successes_in_a_row = 0
        if not self._healthy:
            return False
        self._healthy = False
        self._ejections += 1
        return True

    def came_up(self) -> bool:
        """Back in rotation; ``True`` if it was out."""
        if self._healthy:
            return False
        self._healthy = True
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

    def sits_out(self, until: float) -> None:
        """Ejected as an outlier: probes do not bring it back before ``until``."""
        self._ejected_until = until

    # -- operator state --------------------------------------------------------------

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

    # -- replication between processes (--workers) -----------------------------------

    def shared(self) -> dict[str, Any]:
        """Its part of :data:`txlb._cluster.backend.SHARED_FIELDS`."""
        return {"healthy": self._healthy, "draining": self._draining,
                "removing": self._removing, "last_probe_error": self._last_probe_error,
                "ejected_until": self._ejected_until}

    def mirror(self, state: Mapping[str, Any]) -> None:
        """Take the supervisor's :meth:`shared` part."""
        self._healthy = state["healthy"]
        self._draining = state["draining"]
        self._removing = state["removing"]
        self._last_probe_error = state["last_probe_error"]
        self._ejected_until = state["ejected_until"]

    # -- views -----------------------------------------------------------------------

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
    def successes_in_a_row(self) -> int:
        return self._successes_in_a_row

    @property
    def failures_in_a_row(self) -> int:
        return self._failures_in_a_row

    @property
    def last_probe_error(self) -> str | None:
        return self._last_probe_error

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
    def ejected_until(self) -> float | None:
        return self._ejected_until
