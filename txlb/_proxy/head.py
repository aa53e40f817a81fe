"""
The head translation: a client's request head into the head sent upstream, and a backend's
response head into the head the client gets.

Pure functions of values -- bytes, header lists, numbers; no request, transport or backend
objects -- so every rule of what crosses the proxy can be tested by calling them, and the
exchange only copies their results onto Twisted's objects.  Which single headers cross (the
hop-by-hop set, ``Connection``'s tokens, ``X-Forwarded-*``) is :mod:`txlb._http.headers`;
this module adds the rest of a head: the target, ``Content-Length``, ``Date``/``Server``,
``X-Backend``.
"""

from __future__ import annotations

import attrs

from txlb._http.headers import RawHeaders, downstream_response_headers, upstream_request_headers

#: Response headers Twisted's Request writes itself: the backend's, when it sent them, win.
_REQUEST_OWNED = (b"date", b"server")

#: Headers as Twisted's ``Headers`` holds them: each name once, its values in order.
GroupedHeaders = list[tuple[bytes, list[bytes]]]


def origin_form(uri: bytes, mounted: int = 0) -> bytes:
    """
    The path and query to request upstream, exactly as the client wrote them.

    Built from the raw request URI rather than ``postpath`` (which twisted.web has already
    percent-decoded, losing ``%2F``), dropping the ``mounted`` segments of the mount point
    when the proxy is mounted below the root of a larger site.
    """
    if uri[:8].lower().startswith((b"http://", b"https://")):
        # absolute-form (RFC 9112 3.2.2), as sent to proxies: forward in origin-form
        # the authority ends at the first "/" or "?" (RFC 3986 3.2): "http://h?q" is "/?q"
        after_scheme = uri.split(b"://", 1)[1]
        ends = [i for i in (after_scheme.find(b"/"), after_scheme.find(b"?")) if i >= 0]
        uri = after_scheme[min(ends):] if ends else b""
        if not uri.startswith(b"/"):
            uri = b"/" + uri
    raw_path, question, query = uri.partition(b"?")
    if mounted:
        segments = raw_path.split(b"/")
        raw_path = b"/" + b"/".join(segments[1 + mounted :])
    return raw_path + question + query


@attrs.frozen
class UpstreamHead:
    """What is sent to the backend for one client request (the same on every try)."""

    method: bytes
    #: the path and query, in origin-form
    target: bytes
    headers: RawHeaders


def upstream_head(method: bytes, uri: bytes, mounted: int, headers: RawHeaders,
                  client_host: str, scheme: bytes) -> UpstreamHead:
    """
    The request head for the backend: the client's method, its target in origin-form below
    the mount point, and its end-to-end headers without those the upstream client writes
    itself (``Host``, ``Content-Length``), plus ``X-Forwarded-For``/``-Proto`` for this hop.
    ``headers`` are lowercase ``(name, value)`` pairs (:func:`txlb._http.headers.flatten`).
    """
    return UpstreamHead(method, origin_form(uri, mounted),
                        upstream_request_headers(headers, client_host, scheme))


#: The headers a client's API key comes in (OpenAI's, Anthropic's).
CREDENTIALS = (b"authorization", b"x-api-key")


def with_credentials(headers: RawHeaders, strip: bool, api_key: str | None) -> RawHeaders:
    """
    ``headers`` with the credentials the engine is to get: the client's own are dropped
    when ``strip`` (``--auth keys``: a tenant's key is txlb's, never an engine's) or when
    the backend has its own ``api_key``, which is then sent as the bearer token.
    """
    if not strip and api_key is None:
        return headers
    kept = [(name, value) for name, value in headers if name not in CREDENTIALS]
    if api_key is not None:
        kept.append((b"authorization", b"Bearer " + api_key.encode("ascii")))
    return kept


@attrs.frozen
class ClientHead:
    """What the client gets of a backend's response head."""

    status: int
    #: set in this order, each replacing what the Request already holds (its own Date and
    #: Server); repeated headers keep every value
    headers: GroupedHeaders
    #: the backend's first ``Content-Type``, for the result log
    content_type: bytes | None


def client_head(status: int, method: bytes, headers: RawHeaders, length: int | None,
                backend: tuple[str, int] | None) -> ClientHead:
    """
    The response head for the client, from the backend's ``status``, its ``headers``
    (lowercase pairs as received), the body ``length`` the upstream client read from
    ``Content-Length`` (``None``: a stream), and the request's ``method``.

    ``backend`` is the ``(key, port)`` to name in ``X-Backend``/``X-Backend-Port``, or
    ``None`` when this client may not learn it -- then the backend's own (a balancer or
    nginx behind us names its backends too) are dropped as well.
    """
    grouped: dict[bytes, list[bytes]] = {}
    for name, value in downstream_response_headers(headers):
        grouped.setdefault(name, []).append(value)
    content_type = None
    content_length: list[bytes] = []
    own: dict[bytes, list[bytes]] = {}
    for name, value in headers:
        if name == b"content-type" and content_type is None:
            content_type = value
        elif name == b"content-length":
            content_length.append(value)
        elif name in _REQUEST_OWNED:
            own.setdefault(name, []).append(value)
    grouped.update(own)
    if status == 204:
        pass  # RFC 9110 section 8.6: a 204 carries no Content-Length, whatever was sent
    elif method == b"HEAD" or status == 304:
        # no body follows: the backend's own Content-Length (if any) describes the
        # resource (a 304 may carry it); none is invented
        if content_length:
            grouped[b"content-length"] = content_length[:1]
    elif length is not None:
        grouped[b"content-length"] = [b"%d" % length]
    if backend is not None:
        key, port = backend
        grouped[b"x-backend"] = [key.encode()]
        grouped[b"x-backend-port"] = [b"%d" % port]
    else:
        grouped.pop(b"x-backend", None)
        grouped.pop(b"x-backend-port", None)
    return ClientHead(status, list(grouped.items()), content_type)
