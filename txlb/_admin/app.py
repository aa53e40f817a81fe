"""
The admin port: a Klein app over the backend pool.

Operators drain a GPU for maintenance, add and remove instances, watch ``/status`` and
scrape ``/metrics`` here -- on a port of its own, loopback by default, so none of it is
reachable through the main port.  Every answer, errors included, is JSON (the dashboard at
``/`` aside), and when a token is configured every request needs it.

Loopback is not enough on its own: the operator's browser runs on loopback too (an
``ssh -L`` tunnel puts the port there), and any page it has open can send requests to it.
So before any route runs, :class:`_Guard` refuses what only a browser acting for some
other site sends: a ``Host`` that is not this endpoint's own (DNS rebinding), an
``Origin`` that is not the request's own ``Host`` (a cross-origin page), and for requests
that change state, the content types an HTML form or a "simple" fetch can send without a
CORS preflight.  The body is capped, and every request is validated whole before anything
changes.  With a token, every request but the dashboard page itself (which asks for the
token) needs it, whatever its path: an unknown path is 401 too, so the API's routes are not
revealed to whoever has no token.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import math
import re
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from typing import Any, NoReturn
from urllib.parse import unquote_to_bytes

from klein import Klein
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import Request
from werkzeug.exceptions import HTTPException

from txlb._admin import ADMIN_MAX_BODY  # the largest body the API reads
from txlb._admin.answers import AdminError, json_body
from txlb._admin.answers import error_payload as _error_payload
from txlb._admin.answers import json_answer as _json
from txlb._admin.history import CAPACITY, SAMPLE_SECONDS, History
from txlb._admin.tenants import TenantKeys
from txlb._cluster.backend import Backend
from txlb._cluster.models import MAX_MODEL_NAME, MAX_MODEL_NAMES
from txlb._cluster.pool import Pool
from txlb._config.backends import parse_backend_address
from txlb._config.config import Config
from txlb._config.errors import ConfigError
from txlb._config.table import backend_entry as _backend_item
from txlb._records.metrics import Metrics

log = Logger()

#: What an HTML form (or a fetch without a CORS preflight) can send; never JSON from curl.
_FORM_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data",
                         "text/plain"})

#: Methods that only read; every other one may change state.
_SAFE_METHODS = frozenset({b"GET", b"HEAD"})

#: ``host[:port]`` as it appears in ``Host`` or after ``scheme://`` in ``Origin``.
_AUTHORITY = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9._-]+)(?::([0-9]{1,5}))?")

_DEFAULT_PORTS = {"http": 80, "https": 443}

#: Fields ``POST /backends`` accepts, mapped to the config file's backend table keys.
_ADD_FIELDS = {"backend": "url", "url": "url", "weight": "weight", "max_conns": "max_conns",
               "models": "models"}

#: The longest ``backend`` ``POST /backends`` reads: ``http://``, a 253-character DNS name
#: (or a bracketed IPv6 address), ``:65535`` and a ``/`` fit in it, with room to spare.
MAX_ADDRESS = 300

#: The dashboard's page: served without the token, which the page itself asks for.
_DASHBOARD = b"/"


def _authority(text: str) -> tuple[str, int | None] | None:
    """
    ``(host, port)`` from ``host[:port]``: lower-case, IPv6 in brackets and compressed,
    ``port`` ``None`` when absent.  ``None`` when it is not a well-formed authority (user
    info, a path, stray characters): such a value is never allowed.
    """
    match = _AUTHORITY.fullmatch(text.strip().lower())
    if match is None:
        return None
    host, port = match.group(1), match.group(2)
    if host.startswith("["):
        try:
            host = f"[{ipaddress.IPv6Address(host[1:-1]).compressed}]"
        except ValueError:
            return None
    number = int(port) if port is not None else None
    if number is not None and not 0 < number < 65536:
        return None
    return host, number


def _is_loopback_name(host: str) -> bool:
    """``localhost``, ``[::1]`` or a 127.0.0.0/8 literal: names only this machine answers."""
    if host in ("localhost", "[::1]"):
        return True
    try:
        return ipaddress.IPv4Address(host).is_loopback
    except ValueError:
        return False


def _own_address(request: IRequest) -> str | None:
    """The local address the request's connection arrived on, spelt as in a ``Host``."""
    host = getattr(request.getHost(), "host", None)  # None for a UNIX socket
    if not isinstance(host, str):
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host.lower()
    return f"[{address.compressed}]" if address.version == 6 else address.compressed


