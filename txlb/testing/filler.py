"""
The ``/sim/bytes`` stream: filler bytes written at the pace the client reads them, for
tests of a proxy's flow control and of large bodies.
"""

from __future__ import annotations

import attrs
from twisted.internet.interfaces import IPushProducer
from twisted.python.failure import Failure
from twisted.web.server import Request
from zope.interface import implementer

from txlb.testing.timers import DelayedCall, SimClock
from txlb.testing.wire import filler_bytes


@implementer(IPushProducer)
@attrs.define(eq=False)
class FillerProducer:
    """
    Writes ``/sim/bytes`` one chunk per reactor turn while the consumer is not paused.

    A push producer rather than a pull producer because Twisted drives pull producers
    through the global cooperator, which would escape the injected reactor; and one chunk
    per turn, rather than a loop, so that even a transport that never pauses us (a test's
    ``StringTransport``) gets the stream in bounded steps.  Real transports pause us as soon
    as their buffer is full, which is what keeps the simulator's memory bounded when the
    client reads slowly.
    """

    clock: SimClock
    request: Request
    remaining: int
    chunk: int
    sent: int = 0
    paused: bool = False
    done: bool = False
    call: DelayedCall | None = None

    def start(self) -> None:
        self.request.notifyFinish().addErrback(self._client_gone)
        self.request.registerProducer(self, True)
        self._schedule()

    def _schedule(self) -> None:
        if self.call is None and not self.paused and not self.done:
            self.call = self.clock.callLater(0, self._tick)

    def _cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()
            self.call = None

    def _tick(self) -> None:
        self.call = None
        if self.paused or self.done:
            return
        n = min(self.chunk, self.remaining)
        if n:
            data = filler_bytes(n, self.sent)
            self.sent += n
            self.remaining -= n
            self.request.write(data)  # may pause or even stop us, synchronously
        if self.done:
            return
        if self.remaining == 0:
            self.done = True
            self.request.unregisterProducer()
            self.request.finish()
        else:
            self._schedule()

    def _client_gone(self, reason: Failure) -> None:
        self.done = True
        self._cancel()

    # IPushProducer
    def pauseProducing(self) -> None:
        self.paused = True
        self._cancel()

    def resumeProducing(self) -> None:
        self.paused = False
        self._schedule()

    def stopProducing(self) -> None:
        self.done = True
        self._cancel()
