"""
txlb's own HTTP/1.1 client for the hop to the backends.

Why not ``twisted.web.client.Agent``: profiling the relay (docs/performance.md) showed the
two largest costs per streamed token were Agent decoding the backend's chunked framing and
twisted.web re-encoding the very same chunks for the client -- and, per request, Agent's
URI parsing, endpoint, retrying wrapper and parser objects (~300 µs of CPU per request).
This client does what nginx does instead: it writes the request head itself, parses the
response head itself, and for a chunked response only *tracks* the chunk boundaries (so it
knows where the message ends and that the framing is sound) while handing the bytes on
untouched, so the proxy can pass them to an HTTP/1.1 client as they came.

What it keeps from Agent, because the proxy's guarantees depend on it:

* the same failures: ``ConnectionRefusedError`` and friends from connecting, Twisted's
  ``TimeoutError`` for a connect timeout, :class:`RequestTransmissionFailed` for a
  connection lost while part of the request was still unsent (the backend never had it
  whole), :class:`ResponseNeverReceived` (wrapping the connection's loss) for a backend
  that closed or reset after the whole request left, before its response head;
* keep-alive connections, pooled per backend, closed after :data:`IDLE_TIMEOUT` (before
  uvicorn's 5 s) -- and a request that finds its pooled connection already closed by the
  backend is sent again once on a fresh connection, so an idle-timeout race never looks
  like a dead backend; but only as :func:`~txlb._upstream.resend.may_send_again` allows
  (the write failed, or the close came within 50 ms of the request's last byte with no
  byte of response), never a request the backend held and may have started on;
* flow control: the response object is the body's ``IPushProducer``; pausing it pauses
  the socket read, stopping it aborts the connection (how vLLM learns to abort).

This module is the pool (:class:`UpstreamClient`): which connection a request goes on, and
how long an idle one is kept.  One connection and its response are
:mod:`txlb._upstream.connection`; the bytes of a head, written and read,
:mod:`txlb._upstream.heads`; what the proxy sees of it all, :mod:`txlb._upstream.interfaces`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.protocol import ClientFactory
from twisted.python.failure import Failure

from txlb._config.config import Config
from txlb._http.headers import RawHeaders
from txlb._upstream.connection import Attempt, UpstreamConnection
from txlb._upstream.heads import request_head
from txlb._upstream.interfaces import UpstreamResponse

#: Idle keep-alive connections are closed after this long: vLLM (uvicorn) closes its side
#: after 5 s, and a request sent on a connection the backend is closing fails.
IDLE_TIMEOUT = 4.0
#: At most this many idle connections kept per backend (LLM fleets run hundreds of
#: concurrent streams per backend; more than that are closed when they come back).
MAX_IDLE_PER_BACKEND = 256


def has_spoken(transport: Any) -> bool:
    """
    Whether an idle connection's backend closed it, or sent something, that the reactor has
    not read yet: a peek at its socket (one system call, nothing taken).  A backend's idle
    close that reaches txlb in the same turn as a new request is otherwise found only once
    the request is written -- and if txlb is slow to read it, later than the resend window
    (:mod:`txlb._upstream.resend`) allows, so the client would get a 502 for a request no
    backend ever saw.  txlb reaches backends over plain TCP (``connectTCP``); a transport
    without a socket (in tests) is taken as it is.  Over TLS the raw socket would show
    records the TLS layer has not read (a session ticket) and waste a good connection.
    """
    peek = getattr(getattr(transport, "socket", None), "recv", None)
    if peek is None:
        return False
    try:
        peek(1, _PEEK)
    except BlockingIOError:
        return False  # nothing waiting: the connection is as it was left
    except OSError:
        return True
    return True  # the end of the stream, or bytes nobody asked for


_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT


class _ConnectFactory(ClientFactory):
    """Builds the connection for one attempt and reports a failure to connect."""

    noisy = False  # one per upstream connection: not worth two log lines each

    def __init__(self, client: UpstreamClient, attempt: Attempt) -> None:
        self.client = client
        self.attempt = attempt

    def buildProtocol(self, addr: object) -> UpstreamConnection:
        return UpstreamConnection(self.client, (self.attempt.host, self.attempt.port),
                                  self.attempt)

    def clientConnectionFailed(self, connector: object, reason: Failure) -> None:
        self.attempt.fail(reason)


class UpstreamClient:
    """
    Sends proxied requests on pooled keep-alive connections (see the module docstring).

    ``reactor`` needs ``connectTCP`` and ``callLater``.
    """

    def __init__(self, reactor: Any, connect_timeout: float,
                 idle_timeout: float = IDLE_TIMEOUT,
                 max_idle: int = MAX_IDLE_PER_BACKEND) -> None:
        self._reactor = reactor
        self.now: Callable[[], float] = reactor.seconds
        self._connect_timeout = connect_timeout
        self._idle_timeout = idle_timeout
        self._max_idle = max_idle
        self._idle: dict[tuple[str, int], list[UpstreamConnection]] = {}
        self._host_headers: dict[tuple[str, int], bytes] = {}

    def reconfigure(self, config: Config) -> None:
        """``config``'s ``--connect-timeout``, for the connections opened from now on."""
        self._connect_timeout = config.connect_timeout

    def send(self, host: str, port: int, method: bytes, target: bytes,
             headers: RawHeaders, body: bytes | None) -> Deferred[UpstreamResponse]:
        key = (host, port)
        host_header = self._host_headers.get(key)
        if host_header is None:
            name = f"[{host}]" if ":" in host else host
            authority = name if port == 80 else f"{name}:{port}"
            try:
                host_header = authority.encode("idna")
            except UnicodeError:  # not a valid IDNA name (a label over 63 characters)
                host_header = authority.encode("ascii", "replace")
            self._host_headers[key] = host_header
        attempt = Attempt(host, port, method,
                           request_head(method, target, host_header, headers, body), body)
        self.dispatch(attempt)
        deferred: Deferred[Any] = attempt.deferred
        return deferred

    def dispatch(self, attempt: Attempt) -> None:
        """Send on an idle pooled connection, or connect a new one."""
        key = (attempt.host, attempt.port)
        if not attempt.fresh_only:
            idle = self._idle.get(key)
            while idle:
                connection = idle.pop()
                connection.take()
                transport: Any = connection.transport
                if (connection.state == "idle" and transport is not None
                        and not transport.disconnecting):
                    if not has_spoken(transport):
                        connection.send(attempt)
                        return
                    connection.state = "closed"  # closed (or babbling) while it sat idle
                    transport.loseConnection()
        factory = _ConnectFactory(self, attempt)
        attempt.connector = self._reactor.connectTCP(attempt.host, attempt.port, factory,
                                                     timeout=self._connect_timeout)

    def release(self, connection: UpstreamConnection) -> None:
        """A response was read to its end on a reusable connection: keep it for later."""
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) >= self._max_idle:
            connection.state = "closed"
            if connection.transport is not None:
                connection.transport.loseConnection()
            return
        connection.idle(self._reactor.callLater(self._idle_timeout, self._expire, connection))
        idle.append(connection)

    def _expire(self, connection: UpstreamConnection) -> None:
        """Idle too long: out of the pool at once (not when the close completes), closed."""
        self.forget(connection)
        connection.state = "closed"
        if connection.transport is not None:
            connection.transport.loseConnection()

    def forget(self, connection: UpstreamConnection) -> None:
        """An idle connection closed (or misbehaved): it leaves the pool."""
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)
        connection.take()

    def close_idle(self) -> Deferred[None]:
        for idle in self._idle.values():
            for connection in idle:
                connection.take()
                connection.state = "closed"
                if connection.transport is not None:
                    connection.transport.loseConnection()
        self._idle.clear()
        done: Deferred[None] = Deferred()
        done.callback(None)
        return done

    def idle_count(self, host: str, port: int) -> int:
        """Idle pooled connections to one backend (for tests and status)."""
        return len(self._idle.get((host, port), ()))

