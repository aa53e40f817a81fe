"""
The ``txlb-epoll`` reactor on real loopback sockets, driven by hand (never installed as the
global reactor): eager writes go out at once, in order, and fall back to the stock buffered
path when the kernel is full.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from twisted.internet.protocol import ClientFactory, Factory, Protocol
from twisted.trial.unittest import TestCase

from txlb._server.reactor import (
    CORK_LIMIT,
    DirectDispatchEPollReactor,
    EagerClient,
    EagerServer,
    describe,
    install_by_default,
)

ROOT = Path(__file__).resolve().parents[2]


class Collect(Protocol):
    def __init__(self) -> None:
        self.data = bytearray()
        self.connected_at = None

    def dataReceived(self, data: bytes) -> None:
        self.data += data


class Replier(Protocol):
    """Once told to, answers each read with two writes (as a proxy writes head and body)."""

    replying = False

    def dataReceived(self, data: bytes) -> None:
        if self.replying:
            assert self.transport is not None
            self.transport.write(b"re:")
            self.transport.write(data)


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
        protocol = Replier()
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

    def test_small_write_leaves_with_one_send_and_no_epoll_registration(self) -> None:
        transport = self.server_side[0].transport
        transport.write(b"data: token\n\n")  # type: ignore[union-attr]
        self.assertEqual(self.reactor.corked, [transport])  # sent when the event ends
        self.reactor._flush_corked()
        self.assertEqual(self.reactor.getWriters(), [])  # never waited for writability
        self.assertEqual(transport.dataBuffer, b"")  # type: ignore[union-attr]
        self.spin(lambda: bytes(self.client.data) == b"data: token\n\n")

    def test_writes_of_one_event_leave_together(self) -> None:
        transport = self.server_side[0].transport
        transport.write(b"head,")  # type: ignore[union-attr]
        transport.writeSequence([b"bo", b"dy"])  # type: ignore[union-attr]
        self.assertEqual(transport._corked, [b"head,", b"body"])  # type: ignore[union-attr]
        self.reactor.iterate(0)  # the next poll flushes what timers and callbacks wrote
        self.assertEqual(self.reactor.corked, [])
        self.assertEqual(self.reactor.getWriters(), [])
        self.spin(lambda: bytes(self.client.data) == b"head,body")

    def test_written_during_an_event_is_sent_when_it_ends(self) -> None:
        """A reply written from dataReceived leaves before the reactor polls again."""
        self.server_side[0].replying = True  # type: ignore[attr-defined]
        self.client.transport.write(b"ping")  # type: ignore[union-attr]
        self.spin(lambda: bytes(self.client.data) == b"re:ping")
        self.assertEqual(self.reactor.corked, [])

    def test_close_sends_what_was_written_first(self) -> None:
        transport = self.server_side[0].transport
        transport.write(b"last words")  # type: ignore[union-attr]
        transport.loseConnection()  # type: ignore[union-attr]
        self.spin(lambda: bytes(self.client.data) == b"last words")
        self.spin(lambda: not self.client.transport.connected)  # type: ignore[union-attr]

    def test_a_large_write_is_queued_as_it_is_after_what_was_corked(self) -> None:
        """A request body of megabytes: never joined onto its head, never sliced."""
        transport: Any = self.server_side[0].transport
        body = b"b" * (CORK_LIMIT + 1)
        transport.write(b"head,")
        transport.write(body)
        self.assertIsNone(transport._corked)  # the head went out first
        # the caller's own bytes, queued (Twisted's write buffer)
        self.assertTrue(any(queued is body for queued in transport._tempDataBuffer))
        self.spin(lambda: len(self.client.data) == len(body) + 5)
        self.assertEqual(bytes(self.client.data), b"head," + body)

    def test_large_writes_fall_back_and_keep_order(self) -> None:
        transport = self.server_side[0].transport
        blocks = [bytes([n]) * 1_000_000 for n in range(8)]  # more than a socket buffer
        for block in blocks:
            transport.write(block)  # type: ignore[union-attr]
        transport.writeSequence([b"tail-", b"end"])  # type: ignore[union-attr]
        self.reactor._flush_corked()
        self.assertNotEqual(self.reactor.getWriters(), [])  # the rest waits its turn
        expected = b"".join(blocks) + b"tail-end"
        self.spin(lambda: len(self.client.data) == len(expected), limit=30)
        self.assertEqual(bytes(self.client.data), expected)
        self.spin(lambda: self.reactor.getWriters() == [])


class DefaultChoiceTests(TestCase):
    """How ``twistd -n llmlb`` comes to run on txlb-epoll without ``--reactor``."""

    def test_importing_the_plugin_imports_no_reactor(self) -> None:
        """
        The plugin chooses the reactor while its options are parsed; that works only while
        importing ``txlb.tap`` (and what it imports) installs none.  A module-level import
        of Klein, for one, would install Twisted's default first.
        """
        code = ("import sys, txlb.tap, txlb.demo\n"
                "print('twisted.internet.reactor' in sys.modules)")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=60, check=True)
        self.assertEqual(result.stdout.strip(), "False", result.stderr)

    def test_under_twistd_without_reactor_option_txlb_epoll_is_installed(self) -> None:
        code = ("import sys\n"
                "from twisted.scripts.twistd import ServerOptions\n"
                "options = ServerOptions()\n"
                "options.parseOptions(sys.argv[1:])\n"
                "from twisted.internet import reactor\n"
                "print(type(reactor).__name__)")
        for argv, expected in ((["llmlb", "--backends", "127.0.0.1:9"],
                                "DirectDispatchEPollReactor"),
                               (["--reactor", "poll", "llmlb", "--backends", "127.0.0.1:9"],
                                "PollReactor")):
            result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True,
                                    text=True, timeout=60, cwd=ROOT,
                                    env={**os.environ, "PYTHONPATH": str(ROOT)})
            self.assertEqual(result.stdout.strip(), expected, result.stderr)

    def test_an_installed_reactor_is_left_alone(self) -> None:
        """Under trial a reactor runs already: nothing is installed over it."""
        from twisted.internet import reactor

        self.assertFalse(install_by_default())
        from twisted.internet import reactor as still

        self.assertIs(still, reactor)

    def test_the_start_up_line_names_the_reactor_and_its_path(self) -> None:
        self.assertIn("txlb-epoll: direct dispatch and eager writes",
                      describe(DirectDispatchEPollReactor.__new__(DirectDispatchEPollReactor)))
        from twisted.internet.pollreactor import PollReactor

        line = describe(PollReactor.__new__(PollReactor))
        self.assertIn("twisted.internet.pollreactor.PollReactor: Twisted's stock transports",
                      line)
