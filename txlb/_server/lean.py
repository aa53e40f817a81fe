"""
The main port's HTTP/1.1 server: llhttp (through ``httptools``, the C parser uvicorn -- and
so vLLM's own API server -- uses) with the limits and framing rules of
:mod:`txlb._server.rules`, for a fraction of twisted.web's cost per request.

twisted.web parses a request line by line in Python and builds a ``Request`` that does far
more than a proxy needs; on the path LLM clients take that was the largest part of txlb's
CPU per request.  :class:`LeanSite` is the factory (what ``twistd llmlb`` listens with); its
connections are :class:`~txlb._server.lean_channel.LeanChannel`, which checks each request's
framing (with :mod:`txlb._server.lean_head`) and answers them in order, and
:class:`~txlb._server.lean_request.LeanRequest` is the request the proxy resource renders
against.  An embedder's twisted.web ``Site`` (the resource of
:meth:`txlb.LoadBalancer.resource`, or :meth:`~txlb.LoadBalancer.site`) keeps twisted.web's
server with the same rules.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.interfaces import IProtocolNegotiationFactory, IReactorTime
from twisted.internet.protocol import ServerFactory
from twisted.web.resource import IResource
from zope.interface import classImplements

from txlb._compat import alpn_mutates_shared_context
from txlb._config.config import Config
from txlb._log.quiet import RepeatSummary
from txlb._server.lean_channel import DateCache, LeanChannel


class LeanSite(ServerFactory):
    """
    The main port's factory (what ``twistd llmlb`` listens with): the proxy resource
    served by :class:`~txlb._server.lean_channel.LeanChannel`.  ``max_body`` and
    ``header_timeout`` are read per connection and per request, so a reload retunes them
    in place, as on ``ProxySite``.
    """

    noisy = False  # "Starting factory <LeanSite object at 0x...>" says nothing to operators

    def __init__(self, resource: IResource, max_body: int = 0, header_timeout: float = 30.0,
                 on_refused: Any = None, reactor: IReactorTime | None = None,
                 repeats: RepeatSummary | None = None) -> None:
        self.resource = resource
        self.max_body = max_body
        self.header_timeout = header_timeout
        self.on_refused = on_refused
        self.repeats = repeats
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self.clock: IReactorTime = reactor
        self.date = DateCache(self.clock)

    def reconfigure(self, config: Config) -> None:
        """``config``'s ``--max-body`` and ``--header-timeout``, from the next request on."""
        self.max_body = config.max_body
        self.header_timeout = config.header_timeout

    def buildProtocol(self, addr: Any) -> LeanChannel:
        return LeanChannel(self)

    def acceptableProtocols(self) -> list[bytes]:
        """
        What TLS's ALPN may agree on (``--listen ssl:...``): HTTP/1.1.  Twisted's TLS
        refuses a client that offers ALPN when the factory names no protocol at all.
        (Declared below, except on a Twisted whose TLS would set it on the shared context
        for every connection, which pyOpenSSL refuses after the first.)
        """
        return [b"http/1.1"]

    def logPrefix(self) -> str:
        """
        The main port's start-up line stays ``ProxySite starting on PORT``, whichever
        server serves it: operators' scripts, the bench and the ``--workers`` supervisor's
        own line all say it that way.
        """
        return "ProxySite"


if not alpn_mutates_shared_context():
    classImplements(LeanSite, IProtocolNegotiationFactory)
