"""
Where the state several balancers must agree on lives: the store seam.

One balancer process keeps everything in its own memory.  Several -- the worker processes of
``--workers``, or replicas on several machines -- must agree on three things, each behind an
interface of its own so that each can live elsewhere:

* **in-flight counts** (:class:`IInFlightCounts`): how many requests each backend has, over
  every process, for least-connections and ``max_conns`` to be exact.  The ``--workers``
  shared-memory table (:class:`txlb._cluster.shared_counts.SharedCounts`) is one
  implementation; without one, each backend's own counter is the count.
* **marks** (:class:`IBackendMarks`): whether each backend is healthy, draining or being
  removed, so that an operator's drain or one balancer's verdict reaches the others.
* **rate buckets** (:class:`IRateBuckets`): each client's ``--rate-limit`` tokens, and the
  token budgets' levels (:class:`ITokenLevels`).

:class:`IBackendStore` gathers the three; :class:`txlb._cluster.local_store.LocalStore` (one
process's memory) and :class:`txlb._shared.store.RedisStore` (``--shared-state``) implement
it.  The :class:`~txlb._cluster.pool.Pool` calls the counts and the marks; the rate limiter
calls the buckets.  A store shared between machines implements the same interfaces, and
declares which optional parts it offers beyond them (:mod:`txlb._cluster.store_capabilities`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
from twisted.internet.interfaces import IReactorTime
from zope.interface import Attribute, Interface, implementer

from txlb._config.backends import BackendSpec


class IInFlightCounts(Interface):
    """
    In-flight counts shared by several processes.  With them, a backend's ``active`` is a
    snapshot of the shared total, read before every choice (:meth:`Slots.exclusive
    <txlb._cluster.slots.Slots.exclusive>`) and every status answer (:meth:`Pool.refresh
    <txlb._cluster.pool.Pool.refresh>`).
    """

    def register(key: str) -> int:
        """Give ``key`` a slot (once: the same one ever after); raise ValueError if full."""

    def assign(key: str, slot: int) -> None:
        """Use the slot another process registered for ``key``."""

    def slot(key: str) -> int:
        """``key``'s slot: its index in :meth:`totals`."""

    def take(key: str) -> None:
        """This process sent a request to ``key``."""

    def give_back(key: str) -> None:
        """A request this process sent to ``key`` ended."""

    def untake(key: str) -> None:
        """Undo a :meth:`take` whose request was never sent (a refused choice)."""

    def total(key: str) -> int:
        """Requests in flight on ``key``, over every process."""

    def totals() -> Sequence[int]:
        """Every slot's :meth:`total`, by slot."""

    def started(key: str) -> int:
        """Requests ever sent to ``key``, over every process."""

    def mine(key: str) -> int:
        """Requests in flight on ``key`` that this process sent."""

    def lock() -> None:
        """Let no other process take a slot until :meth:`unlock`."""

    def unlock() -> None:
        """End :meth:`lock`."""


@attrs.frozen
class Marks:
    """
    What an operator or a health verdict says of one backend, as the store keeps it.
    ``healthy`` is ``None`` in what a store hands back when it has no health verdict to
    pass on (a shared store passes on connection refusals only, and their clearing).
    """

    healthy: bool | None = True
    draining: bool = False
    removing: bool = False


class IBackendMarks(Interface):
    """
    The membership and marks of the backends several balancers share.  The pool saves a
    backend's marks each time it adds it or changes them, and in :meth:`Pool.refresh
    <txlb._cluster.pool.Pool.refresh>` takes what other balancers saved meanwhile: backends
    they added, and their drains, removals and health verdicts.  A removed backend stays in
    the store marked ``removing`` (every balancer lets its own requests finish first).
    """

    def save(spec: BackendSpec, marks: Marks, reason: str = "",
             origin: str | None = None) -> None:
        """
        This balancer added the backend of ``spec`` or changed its marks; ``reason`` is
        why it was marked down, when it was; ``origin`` where the backend came from
        (``"config"``, ``"admin"``, ``"dns:NAME"``), if known.
        """

    def configured() -> None:
        """The pool is built: the saves so far were its configured backends."""

    def forget(key: str) -> None:
        """The pool let the backend of ``key`` go (removed, and idle)."""

    def origin(key: str) -> str | None:
        """Where the backend of ``key`` came from, as the store last saw it."""

    def members() -> Sequence[tuple[BackendSpec, Marks]]:
        """Every backend some balancer saved, in the order first saved, with its marks."""


class IRateBuckets(Interface):
    """Every client key's token bucket (``--rate-limit``)."""

    def take(key: str) -> float:
        """Take a token for ``key``: 0 if allowed, else the seconds until one will be there."""


#: One token bucket of a budget: its key, its capacity (the window's tokens) and its refill
#: rate (tokens per second: the capacity over the window).
Bucket = tuple[str, float, float]

#: A token bucket's debt is at most this many windows' tokens (an hour for a minute's
#: budget, 60 days for a day's): what a request cost is paid, but a backend's absurd
#: ``usage`` does not lock a client out for years.  Every :class:`ITokenLevels` keeps it.
DEBT_WINDOWS = 60


class ITokenLevels(Interface):
    """
    The token budgets' buckets (``[[budgets]]``): one per budget, window and client key,
    each holding up to its capacity and refilled continuously at its rate.  Every call
    names the buckets with their current capacity and rate, so a changed budget applies
    at once and a level above a lowered capacity is capped.  A store shared between
    balancers does each call atomically over all its buckets.
    """

    def reserve(buckets: Sequence[Bucket], amount: float) -> float:
        """
        Take ``amount`` from every bucket if each holds it: 0, else (taking nothing) the
        seconds until each would.
        """

    def adjust(buckets: Sequence[Bucket], amount: float) -> None:
        """
        Give ``amount`` back to every bucket (a negative amount takes more), keeping each
        between minus :data:`DEBT_WINDOWS` times its capacity
        (a debt of at most that many windows) and its capacity.
        """

    def level(bucket: Bucket) -> float:
        """The tokens in ``bucket`` now (below 0 while it pays a debt)."""

    def forget(keep: Callable[[str], bool]) -> None:
        """Drop every bucket whose key ``keep`` refuses (a budget that was removed)."""

    def __len__() -> int:
        """Buckets held."""


class IBackendStore(Interface):
    """Everything several balancers share: counts, marks, rate buckets and token levels."""

    counts = Attribute(
        "The :class:`IInFlightCounts` shared with other processes, or ``None``: each "
        "backend's own counter is the count (one process).")
    marks = Attribute("The :class:`IBackendMarks`.")

    def rate_buckets(rate: float, burst: int, clock: IReactorTime) -> IRateBuckets:
        """The buckets of ``--rate-limit rate --rate-burst burst``."""

    def token_levels(clock: IReactorTime) -> ITokenLevels:
        """The buckets of the token budgets (``[[budgets]]``)."""


@implementer(IBackendMarks)
class OwnMarks:
    """
    One balancer's marks: its backends' own fields are the truth, so there is nothing to
    keep and nothing another balancer could have changed.
    """

    def save(self, spec: BackendSpec, marks: Marks, reason: str = "",
             origin: str | None = None) -> None:
        pass

    def configured(self) -> None:
        pass

    def forget(self, key: str) -> None:
        pass

    def origin(self, key: str) -> str | None:
        return None

    def members(self) -> Sequence[tuple[BackendSpec, Marks]]:
        return ()
