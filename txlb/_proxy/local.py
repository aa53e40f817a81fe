"""
The answers txlb makes itself on the main port instead of forwarding: ``GET /__lb_status``
(the pool and the queue, to whoever ``--lb-status`` lets see it), ``GET /v1/models`` (the
models every backend serves, merged) and the ``*`` target (``OPTIONS *`` asks about the
server itself, RFC 9110 9.3.7: 200; any other method there: 405).

Kept out of the resource's ``render`` so that adding a local endpoint is one entry here,
and admission (rate limit, body, routing) stays about requests that are forwarded.
"""

from __future__ import annotations

import json

from twisted.web.server import Request

from txlb._config.config import Config
from txlb._config.keys import TenantSpec
from txlb._http.errors import error_body, write_body
from txlb._proxy.incoming import exposed_to
from txlb._scheduling.router import Router

STATUS_PATH = b"/__lb_status"
MODELS_PATH = b"/v1/models"
#: RFC 9112 3.2.4's asterisk-form: the server as a whole
ASTERISK = b"*"


def _json(request: Request, status: int, payload: object) -> bytes:
    """Finish ``request`` with ``payload`` as JSON; the body written."""
    body = json.dumps(payload).encode("utf-8")
    write_body(request, status, body)
    return body


class LocalAnswers:
    """The requests txlb answers itself, given the router it reports on."""

    def __init__(self, router: Router, lb_status: str = "on") -> None:
        self.router = router
        #: who ``GET /__lb_status`` answers: ``on``, ``loopback`` or ``off`` (the others'
        #: requests for it are proxied like any other path)
        self.lb_status = lb_status

    def reconfigure(self, config: Config) -> None:
        """``config``'s ``--lb-status``, from the next request on."""
        self.lb_status = config.lb_status

    def open(self, request: Request, path: bytes) -> bool:
        """
        Whether ``request`` is answered without an API key under ``--auth keys``: ``OPTIONS
        *`` (about the server, not a model) and ``/__lb_status`` where ``--lb-status``
        exposes it -- what a load balancer or a probe in front of txlb asks.
        """
        return path == ASTERISK or (request.method == b"GET" and path == STATUS_PATH
                                    and exposed_to(self.lb_status, request))

    def answer(self, request: Request, path: bytes,
               tenant: TenantSpec | None = None) -> bytes | None:
        """
        Answer ``request`` (for ``path``, relative to the mount point) if it is one of
        txlb's own: the body it was answered with (its status is the request's), for the
        result log.  ``None``: it is not, and is left untouched, to forward.  A
        ``tenant`` with a list of models sees only those in ``/v1/models``.
        """
        if path == ASTERISK:
            return self._asterisk(request)
        if request.method != b"GET":
            return None
        if path == STATUS_PATH and exposed_to(self.lb_status, request):
            return _json(request, 200, self.status())
        if path == MODELS_PATH:
            only = tenant.models if tenant is not None and tenant.models else None
            return _json(request, 200, self.router.model_list(only))
        return None

    @staticmethod
    def _asterisk(request: Request) -> bytes:
        """
        ``OPTIONS *``: 200 with no body, as twisted.web and vLLM's own server answer it
        (nothing to forward: it asks about this server, not a backend's resource); another
        method with the ``*`` target has no meaning, so 405, allowing ``OPTIONS``.
        """
        if request.method == b"OPTIONS":
            request.setResponseCode(200)
            request.responseHeaders.setRawHeaders(b"content-length", [b"0"])
            request.finish()
            return b""
        body = error_body(405, "the * target is for OPTIONS only")
        request.responseHeaders.setRawHeaders(b"allow", [b"OPTIONS"])
        write_body(request, 405, body)
        return body

    def status(self) -> dict[str, object]:
        """The body of ``GET /__lb_status``: the pool's state and the router's queue."""
        status = self.router.pool.status()
        status["queue"] = self.router.queue_status()
        return status
