"""
Where txlb reads Twisted's private state: each use in one place, with the reason, so that a
Twisted release that changes one fails a test in ``tests/unit/test_compat.py`` instead of
silently changing what txlb does.
"""

from __future__ import annotations

from typing import Any

# The per-connection factory class of HTTPConnectionPool, private to twisted.web.client;
# txlb subclasses it to silence its log lines (txlb._log.quiet.QuietConnectionPool).
from twisted.web.client import _HTTP11ClientFactory as HTTP11ClientFactory

# The chunked body decoder of twisted.web's server, private to twisted.web.http; read by
# chunked_trailer.
from twisted.web.http import _ChunkedTransferDecoder

__all__ = ["BAD_REQUEST_HOOK", "CONNECTOR_MAKE_TRANSPORT", "EPOLL_REACTOR_INTERNALS",
           "HTTP11ClientFactory", "POOL_FACTORY_ATTRIBUTE", "adopt_listening_port",
           "chunked_trailer", "parsed_request_line", "port_logger", "response_connection_headers",
           "set_port_logger", "tcp_endpoint_address", "unsent_bytes", "write_buffer_empty",
           "write_disconnected"]


def unsent_bytes(transport: object) -> int | None:
    """
    How many bytes written to a TCP ``transport`` it has not yet handed to the kernel, or
    ``None`` when it is not one of Twisted's socket transports (a ``StringTransport``).

    Why: a backend that resets the connection while part of the request is still here
    provably never had the whole request, so it cannot have started generating, and the
    request may be tried on another backend.  Twisted keeps unsent data in
    ``FileDescriptor.dataBuffer`` (from ``offset``) and ``_tempDataBuffer``, and leaves both
    as they were when the connection is lost; txlb's eager transports (``txlb-epoll``) also
    hold the writes of the current event in ``_corked``.
    """
    conn: Any = transport
    buffer = getattr(conn, "dataBuffer", None)
    queued = getattr(conn, "_tempDataBuffer", None)
    if not isinstance(buffer, bytes | memoryview) or not isinstance(queued, list):
        return None
    pending = len(buffer) - int(getattr(conn, "offset", 0)) + sum(len(part) for part in queued)
    corked = getattr(conn, "_corked", None)
    if corked:
        pending += sum(len(part) for part in corked)
    return pending


def write_buffer_empty(conn: Any) -> bool:
    """
    Whether a Twisted socket transport holds no unsent data of its own.

    Why: txlb's eager transports (``txlb-epoll``) may send a write straight away only when
    nothing is queued before it, or bytes would leave out of order.  Twisted queues in
    ``FileDescriptor.dataBuffer`` (sent up to ``offset``) and ``_tempDataBuffer``.
    """
    return not conn._tempDataBuffer and conn.offset == len(conn.dataBuffer)


def write_disconnected(conn: Any) -> bool:
    """
    Whether ``loseWriteConnection`` was called on a Twisted socket transport.

    Why: after a half-close an eager transport must leave writes to Twisted's own path,
    which drops them; Twisted records the half-close only in ``_writeDisconnected``.
    """
    return bool(conn._writeDisconnected)


#: The private ``EPollReactor`` state ``txlb-epoll``'s ``doPoll`` replaces Twisted's loop
#: with: its poller, the fd-to-selectable map, and the two dispatch helpers it calls.
EPOLL_REACTOR_INTERNALS = ("_poller", "_selectables", "_doReadOrWrite",
                           "_disconnectSelectable")

#: The private ``tcp.Connector`` method ``txlb-epoll`` overrides to make its eager client
#: transports.
CONNECTOR_MAKE_TRANSPORT = "_makeTransport"

#: The private ``HTTPChannel`` method that answers a malformed request (a bare 400 and a
#: close); ``ProxyChannel`` overrides it to give that 400 a JSON body and a log line.  An
#: override cannot go through a function, so the name is checked here instead.
BAD_REQUEST_HOOK = "_respondToBadRequestAndDisconnect"

#: The private ``HTTPConnectionPool`` class attribute naming the factory class of each
#: connection; ``QuietConnectionPool`` sets it to a factory that does not log.
POOL_FACTORY_ATTRIBUTE = "_factory"


def parsed_request_line(channel: object) -> tuple[bytes | None, bytes | None, bytes | None]:
    """
    The method, target and version of the request whose head an ``HTTPChannel`` is parsing.

    Why: a request refused before its head is complete (too long, a bad header) is still
    logged with its request line, which ``HTTPChannel`` keeps only in ``_command``,
    ``_path`` and ``_version`` until it builds the request.
    """
    return (getattr(channel, "_command", None), getattr(channel, "_path", None),
            getattr(channel, "_version", None))


def unterminated_line(receiver: object) -> bytes:
    """
    What a ``LineReceiver`` (an ``HTTPChannel`` in its head) holds of a line not ended by
    CRLF yet.

    Why: a head whose lines end in a bare LF never gives twisted.web a line, so it would
    only be refused by the header timeout; ``ProxyChannel`` refuses it at once, as llhttp
    does, by looking for an LF in what ``LineReceiver`` keeps in ``_buffer``.
    """
    buffered = getattr(receiver, "_buffer", b"")
    return buffered if isinstance(buffered, bytes) else b""


