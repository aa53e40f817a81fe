"""
The main port's ``Site``: twisted.web's HTTP server with the limits a proxy needs.

twisted.web reads a whole request body (into memory, or a temporary file above 100 kB)
before any resource sees it, and its idle timeout restarts on every byte, so on its own it
would buffer any body a client sends and wait forever for headers trickling in one byte a
second (slowloris).  The channel and request here add what nginx calls
``client_header_timeout`` and ``client_max_body_size``:

* :class:`ProxyChannel` gives each request's line and headers ``header_timeout`` seconds
  from their first byte, then answers 408 and closes;
* :class:`LimitedRequest` answers 413 the moment ``Content-Length`` (or a chunked body
  so far) exceeds ``max_body``, without buffering past the limit, and never lets the
  refused request reach the proxy.

Oversized header blocks are refused: a line over 16 KiB with 431 (here), more than 16 KiB or
500 headers in all with twisted.web's own 400.
"""

from __future__ import annotations

import contextlib
from typing import Any

from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

from ._errors import error_body

log = Logger()


def _raw_response(status: int, reason: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n" % (status, reason, len(body))) + body


class ProxyChannel(HTTPChannel):
    """An HTTP/1.1 channel that gives a request's head a deadline (slowloris defence)."""

    header_timeout = 30.0

    def __init__(self) -> None:
        super().__init__()
        self._awaiting_head = True
        self._head_deadline: IDelayedCall | None = None

    def connectionMade(self) -> None:
        super().connectionMade()
        # Streamed tokens are small writes: do not let Nagle's algorithm hold them back
        # (nginx's tcp_nodelay, on by default).
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            with contextlib.suppress(OSError):  # not a TCP socket, or already closed
                set_no_delay(True)

    def dataReceived(self, data: bytes) -> None:
        if self._awaiting_head and self._head_deadline is None:
            self._head_deadline = self.callLater(self.header_timeout, self._head_too_slow)
        super().dataReceived(data)

    def allHeadersReceived(self) -> None:
        self._awaiting_head = False
        self._cancel_deadline()
        super().allHeadersReceived()

    def requestDone(self, request: Request) -> None:
        # the next request's head gets its own deadline, from its first byte
        self._awaiting_head = True
        super().requestDone(request)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._cancel_deadline()
        super().connectionLost(reason)

    def lineLengthExceeded(self, line: bytes) -> None:
        """A request line or header over 16 KiB: 431, as nginx answers, not a bare close."""
        self._cancel_deadline()
        if self.transport is not None:
            body = error_body(431, "request header fields too large")
            self.transport.write(
                _raw_response(431, b"Request Header Fields Too Large", body))
            self.transport.loseConnection()

    def _cancel_deadline(self) -> None:
        if self._head_deadline is not None and self._head_deadline.active():
            self._head_deadline.cancel()
        self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self.transport is None:
            return
        log.info("client {peer} sent no complete request head within {timeout:g}s",
                 peer=str(self.transport.getPeer()), timeout=self.header_timeout)
        body = error_body(408, f"request headers not received within "
                               f"{self.header_timeout:g}s")
        self.transport.write(_raw_response(408, b"Request Timeout", body))
        self.transport.loseConnection()


class LimitedRequest(Request):
    """A request that refuses a body over its site's ``max_body`` while it arrives."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._body_seen = 0
        self._refused = False

    @property
    def _max_body(self) -> int:
        site = getattr(self.channel, "site", None)
        return getattr(site, "max_body", 0) or 0

    def gotLength(self, length: int | None) -> None:
        limit = self._max_body
        if limit and length is not None and length > limit:
            # no "100 Continue" for a body that is refused anyway
            self.requestHeaders.removeHeader(b"expect")
            self._refuse(f"the request body ({length} bytes) is over the limit of "
                         f"{limit} bytes")
            return
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        if self._refused:
            return
        self._body_seen += len(data)
        limit = self._max_body
        if limit and self._body_seen > limit:
            self._refuse(f"the request body is over the limit of {limit} bytes")
            return
        super().handleContentChunk(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if self._refused:
            return  # answered already; the proxy never sees it
        super().requestReceived(command, path, version)

    def _refuse(self, message: str) -> None:
        self._refused = True
        body = error_body(413, message)
        channel = self.channel
        # The request line is parsed but not yet given to the request: take it from the
        # channel, so the result log says what was refused.
        self.method = getattr(channel, "_command", None) or self.method
        self.uri = getattr(channel, "_path", None) or self.uri
        site = getattr(channel, "site", None)
        if site is not None and getattr(site, "on_refused", None) is not None:
            site.on_refused(self, 413, body)
        if channel is not None and channel.transport is not None:
            channel.transport.write(_raw_response(413, b"Content Too Large", body))
            channel.loseConnection()


class ProxySite(Site):
    """
    The main port's Site.

    No twisted.web access log: formatting a Common Log Format line per request costs the
    proxy throughput, and txlb's own result log is the one operators read.
    """

    protocol = ProxyChannel  # type: ignore[assignment]
    requestFactory = LimitedRequest

    def __init__(self, resource: IResource, max_body: int = 0, header_timeout: float = 30.0,
                 on_refused: Any = None, **kwargs: Any) -> None:
        super().__init__(resource, **kwargs)
        self.max_body = max_body
        self.header_timeout = header_timeout
        self.on_refused = on_refused

    def buildProtocol(self, addr: Any) -> Any:
        channel = super().buildProtocol(addr)
        if channel is not None:
            channel.header_timeout = self.header_timeout
        return channel

    def log(self, request: Any) -> None:
        pass
