"""
Keeping the service log about what changed.

An on-call engineer reads txlb's service log (journald, supervisor's file) for the events
that matter: a backend down, up, ejected or drained, a config error, a result log failing.
Twisted's defaults bury those under routine lines:

* every client factory logs ``Starting factory`` / ``Stopping factory`` around each
  connection, and a health probe opens a fresh connection per probe: two lines per backend
  per interval (:class:`QuietConnectionPool`);
* ``Site`` writes an access line per request, and the dashboard polls the admin port every
  two seconds (the admin Site overrides ``log``);
* a listening port logs one line per connection it fails to accept, so at the file-descriptor
  limit every refused client adds a line (:class:`AcceptErrorSummary`);
* txlb's own per-request warnings (a backend killed with 200 streams in flight, a slow
  client's head, a 503 retried elsewhere) would be one line per request
  (:class:`RepeatSummary`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IDelayedCall,
    IListeningPort,
    IReactorTime,
    IStreamServerEndpoint,
)
from twisted.logger import ILogObserver, Logger, LogLevel
from twisted.web.client import HTTPConnectionPool
from zope.interface import implementer

from txlb._compat import HTTP11ClientFactory, port_logger, set_port_logger

__all__ = ["AcceptErrorSummary", "QuietAcceptErrors", "QuietConnectionPool",
           "RepeatSummary", "summarise_accept_errors"]


class _QuietHTTP11ClientFactory(HTTP11ClientFactory):
    """The factory an HTTP client pool makes per connection, without its two log lines."""

    noisy = False


class QuietConnectionPool(HTTPConnectionPool):
    """
    An ``HTTPConnectionPool`` whose connections log nothing as they open and close.

    ``HTTPConnectionPool`` builds each connection's factory from its ``_factory`` class
    attribute, and that factory is what logs ``Starting factory`` / ``Stopping factory``;
    a health probe opens a fresh connection every time, so without this each probe of
    each backend writes two lines.
    """

    _factory = _QuietHTTP11ClientFactory  # txlb._compat.POOL_FACTORY_ATTRIBUTE


_log = Logger()


@implementer(ILogObserver)
class AcceptErrorSummary:
    """
    A log observer for one listening port's accept errors: the first one in a window is
    logged as a warning in words, the rest are counted and summarised in one line when the
    window ends.  So a port at its file-descriptor limit writes two lines a minute, not one
    per refused client.

    Every event a Twisted port's own logger emits is about failing to accept (``EMFILE``,
    ``ENFILE``, ``ENOBUFS``, the reserved-descriptor recovery that closes each waiting
    client), so all of them count.
    """

    def __init__(self, clock: IReactorTime, description: str, window: float = 60.0,
                 log: Logger = _log) -> None:
        self._clock = clock
        self._description = description
        self._window = window
        self._log = log
        self._suppressed = 0
        self._timer: IDelayedCall | None = None

    def __call__(self, event: dict[str, Any]) -> None:
        if self._timer is not None:
            self._suppressed += 1
            return
        error = event.get("acceptError")
        reason = f" ({error})" if isinstance(error, str) else ""
        self._log.warn(
            "{port}: cannot accept new connections{reason}: the process is out of file "
            "descriptors or socket buffers; clients are being refused. Raise the limit "
            "(ulimit -n, systemd LimitNOFILE=) or lower the load",
            port=self._description, reason=reason)
        self._timer = self._clock.callLater(self._window, self._summarise)

    def _summarise(self) -> None:
        self._timer = None
        count, self._suppressed = self._suppressed, 0
        if count:
            self._log.warn("{port}: {count} more accept errors in the last {window:g}s",
                           port=self._description, count=count, window=self._window)


@implementer(IStreamServerEndpoint)
class QuietAcceptErrors:
    """
    A server endpoint whose listening port reports accept errors through an
    :class:`AcceptErrorSummary` instead of one line each (see
    :func:`summarise_accept_errors`).
    """

    def __init__(self, endpoint: IStreamServerEndpoint, clock: IReactorTime,
                 description: str) -> None:
        self._endpoint = endpoint
        self._clock = clock
        self._description = description

    def listen(self, protocolFactory: Any) -> Deferred[IListeningPort]:
        listening: Deferred[IListeningPort] = self._endpoint.listen(protocolFactory)
        return listening.addCallback(self._quieten)

    def _quieten(self, port: IListeningPort) -> IListeningPort:
        summarise_accept_errors(port, self._clock, self._description)
        return port


def summarise_accept_errors(port: object, clock: IReactorTime, description: str) -> None:
    """
    Have a Twisted TCP or UNIX ``port`` report its accept errors through an
    :class:`AcceptErrorSummary`: they log through the port's ``_logger`` attribute (a class
    attribute, which an instance attribute overrides).  Other ports are left as they are.
    """
    original = port_logger(port)
    if isinstance(original, Logger):
        summary = AcceptErrorSummary(clock, description)
        set_port_logger(port, Logger(namespace=original.namespace, observer=summary))


class RepeatSummary:
    """
    Per-request warnings, at most one line per kind a window: the first of a kind is
    logged as it happens, the rest of that window are counted and summarised in one line
    when it ends.

    A kind is what an operator acts on -- "backend B stopped part-way", "slow client
    heads" -- not each request: a backend killed with 200 streams in flight is one event,
    and a client opening connections it never completes must not be able to write a line
    per connection.
    """

    def __init__(self, clock: IReactorTime, window: float = 60.0) -> None:
        self._clock = clock
        self._window = window
        #: kinds logged within the window -> how many more came since
        self._open: dict[Hashable, int] = {}
        self._timers: dict[Hashable, tuple[IDelayedCall, tuple[Any, ...]]] = {}

    def emit(self, kind: Hashable, log: Logger, level: LogLevel, format: str,
             **fields: Any) -> None:
        """
        Log ``format`` through ``log`` (the caller's, so its namespace stays), or count it
        if this kind was logged within the window.
        """
        if kind in self._open:
            self._open[kind] += 1
            return
        log.emit(level, format, **fields)
        self._open[kind] = 0
        arguments = (kind, log, level, format, fields)
        self._timers[kind] = (self._clock.callLater(self._window, self._close, *arguments),
                              arguments)

    def flush(self) -> None:
        """Write every open window's summary now (at shutdown: no count is lost)."""
        for timer, arguments in list(self._timers.values()):
            if timer.active():
                timer.cancel()
                self._close(*arguments)

    def _close(self, kind: Hashable, log: Logger, level: LogLevel, format: str,
               fields: dict[str, Any]) -> None:
        self._timers.pop(kind, None)
        count = self._open.pop(kind)
        if count:
            log.emit(level, format + "; {repeats} more like this in the last {window:g}s",
                     **fields, repeats=count, window=self._window)
