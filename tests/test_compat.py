"""
The private Twisted state txlb reads (:mod:`txlb._compat`), checked on real sockets, so a
Twisted release that changes it fails here rather than silently changing what txlb does.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer, reactor, task
from twisted.internet.protocol import ClientFactory, Factory, Protocol, connectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from txlb._compat import unsent_bytes

PAYLOAD = 16 * 1024 * 1024  # more than loopback's socket buffers take


class _Stalled(Protocol):
    """A server that reads nothing until told to reset."""

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.transport.pauseProducing()  # type: ignore[attr-defined]


class _Writer(Protocol):
    def __init__(self) -> None:
        self.made: defer.Deferred[None] = defer.Deferred()
        self.lost: defer.Deferred[int | None] = defer.Deferred()

    def connectionMade(self) -> None:
        self.made.callback(None)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost.callback(unsent_bytes(self.transport))


class UnsentBytesTests(TestCase):
    timeout = 30

    def test_not_a_socket_transport(self) -> None:
        self.assertIsNone(unsent_bytes(StringTransport()))
        self.assertIsNone(unsent_bytes(object()))

    @defer.inlineCallbacks
    def test_counts_what_the_kernel_has_not_taken_even_after_a_reset(self) -> Any:
        servers: list[_Stalled] = []

        def build() -> _Stalled:
            servers.append(_Stalled())
            return servers[-1]

        port = reactor.listenTCP(0, Factory.forProtocol(build), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        writer = _Writer()
        factory = ClientFactory.forProtocol(lambda: writer)
        reactor.connectTCP("127.0.0.1", port.getHost().port, factory)
        yield writer.made
        assert writer.transport is not None
        self.assertEqual(unsent_bytes(writer.transport), 0)
        writer.transport.write(b"x" * PAYLOAD)
        pending = unsent_bytes(writer.transport)
        assert pending is not None
        self.assertGreater(pending, 0)
        self.assertLessEqual(pending, PAYLOAD)
        while not servers:  # the server side accepts in a later reactor turn
            yield task.deferLater(reactor, 0, lambda: None)
        servers[0].transport.abortConnection()  # type: ignore[union-attr]
        left = yield writer.lost
        self.assertIsNotNone(left)
        self.assertGreater(left, 0)
