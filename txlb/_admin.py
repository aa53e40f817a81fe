"""
The admin port: a Klein app over the backend pool.

Operators drain a GPU for maintenance, add and remove instances, watch ``/status`` and
scrape ``/metrics`` here -- on a port of its own, loopback by default, so none of it is
reachable through the main port.  Every answer, errors included, is JSON (the dashboard at
``/`` aside), and when a token is configured every request needs it.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from klein import Klein
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.server import Request
from werkzeug.exceptions import HTTPException

from ._backend import Backend, Pool
from ._config import ConfigError, _backend_item
from ._metrics import Metrics

#: Fields ``POST /backends`` accepts, mapped to the config file's backend table keys.
_ADD_FIELDS = {"backend": "url", "url": "url", "weight": "weight", "max_conns": "max_conns",
               "models": "models"}


class AdminError(Exception):
    """An error answered as ``{"error": {...}}`` with its status code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _json(request: IRequest, status: int, payload: object) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    request.setHeader(b"cache-control", b"no-store")
    return json.dumps(payload).encode("utf-8")


def _error_payload(status: int, message: str) -> dict[str, object]:
    return {"error": {"message": message, "type": "admin_error", "code": status}}


class Admin:
    """
    The admin API, bound to one balancer's pool.

    ``on_added`` is called with each backend added through the API (the balancer probes it
    at once); ``token`` (``None`` = open) is compared in constant time.
    """

    app = Klein()

    def __init__(self, pool: Pool, metrics: Metrics, token: str | None,
                 on_added: Callable[[Backend], object] = lambda backend: None,
                 clock: Callable[[], float] = time.time,
                 extra_status: Callable[[], dict[str, object]] | None = None) -> None:
        self.pool = pool
        self._metrics = metrics
        self._token = token.encode("utf-8") if token else None
        self._on_added = on_added
        self._clock = clock
        self._started = clock()
        #: more top-level keys for ``/status`` (the worker processes, with --workers)
        self._extra_status = extra_status

    # -- guards -------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self._token is None:
            return
        given = request.getHeader(b"authorization") or b""
        scheme, _, credentials = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(credentials.strip(),
                                                                  self._token):
            request.setHeader(b"www-authenticate", b'Bearer realm="txlb admin"')
            raise AdminError(401, "missing or wrong admin token")

    def _backend(self, key: str) -> Backend:
        # With --workers this process's counts are as of the last message from a worker:
        # read the shared ones, so what drain, undrain and remove log and answer (``active``,
        # removed at once or not) is true now.  A no-op in one process.
        self.pool.refresh()
        backend = self.pool.get(key)
        if backend is None:
            raise AdminError(404, f"no backend {key}")
        return backend

    @app.handle_errors(AdminError)
    def _admin_error(self, request: IRequest, failure: Failure) -> bytes:
        error: AdminError = failure.value  # type: ignore[assignment]
        return _json(request, error.status, _error_payload(error.status, error.message))

    @app.handle_errors(HTTPException)
    def _http_error(self, request: IRequest, failure: Failure) -> bytes:
        error: HTTPException = failure.value  # type: ignore[assignment]
        status = error.code or 500
        allowed = getattr(error, "valid_methods", None)
        if allowed:
            request.setHeader(b"allow", ", ".join(allowed).encode())
        return _json(request, status, _error_payload(status, error.description or error.name))

    # -- routes -------------------------------------------------------------------------

    @app.route("/", methods=["GET"])
    def dashboard(self, request: Request) -> bytes:
        """The self-contained status page (it asks for the token itself, if one is set)."""
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        request.setHeader(b"cache-control", b"no-store")
        return resources.files("txlb").joinpath("dashboard.html").read_bytes()

    @app.route("/status", methods=["GET"])
    def status(self, request: Request) -> bytes:
        self._authorize(request)
        summary = self.pool.status()
        backends = list(self.pool)
        summary["backends"] = [backend.detailed_status() for backend in backends]
        summary["in_flight"] = sum(b.active for b in backends)
        summary["requests"] = sum(b.requests for b in backends)
        summary["draining"] = sum(1 for b in backends if b.draining)
        summary["uptime_s"] = round(self._clock() - self._started, 3)
        if self._extra_status is not None:
            summary.update(self._extra_status())
        return _json(request, 200, summary)

    @app.route("/metrics", methods=["GET"])
    def metrics(self, request: Request) -> bytes:
        self._authorize(request)
        request.setHeader(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")
        return self._metrics.exposition()

    @app.route("/backends/<string:key>/drain", methods=["POST"])
    def drain(self, request: Request, key: str) -> bytes:
        self._authorize(request)
        backend = self._backend(key)
        self.pool.drain(backend)
        return _json(request, 200, backend.detailed_status())

    @app.route("/backends/<string:key>/undrain", methods=["POST"])
    def undrain(self, request: Request, key: str) -> bytes:
        self._authorize(request)
        backend = self._backend(key)
        try:
            self.pool.undrain(backend)
        except ValueError as error:
            raise AdminError(409, str(error)) from None
        return _json(request, 200, backend.detailed_status())

    @app.route("/backends", methods=["POST"])
    def add(self, request: Request) -> bytes:
        self._authorize(request)
        fields = self._json_body(request)
        unknown = sorted(set(fields) - set(_ADD_FIELDS))
        if unknown:
            raise AdminError(400, f"unknown field {unknown[0]!r}")
        address = fields.get("backend", fields.get("url"))
        if not isinstance(address, str):
            raise AdminError(400, "'backend' must be a \"host:port\" string")
        table = {_ADD_FIELDS[name]: value for name, value in fields.items()}
        table["url"] = address
        try:
            spec = _backend_item("backend", table)
        except ConfigError as error:
            raise AdminError(400, str(error)) from None
        try:
            backend = self.pool.add(spec)
        except ValueError as error:
            raise AdminError(409, str(error)) from None
        self._on_added(backend)
        return _json(request, 201, backend.detailed_status())

    @app.route("/backends/<string:key>", methods=["DELETE"])
    def remove(self, request: Request, key: str) -> bytes:
        self._authorize(request)
        backend = self._backend(key)
        self.pool.remove(backend)
        state = backend.detailed_status()
        state["removed"] = self.pool.get(key) is None
        return _json(request, 202 if not state["removed"] else 200, state)

    def _json_body(self, request: Request) -> dict[str, Any]:
        raw = request.content.read() if request.content is not None else b""
        try:
            body = json.loads(raw)
        except ValueError:
            raise AdminError(400, "the body must be JSON") from None
        if not isinstance(body, dict):
            raise AdminError(400, "the body must be a JSON object")
        return body
