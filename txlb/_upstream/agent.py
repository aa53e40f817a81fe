"""
The proxy's upstream hop through any ``IAgent`` -- for embedders who pass their own agent
(and for the unit tests' fake one).

``twistd llmlb`` and ``LoadBalancer()`` without ``agent=`` use :mod:`txlb._upstream.client`, which
passes chunked bodies through untouched; this adapter gives an Agent the same
:class:`~txlb._upstream.interfaces.Upstream` face, so the proxy has one code path for both.  Through
an Agent the body arrives decoded, so it is never passed through raw.

Backpressure still comes from Twisted's producer/consumer API: the response body's
transport is the producer the proxy pauses when the client's socket fills.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IConsumer, IPushProducer
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IAgent, IBodyProducer, IResponse
from zope.interface import implementer

from txlb._compat import response_connection_headers
from txlb._config.config import Config
from txlb._http.headers import RawHeaders, connection_tokens, flatten
from txlb._upstream.heads import MAX_CONTENT_LENGTH, BadResponse, parse_content_length
from txlb._upstream.interfaces import IRelayOwner, UpstreamResponse


@implementer(IBodyProducer)
class BytesProducer:
    """
    The buffered request body, sent in one write.

    twisted.web has already read the whole body before ``render`` runs, so there is nothing
    to stream; writing it at once also needs no cooperator (unlike ``FileBodyProducer``).
    """

    def __init__(self, body: bytes) -> None:
        self._body = body
        self.length = len(body)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        consumer.write(self._body)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


class BodyRelay(Protocol):
    """
    The protocol handed to ``IResponse.deliverBody``: translates Twisted's body-protocol
    events into the owner's three callbacks.  ``PotentialDataLoss`` is a clean end: it is
    how Agent reports a body delimited by the connection closing, which is legal HTTP/1.1
    for responses without ``Content-Length`` or chunking.
    """

    def __init__(self, owner: IRelayOwner) -> None:
        self._owner = owner

    def connectionMade(self) -> None:
        assert self.transport is not None
        self._owner.body_started(IPushProducer(self.transport))

    def dataReceived(self, data: bytes) -> None:
        self._owner.body_chunk(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if reason.check(ResponseDone, PotentialDataLoss):
            self._owner.body_ended(None)
        else:
            self._owner.body_ended(reason)


class _Discard(Protocol):
    """Takes the body of an answer that will not be relayed, closing its connection."""

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.stopProducing()  # type: ignore[attr-defined]


class AgentResponse:
    """An ``IResponse`` as an :class:`~txlb._upstream.interfaces.UpstreamResponse`."""

    chunked = False

    def __init__(self, response: IResponse) -> None:
        self._response = response
        self.code: int = response.code
        self.phrase: bytes = response.phrase
        named = connection_named(response)
        self.headers: RawHeaders = [
            (name, value) for name, value in flatten(response.headers.getAllRawHeaders())
            if name not in named
        ]
        self.length: int | None = (None if response.length is UNKNOWN_LENGTH
                                   else response.length)

    def deliver(self, owner: IRelayOwner, raw: bool) -> None:
        self._response.deliverBody(BodyRelay(owner))

    def discard(self) -> None:
        self._response.deliverBody(_Discard())


class AgentUpstream:
    """Sends the proxy's requests with an ``IAgent``."""

    def __init__(self, agent: IAgent) -> None:
        self.agent = agent

    def reconfigure(self, config: Config) -> None:
        """Nothing to take: the embedder's agent has its own timeouts."""

    def send(self, host: str, port: int, method: bytes, target: bytes,
             headers: RawHeaders, body: bytes | None) -> Deferred[UpstreamResponse]:
        outgoing = Headers()
        for name, value in headers:
            outgoing.addRawHeader(name, value)
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        uri = b"http://" + authority.encode("idna") + target
        producer = None if body is None else BytesProducer(body)
        sent: Deferred[Any] = self.agent.request(method, uri, outgoing, producer)
        sent.addCallback(checked_response)
        return sent

    def close_idle(self) -> Deferred[None]:
        return succeed(None)


def checked_response(response: IResponse) -> AgentResponse:
    """
    ``response`` for the proxy -- unless its length is no length (Agent takes any number:
    ``Content-Length: 99999999999999999999999`` would reach the client, promising a body
    that never comes): then it is closed and fails as :mod:`txlb._upstream.client` fails a
    bad response head, so the client gets a 502 before any head.  A HEAD answer's
    ``Content-Length`` stays in its headers (it describes the resource) and is checked too.
    """
    adapted = AgentResponse(response)
    try:
        if adapted.length is not None and adapted.length > MAX_CONTENT_LENGTH:
            raise BadResponse(f"Content-Length {adapted.length} is over 2**63-1")
        parse_content_length([value for name, value in adapted.headers
                              if name == b"content-length"])
    except BadResponse:
        adapted.discard()
        raise ResponseFailed([Failure()]) from None
    return adapted


def connection_named(response: IResponse) -> frozenset[bytes]:
    """
    The headers the backend's ``Connection`` header names: hop-by-hop for that hop, so not
    for the client.  Agent moves ``Connection`` out of ``response.headers`` into its parser,
    so it is read there; should a Twisted version move it, nothing is stripped (the headers
    pass, as before) rather than anything failing.
    """
    headers = response_connection_headers(response)
    if not isinstance(headers, Headers):
        return frozenset()
    return connection_tokens(flatten(headers.getAllRawHeaders()))
