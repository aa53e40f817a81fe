"""
Header rewriting for a transparent proxy: which headers cross the proxy, in each direction.

Kept apart from the proxy resource because it is pure (lists of raw header pairs in, lists
out) and is where an HTTP proxy most often gets subtly wrong: repeated headers must survive,
hop-by-hop headers must not, and neither may the headers that ``Connection`` names.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

RawHeaders = list[tuple[bytes, bytes]]

#: RFC 9110 section 7.6.1 plus the de-facto ``Proxy-Connection`` and ``Keep-Alive``.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)

#: Request headers the upstream client writes itself (Host, Content-Length) or that must
#: not reach the backend from the client (Expect: txlb already read the whole body).
_AGENT_OWNED = frozenset({b"host", b"content-length", b"expect"})

#: Request headers the proxy sets itself (X-Forwarded-For is appended to, not dropped).
_PROXY_OWNED = frozenset({b"x-forwarded-for", b"x-forwarded-proto"})


def flatten(raw: Iterable[tuple[bytes, Sequence[bytes]]]) -> RawHeaders:
    """``Headers.getAllRawHeaders()`` as ordered ``(lowercase name, value)`` pairs."""
    return [(name.lower(), value) for name, values in raw for value in values]


def connection_tokens(headers: RawHeaders) -> frozenset[bytes]:
    """The header names listed in ``Connection`` (which are hop-by-hop for this hop only)."""
    tokens: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return frozenset(tokens)


def end_to_end(headers: RawHeaders) -> RawHeaders:
    """Drop hop-by-hop headers and every header ``Connection`` names; keep the rest in order."""
    dropped = HOP_BY_HOP | connection_tokens(headers)
    return [(name, value) for name, value in headers if name not in dropped]


def upstream_request_headers(
    headers: RawHeaders, client_host: str, scheme: bytes
) -> RawHeaders:
    """
    The headers to send the backend for a client request.

    ``X-Forwarded-For`` keeps whatever the client (or an earlier proxy) sent and appends this
    hop's client address, as nginx's ``$proxy_add_x_forwarded_for`` does; ``X-Forwarded-Proto``
    is replaced by the scheme the client actually used.
    """
    forwarded_for = [value.strip() for name, value in headers if name == b"x-forwarded-for"]
    kept = [
        (name, value)
        for name, value in end_to_end(headers)
        if name not in _AGENT_OWNED and name not in _PROXY_OWNED
    ]
    forwarded_for.append(client_host.encode("ascii", "replace"))
    kept.append((b"x-forwarded-for", b", ".join(v for v in forwarded_for if v)))
    kept.append((b"x-forwarded-proto", scheme))
    return kept


def downstream_response_headers(headers: RawHeaders) -> RawHeaders:
    """
    The backend's response headers to pass to the client.

    ``Content-Length`` is dropped here because the upstream client reports it as the
    response's ``length``; the proxy sets it again from there so a fixed-length response is
    not re-sent chunked.
    """
    return [(name, value) for name, value in end_to_end(headers)
            if name != b"content-length"]
