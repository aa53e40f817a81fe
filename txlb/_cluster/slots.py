"""
In-flight slots: :class:`Slots`, which gives and takes them back, and the :class:`Lease` on one.

Every ``max_conns`` and every load-aware policy rests on one number, a backend's requests in
flight, so it rises at the moment of choice (nothing can run between a choice and its take)
and falls exactly once per request, whichever of its many ways out calls
:meth:`Lease.release`.  With ``--workers`` the count is shared between processes (a choice
is made under their common lock, on fresh totals); with ``--shared-state`` a slot on a
capped backend is also confirmed over every replica by the :class:`SlotGate`.  The
:class:`~txlb._cluster.pool.Pool` holds the slots of its backends (``pool.slots``) and is
told of every slot given back, to let a removed backend go once idle and to wake the
requests that wait for room.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

import attrs
from twisted.internet.defer import Deferred, succeed

from txlb._cluster.backend import Backend
from txlb._cluster.store import IInFlightCounts

_T = TypeVar("_T")


class SlotGate(Protocol):
    """
    Confirms a slot the pool gave before the request goes out: ``--shared-state``'s exact
    ``max_conns`` over every replica (:class:`txlb._shared.slots.SharedSlots`).  Without
    one (a single process, ``--workers``) a slot is the pool's to give and nothing waits.
    """

    def needs(self, backend: Backend) -> bool:
        """Whether a slot on ``backend`` must be confirmed (it has ``max_conns``, link up)."""

    def confirm(self, backend: Backend) -> Deferred[bool]:
        """
        Whether the slot just taken on ``backend`` is within its ``max_conns`` over the
        fleet; never fails (an unanswered confirmation admits on the local view).
        """

    def released(self, backend: Backend) -> None:
        """A slot on ``backend`` was given back: tell the other replicas' queues."""


class Slots:
    """
    The in-flight slots on a pool's backends.  ``backends`` lists them now; ``let_go`` is
    called with a backend one of its slots was given back on (a removed one leaves once
    idle), ``changed`` when waiting requests must look again.
    """

    def __init__(self, backends: Callable[[], Iterable[Backend]],
                 shared: IInFlightCounts | None, let_go: Callable[[Backend], None],
                 changed: Callable[[], None]) -> None:
        self._backends = backends
        #: the counts shared with other worker processes, if any (``--workers``)
        self.shared = shared
        self._let_go = let_go
        self._changed = changed
        self._gate: SlotGate | None = None
        self._idle_waiters: list[Deferred[None]] = []

    def confirm_with(self, gate: SlotGate | None) -> None:
        """Have ``gate`` confirm each slot on a capped backend (``--shared-state``)."""
        self._gate = gate

    @property
    def gate(self) -> SlotGate | None:
        """
        What confirms a slot on a backend with ``max_conns`` before it is used (the
        balancer's, with ``--shared-state``); ``None``: the pool's slot is final.
        """
        return self._gate

    def acquire(self, backend: Backend) -> Lease:
        """
        Take an in-flight slot.  Synchronous on purpose: the count rises at the moment of
        choice, before anything else can run, so a burst cannot all see the same idle
        backend.
        """
        backend.counts.took_slot()
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
            for backend in self._backends():
                backend.counts.counted(totals[slot(backend.key)])
            return choose(*args)
        finally:
            shared.unlock()

    def recount(self) -> None:
        """Read the shared counts into each backend's ``active`` and ``requests``."""
        shared = self.shared
        if shared is not None:
            totals, slot = shared.totals(), shared.slot
            for backend in list(self._backends()):
                backend.counts.counted(totals[slot(backend.key)], shared.started(backend.key))

    def held(self, backend: Backend) -> int:
        """Requests in flight on ``backend`` that this process must wait for."""
        return backend.counts.active if self.shared is None else self.shared.mine(backend.key)

    def withdraw(self, lease: Lease) -> None:
        """
        Give back a slot whose choice the :attr:`gate` refused, as if never taken: no
        request was sent, so none finished (no release, no listener told of a freed slot:
        the backend is as full as the refusal said).
        """
        if not lease.withdraw():
            return
        backend = lease.backend
        backend.counts.untook_slot()
        if self.shared is not None:
            self.shared.untake(backend.key)
        self._let_go(backend)
        self._wake_if_idle()

    def _released(self, backend: Backend) -> None:
        if self.shared is not None:
            self.shared.give_back(backend.key)
        if self._gate is not None:
            self._gate.released(backend)
        self._let_go(backend)
        self._changed()
        self._wake_if_idle()

    def _wake_if_idle(self) -> None:
        if self._idle_waiters and self.in_flight == 0:
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                waiter.callback(None)

    def capacity_changed(self) -> None:
        """
        Another process sharing the counts freed a slot: let waiting requests look again
        (the router's queue listens on the pool's ``on_change``).
        """
        self._changed()

    def when_idle(self) -> Deferred[None]:
        """Fires once no request is in flight on any backend (at once if none is)."""
        if self.in_flight == 0:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._idle_waiters.append(waiter)
        return waiter

    @property
    def in_flight(self) -> int:
        """Requests in flight that this process holds (its own, with shared counts)."""
        if self.shared is not None:
            return sum(self.held(backend) for backend in self._backends())
        return sum(backend.counts.active for backend in self._backends())


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
