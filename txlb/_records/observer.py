"""
:class:`IRequestObserver`: what the proxy, the router and the pool tell about the requests
they handle -- the one channel through which traffic reaches the books.

The proxy (:mod:`txlb._proxy.exchange`) and the router report events; they never decide who
counts them.  In a single process the observer is the :class:`~txlb._records.bookkeeper.
Bookkeeper`, which keeps the books here; in a ``--workers`` worker it is a forwarder
(:mod:`txlb._workers.reports`) that sends each event to the supervisor as a typed message,
where the supervisor's own bookkeeper receives it.  Either way the reporting code is the
same, and nothing climbs back up to the composition root.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zope.interface import Attribute, Interface, implementer

from txlb._records.needs import Needs

if TYPE_CHECKING:
    from txlb._cluster.backend import Backend
    from txlb._records.record import RequestRecord


class IRequestObserver(Interface):
    """
    The events of the traffic one balancer process handles.  Implementations must not
    raise into the caller's request path more than they can help: a bookkeeping bug must
    not fail a request (the proxy turns an exception before the answer's head into a 502).
    """

    needs = Attribute(
        "What its readers need of an answer (txlb._records.needs.Needs), read as each "
        "request starts: the record captures no more.  Optional: an observer without it "
        "gets everything.")

    def ended(record: RequestRecord) -> None:
        """A request finished, whichever way (answered, refused, failed, abandoned)."""

    def answered(backend: Backend, status: int, client: str | None) -> None:
        """
        ``backend`` answered ``status`` (a status of its own, not one txlb made up).
        ``client`` is the key (``--rate-key``) of who sent the request, or ``None`` when
        the request itself provoked a 5xx (its body is not JSON): for outlier ejection.
        """

    def suspect(backend: Backend) -> None:
        """A connection to ``backend`` was reset: it should be probed now."""

    def retried() -> None:
        """A request left a backend that failed it and tries another one."""

    def waited(seconds: float) -> None:
        """A request waited ``seconds`` for a slot in the ``max_conns`` queue."""

    def down(backend: Backend, reason: str) -> None:
        """This process's pool took ``backend`` out of rotation (refused, reset, hung...)."""


@implementer(IRequestObserver)
class NullObserver:
    """Hears everything, keeps nothing: a proxy built without anyone keeping its books."""

    needs = Needs.NOTHING

    def ended(self, record: RequestRecord) -> None:
        pass

    def answered(self, backend: Backend, status: int, client: str | None) -> None:
        pass

    def suspect(self, backend: Backend) -> None:
        pass

    def retried(self) -> None:
        pass

    def waited(self, seconds: float) -> None:
        pass

    def down(self, backend: Backend, reason: str) -> None:
        pass
