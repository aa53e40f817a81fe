"""
``twistd -n llmlb --workers 2`` as a real process in front of simulated vLLM backends:
both workers serve, least-connections is exact across them, one result log gets one whole
line per request, the admin API's drain reaches every worker, a max_conns queue in one
worker is woken by a slot freed in the other, SIGTERM drains and exits 0, and a SIGKILLed
worker is replaced with its counts cleared.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor, task
from twisted.trial.unittest import TestCase

from ..processes import (
    Chunks,
    Client,
    TwistdProcess,
    chat_body,
    clean_environment,
    header,
    twistd_command,
    wait_until,
)
from .test_integration import JSON, Fleet

#: A text result-log line as a whole: stamp, orid, backend, then the fields.
LOG_LINE = re.compile(r"^\d\d-\d\d \d\d:\d\d:\d\d orid=\S+ (127\.0\.0\.1:\d+|-) \S.*$")
#: Bounds on every loop that waits for both workers to have served something.
MAX_REQUESTS = 200


class WorkersProcessTests(TestCase):
    timeout = 120

    async def start(self, backends: int, *args: str, **sim_options: Any) -> None:
        self.fleet = Fleet(self, backends, **sim_options)
        self.log_path = Path(self.mktemp()).resolve()
        self.lb = TwistdProcess("--workers", "2", "--backends", ",".join(self.fleet.keys),
                                "--admin", "tcp:0:interface=127.0.0.1",
                                "--log-file", str(self.log_path), *args)
        self.addCleanup(lambda: defer.ensureDeferred(self.lb.stop()))
        await self.lb.started()
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)
        await wait_until(lambda: self.lb.output().count(") serving") >= 2, timeout=30,
                         what="both workers")

    async def status(self) -> dict[str, Any]:
        _, body = await self.client.fetch(self.lb.admin_url + "/status")
        result: dict[str, Any] = json.loads(body.body)
        return result

    async def open_stream(self, tokens: int) -> Chunks:
        response = await self.client.request(
            self.lb.url + "/v1/chat/completions", b"POST", chat_body(),
            {**JSON, b"x-sim-tokens": [str(tokens).encode()]})
        self.assertEqual(response.code, 200)
        stream = Chunks()
        response.deliverBody(stream)
        await wait_until(lambda: len(stream.chunks) > 1, what="tokens")
        return stream

    async def small_request(self) -> str | None:
        response, _ = await self.client.fetch(
            self.lb.url + "/v1/chat/completions", b"POST", chat_body(stream=False),
            {**JSON, b"x-sim-tokens": [b"1"]})
        self.assertEqual(response.code, 200)
        return header(response, b"x-backend")

    async def until_both_workers_served(self, since: list[int]) -> list[str | None]:
        """
        Small requests until each worker has served one more than ``since``; bounded in
        count and in time.
        """
        backends = []
        deadline = time.monotonic() + 30
        for _ in range(MAX_REQUESTS):
            backends.append(await self.small_request())
            rows = (await self.status())["workers"]
            if all(row["requests"] > before for row, before in zip(rows, since, strict=True)):
                return backends
            self.assertLess(time.monotonic(), deadline, "one worker served nothing in 30 s")
        raise AssertionError(f"one worker served nothing in {MAX_REQUESTS} requests")

    async def status_when(self, condition: Callable[[dict[str, Any]], bool], what: str,
                          timeout: float = 30.0) -> dict[str, Any]:
        """Poll the admin status every 10 ms until ``condition`` holds; fail after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            status = await self.status()
            if condition(status):
                return status
            self.assertLess(time.monotonic(), deadline, f"timed out waiting for {what}")
            await task.deferLater(reactor, 0.01)

    async def until_queued(self, count: int) -> None:
        """Poll the admin status until ``count`` requests wait in the workers' queues."""
        await self.status_when(
            lambda status: sum(row["queued"] for row in status["workers"]) >= count,
            f"{count} requests to queue", timeout=10)

    def log_lines(self) -> list[str]:
        if not self.log_path.exists():
            return []
        return self.log_path.read_text().splitlines()

    async def test_privacy_options_hold_across_workers(self) -> None:
        """
        Workers summarise, the supervisor writes: with --log-content 0, --log-user hash and
        --log-error-body none no address, answer or echoed prompt reaches the file, and one
        user gets one digest whichever worker served it.
        """
        await self.start(2, "--log-content", "0", "--log-user", "hash",
                         "--log-error-body", "none")
        for _ in range(6):
            await self.client.fetch(self.lb.url + "/v1/chat/completions", b"POST",
                                    chat_body(stream=False, user="alice@example.com"), JSON)
        await self.client.fetch(self.lb.url + "/v1/chat/completions", b"POST",
                                chat_body(user="alice@example.com", max_tokens="secret-prompt"),
                                JSON)
        await wait_until(lambda: len(self.log_lines()) >= 7, what="seven log lines")
        text = self.log_path.read_text()
        self.assertNotIn("alice", text)
        self.assertNotIn("secret-prompt", text)
        orids = {line.split()[2] for line in self.log_lines()}
        self.assertEqual(len(orids), 1, orids)
        self.assertRegex(orids.pop(), r"^orid=h:[0-9a-f]{16}$")
        for line in self.log_lines():
            self.assertTrue(line.endswith(" | "), line)

    async def test_history_is_merged_by_the_supervisor(self) -> None:
        """
        Every worker's requests reach the supervisor's history: the samples add up to all
        the requests both workers served, and a stream held open shows as in flight.
        """
        await self.start(2, tokens_per_second=20)
        served = await self.until_both_workers_served([0, 0])
        stream = await self.open_stream(200)
        deadline = time.monotonic() + 30
        while True:
            _, body = await self.client.fetch(self.lb.admin_url + "/status/history")
            samples = json.loads(body.body)["samples"]
            counted = sum(sum(b["requests"] for b in s["backends"].values())
                          for s in samples)
            if counted >= len(served) and samples and samples[-1]["in_flight"] >= 1:
                break
            self.assertLess(time.monotonic(), deadline, f"history: {samples[-3:]}")
            await task.deferLater(reactor, 0.2)
        self.assertEqual(counted, len(served))
        self.assertEqual(sum(s["requests"] for s in samples), counted)
        self.assertEqual(set(samples[-1]["backends"]), set(self.fleet.keys))
        stream.transport.stopProducing()  # type: ignore[union-attr]

    async def test_least_conn_is_exact_across_workers(self) -> None:
        await self.start(4, tokens_per_second=20)
        streams = await defer.gatherResults([
            defer.ensureDeferred(self.open_stream(100)) for _ in range(8)])
        status = await self.status()
        self.assertEqual(status["in_flight"], 8)
        self.assertEqual([b["active"] for b in status["backends"]], [2, 2, 2, 2])
        self.assertEqual(sum(row["in_flight"] for row in status["workers"]), 8)
        # what a worker answers on the main port is the global count too
        _, lb_status = await self.client.fetch(self.lb.url + "/__lb_status")
        self.assertEqual([b["active"] for b in json.loads(lb_status.body)["backends"]],
                         [2, 2, 2, 2])

        # both processes serve (the kernel hands each connection to one of them)
        served = await self.until_both_workers_served([0, 0])
        pids = {row["pid"] for row in (await self.status())["workers"]}
        self.assertEqual(len(pids), 2)
        for stream in streams:
            await stream.done
            self.assertTrue(stream.clean)

        # one result log, one whole line per request, written by the supervisor alone
        # (the streams, the requests that found both workers, and the /__lb_status answer)
        expected = 8 + len(served) + 1
        await wait_until(lambda: len(self.log_lines()) == expected, what="every log line")
        lines = self.log_lines()
        self.assertEqual(len(lines), expected)
        for line in lines:
            self.assertRegex(line, LOG_LINE)
        self.assertEqual(sum(" finish=stop ctok=" in line for line in lines), expected - 1)
        self.assertEqual(sum(" /__lb_status " in line for line in lines), 1)
        self.assertTrue(self.log_path.read_text().endswith("\n"))
        _, metrics = await self.client.fetch(self.lb.admin_url + "/metrics")
        counted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.body.decode().splitlines()
                      if line.startswith("txlb_requests_total{"))
        self.assertEqual(counted, expected)

    async def test_drain_reaches_every_worker(self) -> None:
        await self.start(2)
        drained = self.fleet.keys[0]
        response, _ = await self.client.fetch(
            f"{self.lb.admin_url}/backends/{drained}/drain", b"POST")
        self.assertEqual(response.code, 200)
        since = [row["requests"] for row in (await self.status())["workers"]]
        backends = await self.until_both_workers_served(since)
        self.assertNotIn(drained, backends)
        self.assertEqual(set(backends), {self.fleet.keys[1]})

    async def test_max_conns_queue_is_woken_by_the_other_worker(self) -> None:
        fleet_config = Path(self.mktemp()).resolve()
        self.fleet = Fleet(self, 1, tokens_per_second=50)
        fleet_config.write_text(
            f'[[backends]]\nurl = "{self.fleet.keys[0]}"\nmax_conns = 1\n')
        self.log_path = Path(self.mktemp()).resolve()
        self.lb = TwistdProcess("--workers", "2", "--config", str(fleet_config),
                                "--admin", "tcp:0:interface=127.0.0.1", "--queue-timeout", "20",
                                "--log-file", str(self.log_path))
        self.addCleanup(lambda: defer.ensureDeferred(self.lb.stop()))
        await self.lb.started()
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)
        await wait_until(lambda: self.lb.output().count(") serving") >= 2, timeout=30,
                         what="both workers")
        sim = self.fleet.sims[0]
        held = await self.open_stream(100_000)  # takes the only slot
        requests = []
        for _ in range(20):  # until each worker has a request waiting in its own queue
            requests.append(defer.ensureDeferred(self.client.fetch(
                self.lb.url + "/v1/chat/completions", b"POST", chat_body(),
                {**JSON, b"x-sim-tokens": [b"10"]})))
            queued = len(requests)
            await self.until_queued(queued)
            rows = (await self.status())["workers"]
            if all(row["queued"] > 0 for row in rows):
                break
        else:
            raise AssertionError("the requests all went to one worker")
        peak = 0

        def all_done() -> bool:
            nonlocal peak
            peak = max(peak, sim.running)
            return all(d.called for d in requests)

        began = time.monotonic()
        assert held.transport is not None
        held.transport.stopProducing()  # the client leaves: its slot frees up
        await wait_until(all_done, timeout=30, what="every queued request")
        elapsed = time.monotonic() - began
        results = [await d for d in requests]
        self.assertEqual([r.code for r, _ in results], [200] * len(requests))
        self.assertEqual(peak, 1)  # never two at once, whichever worker took them
        # The waiters of the worker that did not hold the slot would sit out the whole
        # 20 s queue timeout if slots freed in the other worker did not wake them.
        self.assertLess(elapsed, 15)

    async def test_sigterm_drains_every_worker_and_exits_0(self) -> None:
        await self.start(2, tokens_per_second=40)
        streams = []
        for _ in range(30):
            streams.append(await self.open_stream(120))
            rows = (await self.status())["workers"]
            if all(row["in_flight"] > 0 for row in rows):
                break
        else:
            raise AssertionError("the streams all went to one worker")
        pids = [row["pid"] for row in rows]
        self.lb.process.send_signal(signal.SIGTERM)
        for stream in streams:
            await stream.done
            self.assertTrue(stream.clean)
        code = await self.lb.stop(signal_it=False)
        self.assertEqual(code, 0, self.lb.final_output)
        # the workers' own log lines reach the supervisor's log, tagged with the worker
        for index in (0, 1):
            self.assertIn(f"[worker {index} txlb._workers.main] stopping (the supervisor asked)",
                          self.lb.final_output)
        for pid in pids:
            self.assertFalse(Path(f"/proc/{pid}").exists() and _alive(pid))
        lines = self.log_lines()
        self.assertEqual(len(lines), len(streams))
        self.assertTrue(all(" status=200 finish=stop " in line for line in lines))

    async def test_port_refuses_connections_once_stopping(self) -> None:
        """
        Once SIGTERM stops the workers accepting, the port is closed for good (as with one
        process): nothing may keep the inherited listening socket open while the workers
        drain, or the kernel accepts connections that nobody will ever answer.
        """
        await self.start(1, "--shutdown-timeout", "5", tokens_per_second=5)
        stream = await self.open_stream(1000)  # keeps its worker draining for 5 s
        self.lb.process.send_signal(signal.SIGTERM)

        def refused() -> bool:
            try:
                probe = socket.create_connection(("127.0.0.1", self.lb.port), timeout=1)
            except ConnectionRefusedError:
                return True
            except TimeoutError:  # accepted by nobody until the backlog is full
                return False
            probe.close()
            return False

        await wait_until(refused, timeout=10, what="the port to refuse connections")
        self.assertFalse(stream.done.called)  # refused while a stream still drains
        stream.done.addErrback(lambda failure: None)

    async def test_sigkilled_worker_is_replaced_and_its_counts_cleared(self) -> None:
        await self.start(2, tokens_per_second=20)
        streams = []
        for _ in range(30):
            streams.append(await self.open_stream(400))
            rows = (await self.status())["workers"]
            if all(row["in_flight"] > 0 for row in rows):
                break
        else:
            raise AssertionError("the streams all went to one worker")
        victim = rows[0]
        survivor_in_flight = rows[1]["in_flight"]
        os.kill(victim["pid"], signal.SIGKILL)

        status = await self.status_when(
            lambda status: status["workers"][0]["ready"]
            and status["workers"][0]["pid"] != victim["pid"], "worker 0 to be replaced")
        row = status["workers"][0]
        self.assertEqual((row["in_flight"], row["restarts"]), (0, 1))
        self.assertEqual(status["in_flight"], survivor_in_flight)
        self.assertEqual(sum(b["active"] for b in status["backends"]), survivor_in_flight)
        self.assertIn("ended unexpectedly", self.lb.output())
        killed = [s for s in streams if s.done.called and not s.clean]
        self.assertEqual(len(killed), victim["in_flight"])
        await self.until_both_workers_served([0, status["workers"][1]["requests"]])
        for stream in streams:
            stream.done.addErrback(lambda failure: None)
        # the survivor's streams are still running; stopping cuts them (shutdown timeout)


