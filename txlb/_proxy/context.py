"""
What every exchange of one proxy shares (:class:`ProxyContext`), and how one request gets
another backend on failover (:class:`RetryPlan`).

Built once by the composition root (:mod:`txlb._balancer`) and handed to the resource, which
hands it to each :class:`~txlb._proxy.exchange.Exchange`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.web.server import Request

from txlb._cluster.backend import Backend
from txlb._cluster.hung import InFlight
from txlb._cluster.pool import Pool
from txlb._cluster.slots import Lease
from txlb._config.config import Config
from txlb._log.quiet import RepeatSummary
from txlb._records.observer import IRequestObserver, NullObserver
from txlb._scheduling.ratelimit import client_key
from txlb._upstream.interfaces import Upstream


class LiveExchange(InFlight, Protocol):
    """
    What the proxy's set of requests in flight is read for: the hung-backend detector
    watches each one's backend (:class:`~txlb._cluster.hung.InFlight`), and a shutdown whose
    time ran out aborts them.  Declared here, below :mod:`txlb._proxy.exchange`, so that the
    context every exchange is built with need not know the exchange.
    """

    def abort(self, reason: str) -> None:
        """End the request from outside (shutdown)."""


@attrs.define
class ProxyContext:
    """What every exchange of one proxy shares: collaborators, limits and its observer."""

    pool: Pool
    upstream: Upstream
    clock: IReactorTime
    read_timeout: float
    send_timeout: float = 60.0
    retries: int = 0
    retry_window: float = 10.0
    #: who hears what happens to each request: the bookkeeper, or a worker's forwarder
    observer: IRequestObserver = attrs.field(factory=NullObserver)
    #: who sent a request, for the outlier streak's "two clients at least"
    client_key: Callable[[Request], str] = client_key
    live: set[LiveExchange] = attrs.field(factory=set)
    #: told ``(backend, sent, left)`` when a client left before any byte of its backend's
    #: answer came: what the hung-backend detector weighs beside the requests in flight
    left_unanswered: Callable[[Backend, float, float], object] = lambda *_: None
    #: who gets ``X-Backend``/``X-Backend-Port``: ``on``, ``loopback`` or ``off``
    x_backend: str = "on"
    #: per-request warnings, one line per kind a minute (``None``: every one logged)
    repeats: RepeatSummary | None = None
    #: ``--auth``: with ``keys`` a client's key is never forwarded to an engine
    auth: str = "off"
    #: ``--resume-tries``: continuations a stream may have when its engine fails part-way
    #: (0 with ``--resume off``)
    resume_tries: int = 0

    def reconfigure(self, config: Config) -> None:
        """
        ``config``'s timeouts, retries, resumes, ``X-Backend`` exposure, ``--auth`` (whether a
        client's key is forwarded) and ``--rate-key`` (who a client is, for the outlier
        streak), for the exchanges that start from now on.
        """
        self.read_timeout = config.read_timeout
        self.send_timeout = config.send_timeout
        self.retries = config.retries
        self.retry_window = config.retry_window
        self.x_backend = config.x_backend
        self.auth = config.auth
        self.resume_tries = config.resume_tries if config.resume else 0
        self.client_key = functools.partial(client_key, kind=config.rate_key)


@attrs.frozen
class RetryPlan:
    """How one request gets another backend: ``acquire(tried)`` and ``possible(tried)``."""

    acquire: Callable[[frozenset[str]], Deferred[Lease]]
    possible: Callable[[frozenset[str]], bool]

