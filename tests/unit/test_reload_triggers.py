"""
What starts a reload, and what checks a config without starting: ``kill -HUP``'s handler,
``twistd -n llmlb --check`` and ``python -m txlb.check``.
"""

from __future__ import annotations

import io
import signal
from pathlib import Path
from typing import Any
from unittest.mock import patch

from twisted.internet.testing import MemoryReactorClock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from txlb import LoadBalancer
from txlb._reload import ConfigSource
from txlb.check import main as check_main
from txlb.tap import Options, _ReloadOnHangup

from ..helpers import FakeUpstream

A, B = "127.0.0.1:8002", "127.0.0.1:8003"


class _Reactor(MemoryReactorClock):
    """Runs ``callFromThread`` calls at once (they are queued for the reactor's turn)."""

    def __init__(self) -> None:
        super().__init__()
        self.from_thread: list[Any] = []

    def callFromThread(self, f: Any, *args: Any, **kwargs: Any) -> None:
        self.from_thread.append((f, args, kwargs))

    def run_thread_calls(self) -> None:
        calls, self.from_thread = self.from_thread, []
        for f, args, kwargs in calls:
            f(*args, **kwargs)


class HangupTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.path = Path(self.mktemp())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(f'log-file = "none"\nbackends = ["{A}"]\n')
        source = ConfigSource.snapshot({"config": str(self.path)}, {})
        self.reactor = _Reactor()
        self.lb = LoadBalancer(config=source.read(), source=source, reactor=self.reactor,
                               agent=FakeUpstream(), probe_agent=FakeUpstream())
        self.service = _ReloadOnHangup(self.reactor, self.lb)
        previous = signal.getsignal(signal.SIGHUP)
        self.addCleanup(signal.signal, signal.SIGHUP, previous)

    def installed(self) -> Any:
        self.service.startService()
        self.reactor.run()
        return signal.getsignal(signal.SIGHUP)

    def test_the_handler_is_installed_when_the_service_starts(self) -> None:
        # before the reactor runs: a HUP during start-up must not kill the process
        self.service.startService()
        self.assertEqual(signal.getsignal(signal.SIGHUP), self.service._hangup)

    def test_a_hangup_during_start_up_reloads_once_the_reactor_runs(self) -> None:
        self.service.startService()
        self.path.write_text(f'log-file = "none"\nbackends = ["{A}", "{B}"]\n')
        signal.getsignal(signal.SIGHUP)(signal.SIGHUP, None)  # type: ignore[operator]
        self.assertEqual(self.lb.reloader.generation.generation, 1)
        self.reactor.run()
        self.reactor.run_thread_calls()  # the reactor's first turn
        self.reactor.advance(0)
        self.assertEqual((len(self.lb.pool), self.lb.reloader.generation.generation), (2, 2))

    def test_a_hangup_during_the_handler_returns_at_once(self) -> None:
        """A signal arriving while the handler runs runs it again, nested: not deeper."""
        handler = self.installed()
        depth = [0, 0]
        hand_over = self.reactor.callFromThread

        def nested_signal(f: Any, *args: Any) -> None:
            depth[0] += 1
            depth[1] = max(depth)
            if depth[0] < 50:
                handler(signal.SIGHUP, None)  # another HUP, between two bytecodes
            hand_over(f, *args)
            depth[0] -= 1

        self.reactor.callFromThread = nested_signal  # type: ignore[method-assign]
        handler(signal.SIGHUP, None)
        self.assertEqual(depth[1], 1)  # before: 50 deep, and a storm overflowed the stack
        self.assertEqual(len(self.reactor.from_thread), 1)
        self.reactor.run_thread_calls()
        handler(signal.SIGHUP, None)  # taken in the reactor's turn: the next one counts
        self.assertEqual(len(self.reactor.from_thread), 1)

    def test_the_handler_only_hands_over_to_the_reactor(self) -> None:
        handler = self.installed()
        self.path.write_text(f'log-file = "none"\nbackends = ["{A}", "{B}"]\n')
        handler(signal.SIGHUP, None)
        self.assertEqual(len(self.lb.pool), 1)  # nothing yet: in the reactor's turn
        self.reactor.run_thread_calls()
        self.reactor.advance(0)
        self.assertEqual(len(self.lb.pool), 2)
        self.assertEqual(self.lb.reloader.generation.generation, 2)

    def test_several_hangups_before_the_reactor_turn_are_one_reload(self) -> None:
        handler = self.installed()
        for _ in range(3):
            handler(signal.SIGHUP, None)
        self.reactor.run_thread_calls()
        self.reactor.advance(0)
        self.assertEqual(self.lb.reloader.generation.generation, 2)
        handler(signal.SIGHUP, None)
        self.reactor.run_thread_calls()
        self.reactor.advance(0)
        self.assertEqual(self.lb.reloader.generation.generation, 3)

    def test_a_broken_file_keeps_the_process_serving_and_says_so_in_one_line(self) -> None:
        handler = self.installed()
        self.path.write_text("backends = [\n")
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        handler(signal.SIGHUP, None)
        self.reactor.run_thread_calls()
        self.reactor.advance(0)  # the refusal is logged, not raised out of the reactor
        lines = [formatEvent(event) for event in events]
        self.assertEqual(len(lines), 1, lines)
        self.assertTrue(lines[0].startswith("reload (SIGHUP) refused, still running "
                                            "generation 1: --config:"), lines)
        self.assertEqual((len(self.lb.pool), self.lb.reloader.generation.generation), (1, 1))
        self.assertIn("not valid TOML", self.lb.reloader.generation.last_error or "")


    def test_a_file_that_cannot_be_parsed_is_refused_in_one_line(self) -> None:
        handler = self.installed()
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        for raw, words in ((b'backends = ["\xff"]\n', "not UTF-8 text"),
                           (b"retries = " + b"{a = " * 5000, "nested too deeply")):
            self.path.write_bytes(raw)
            handler(signal.SIGHUP, None)
            self.reactor.run_thread_calls()
            self.reactor.advance(0)  # nothing raised out of the reactor's turn
            self.assertIn(words, self.lb.reloader.generation.last_error or "")
        lines = [formatEvent(event) for event in events]
        self.assertEqual(len(lines), 2, lines)
        self.assertEqual(self.lb.reloader.generation.generation, 1)


class CheckTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.path = Path(self.mktemp())
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def run_check(self, *args: str, environ: dict[str, str] | None = None,
                  ) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with patch("sys.stdout", out), patch("sys.stderr", err), \
                patch.dict("os.environ", environ or {}, clear=True):
            code = check_main(list(args))
        return code, out.getvalue(), err.getvalue()

    def test_a_good_file_is_ok_with_a_summary(self) -> None:
        self.path.write_text(f'policy = "p2c"\nbackends = ["{A}", "{B}"]\n')
        code, out, err = self.run_check(str(self.path))
        self.assertEqual((code, out, err),
                         (0, f"OK: {self.path} (2 backends, policy p2c)\n", ""))

    def test_a_bad_file_is_the_one_line_and_exit_2(self) -> None:
        self.path.write_text('queue-timeout = "soon"\n')
        code, out, err = self.run_check(str(self.path))
        self.assertEqual((code, out), (2, ""))
        self.assertEqual(err.count("\n"), 1)
        self.assertIn("--queue-timeout", err)

    def test_the_command_line_and_environment_count_as_at_start(self) -> None:
        self.path.write_text(f'backends = ["{A}"]\n')
        code, _, err = self.run_check(str(self.path), "--workers", "2", "--listen",
                                      "unix:/tmp/x.sock")
        self.assertEqual(code, 2)
        self.assertIn("--workers", err)
        code, _, err = self.run_check(str(self.path), environ={"LB_HC_INTERVAL": "-3"})
        self.assertEqual(code, 2)
        self.assertIn("LB_HC_INTERVAL", err)

    def test_a_file_without_backends_fails_the_check(self) -> None:
        self.path.write_text('policy = "p2c"\n')  # a truncated save
        code, out, err = self.run_check(str(self.path))
        self.assertEqual((code, out, err.count("\n")), (2, "", 1))
        self.assertIn("has no 'backends' key", err)
        code, out, _ = self.run_check(str(self.path), "--backends", A)
        self.assertEqual((code, out), (0, f"OK: {self.path} (1 backend, policy p2c)\n"))
        self.path.write_text("backends = []\n")
        code, out, _ = self.run_check(str(self.path))
        self.assertEqual((code, out), (0, f"OK: {self.path} (0 backends, policy least-conn)\n"))

    def test_a_file_that_cannot_be_decoded_or_parsed_fails_in_one_line(self) -> None:
        for raw, words in ((b'backends = ["\xff"]\n', "not UTF-8 text"),
                           (b"retries = " + b"[" * 5000, "nested too deeply")):
            self.path.write_bytes(raw)
            code, out, err = self.run_check(str(self.path))
            self.assertEqual((code, out, err.count("\n")), (2, "", 1), err)
            self.assertIn(words, err)

    def test_an_unreadable_file(self) -> None:
        code, _, err = self.run_check(str(self.path))
        self.assertEqual(code, 2)
        self.assertIn("cannot read", err)

    def test_it_opens_no_port(self) -> None:
        """A port in use is no error: nothing is listened on."""
        self.path.write_text(f'listen = "tcp:1"\nadmin = "tcp:1"\nbackends = ["{A}"]\n')
        self.assertEqual(self.run_check(str(self.path))[0], 0)

    def test_twistd_llmlb_check_prints_ok_and_exits_0(self) -> None:
        self.path.write_text(f'backends = ["{A}"]\n')
        out = io.StringIO()
        with patch("sys.stdout", out), self.assertRaises(SystemExit) as caught:
            Options().parseOptions(["--check", "--config", str(self.path)])
        self.assertEqual((caught.exception.code, out.getvalue()),
                         (0, f"OK: {self.path} (1 backend, policy least-conn)\n"))

    def test_twistd_llmlb_check_refuses_like_a_start(self) -> None:
        self.path.write_text("retries = -1\n")
        with self.assertRaises(usage.UsageError) as caught:
            Options().parseOptions(["--check", "--config", str(self.path)])
        self.assertIn("--retries", str(caught.exception))