def _header(request: IRequest, name: bytes) -> str | None:
    """The one value of header ``name`` (``None`` when absent); a repeated one is refused."""
    values = request.requestHeaders.getRawHeaders(name) or []
    if len(values) > 1:
        raise AdminError(403 if name != b"content-type" else 415,
                         f"more than one {name.decode()} header")
    return values[0].decode("latin-1") if values else None


def _body_size(request: IRequest) -> int:
    content = getattr(request, "content", None)
    if content is None:
        return 0
    position = content.tell()
    size = content.seek(0, 2)
    content.seek(position)
    return int(size)


class _Guard(Resource):
    """
    The admin API's root: checks every request (any path, any method) before the Klein
    app routes it, so no route can forget to -- see the module docstring for why each
    check exists.  A refused request gets a JSON error and never reaches a route.
    """

    isLeaf = True

    def __init__(self, app: IResource, allowed_hosts: Iterable[str],
                 authorize: Callable[[Request], None] = lambda request: None) -> None:
        super().__init__()
        self._app = app
        self._allowed = frozenset(allowed_hosts)
        #: raises AdminError (401) for a request without the token, when one is set
        self._authorize = authorize

    def allow(self, hosts: Iterable[str]) -> None:
        """A reload's ``--admin-hosts``, from the next request on."""
        self._allowed = frozenset(hosts)

    def render(self, request: Request) -> Any:
        # twisted.web's Request names itself in Server (TwistedWeb/...) on every answer:
        # under any Site, the admin port names no software, as the main port names none
        request.responseHeaders.removeHeader(b"server")
        # No page may frame the dashboard either: a click on its drain button would be the
        # operator's own, Origin and all.
        request.setHeader(b"x-frame-options", b"DENY")
        request.setHeader(b"content-security-policy", b"frame-ancestors 'none'")
        request.setHeader(b"x-content-type-options", b"nosniff")
        try:
            self._check(request)
        except AdminError as error:
            return _json(request, error.status, _error_payload(error.status, error.message))
        except Exception:
            log.failure("checking admin request {method} {uri} failed",
                        method=request.method, uri=request.uri)
            return _json(request, 500, _error_payload(500, "internal error (see txlb's log)"))
        return self._app.render(request)

    def _check(self, request: Request) -> None:
        try:
            # what Klein decodes before routing, answering a failure with text/html
            unquote_to_bytes(request.path).decode("utf-8")
        except UnicodeDecodeError:
            raise AdminError(400, "the request path is not UTF-8") from None
        host = self._check_host(request)
        self._check_origin(request, host)
        if len(request.requestHeaders.getRawHeaders(b"authorization") or ()) > 1:
            # as on the main port: which one would be the token?
            raise AdminError(400, "the request has more than one Authorization header")
        if not (request.path == _DASHBOARD and request.method in _SAFE_METHODS):
            # before routing: an unknown path is 401 too, not a 404 saying it is unknown
            self._authorize(request)
        if request.method not in _SAFE_METHODS:
            self._check_body(request)

    def _check_host(self, request: Request) -> str | None:
        """
        DNS rebinding: a page on ``evil.example`` whose name now resolves to 127.0.0.1 is
        same-origin with the admin port as far as the browser knows, but its requests say
        ``Host: evil.example``.  Answer only names that cannot be rebound (loopback, this
        endpoint's own address) and the ones the operator listed.  No ``Host`` at all
        (HTTP/1.0 tools) is not a browser.
        """
        given = _header(request, b"host")
        if given is None:
            return None
        parsed = _authority(given)
        if parsed is None:
            raise AdminError(403, "the Host header is malformed")
        name = parsed[0]
        if not ("*" in self._allowed or name in self._allowed or _is_loopback_name(name)
                or name == _own_address(request)):
            raise AdminError(403, f"Host {name[:100]!r} is not this admin endpoint's address "
                                  "or a loopback name (see --admin-hosts)")
        return given

    def _check_origin(self, request: Request, host: str | None) -> None:
        """
        A cross-origin page: browsers send ``Origin`` on every cross-origin POST and
        DELETE (and CORS GET), so one naming anything but the request's own ``Host`` is a
        page of another site acting on its own.  Comparing with ``Host`` rather than a
        fixed address keeps ``ssh -L 9001:127.0.0.1:8001`` and the dashboard working.
        """
        origin = _header(request, b"origin")
        if origin is None:
            return
        scheme, separator, rest = origin.strip().lower().partition("://")
        default = _DEFAULT_PORTS.get(scheme)
        theirs = _authority(rest) if separator and default else None
        ours = _authority(host) if host is not None else None
        if theirs is None or ours is None or (theirs[0], theirs[1] or default) != (
                ours[0], ours[1] or default):
            raise AdminError(403, f"Origin {origin[:100]!r} is not this admin endpoint: "
                                  "requests from other web pages are refused")

    def _check_body(self, request: Request) -> None:
        """
        Form content types are what a page can send cross-site without a CORS preflight
        (an auto-submitting form drains with an empty one); a body must say it is JSON.
        """
        given = _header(request, b"content-type")
        media = given.split(";", 1)[0].strip().lower() if given is not None else None
        if media in _FORM_TYPES:
            raise AdminError(415, f"{media} is refused so that no web page can change state: "
                                  "send no body, or JSON with Content-Type: application/json")
        size = _body_size(request)  # twisted.web has read it all by now
        if size > ADMIN_MAX_BODY:
            raise AdminError(413, f"the request body is over {ADMIN_MAX_BODY} bytes")
        if size and not (media == "application/json" or (
                media is not None and media.startswith("application/")
                and media.endswith("+json"))):
            raise AdminError(415, "a request body must be JSON, sent with "
                                  "Content-Type: application/json")


