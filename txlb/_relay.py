"""
Upstream response body -> client, chunk by chunk, with backpressure.

This is the per-chunk hot path, so it does the least it can: one ``request.write`` per
upstream read and a watchdog reset.  Everything else (choosing a backend, mapping errors,
releasing the slot) lives in :mod:`txlb._proxy`, which is told how the body ended through
the :class:`IRelayOwner` callbacks.

Backpressure comes from Twisted's producer/consumer API rather than from buffering: the
upstream connection's transport is registered as a *streaming* producer on the client
request, so when the client's socket buffer fills, Twisted pauses the upstream read, the
backend's own send buffer fills, and the backend slows down -- memory per connection stays
bounded by socket buffers.
"""

from __future__ import annotations

from typing import Protocol as TypingProtocol

from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss


class IRelayOwner(TypingProtocol):
    """What the relay reports to: the exchange that owns the client request."""

    def body_started(self, producer: IPushProducer) -> None:
        """The upstream body began; ``producer`` pauses/resumes/stops the upstream read."""

    def body_chunk(self, data: bytes) -> None:
        """One upstream read, to be written to the client now."""

    def body_ended(self, failure: Failure | None) -> None:
        """The upstream body ended: cleanly (``None``) or not (the failure)."""


class BodyRelay(Protocol):
    """
    The protocol handed to ``IResponse.deliverBody``.

    It only translates Twisted's body-protocol events into the owner's three callbacks, so
    the owner can keep all the request's state in one place.  ``PotentialDataLoss`` is a
    clean end: it is how Agent reports a body delimited by the connection closing, which
    is legal HTTP/1.1 for responses without ``Content-Length`` or chunking.
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
