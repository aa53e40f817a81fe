"""
What the proxy reads off a client's :class:`~twisted.web.server.Request`: the target to
forward, the path relative to where the proxy is mounted, the buffered body, and whether the
peer is on this host.

Shared by the resource (admission, local answers) and the exchange (forwarding), so neither
has to import the other for them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from urllib.parse import unquote_to_bytes

from twisted.internet.address import UNIXAddress
from twisted.web.http import HTTPChannel
from twisted.web.server import Request

from txlb._proxy.head import origin_form


def forwarded_uri(request: Request) -> bytes:
    """The path and query to request upstream (:func:`txlb._proxy.head.origin_form`)."""
    return origin_form(request.uri, len(request.prepath or ()))


def local_path(request: Request) -> bytes:
    """
    The request path relative to where the proxy is mounted, without the query, and
    percent-decoded once -- as the engines' ASGI servers decode it before routing, so that
    ``/v1/%63ompletions`` is known as the completions API it is to the engine (its
    budget's estimate, its usage, its class).  What is forwarded is the raw target
    (:func:`forwarded_uri`), unchanged.
    """
    return unquote_to_bytes(forwarded_uri(request).partition(b"?")[0])


def read_body(request: Request) -> bytes:
    """
    The request body twisted.web has already read (into memory or a temporary file).

    Its buffer is closed once read: the proxy keeps its own copy (for retries and the log),
    and a long prompt should not sit in memory twice for the whole generation.
    """
    if request.content is None:
        return b""
    request.content.seek(0)
    body = request.content.read()
    request.content.close()
    return body



def framed_writer(request: Request) -> Callable[[bytes], object] | None:
    """
    Where body bytes already in chunked framing (a chunked backend answer, passed through
    as it came) go to reach the client unchanged, or ``None`` when the request's server
    offers no such way.  The request still writes the last chunk when it finishes, so a
    stream cut short stays cut short.  The lean main-port server's request says so itself
    (``write_framed``); twisted.web's channel writes straight to the transport.
    """
    write_framed: Callable[[bytes], object] | None = getattr(request, "write_framed", None)
    if write_framed is not None:
        return write_framed
    channel = request.channel
    return channel.write if isinstance(channel, HTTPChannel) else None


def is_local_client(request: Request) -> bool:
    """
    Whether the client is on this host: a loopback address (127.0.0.0/8, ``::1``, or
    ``::ffff:127.x`` on a dual-stack socket) or a UNIX socket.  The peer address only:
    ``X-Forwarded-For`` is the client's to write.
    """
    address = request.getClientAddress()
    host = getattr(address, "host", None)
    if host is None:
        return isinstance(address, UNIXAddress)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback



def exposed_to(exposure: str, request: Request) -> bool:
    """Whether a ``on``/``loopback``/``off`` option (``--lb-status``, ``--x-backend``)
    lets this request's client see what it guards."""
    return exposure == "on" or (exposure == "loopback" and is_local_client(request))
