"""
What the proxy and an upstream promise each other: how a request is sent (:class:`Upstream`),
what comes back (:class:`UpstreamResponse`) and who its body is reported to
(:class:`IRelayOwner`).

txlb's own client (:mod:`txlb._upstream.client`) and an embedder's Agent
(:mod:`txlb._upstream.agent`) both keep these promises, so the proxy
(:mod:`txlb._proxy.exchange`) has one code path for both and knows neither.
"""

from __future__ import annotations

from typing import Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.python.failure import Failure

from txlb._http.headers import RawHeaders


class IRelayOwner(TypingProtocol):
    """What a response body is reported to: the exchange that owns the client request."""

    def body_started(self, producer: IPushProducer) -> None:
        """The body began; ``producer`` pauses/resumes/stops the upstream read."""

    def body_chunk(self, data: bytes) -> None:
        """One upstream read of body bytes, to be written to the client now."""

    def body_ended(self, failure: Failure | None) -> None:
        """The body ended: cleanly (``None``) or not (the failure)."""


class UpstreamResponse(TypingProtocol):
    """A response head from a backend, with a way to receive (or refuse) its body."""

    code: int
    phrase: bytes
    #: every header as received, names lowercased, in order (hop-by-hop ones included)
    headers: RawHeaders
    #: the body's length when the backend said it (Content-Length), else ``None``
    length: int | None
    #: the body arrives in chunked framing; ``deliver(owner, raw=True)`` passes it as is
    chunked: bool

    def deliver(self, owner: IRelayOwner, raw: bool) -> None:
        """
        Stream the body to ``owner``.  With ``raw`` a chunked body is handed on with its
        framing (minus the last chunk and trailers, which the client's side writes
        itself); otherwise only the payload bytes.
        """

    def discard(self) -> None:
        """The body is not wanted (the request goes to another backend): drop it."""


class Upstream(TypingProtocol):
    """How the proxy sends a request to a backend."""

    def send(self, host: str, port: int, method: bytes, target: bytes,
             headers: RawHeaders, body: bytes | None) -> Deferred[UpstreamResponse]:
        """
        Send ``method target`` with ``headers`` (end-to-end ones: ``Host`` and
        ``Content-Length`` are the client's to write) and ``body`` (``None``: no body and
        no ``Content-Length``).  Cancelling the Deferred aborts the attempt.
        """

    def close_idle(self) -> Deferred[None]:
        """Close every idle pooled connection (at shutdown)."""
