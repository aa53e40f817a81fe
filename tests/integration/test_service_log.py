"""
The service log of the real ``twistd -n llmlb`` process says what changed and little else,
and every start-up failure is one line naming the option and the value.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import time
from typing import Any

from twisted.internet import defer, reactor, task
from twisted.internet.task import Clock
from twisted.logger import Logger, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase

from txlb._log.quiet import AcceptErrorSummary, QuietAcceptErrors

from ..processes import (
    ROOT,
    Client,
    TwistdProcess,
    clean_environment,
    twistd_command,
    wait_until,
)
from .test_integration import Fleet


def health_probes(fleet: Fleet) -> list[int]:
    return [sum(1 for r in sim.requests if r.path == b"/health") for sim in fleet.sims]


class IdleLogTests(TestCase):
    """An idle balancer, probing fast and polled by a dashboard, writes nothing."""

    timeout = 90

    def test_idle_balancer_writes_nothing_after_start_up(self) -> Any:
        return self.idle()

    def test_idle_balancer_with_workers_writes_nothing_after_start_up(self) -> Any:
        return self.idle("--workers", "2")

    @defer.inlineCallbacks
    def idle(self, *args: str) -> Any:
        fleet = Fleet(self, 2)
        with socket.socket() as probe:  # a port with nothing behind it: a down backend
            probe.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{probe.getsockname()[1]}"
        lb = TwistdProcess("--backends", ",".join([*fleet.keys, dead]),
                           "--health-interval", "0.1", "--admin", "tcp:0:interface=127.0.0.1",
                           *args)
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        yield defer.ensureDeferred(lb.started())
        workers = int(args[1]) if args else 0
        yield defer.ensureDeferred(wait_until(
            lambda: lb.output().count(" serves ") == 2 and "marked down" in lb.output()
            and lb.output().count(") serving") == workers,
            what="the first probes"))
        start_up = lb.output().splitlines()
        before = health_probes(fleet)
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)
        # a dashboard and a Prometheus polling every 0.05s, while every backend is probed
        # 20 more times (about 2s; bounded at 30s by the deadline, and by the count)
        deadline = time.monotonic() + 30
        for _ in range(1000):
            if min(now - then for now, then in zip(health_probes(fleet), before,
                                                  strict=True)) >= 20:
                break
            self.assertLess(time.monotonic(), deadline, "the backends were not probed")
            for path in ("/", "/status", "/metrics"):
                response, _ = yield defer.ensureDeferred(client.fetch(lb.admin_url + path))
                self.assertEqual(response.code, 200)
            yield task.deferLater(reactor, 0.05)
        else:
            self.fail("the backends were not probed 20 times")
        after = lb.output().splitlines()[len(start_up):]
        self.assertEqual(after, [], "lines written by an idle balancer")
        # start-up said what matters, once: each backend's models, the dead one down
        self.assertEqual(sum("marked down" in line for line in start_up), 1)
        self.assertFalse([line for line in start_up if "factory" in line.lower()])


class AcceptErrorSummaryTests(SynchronousTestCase):
    """At the file-descriptor limit a port writes two lines a minute, not one per client."""

    def setUp(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.clock = Clock()
        self.summary = AcceptErrorSummary(self.clock, "--listen tcp:8000", window=60,
                                          log=Logger(observer=self.events.append))

    def test_first_error_in_words_then_one_summary(self) -> None:
        for _ in range(500):
            self.summary({"log_format": "Could not accept new connection ({acceptError})",
                          "acceptError": "EMFILE"})
        self.assertEqual(len(self.events), 1)
        self.assertIn("cannot accept new connections", self.events[0]["log_format"])
        self.assertEqual(self.events[0]["reason"], " (EMFILE)")
        self.clock.advance(60)
        self.assertEqual(len(self.events), 2)
        self.assertEqual(self.events[1]["count"], 499)
        self.clock.advance(600)
        self.assertEqual(len(self.events), 2, "nothing more while nothing happens")

    def test_a_lone_error_has_no_summary(self) -> None:
        self.summary({"log_format": "EMFILE encountered; releasing reserved file descriptor."})
        self.clock.advance(60)
        self.assertEqual(len(self.events), 1)

    def test_real_tcp_port_reports_through_the_summary(self) -> None:
        from twisted.internet import endpoints
        from twisted.internet.protocol import Factory

        endpoint = QuietAcceptErrors(
            endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1"), reactor, "x")
        port = self.successResultOf(endpoint.listen(Factory()))
        self.addCleanup(port.stopListening)
        self.assertIsInstance(port._logger.observer, AcceptErrorSummary)  # type: ignore


class DescriptorExhaustionTests(TestCase):
    """The real process at its file-descriptor limit, refusing clients, stays quiet."""

    timeout = 90

    def test_refused_clients_are_summarised(self) -> Any:
        return self.exhaust()

    def test_refused_clients_are_summarised_with_workers(self) -> Any:
        return self.exhaust("--workers", "2")

    @defer.inlineCallbacks
    def exhaust(self, *args: str) -> Any:
        fleet = Fleet(self, 1)
        limit = 64
        lb = TwistdProcess("--backends", fleet.keys[0], "--health-interval", "0.5", *args,
                           preexec_fn=lambda: resource.setrlimit(
                               resource.RLIMIT_NOFILE, (limit, limit)))
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        yield defer.ensureDeferred(lb.started())
        clients: list[socket.socket] = []
        def close_clients() -> None:
            for client in clients:
                client.close()

        self.addCleanup(close_clients)
        processes = int(args[1]) if args else 1
        for _ in range(2 * limit * processes):  # more clients than there are descriptors
            client = socket.create_connection(("127.0.0.1", lb.port), timeout=5)
            client.setblocking(False)
            clients.append(client)

        def refused() -> int:
            count = 0
            for client in clients:
                try:
                    count += client.recv(1) == b""
                except BlockingIOError:
                    pass
                except OSError:
                    count += 1
            return count

        def accept_lines() -> list[str]:
            return [line for line in lb.output().splitlines()
                    if "accept" in line.lower() or "emfile" in line.lower()]

        # a client sees its connection closed a moment before the process logs about it
        yield defer.ensureDeferred(wait_until(
            lambda: refused() >= limit // 2 and bool(accept_lines()), timeout=30,
            what="clients refused at the limit, and the log saying so"))
        lines = accept_lines()
        self.assertLessEqual(len(lines), processes, lines[:6])  # one per process
        self.assertIn("cannot accept new connections", lines[0])


class StartUpErrorTests(SynchronousTestCase):
    """Every start-up failure: one line naming the option and value, exit non-zero."""

    def run_twistd(self, *args: str) -> tuple[int, list[str]]:
        done = subprocess.run(twistd_command(*args), capture_output=True, text=True,
                              timeout=60, env=clean_environment(), cwd=ROOT)
        output = done.stdout + done.stderr
        self.assertNotIn("Traceback", output)
        self.assertNotIn("Usage:", output)
        errors = [line for line in output.splitlines() if "error" in line.lower()]
        self.assertEqual(len(errors), 1, output)
        self.assertNotEqual(done.returncode, 0)
        return done.returncode, errors

    def test_port_in_use(self) -> None:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            listen = f"tcp:{holder.getsockname()[1]}:interface=127.0.0.1"
            _, [line] = self.run_twistd("--listen", listen, "--admin", "none",
                                        "--log-file", "none", "--backends", "127.0.0.1:9")
        self.assertIn(f"--listen {listen}: cannot listen: address already in use", line)
        self.assertIn("choose another with --listen", line)

    def test_port_in_use_with_workers(self) -> None:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            listen = f"tcp:{holder.getsockname()[1]}:interface=127.0.0.1"
            _, [line] = self.run_twistd("--listen", listen, "--workers", "2", "--admin",
                                        "none", "--log-file", "none",
                                        "--backends", "127.0.0.1:9")
        self.assertIn(f"--listen {listen}: cannot listen: address already in use", line)

    def test_admin_port_in_use(self) -> None:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            admin = f"tcp:{holder.getsockname()[1]}:interface=127.0.0.1"
            _, [line] = self.run_twistd("--listen", "tcp:0:interface=127.0.0.1",
                                        "--admin", admin, "--log-file", "none",
                                        "--backends", "127.0.0.1:9")
        self.assertIn(f"--admin {admin}: cannot listen", line)

    def test_unix_socket_in_missing_directory(self) -> None:
        """
        Not only a port in use: a path Twisted cannot even lock (its directory is
        missing) raises a plain OSError, which twistd printed as a 40-line traceback.
        """
        # not under mktemp(): its path has this class's name, an "error" in every line
        listen = f"unix:/tmp/txlb-no-such-directory-{os.getpid()}/lb.sock"
        _, [line] = self.run_twistd("--listen", listen, "--admin", "none",
                                    "--log-file", "none", "--backends", "127.0.0.1:9")
        self.assertIn(f"--listen {listen}: cannot listen: no such file or directory", line)
        self.assertNotIn("Stop whatever holds it", line)  # nothing holds it
        self.assertIn("choose another with --listen", line)

    def test_address_not_on_this_host(self) -> None:
        """EADDRNOTAVAIL is not a port someone holds: the hint must not say so."""
        listen = "tcp:0:interface=192.0.2.1"  # TEST-NET-1, never a local address
        _, [line] = self.run_twistd("--listen", listen, "--admin", "none",
                                    "--log-file", "none", "--backends", "127.0.0.1:9")
        self.assertIn(f"--listen {listen}: cannot listen: cannot assign requested", line)
        self.assertNotIn("Stop whatever holds it", line)

    def test_mistyped_option(self) -> None:
        code, [line] = self.run_twistd("--helth-interval", "3")
        self.assertEqual(code, 2)
        self.assertEqual(line, "txlb: error: unknown option --helth-interval (did you mean "
                               "--health-interval?); 'twistd llmlb --help' lists them all")

    def test_bad_value(self) -> None:
        _, [line] = self.run_twistd("--retries", "lots")
        self.assertEqual(line, "txlb: error: --retries: 'lots' is not a whole number")

    def test_unknown_backend_key(self) -> None:
        path = os.path.abspath(self.mktemp())
        with open(path, "w") as handle:
            handle.write('[[backends]]\nurl = "http://127.0.0.1:8002"\nmaxconns = 4\n')
        code, [line] = self.run_twistd("--config", path)
        self.assertEqual(code, 2)
        self.assertIn("unknown key 'maxconns'", line)
        self.assertIn("did you mean 'max_conns'?", line)
        self.assertIn("http://127.0.0.1:8002", line)
        self.assertNotIn("{", line)  # no Python dict


class RepeatedEventTests(SynchronousTestCase):
    """A state that persists is logged when it begins, not on every event that confirms it."""

    def test_outlier_kept_in_is_logged_once_per_run_of_5xx(self) -> None:
        from txlb import LoadBalancer

        from ..helpers import FakeUpstream

        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        lb = LoadBalancer(["127.0.0.1:8002", "127.0.0.1:8003"], reactor=Clock(),
                          agent=FakeUpstream(), probe_agent=FakeUpstream(), log_file="none")
        first, second = list(lb.pool)
        lb.pool.mark_down(first, "test")  # half the fleet out: the other must stay in
        for number in range(50):  # from two clients, so the streak would eject
            lb.pool.record_answer(second, 500, client=f"10.0.0.{number % 2}")
        stays = [e for e in events if "stays in" in str(e.get("log_format"))]
        self.assertEqual(len(stays), 1)
        self.assertTrue(second.health.healthy)


class BackendChosenTextTests(SynchronousTestCase):
    """What a backend chooses (its model names) cannot forge or split a service-log line."""

    def test_model_names_are_escaped(self) -> None:
        from twisted.logger import formatEvent

        from txlb import BackendSpec, Pool

        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        pool = Pool((BackendSpec("127.0.0.1", 8002),))
        backend = pool.get("127.0.0.1:8002")
        assert backend is not None
        pool.set_models(backend, [{"id": "m\nbackend 127.0.0.1:8003 marked down: forged"},
                                  {"id": "\x1b]0;pwned\x07"}])
        lines = [formatEvent(e) for e in events if "serves" in str(e.get("log_format"))]
        self.assertEqual(len(lines), 1)
        self.assertNotIn("\n", lines[0])
        self.assertNotIn("\x1b", lines[0])
        self.assertIn("\\n", lines[0])
        self.assertEqual(backend.listing.names,
                         ("m\nbackend 127.0.0.1:8003 marked down: forged", "\x1b]0;pwned\x07"))
