"""
What a store may offer beyond the seam: each optional part an interface of its own.

The seam (:mod:`txlb._cluster.store`) is what every store must be: counts, marks, rate
buckets and token levels.  A store shared between machines can do more -- confirm a
``max_conns`` slot over the fleet, wake this balancer when another one frees a slot or
changes a mark, share the cache-aware index, take a ``--rate-limit`` token for a
``--workers`` worker, report its state, run in the background -- and which of these it does
is the store's own to declare (``@implementer``).  Whoever needs a part asks the store for
it, ``ISlotGates(store, None)`` (the store itself if it provides the interface, else
``None``), never which class it is: a second shared store (etcd, NATS) declares what it
provides, and the balancer, the ``--workers`` supervisor and their wire stay as they are.

A part a store does not provide is simply absent: no slot gate means the pool's own slots
are exact (one process); no wake means nobody else frees slots; and so on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from twisted.application.service import IService
from twisted.internet.defer import Deferred
from zope.interface import Interface

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from txlb._cluster.backend import Backend
    from txlb._cluster.pool import Pool


class IStoreService(Interface):
    """A store with background work (a connection, a poll)."""

    def service() -> IService:
        """
        The work as a service, started and stopped with the balancer's (first, so that it
        stops last: the drain's requests stay shared until they end).
        """


class IStoreReport(Interface):
    """A store that reports on itself (``/status`` and the metrics)."""

    def status() -> dict[str, object]:
        """``/status``'s ``shared_state``: the store's link, this replica, what it shares."""

    def collector() -> Collector:
        """The store's metrics, read at scrape time."""


class IFleetWake(Interface):
    """A store through which other balancers' changes reach this one, and this one's them."""

    def attach(refresh: Callable[[], object], freed: Callable[[], object]) -> None:
        """
        Tell ``refresh`` when other balancers' marks arrived (the pool takes them), and
        ``freed`` when they freed slots (the queue looks again).
        """

    def publish_freed(key: str) -> None:
        """A ``max_conns`` slot of ``key`` was given back here: tell the others' queues."""


class IFleetSlotGate(Interface):
    """
    A :class:`~txlb._cluster.pool.SlotGate` over the fleet: each ``max_conns`` slot this
    balancer takes confirmed against every balancer's count.
    """

    def wake_with(wake: Callable[[], object]) -> None:
        """Run ``wake`` (a queue's dispatch) when another balancer freed a slot."""

    def needs(backend: Backend) -> bool:
        """Whether a slot on ``backend`` must be confirmed."""

    def confirm(backend: Backend) -> Deferred[bool]:
        """Whether the slot just taken on ``backend`` is within its ``max_conns``."""

    def released(backend: Backend) -> None:
        """A slot on ``backend`` was given back."""

    def service() -> IService:
        """The gate's background work (hearing others' freed slots)."""

    def collector() -> Collector:
        """The gate's metrics."""

    def status() -> dict[str, int]:
        """``/status``'s ``shared_state.slots``."""


class ISlotGates(Interface):
    """A store that keeps ``max_conns`` exact over the fleet."""

    def slot_gate(wake: Callable[[], object]) -> IFleetSlotGate:
        """The pool's gate; ``wake`` runs the queue's dispatch (``pool.capacity_changed``)."""


class IFleetPrefixIndex(Interface):
    """The cache-aware index shared by the fleet (its key, its sends, the others')."""

    def attach() -> None:
        """The balancer's policy may have changed (a reload): share its index, if any."""

    def status() -> dict[str, object]:
        """``/status``'s ``shared_state.prefix_index``."""


class IPrefixSharing(Interface):
    """A store that shares ``--policy cache-aware``'s index over the fleet."""

    def prefix_index(pool: Pool, policy: Callable[[], object]) -> IFleetPrefixIndex:
        """The shared index of ``pool``'s backends; ``policy`` is the balancer's of the moment."""


class IFleetPresence(Interface):
    """
    A store that knows whether it answers and how many balancers share it: what a
    ``--workers`` supervisor tells its workers, who divide the rate among them.
    """

    def presence() -> tuple[bool, int]:
        """Whether the store answers, and the live balancers sharing it (1 at least)."""

    def watch(listener: Callable[[], object]) -> None:
        """Tell ``listener`` whenever :meth:`presence` may have changed."""


class ISharedRateTakes(Interface):
    """
    A store whose ``--rate-limit`` buckets a process without its own connection (a
    ``--workers`` worker) can take from through the one that has it (its supervisor).
    """

    def take_shared(bucket: str, rate: float, burst: int) -> Deferred[float | None]:
        """
        Take one token from the fleet's bucket ``bucket`` (a client key's digest) of
        ``rate`` tokens a second and ``burst`` at most: the bucket's level after, ``None``
        if the store answered something that is no level; fails if it did not answer.
        """


class FairCounters(Protocol):
    """
    What a store shares of the fair queue (:class:`~txlb._scheduling.fairness.FairShares`):
    this host's changes, told as they happen, and the fleet's counters, taken in.
    """

    on_host_change: list[Callable[[str, float], object]]

    def take_fleet(self, fleet: dict[str, float], unsent: dict[str, float]) -> None: ...


class ITenantSharing(Interface):
    """
    A store that shares the tenants of ``--auth keys`` over the fleet: the fair queue's
    counters and the keys revoked (:mod:`txlb._shared.fair`).
    """

    def tenant_sharing(fairness: FairCounters) -> Any:
        """The fleet's part of ``fairness``: a :class:`txlb._shared.fair.SharedTenants`."""
