"""
The part of a reactor the simulator's timers use, as structural types mypy can check.

zope interfaces declare methods without ``self``, which mypy cannot check without a plugin;
going through a Protocol keeps every module of the simulator type-checked either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class DelayedCall(Protocol):
    """The part of ``IDelayedCall`` used here, as a structural type mypy can check."""

    def cancel(self) -> None: ...


class SimClock(Protocol):
    """
    The part of ``IReactorTime`` used here.

    zope interfaces declare methods without ``self``, which mypy cannot check without a
    plugin; going through a Protocol keeps this module type-checked either way.
    """

    def callLater(
        self, delay: float, callable: Callable[..., object], *args: object, **kw: object
    ) -> DelayedCall: ...

    def seconds(self) -> float: ...