class WorkersReactorTests(TestCase):
    timeout = 60

    async def test_workers_run_the_supervisors_reactor(self) -> None:
        fleet = Fleet(self, 2)
        lb = TwistdProcess("--workers", "2", "--backends", ",".join(fleet.keys),
                           "--admin", "tcp:0:interface=127.0.0.1", reactor="txlb-epoll")
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        await lb.started()
        await wait_until(lambda: lb.output().count(") serving") >= 2, timeout=30,
                         what="both workers")
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)
        for _ in range(4):
            response, chunks = await client.fetch(
                lb.url + "/v1/chat/completions", b"POST", chat_body(), JSON)
            self.assertEqual(response.code, 200)
            self.assertTrue(chunks.body.endswith(b"data: [DONE]\n\n"))
        _, body = await client.fetch(lb.admin_url + "/status")
        for row in json.loads(body.body)["workers"]:
            with open(f"/proc/{row['pid']}/cmdline", "rb") as cmdline:
                self.assertIn(b"\0--reactor\0txlb-epoll", cmdline.read())
        self.assertEqual(await lb.stop(), 0, lb.final_output)
        self.assertNotIn("ended unexpectedly", lb.final_output)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class WorkersStartupTests(TestCase):
    timeout = 60

    def assertStartupRefused(self, args: list[str], *words: str) -> None:
        result = subprocess.run(twistd_command(*args), env=clean_environment(),
                                capture_output=True, text=True, timeout=60)
        self.assertNotEqual(result.returncode, 0)
        lines = result.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, result.stderr)
        for word in words:
            self.assertIn(word, lines[0])

    def test_bad_workers_value_stops_startup_with_one_line(self) -> None:
        self.assertStartupRefused(["--workers", "0"], "--workers", "'0'")
        self.assertStartupRefused(["--workers", "many"], "--workers", "'many'")
        self.assertStartupRefused(["--workers", "2", "--listen", "unix:/tmp/txlb-test.sock"],
                                  "--workers", "unix:/tmp/txlb-test.sock")
