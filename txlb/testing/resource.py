"""
The simulated vLLM's twisted.web side: one leaf resource that hands every request to the
simulator, and a Site that keeps a test run's log free of access lines.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.web import http
from twisted.web.resource import Resource
from twisted.web.server import Request, Site


class SimResource(Resource):
    """Routes every request to its simulator; a leaf, so the whole path is ours."""

    isLeaf = True

    def __init__(self, render: Callable[[Request], bytes | int]) -> None:
        super().__init__()
        self._render = render

    def render(self, request: Request) -> bytes | int:
        return self._render(request)


class QuietSite(Site):
    """A Site that writes no access log: a test run should not log every request."""

    noisy = False

    def log(self, request: http.Request) -> None:
        pass
