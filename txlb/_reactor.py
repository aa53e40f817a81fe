"""
``twistd --reactor txlb-epoll``: the epoll reactor without the per-event logging wrapper.

Twisted's reactors dispatch every ready socket through ``log.callWithLogger``, which sets
up a logging context (the ``system`` prefix of log lines: protocol name, connection
number, peer) before calling ``doRead``/``doWrite``.  On a proxy relaying many small SSE
events that wrapper is a fixed cost per socket event -- measured at about 12 us of the
~78 us a plain Twisted proxy spends per relayed chunk.  This reactor dispatches directly;
everything else is the stock :class:`~twisted.internet.epollreactor.EPollReactor`.

The one difference an operator sees: log lines emitted while handling a socket event show
``[-]`` instead of the connection's prefix.  The stock reactor stays the default until this
one has been proven in production; the change that would make this subclass unnecessary
upstream is described in docs/performance.md.
"""

from __future__ import annotations

import errno
from typing import Any

from twisted.internet.epollreactor import EPollReactor


class DirectDispatchEPollReactor(EPollReactor):
    """EPollReactor whose ``doPoll`` calls ``_doReadOrWrite`` without a log context."""

    def doPoll(self, timeout: float | None) -> None:
        if timeout is None:
            timeout = -1  # wait indefinitely
        try:
            events = self._poller.poll(timeout, len(self._selectables))
        except OSError as error:
            if error.errno == errno.EINTR:
                return
            raise
        dispatch = self._doReadOrWrite
        selectables = self._selectables
        for fd, event in events:
            selectable: Any = selectables.get(fd)
            if selectable is not None:
                dispatch(selectable, fd, event)

    doIteration = doPoll


def install() -> None:
    """Install :class:`DirectDispatchEPollReactor` as the global reactor."""
    from twisted.internet.main import installReactor

    installReactor(DirectDispatchEPollReactor())
