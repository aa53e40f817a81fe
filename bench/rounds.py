"""
Quiet, alternating rounds for ``python -m bench relay --rounds N``.

One run of every target is one round.  The machine is shared, so a single round says little:
before each round the bench waits (a bounded time) for a quiet machine, and each round
measures the targets in a rotated order, so that no target is always the one measured
first, right after the backend warmed up, or last, when a neighbour's job may have started.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

#: The 1-minute load average under which the machine counts as quiet.
QUIET_LOAD = 0.7


def rotated(items: Sequence[T], round_index: int) -> list[T]:
    """``items`` rotated left by ``round_index``: round 0 keeps the order, round 1 starts at
    the second item, and so on (wrapping around)."""
    if not items:
        return []
    shift = round_index % len(items)
    return [*items[shift:], *items[:shift]]


def read_load() -> float:
    """The 1-minute load average from ``/proc/loadavg``."""
    with open("/proc/loadavg") as avg:
        return float(avg.read().split()[0])


@dataclass(frozen=True)
class Quiet:
    """How the wait for a quiet machine before a round went."""

    quiet: bool  # the load fell under the threshold (False: waited the longest, went on)
    load: float  # the 1-minute load average when the round started
    waited_s: float

    def describe(self, threshold: float = QUIET_LOAD) -> str:
        """One line for the report."""
        if self.quiet:
            return f"quiet (load {self.load:.2f} < {threshold:g}) after {self.waited_s:.0f} s"
        return (f"NOT quiet: load {self.load:.2f} ≥ {threshold:g} after waiting"
                f" {self.waited_s:.0f} s; measured anyway")


def wait_quiet(longest: float, threshold: float = QUIET_LOAD,
               load: Callable[[], float] = read_load,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep, poll: float = 5.0) -> Quiet:
    """
    Wait until the 1-minute load average is under ``threshold``, at most ``longest`` seconds;
    then go on either way and say which it was.
    """
    start = clock()
    while True:
        current = load()
        waited = clock() - start
        if current < threshold:
            return Quiet(True, current, waited)
        if waited >= longest:
            return Quiet(False, current, waited)
        sleep(min(poll, max(0.0, longest - waited)))
