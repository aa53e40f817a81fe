"""
How the admin API answers: JSON bodies, its errors in one shape, and the JSON bodies it
reads -- shared by the routes of :mod:`txlb._admin.app` and the helpers they call.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.web.iweb import IRequest


class AdminError(Exception):
    """An error answered as ``{"error": {...}}`` with its status code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def json_answer(request: IRequest, status: int, payload: object) -> bytes:
    """``payload`` as the JSON body of a ``status`` answer, never cached."""
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"cache-control", b"no-store")
    return json.dumps(payload).encode("utf-8")


def error_payload(status: int, message: str) -> dict[str, object]:
    return {"error": {"message": message, "type": "admin_error", "code": status}}


def json_body(request: IRequest) -> dict[str, Any]:
    """The request's body as a JSON object (the guard has bounded its size), or a 400."""
    content = getattr(request, "content", None)
    raw = content.read() if content is not None else b""
    try:
        body = json.loads(raw)
    except ValueError:
        raise AdminError(400, "the body must be JSON") from None
    except RecursionError:
        raise AdminError(400, "the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise AdminError(400, "the body must be a JSON object")
    return body