def _check_models(models: object) -> None:
    """
    The bounds a backend's own ``/v1/models`` is held to (:mod:`txlb._cluster.models`):
    every name is matched per request and listed in every 404.  The rest of ``models``
    (a list of non-empty strings) is checked with the config file's rules.
    """
    if not isinstance(models, list):
        return
    if len(models) > MAX_MODEL_NAMES:
        raise AdminError(400, f"'models' lists {len(models)} names: at most "
                              f"{MAX_MODEL_NAMES}")
    for name in models:
        if isinstance(name, str) and len(name) > MAX_MODEL_NAME:
            raise AdminError(400, f"a model name is over {MAX_MODEL_NAME} characters: "
                                  f"{name[:40]!r}...")


def _dashboard_status(state: dict[str, object], backend: Backend, now: float
                      ) -> dict[str, object]:
    """
    A backend's ``/status`` entry (``state``), plus what the dashboard shows as state: how
    long an outlier ejection still lasts, and how far a slow start has ramped (1 = full
    weight).
    """
    until = backend.health.ejected_until
    state["ejected_for_s"] = round(until - now, 1) if until is not None and until > now else 0
    state["slow_start_ramp"] = round(backend.slow_start.ramp, 3)
    return state


class Admin:
    """
    The admin API, bound to one balancer's pool.

    ``on_added`` is called with each backend added through the API (the balancer probes it
    at once); ``token`` (``None`` = open) is compared in constant time; ``allowed_hosts``
    are the ``Host`` names answered besides loopback names and the endpoint's own address
    (``--admin-hosts``).  Serve :meth:`resource`, which checks every request first.
    """

    app = Klein()

    def __init__(self, pool: Pool, metrics: Metrics, token: str | None,
                 on_added: Callable[[Backend], object] = lambda backend: None,
                 clock: IReactorTime | None = None,
                 extra_status: Callable[[], dict[str, object]] | None = None,
                 allowed_hosts: Iterable[str] = (),
                 history: History | None = None,
                 describe: Callable[[Backend], Mapping[str, object]] = lambda backend: {},
                 reload: Callable[[], Deferred[int]] | None = None,
                 config_status: Callable[[], dict[str, object]] | None = None,
                 tenants: TenantKeys | None = None,
                 ) -> None:
        self.pool = pool
        #: ``/tenants``: the tenants of ``--auth keys``, their keys added and revoked
        self._tenants = tenants
        self._allowed_hosts = tuple(allowed_hosts)
        self._metrics = metrics
        self._token = token.encode("utf-8") if token else None
        self._on_added = on_added
        if clock is None:
            from twisted.internet import reactor as clock
        assert clock is not None
        self._clock: IReactorTime = clock
        self._started = clock.seconds()
        #: more top-level keys for ``/status`` (the worker processes, with --workers)
        self._extra_status = extra_status
        self._history = history
        #: what the policy knows of a backend (IPolicy.describe), added to its entry
        self._describe = describe
        #: ``POST /reload``: re-read the config; the new generation, or ReloadRefused
        self._reload = reload
        #: ``/status``'s ``config``: the generation running, when loaded, the last refusal
        self._config_status = config_status
        self._guards: list[_Guard] = []

    def reconfigure(self, config: Config) -> None:
        """
        ``config``'s ``--admin-token`` and ``--admin-hosts``, from the next request on: a
        token can be rotated without a restart.
        """
        token, self._allowed_hosts = config.admin_token, tuple(config.admin_hosts)
        self._token = token.encode("utf-8") if token else None
        for guard in self._guards:
            guard.allow(self._allowed_hosts)

    def _backend_status(self, backend: Backend) -> dict[str, object]:
        """A backend's entry in ``/status`` and the answers about one backend."""
        return {**backend.detailed_status(), **self._describe(backend)}

    def resource(self) -> IResource:
        """The admin API as a resource: the Klein app behind the request checks."""
        guard = _Guard(self.app.resource(), self._allowed_hosts, self._authorize)
        self._guards.append(guard)
        return guard

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
        if backend is None and "[" in key:
            # an IPv6 key as the operator spelt it ([0:0::1]:8004): keys are the short form
            with contextlib.suppress(ConfigError):
                backend = self.pool.get(parse_backend_address("backend", key).key)
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

    @app.handle_errors(Exception)
    def _unexpected(self, request: IRequest, failure: Failure) -> bytes:
        """Anything else is txlb's bug: logged whole here, a JSON 500 without details there."""
        log.failure("admin request {method} {uri} failed", failure,
                    method=request.method, uri=request.uri)
        return _json(request, 500, _error_payload(500, "internal error (see txlb's log)"))

    # -- routes -------------------------------------------------------------------------

    @app.route("/", methods=["GET"])
    def dashboard(self, request: Request) -> bytes:
        """The self-contained status page (it asks for the token itself, if one is set)."""
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        request.setHeader(b"cache-control", b"no-store")
        return resources.files("txlb._admin").joinpath("dashboard.html").read_bytes()

    @app.route("/status", methods=["GET"])
    def status(self, request: Request) -> bytes:
        summary = self.pool.status()
        backends = list(self.pool)
        now = self._clock.seconds()
        summary["backends"] = [
            _dashboard_status(self._backend_status(backend), backend, now)
            for backend in backends]
        summary["in_flight"] = sum(b.counts.active for b in backends)
        summary["requests"] = sum(b.counts.requests for b in backends)
        summary["draining"] = sum(1 for b in backends if b.health.draining)
        summary["uptime_s"] = round(self._clock.seconds() - self._started, 3)
        if self._config_status is not None:
            summary["config"] = self._config_status()
        if self._extra_status is not None:
            summary.update(self._extra_status())
        return _json(request, 200, summary)

    @app.route("/status/history", methods=["GET"])
    def history(self, request: Request) -> bytes:
        """
        The last minutes, one sample a second (see txlb._admin.history), for the dashboard's
        charts.  ``?since=T`` returns only the samples after time ``T`` (a sample's
        ``t``), so a page that has the rest fetches a second or two.
        """
        given = request.args.get(b"since", [None])[-1]
        after: float | None = None
        if given is not None:
            try:
                after = float(given[:32])
            except ValueError:
                raise AdminError(400, "since must be a number (a sample's t)") from None
            if not math.isfinite(after):
                raise AdminError(400, "since must be a finite number")
        samples = [] if self._history is None else self._history.since(after)
        return _json(request, 200, {"interval_s": SAMPLE_SECONDS, "capacity": CAPACITY,
                                    "samples": samples})

    @app.route("/metrics", methods=["GET"])
    def metrics(self, request: Request) -> bytes:
        request.setHeader(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")
        return self._metrics.exposition()

    @app.route("/reload", methods=["POST"])
    def reload(self, request: Request) -> Deferred[bytes]:
        """
        Re-read the config file and apply it, as SIGHUP does: the new generation, or the
        refusal's one line (400: the new config is invalid; 409: there is no file).  The
        answer waits for the file to be read (off the reactor thread) and applied.
        """
        if self._reload is None:
            raise AdminError(409, "this balancer cannot reload its configuration")

        def applied(generation: int) -> bytes:
            config = self._config_status() if self._config_status is not None else {}
            return _json(request, 200, {"reloaded": True, "generation": generation,
                                        "config": config})

        def refused(failure: Failure) -> NoReturn:
            failure.trap(ConfigError)  # txlb._reload.ReloadRefused, logged already
            error = failure.value
            raise AdminError(getattr(error, "status", 400), str(error))

        return self._reload().addCallbacks(applied, refused)

    def _tenant_keys(self) -> TenantKeys:
        if self._tenants is None:
            raise AdminError(404, "this balancer has no tenants")
        return self._tenants

    @app.route("/tenants", methods=["GET"])
    def tenants(self, request: Request) -> bytes:
        return _json(request, 200, self._tenant_keys().listing())

    @app.route("/tenants/keys", methods=["POST"])
    def add_key(self, request: Request) -> Deferred[bytes]:
        made = self._tenant_keys().add(json_body(request))
        return made.addCallback(lambda answer: _json(request, 201, answer))

    @app.route("/tenants/keys/<string:key_id>", methods=["DELETE"])
    def revoke_key(self, request: Request, key_id: str) -> Deferred[bytes]:
        revoked = self._tenant_keys().revoke(key_id)
        return revoked.addCallback(lambda answer: _json(request, 200, answer))

    @app.route("/backends/<string:key>/drain", methods=["POST"])
    def drain(self, request: Request, key: str) -> bytes:
        backend = self._backend(key)
        self.pool.drain(backend)
        return _json(request, 200, self._backend_status(backend))

    @app.route("/backends/<string:key>/undrain", methods=["POST"])
    def undrain(self, request: Request, key: str) -> bytes:
        backend = self._backend(key)
        try:
            self.pool.undrain(backend)
        except ValueError as error:
            raise AdminError(409, str(error)) from None
        return _json(request, 200, self._backend_status(backend))

    @app.route("/backends", methods=["POST"])
    def add(self, request: Request) -> bytes:
        fields = json_body(request)
        unknown = sorted(set(fields) - set(_ADD_FIELDS))
        if unknown:
            raise AdminError(400, f"unknown field {unknown[0]!r}")
        address = fields.get("backend", fields.get("url"))
        if not isinstance(address, str):
            raise AdminError(400, "'backend' must be a \"host:port\" string")
        if len(address) > MAX_ADDRESS:
            raise AdminError(400, f"'backend' is over {MAX_ADDRESS} characters")
        _check_models(fields.get("models"))
        table = {_ADD_FIELDS[name]: value for name, value in fields.items()}
        table["url"] = address
        try:
            spec = _backend_item("backend", table)
        except ConfigError as error:
            raise AdminError(400, str(error)) from None
        try:
            backend = self.pool.add(spec, origin="admin")
        except ValueError as error:
            raise AdminError(409, str(error)) from None
        # here, not in Pool.add, which also builds the configured fleet at start-up
        log.info("backend {backend} added through the admin API (weight {weight}, "
                 "max_conns {max_conns})", backend=backend.key, weight=spec.weight,
                 max_conns=spec.max_conns)
        try:
            self._on_added(backend)
        except Exception:
            # It is in the pool now; say so.  The regular health checks probe it later.
            log.failure("could not start the first probe of {backend}", backend=backend.key)
        return _json(request, 201, self._backend_status(backend))

    @app.route("/backends/<string:key>", methods=["DELETE"])
    def remove(self, request: Request, key: str) -> bytes:
        backend = self._backend(key)
        self.pool.remove(backend)
        state = self._backend_status(backend)
        state["removed"] = self.pool.get(key) is None
        return _json(request, 202 if not state["removed"] else 200, state)
