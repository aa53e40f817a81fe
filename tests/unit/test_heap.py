"""
The start-up heap is frozen once the reactor runs (txlb._server.heap): a full garbage
collection then walks only what came after, so it no longer stalls every stream.
"""

from __future__ import annotations

from twisted.application.service import MultiService
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from txlb._server.heap import FreezeHeapOnStart, freeze_heap
from txlb.tap import Options, makeService


class RunningClock(Clock):
    """A Clock with ``callWhenRunning`` that waits until told the reactor runs."""

    def __init__(self) -> None:
        super().__init__()
        self.when_running: list[object] = []

    def callWhenRunning(self, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.when_running.append(lambda: f(*args, **kwargs))

    def run(self) -> None:
        for call in self.when_running:
            call()  # type: ignore[operator]


class FreezeTests(TestCase):
    def test_garbage_is_collected_before_the_rest_is_frozen(self) -> None:
        calls: list[str] = []
        count = freeze_heap(collect=lambda: calls.append("collect"),
                            freeze=lambda: calls.append("freeze"),
                            frozen=lambda: 67000)
        self.assertEqual(calls, ["collect", "freeze"])
        self.assertEqual(count, 67000)

    def test_frozen_only_once_the_reactor_runs(self) -> None:
        """Freezing before start-up ends would leave later start-up garbage frozen too."""
        reactor = RunningClock()
        frozen: list[int] = []
        service = FreezeHeapOnStart(reactor, freeze=lambda: frozen.append(1) or 1)
        service.startService()
        self.assertEqual(frozen, [])
        reactor.run()
        self.assertEqual(frozen, [1])

    def test_twistd_llmlb_freezes_its_heap_last(self) -> None:
        """The plugin's service tree ends with the freeze, alone and with --workers."""
        for argv in (["--backends", "127.0.0.1:9"],
                     ["--backends", "127.0.0.1:9", "--workers", "2"]):
            options = Options()
            options.parseOptions(argv)
            top = makeService(options)
            assert isinstance(top, MultiService)
            self.assertIsInstance(list(top)[-1], FreezeHeapOnStart, argv)
