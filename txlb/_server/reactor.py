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
``[-]`` instead of the connection's prefix.

``twistd -n llmlb`` runs on this reactor by default (:func:`install_by_default`, called
while its options are parsed, before anything has imported a reactor); ``--reactor NAME``
chooses another, and an embedder's own reactor is used as it is.  On any reactor that is
not this one txlb runs on Twisted's stock transports, and its start-up line
(:func:`describe`) says which reactor runs and what that means.  The change that would
make this subclass unnecessary upstream is described in docs/performance.md.
"""

from __future__ import annotations

import errno
import select
import sys
from collections.abc import Iterable
from typing import Any

from twisted.internet import tcp
from twisted.internet.epollreactor import EPollReactor
from twisted.python import log as legacy_log

from txlb._compat import write_buffer_empty, write_disconnected

_EPOLLIN = select.EPOLLIN
#: send() results that mean "the kernel buffer is full": queue the data the stock way.
_WOULD_BLOCK = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.EINTR})

#: A write this large is not corked: what is corked goes out first, then the write takes the
#: stock path, which sends it from the caller's own bytes (a request body of megabytes is
#: never joined onto its head, nor its unsent rest sliced into a copy).
CORK_LIMIT = 256 * 1024


class EagerWriteMixin:
    """
    For :class:`twisted.internet.tcp.Connection` subclasses: data written while the
    reactor handles one event is held ("corked") and sent with one ``send`` when that
    event's handler returns -- so a proxied response's head and body, or a relayed read
    that became several writes, leave in one system call, in the turn they were written.

    Anything that cannot go out then -- a partial send, a full kernel buffer -- and any
    write while data is already queued, TLS is started or the connection is closing takes
    the stock path, which also handles errors and producer pausing.  FileDescriptor's
    private buffer state is read through :mod:`txlb._compat`.
    """

    #: data written during the current event, not sent yet (``None``: nothing corked)
    _corked: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if not data:
            return
        conn: Any = self
        corked = conn._corked
        if len(data) > CORK_LIMIT:
            if corked is not None:
                self.flush_corked()
            tcp.Connection.write(conn, data)
            return
        if corked is not None:
            corked.append(data)
            return
        pending = getattr(conn.reactor, "corked", None)
        if (
            pending is not None
            and conn.connected
            and not conn.disconnecting
            and not write_disconnected(conn)
            and not conn.TLS
            and write_buffer_empty(conn)
        ):
            conn._corked = [data]
            pending.append(conn)
            return
        tcp.Connection.write(conn, data)

    def writeSequence(self, iovec: Iterable[bytes]) -> None:
        self.write(b"".join(iovec))

    def flush_corked(self) -> None:
        """Send what was written during the event that just ended (the reactor calls it)."""
        conn: Any = self
        corked, conn._corked = conn._corked, None
        if not corked or not conn.connected:
            return
        data = corked[0] if len(corked) == 1 else b"".join(corked)
        if conn.disconnecting or write_disconnected(conn) or conn.TLS:
            tcp.Connection.write(conn, data)
            return
        try:
            sent = conn.socket.send(data)
        except OSError as error:
            if error.errno not in _WOULD_BLOCK:
                tcp.Connection.write(conn, data)  # the stock path reports the loss
                return
            sent = 0
        if sent < len(data):
            tcp.Connection.write(conn, data[sent:])

    def loseConnection(self, *args: Any) -> None:
        self.flush_corked()  # what was written before the close goes first
        tcp.Connection.loseConnection(self, *args)  # type: ignore[arg-type]

    def loseWriteConnection(self) -> None:
        self.flush_corked()
        tcp.Connection.loseWriteConnection(self)  # type: ignore[arg-type]

    def startTLS(self, *args: Any) -> None:
        self.flush_corked()  # plaintext written before TLS starts goes out as plaintext
        tcp.Connection.startTLS(self, *args)  # type: ignore[arg-type]


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

    def __init__(self) -> None:
        #: connections with corked writes, flushed when the current event is handled
        self.corked: list[Any] = []
        super().__init__()

    def _flush_corked(self) -> None:
        corked = self.corked
        while corked:
            connections = corked[:]
            del corked[:]
            for connection in connections:
                connection.flush_corked()

    def doPoll(self, timeout: float | None) -> None:
        corked = self.corked
        if corked:  # written by timers and callbacks since the last poll
            self._flush_corked()
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
            if selectable is None:
                continue
            if event == _EPOLLIN:
                # Only readable, nothing else to check (no hang-up, no error, no write
                # interest): _doReadOrWrite's work without its bookkeeping.
                try:
                    why = selectable.doRead()
                except BaseException:
                    why = sys.exc_info()[1]
                    legacy_log.err()
                if why:
                    self._disconnectSelectable(selectable, why, True)
            else:
                dispatch(selectable, fd, event)
            if corked:
                self._flush_corked()

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


def install_by_default() -> bool:
    """
    Install :class:`DirectDispatchEPollReactor` unless a reactor is installed already
    (``twistd --reactor NAME``, or anything that imported ``twisted.internet.reactor``)
    or this platform has no epoll; ``True`` when it did.

    Why here and not in ``twistd``'s own default: ``twistd`` picks Twisted's default
    reactor lazily, at its first import, which comes after the plugin's options are
    parsed -- so the plugin can choose first without taking the choice from the operator.
    """
    if "twisted.internet.reactor" in sys.modules or not hasattr(select, "epoll"):
        return False
    install()
    return True


def describe(reactor: object) -> str:
    """
    The start-up line's words for ``reactor``: its name and whether txlb's fast path
    (direct dispatch, eager writes) runs on it.
    """
    if isinstance(reactor, DirectDispatchEPollReactor):
        return ("reactor txlb-epoll: direct dispatch and eager writes "
                "(--reactor NAME chooses another)")
    kind = type(reactor)
    return (f"reactor {kind.__module__}.{kind.__qualname__}: Twisted's stock transports, "
            "slower per request and per streamed chunk than the default txlb-epoll "
            "(see docs/performance.md)")
