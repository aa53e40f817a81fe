"""
The responses txlb makes itself, in the OpenAI error shape clients already parse.

OpenAI-compatible clients (the ``openai`` SDK, LangChain, ...) read
``{"error": {"message", "type", "code"}}`` and show the message; an HTML error page would
surface as an opaque decode error.  Every error the balancer itself produces goes through
:func:`error_body` so they all look alike.
"""

from __future__ import annotations

import json

from twisted.web.iweb import IRequest

#: The ``type`` field for each status the balancer produces.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    501: "invalid_request_error",
    429: "rate_limit_exceeded",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


def error_body(status: int, message: str, code: str | None = None) -> bytes:
    """
    The JSON body for an error ``status`` with a human-readable ``message``.  ``code`` is
    OpenAI's own code where clients branch on it (``invalid_api_key``,
    ``model_not_found``); else the status.
    """
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "proxy_error"),
            "code": status if code is None else code,
        }
    }
    return json.dumps(body).encode("utf-8")


def write_json(request: IRequest, status: int, payload: object) -> None:
    """Finish ``request`` with a JSON body (used for status pages and errors alike)."""
    write_body(request, status, json.dumps(payload).encode("utf-8"))


def write_body(
    request: IRequest, status: int, body: bytes, retry_after: int | None = None
) -> None:
    """Finish ``request`` with a ready JSON ``body`` (and ``Retry-After`` when given)."""
    request.setResponseCode(status)
    headers = request.responseHeaders
    headers.setRawHeaders(b"content-type", [b"application/json"])
    headers.setRawHeaders(b"content-length", [str(len(body)).encode()])
    if retry_after is not None:
        headers.setRawHeaders(b"retry-after", [str(retry_after).encode()])
    request.write(body)
    request.finish()
