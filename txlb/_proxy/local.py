"""
The answers txlb makes itself on the main port instead of forwarding: ``GET /__lb_status``
(the pool and the queue, to whoever ``--lb-status`` lets see it) and ``GET /v1/models`` (the
models every backend serves, merged).

Kept out of the resource's ``render`` so that adding a local endpoint is one entry here,
and admission (rate limit, body, routing) stays about requests that are forwarded.
"""

from __future__ import annotations

from twisted.web.server import Request

from txlb._proxy.errors import write_json
from txlb._proxy.incoming import exposed_to
from txlb._scheduling.router import Router

STATUS_PATH = b"/__lb_status"
MODELS_PATH = b"/v1/models"


class LocalAnswers:
    """The requests txlb answers itself, given the router it reports on."""

    def __init__(self, router: Router, lb_status: str = "on") -> None:
        self.router = router
        #: who ``GET /__lb_status`` answers: ``on``, ``loopback`` or ``off`` (the others'
        #: requests for it are proxied like any other path)
        self.lb_status = lb_status

    def answer(self, request: Request, path: bytes) -> bool:
        """
        Answer ``request`` (for ``path``, relative to the mount point) if it is one of
        txlb's own; whether it was.  A request that is not is left untouched, to forward.
        """
        if request.method != b"GET":
            return False
        if path == STATUS_PATH and exposed_to(self.lb_status, request):
            write_json(request, 200, self.status())
            return True
        if path == MODELS_PATH:
            write_json(request, 200, self.router.model_list())
            return True
        return False

    def status(self) -> dict[str, object]:
        """The body of ``GET /__lb_status``: the pool's state and the router's queue."""
        status = self.router.pool.status()
        status["queue"] = self.router.queue_status()
        return status