def chunked_trailer(channel: object) -> tuple[list[bytearray], bytearray] | None:
    """
    The trailer section an ``HTTPChannel`` has read of the chunked request body it is
    decoding: its whole lines so far (each without its CRLF, in order), and what it holds
    of a line not ended yet; ``None`` when no chunked body is being read, or its decoder is
    not past the last chunk yet.  Both are the decoder's own buffers: read them, never
    change them.

    Why: twisted.web drops trailers unchecked and ends them at the first empty line ended
    by CRLF, so a bare LF, a control character or a ``Content-Length`` there is taken in
    silently where llhttp (the lean server) refuses it -- and a request pipelined behind
    ``X-T: 1\\n\\r\\n`` is swallowed as trailers.  ``ProxyChannel`` checks the section as
    it arrives and before the request goes on.  The channel's decoder is in
    ``_transferDecoder``; a ``_ChunkedTransferDecoder`` says in ``state`` (``TRAILER``,
    then ``FINISHED``) that it is past the last chunk, and keeps the trailer lines in
    ``_trailerHeaders`` and the rest in ``_buffer``.
    """
    decoder = getattr(channel, "_transferDecoder", None)
    if not isinstance(decoder, _ChunkedTransferDecoder):
        return None
    if decoder.state not in ("TRAILER", "FINISHED"):
        return None
    return decoder._trailerHeaders, decoder._buffer


def port_logger(port: object) -> Any:
    """
    The ``Logger`` a Twisted TCP or UNIX listening ``port`` reports accept errors to, or
    ``None`` for other ports.

    Why: txlb summarises a burst of accept errors (``EMFILE``) in one line a window; the
    port logs them through its ``_logger`` class attribute, which an instance attribute
    set by :func:`set_port_logger` overrides.
    """
    return getattr(port, "_logger", None)


def set_port_logger(port: object, logger: object) -> None:
    """Have ``port`` report its accept errors to ``logger`` (see :func:`port_logger`)."""
    port._logger = logger  # type: ignore[attr-defined]


def response_connection_headers(response: object) -> object:
    """
    The ``Connection`` headers of an Agent ``response`` (a ``Headers``), or ``None`` when
    they cannot be found.

    Why: Agent moves ``Connection`` out of ``response.headers`` into its parser's
    ``connHeaders``; txlb must strip the headers it names before relaying.  The parser is
    reached through ``Response._transport`` (a ``TransportProxyProducer``), its
    ``_producer`` (the TCP transport) and that transport's protocol, under up to three
    ``_wrappedProtocol`` wrappers (the endpoint's, TLS).
    """
    proxy = getattr(response, "_transport", None)
    connection = getattr(getattr(proxy, "_producer", None), "protocol", None)
    for _ in range(3):
        if hasattr(connection, "_parser"):
            break
        connection = getattr(connection, "_wrappedProtocol", None)
    return getattr(getattr(connection, "_parser", None), "connHeaders", None)


def tcp_endpoint_address(endpoint: object) -> tuple[int, str, int]:
    """
    The port, interface (``""`` for any) and backlog a ``TCP4ServerEndpoint`` or
    ``TCP6ServerEndpoint`` will listen on.

    Why: ``--workers`` binds the ``--listen`` endpoint itself as a plain socket the workers
    inherit; the endpoint keeps what it parsed only in ``_port``, ``_interface`` and
    ``_backlog``.
    """
    conn: Any = endpoint
    return int(conn._port), str(conn._interface or ""), int(conn._backlog)


def adopt_listening_port(port_class: Any, reactor: object, fd: int, family: int,
                         factory: object) -> Any:
    """
    A ``port_class`` (a ``tcp.Port`` subclass) serving the listening socket ``fd``, not yet
    listening.

    Why: a ``--workers`` worker subclasses the port (one accept per wake-up, eager writes),
    which the public ``adoptStreamPort`` cannot do; ``tcp.Port._fromListeningDescriptor``
    is what it calls.
    """
    return port_class._fromListeningDescriptor(reactor, fd, family, factory)


def quiet_client_service(base: Any) -> Any:
    """
    A subclass of ``twisted.application.internet.ClientService`` (``base``) that logs
    nothing: its private ``_log`` is the logger it hands its connection machine when built,
    and ClientService logs a line per reconnection attempt ("Scheduling retry N to
    connect ..."), every two seconds of an outage.  The shared state's link says once that
    Redis is unreachable and once that it is back instead.
    """
    from twisted.logger import ILogObserver, Logger
    from zope.interface import provider

    @provider(ILogObserver)
    def nothing(event: dict[str, Any]) -> None:
        pass

    class QuietClientService(base):
        _log = Logger(observer=nothing)

    return QuietClientService


def alpn_mutates_shared_context() -> bool:
    """
    Whether this Twisted's TLS sets ALPN on the listening port's shared SSL context for
    each new connection (``TLSMemoryBIOFactory._applyProtocolNegotiation``, Twisted 25.5),
    which pyOpenSSL 25 and later refuse once the context has made a connection: every TLS
    connection after the first would fail.  Later Twisted sets it once, when the context
    is made.  The main port's server names ALPN protocols only where that is safe.
    """
    from twisted.protocols.tls import TLSMemoryBIOFactory

    return hasattr(TLSMemoryBIOFactory, "_applyProtocolNegotiation")
