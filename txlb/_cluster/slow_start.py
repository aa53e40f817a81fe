"""
A recovered backend's weight ramp: :class:`SlowStart` (``--slow-start``).

An engine back in rotation has a cold cache; handed its full share at once it would
answer slowly for everyone.  Its weight therefore ramps from a hundredth to whole over
``--slow-start`` seconds from when it came up, on the pool's clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from twisted.internet.interfaces import IReactorTime


@attrs.define(eq=False)
class SlowStart:
    """One backend's ramp: the pool's clock and ramp length, and when it came up."""

    #: the pool's clock (``None``: no ramp, a backend built by a test or a tool)
    clock: IReactorTime | None = attrs.field(default=None, repr=False)
    _length: float = 0.0
    _up_since: float | None = None

    def restart(self, now: float) -> None:
        """Back in rotation at ``now``: the ramp counts from here."""
        self._up_since = now

    def ramps_over(self, length: float) -> None:
        """A reloaded ``--slow-start``: a ramp under way continues at the new length."""
        self._length = length

    def shared(self) -> dict[str, Any]:
        """Its part of :data:`txlb._cluster.backend.SHARED_FIELDS`."""
        return {"up_since": self._up_since}

    def mirror(self, state: Mapping[str, Any]) -> None:
        """Take the supervisor's :meth:`shared` part."""
        self._up_since = state["up_since"]

    @property
    def length(self) -> float:
        return self._length

    @property
    def up_since(self) -> float | None:
        return self._up_since

    @property
    def ramp(self) -> float:
        """
        How far the weight has ramped back up, from a hundredth (never zero: it must be
        choosable) to 1 over the ramp's length.
        """
        if not self._length or self._up_since is None or self.clock is None:
            return 1.0
        return max(0.01, min(1.0, (self.clock.seconds() - self._up_since) / self._length))
