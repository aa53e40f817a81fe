"""
``twistd --reactor txlb-epoll``: the epoll reactor, dispatching and writing directly.

Twisted's reactors dispatch every ready socket through ``log.callWithLogger``, which sets
up a logging context (the ``system`` prefix of log lines: protocol name, connection
number, peer) before calling ``doRead``/``doWrite``.  On a proxy relaying many small SSE
events that wrapper is a fixed cost per socket event -- measured at about 12 us of the
~78 us a plain Twisted proxy spends per relayed chunk.  This reactor dispatches directly;
everything else is the stock :class:`~twisted.internet.epollreactor.EPollReactor`.

Its TCP transports also write *eagerly*: a stock transport buffers every write and waits for
the next reactor iteration (two ``epoll_ctl`` calls to register and unregister interest,
one ``epoll_wait``, then ``send``).  When nothing is queued, :class:`EagerWriteMixin` calls
``send`` at once and buffers only what the kernel did not take -- so a relayed SSE event
leaves the proxy in the same reactor turn it arrived in, with one system call.

The one difference an operator sees: log lines emitted while handling a socket event show
``[-]`` instead of the connection's prefix.  The stock reactor stays the default until this
one has been proven in production; the change that would make this subclass unnecessary
upstream is described in docs/performance.md.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from typing import Any

from twisted.internet import tcp
from twisted.internet.epollreactor import EPollReactor

#: send() results that mean "the kernel buffer is full": queue the data the stock way.
_WOULD_BLOCK = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.EINTR})


class EagerWriteMixin:
    """
    For :class:`twisted.internet.tcp.Connection` subclasses: send at once when nothing
    is queued -- the first write of each reactor iteration (later ones in the same
    iteration are coalesced the stock way, which keeps bulk relays from paying a system
    call per write).

    Anything that cannot go out now -- a partial send, a full kernel buffer, TLS started
    on the connection, data already queued (order must be kept), a connection closing --
    takes the stock path, which also handles errors and producer pausing.  It relies on
    FileDescriptor's buffer attributes (``dataBuffer``, ``offset``, ``_tempDataBuffer``),
    unchanged in the Twisted versions setup.cfg allows.
    """

    #: the reactor iteration of this transport's last eager send
    _eager_iteration = -1

    def write(self, data: bytes) -> None:
        conn: Any = self
        iteration = getattr(conn.reactor, "iteration", None)
        if (
            data
            and iteration != conn._eager_iteration
            and conn.connected
            and not conn.disconnecting
            and not conn._writeDisconnected
            and not conn.TLS
            and not conn._tempDataBuffer
            and conn.offset == len(conn.dataBuffer)
        ):
            # Only the first write of a reactor iteration goes out at once: a token stream
            # writes once per event and gets it out with no delay, while a bulk relay that
            # writes many times per read still has the rest coalesced into one send.
            conn._eager_iteration = iteration
            try:
                sent = conn.socket.send(data)
            except OSError as error:
                if error.errno not in _WOULD_BLOCK:
                    tcp.Connection.write(conn, data)  # the stock path reports the loss
                    return
                sent = 0
            if sent == len(data):
                return
            data = data[sent:]
        tcp.Connection.write(conn, data)

    def writeSequence(self, iovec: Iterable[bytes]) -> None:
        self.write(b"".join(iovec))


class EagerServer(EagerWriteMixin, tcp.Server):
    """Accepted connections that write eagerly."""


class EagerClient(EagerWriteMixin, tcp.Client):
    """Outgoing connections that write eagerly."""


class EagerPort(tcp.Port):
    transport = EagerServer


class EagerConnector(tcp.Connector):
    def _makeTransport(self) -> tcp.Client:
        return EagerClient(self.host, self.port, self.bindAddress, self, self.reactor)


class DirectDispatchEPollReactor(EPollReactor):
    """
    EPollReactor whose ``doPoll`` calls ``_doReadOrWrite`` without a log context, and
    whose TCP connections write eagerly.
    """

    #: incremented on every poll; transports use it to write eagerly once per iteration
    iteration = 0

    def doPoll(self, timeout: float | None) -> None:
        self.iteration += 1
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

    def listenTCP(self, port: int, factory: Any, backlog: int = 50,
                  interface: str = "") -> Any:
        listening = EagerPort(port, factory, backlog, interface, self)
        listening.startListening()
        return listening

    def connectTCP(self, host: str, port: int, factory: Any, timeout: float = 30.0,
                   bindAddress: Any = None) -> Any:
        connector = EagerConnector(host, port, factory, timeout, bindAddress, self)
        connector.connect()
        return connector


def install() -> None:
    """Install :class:`DirectDispatchEPollReactor` as the global reactor."""
    from twisted.internet.main import installReactor

    installReactor(DirectDispatchEPollReactor())
