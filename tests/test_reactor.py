"""
The ``txlb-epoll`` reactor on real loopback sockets, driven by hand (never installed as the
global reactor): eager writes go out at once, in order, and fall back to the stock buffered
path when the kernel is full.
"""

from __future__ import annotations

import time

from twisted.internet.protocol import ClientFactory, Factory, Protocol
from twisted.trial.unittest import TestCase

from txlb._reactor import DirectDispatchEPollReactor, EagerClient, EagerServer


class Collect(Protocol):
    def __init__(self) -> None:
        self.data = bytearray()
        self.connected_at = None

    def dataReceived(self, data: bytes) -> None:
        self.data += data


class ReactorTests(TestCase):
    def setUp(self) -> None:
        self.reactor = DirectDispatchEPollReactor()
        self.server_side: list[Protocol] = []
        factory = Factory.forProtocol(Protocol)
        factory.buildProtocol = self._server_protocol  # type: ignore[method-assign]
        self.port = self.reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.client = Collect()
        client_factory = ClientFactory()
        client_factory.buildProtocol = lambda addr: self.client  # type: ignore[method-assign]
        self.reactor.connectTCP("127.0.0.1", self.port.getHost().port, client_factory)
        self.spin(lambda: bool(self.server_side) and self.client.transport is not None)
        self.addCleanup(self.close)

    def _server_protocol(self, addr: object) -> Protocol:
        protocol = Protocol()
        self.server_side.append(protocol)
        return protocol

    def spin(self, condition: object, limit: float = 10.0) -> None:
        deadline = time.monotonic() + limit
        while not condition():  # type: ignore[operator]
            if time.monotonic() > deadline:
                self.fail("condition not reached")
            self.reactor.iterate(0.01)

    def close(self) -> None:
        for protocol in self.server_side:
            if protocol.transport is not None:
                protocol.transport.abortConnection()  # type: ignore[attr-defined]
        if self.client.transport is not None:
            self.client.transport.abortConnection()  # type: ignore[attr-defined]
        self.port.stopListening()
        for _ in range(5):
            self.reactor.iterate(0)
        self.reactor.removeAll()

    def test_transports_are_eager(self) -> None:
        self.assertIsInstance(self.server_side[0].transport, EagerServer)
        self.assertIsInstance(self.client.transport, EagerClient)

    def test_small_write_leaves_at_once(self) -> None:
        transport = self.server_side[0].transport
        transport.write(b"data: token\n\n")  # type: ignore[union-attr]
        # sent in the same call: nothing queued, no writer registered with epoll
        self.assertEqual(self.reactor.getWriters(), [])
        self.assertEqual(transport.dataBuffer, b"")  # type: ignore[union-attr]
        self.spin(lambda: bytes(self.client.data) == b"data: token\n\n")

    def test_later_writes_of_the_same_iteration_are_coalesced(self) -> None:
        transport = self.server_side[0].transport
        transport.write(b"first,")  # type: ignore[union-attr]
        self.assertEqual(self.reactor.getWriters(), [])
        transport.write(b"second")  # type: ignore[union-attr]
        self.assertEqual(self.reactor.getWriters(), [transport])  # waits for the next poll
        self.spin(lambda: bytes(self.client.data) == b"first,second")

    def test_large_writes_fall_back_and_keep_order(self) -> None:
        transport = self.server_side[0].transport
        blocks = [bytes([n]) * 1_000_000 for n in range(8)]  # more than a socket buffer
        for block in blocks:
            transport.write(block)  # type: ignore[union-attr]
        transport.writeSequence([b"tail-", b"end"])  # type: ignore[union-attr]
        self.assertNotEqual(self.reactor.getWriters(), [])  # the rest waits its turn
        expected = b"".join(blocks) + b"tail-end"
        self.spin(lambda: len(self.client.data) == len(expected), limit=30)
        self.assertEqual(bytes(self.client.data), expected)
        self.spin(lambda: self.reactor.getWriters() == [])
