"""
A free slot left to another worker's less served tenant (``--workers`` with
``--fairness vtc``): the router's side of the fair handoff.

Each worker orders its own queue.  Without a handoff, a slot freed in one worker goes to
that worker's least served waiting tenant, although another worker may have a waiting
tenant that has received less.  With it, before a waiter takes a free slot, the router asks
:attr:`SlotHandoff.defers` (the worker's view of the other workers' waiting tenants:
:mod:`txlb._workers.handoff`); when another worker's waiter is owed the slot, this one
leaves it -- the supervisor has kicked that worker's queue -- for :data:`HANDOFF_GRACE`
seconds, after which this queue is served as if no one had asked.  So the slot is never
lost: at worst it waits the grace (the other worker's waiter could not use it, or that
worker was too busy to look).
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from txlb._scheduling.classes import QueueClass

#: Seconds a slot another worker's waiter should have is left for it: long enough for the
#: supervisor's kick to reach that worker, short enough that a waiter that cannot use the
#: slot costs the fleet no more than this
HANDOFF_GRACE = 0.05


class SlotHandoff:
    """Whether a waiter leaves a free slot to another worker, and the grace that ends it."""

    def __init__(self, clock: IReactorTime, dispatch: Callable[[], object]) -> None:
        self._clock = clock
        self._dispatch = dispatch
        #: whether a waiter of this class and tenant should leave a free slot to another
        #: worker's less served tenant (``None``: never; one process)
        self.defers: Callable[[QueueClass, str | None], bool] | None = None
        self._grace: IDelayedCall | None = None
        self._in_grace = False

    def defer_with(self, defers: Callable[[QueueClass, str | None], bool]) -> None:
        """Ask ``defers(class, tenant)`` before a waiter takes a free slot."""
        self.defers = defers

    def leaves(self, klass: QueueClass, tenant: str | None,
               has_room: Callable[[], bool]) -> bool:
        """
        Whether the waiter of ``klass`` and ``tenant`` leaves the slot it could take
        (``has_room``, asked last: it takes the shared lock) to another worker's waiter;
        if so, the grace starts (once: one timer however many waiters leave it).
        """
        defers = self.defers
        if defers is None or self._in_grace or not defers(klass, tenant) or not has_room():
            return False
        if self._grace is None:
            self._grace = self._clock.callLater(HANDOFF_GRACE, self._grace_over)
        return True

    def _grace_over(self) -> None:
        """The slot left to another worker is still free: this queue may take it now."""
        self._grace = None
        self._in_grace = True
        try:
            self._dispatch()
        finally:
            self._in_grace = False

    def stop(self) -> None:
        """No more graces (the queue was abandoned: the balancer stops)."""
        if self._grace is not None and self._grace.active():
            self._grace.cancel()
        self._grace = None
