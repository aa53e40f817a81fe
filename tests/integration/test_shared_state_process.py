"""
``--shared-state`` for real: a real ``redis-server`` on a free loopback port and three real
``twistd -n llmlb`` replicas over the same simulated engines.  With shared state the replicas
act as one balancer: least-connections counts the others' streams, a drain on one stops the
others' traffic within a second, ``--rate-limit`` is the fleet's, a replica killed with
SIGKILL leaves no count behind, and Redis killed mid-run costs no request.  ``max_conns``
holds over the fleet even in a simultaneous burst (each slot confirmed by one script), and
a slot freed on one replica wakes another's queue at once (pub/sub), not at its next poll.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from typing import Any

from twisted.internet import defer
from twisted.trial.unittest import TestCase

from ..processes import Chunks, Client, TwistdProcess, chat_body, header, wait_until
from ..redis import RedisServer
from .test_integration import JSON, Fleet

#: Bound on every request loop here.
MAX_REQUESTS = 400


class SharedStateCase(TestCase):
    """A real redis-server, and replicas of twistd -n llmlb sharing it."""

    timeout = 120

    def setUp(self) -> None:
        self.redis = RedisServer()
        self.addCleanup(self.redis.stop)
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)

    async def replica(self, *args: str, shared: bool = True) -> TwistdProcess:
        state = ["--shared-state", self.redis.url] if shared else []
        if "--config" not in args:
            state += ["--backends", ",".join(self.fleet.keys)]
        process = TwistdProcess("--admin", "tcp:0:interface=127.0.0.1",
                                "--health-interval", "0.5", "--shutdown-timeout", "2",
                                *state, *args)
        self.addCleanup(lambda: defer.ensureDeferred(process.stop()))
        await process.started()
        return process

    async def replicas(self, count: int, *args: str, shared: bool = True,
                       ) -> list[TwistdProcess]:
        started = [await self.replica(*args, shared=shared) for _ in range(count)]
        if shared:
            for process in started:
                await wait_until(lambda p=process: "shared state: connected" in p.output(),
                                 timeout=10, what="the replica to reach Redis")
            await wait_until(lambda: all(
                "shared state: connected" in p.output() for p in started), timeout=10)
        return started

    async def status(self, process: TwistdProcess) -> dict[str, Any]:
        _, body = await self.client.fetch(process.admin_url + "/status")
        result: dict[str, Any] = json.loads(body.body)
        return result

    async def in_flight(self, process: TwistdProcess) -> dict[str, int]:
        status = await self.status(process)
        return {b["backend"]: b["active"] for b in status["backends"]}

    async def open_stream(self, process: TwistdProcess, tokens: int = 200,
                          ) -> tuple[str | None, Chunks]:
        response = await self.client.request(
            process.url + "/v1/chat/completions", b"POST", chat_body(),
            {**JSON, b"x-sim-tokens": [str(tokens).encode()]})
        self.assertEqual(response.code, 200)
        stream = Chunks()
        response.deliverBody(stream)
        await wait_until(lambda: len(stream.chunks) > 1, what="tokens")
        return header(response, b"x-backend"), stream

    async def small_request(self, process: TwistdProcess) -> tuple[int, str | None]:
        response, _ = await self.client.fetch(
            process.url + "/v1/chat/completions", b"POST", chat_body(stream=False),
            {**JSON, b"x-sim-tokens": [b"1"]})
        return response.code, header(response, b"x-backend")

    async def spread(self, shared: bool) -> set[str | None]:
        """A sends 4 long streams, then B sends 4: the engines the 8 landed on."""
        self.fleet = Fleet(self, 8, tokens_per_second=20)
        a, b = await self.replicas(2, "--policy", "least-conn", shared=shared)
        landed = [(await self.open_stream(a))[0] for _ in range(4)]
        if shared:
            # B has read A's row once its view shows A's four streams
            async def counted() -> bool:
                return sum((await self.in_flight(b)).values()) == 4
            await _until(counted, "B to see A's streams")
        landed += [(await self.open_stream(b))[0] for _ in range(4)]
        return set(landed)


class SharedStateProcessTests(SharedStateCase):
    async def test_streams_of_two_replicas_land_on_eight_engines(self) -> None:
        self.assertEqual(len(await self.spread(shared=True)), 8)

    async def test_without_shared_state_b_reuses_as_engines(self) -> None:
        # the other way round: the test above is only worth something if this one holds
        self.assertEqual(len(await self.spread(shared=False)), 4)

    async def test_drain_on_one_replica_stops_the_others_within_a_second(self) -> None:
        self.fleet = Fleet(self, 2)
        a, b, c = await self.replicas(3)
        drained = self.fleet.keys[0]
        response, _ = await self.client.fetch(
            a.admin_url + f"/backends/{drained}/drain", b"POST")
        self.assertEqual(response.code, 200)
        began = time.monotonic()

        async def drained_everywhere() -> bool:
            for process in (b, c):
                status = await self.status(process)
                if not any(x["backend"] == drained and x["draining"]
                           for x in status["backends"]):
                    return False
            return True

        await _until(drained_everywhere, "the drain to reach B and C", timeout=5)
        self.assertLess(time.monotonic() - began, 1.0)
        for _ in range(10):
            code, backend = await self.small_request(b)
            self.assertEqual((code, backend), (200, self.fleet.keys[1]))
        # kept across a restart: a new replica starts with the drain
        d = await self.replica()
        await wait_until(lambda: "shared state: connected" in d.output(), timeout=10)

        async def d_drained() -> bool:
            status = await self.status(d)
            return any(x["backend"] == drained and x["draining"] for x in status["backends"])

        await _until(d_drained, "the new replica to take the stored drain")

    async def test_rate_limit_is_the_fleets(self) -> None:
        self.fleet = Fleet(self, 2)
        replicas = await self.replicas(3, "--rate-limit", "10/s")
        seconds, began = 4.0, time.monotonic()
        codes: list[int] = []

        async def client(process: TwistdProcess) -> None:
            # one client per replica, each as fast as its replica answers
            for _ in range(MAX_REQUESTS):
                if time.monotonic() - began >= seconds:
                    return
                codes.append((await self.small_request(process))[0])

        await defer.gatherResults([defer.ensureDeferred(client(p)) for p in replicas])
        elapsed = time.monotonic() - began
        allowed = codes.count(200)
        self.assertEqual(codes.count(200) + codes.count(429), len(codes))
        expected = 10 + 10 * elapsed  # the burst (one second's worth), then the rate
        # enough sent that replicas limiting each on its own would let through 1.3x more
        self.assertGreater(len(codes), 1.5 * expected, "too few sent to test the limit")
        self.assertTrue(0.7 * expected <= allowed <= 1.3 * expected,
                        f"{allowed} of {len(codes)} let through in {elapsed:.1f}s, "
                        f"expected ~{expected:.0f}")

    async def test_a_token_budget_is_the_fleets(self) -> None:
        self.fleet = Fleet(self, 1)
        config = os.path.abspath(self.mktemp())
        with open(config, "w") as handle:
            handle.write(f'backends = ["{self.fleet.keys[0]}"]\n[[budgets]]\n'
                         'name = "per-client"\nkey = "ip"\ntokens_per_minute = 600\n')
        a, b = await self.replicas(2, "--config", config)
        body = json.dumps({"model": "sim-model", "prompt": "hello there",
                           "max_tokens": 30}).encode()

        async def post(process: TwistdProcess) -> int:
            response, _ = await self.client.fetch(process.url + "/v1/completions", b"POST",
                                                  body, JSON)
            return int(response.code)

        for _ in range(60):  # a budget of 600 holds ~15 of them: bounded
            if await post(a) == 429:
                break
        else:
            self.fail("A never refused")
        # B's copy learns the fleet's level from its first reservation's answer at most
        codes = [await post(b) for _ in range(3)]
        self.assertIn(429, codes[:2], codes)

    async def test_a_password_is_used_and_never_shown(self) -> None:
        self.redis.stop()
        self.redis = RedisServer(password="s3cret-redis-pass")
        self.addCleanup(self.redis.stop)
        self.fleet = Fleet(self, 1)
        secret = os.path.abspath(self.mktemp())
        with open(secret, "w") as handle:
            handle.write("s3cret-redis-pass\n")
        url = f"redis://127.0.0.1:{self.redis.port}/0?password_file={secret}"
        a = await self.replica("--shared-state", url, shared=False)
        await wait_until(lambda: "shared state: connected" in a.output(), timeout=10)
        status = await self.status(a)
        self.assertEqual(status["shared_state"]["url"],
                         f"redis://:***@127.0.0.1:{self.redis.port}/0")
        _, metrics = await self.client.fetch(a.admin_url + "/metrics")
        self.assertIn(b"txlb_shared_state_up 1.0", metrics.body)
        # the freed-slot subscription, on its own connection, authenticated too
        await wait_until(lambda: self.redis.command("PUBSUB", "NUMSUB", "txlb:freed")
                         .endswith(b":1\r\n"), timeout=10, what="A to subscribe")
        # a wrong password in the URL itself: refused by Redis, said without the password
        b = await self.replica("--shared-state",
                               f"redis://:wrong-pass-42@127.0.0.1:{self.redis.port}/0",
                               shared=False)
        await wait_until(lambda: "uses its local view" in b.output(), timeout=10)
        code, _ = await self.small_request(b)
        self.assertEqual(code, 200)
        # ... and reported as a refused login, not as a server that does not answer
        error = (await self.status(b))["shared_state"]["last_error"]
        self.assertIn("WRONGPASS", error)
        self.assertIn("login refused", error)
        for process in (a, b):
            shown = process.output() + json.dumps(await self.status(process))
            self.assertNotIn("s3cret-redis-pass", shown)
            self.assertNotIn("wrong-pass-42", shown)

    async def test_a_replica_killed_leaves_no_count_behind(self) -> None:
        self.fleet = Fleet(self, 2, tokens_per_second=20)
        a, b = await self.replicas(2)
        for _ in range(2):
            await self.open_stream(a, tokens=5000)

        async def b_sees(count: int) -> bool:
            return sum((await self.in_flight(b)).values()) == count

        await _until(b_sees, "B to count A's streams", 2)
        a.process.send_signal(signal.SIGKILL)
        await a.stop(signal_it=False)
        await _until(b_sees, "A's counts to expire", 0, timeout=10)

    async def test_redis_killed_costs_no_request_and_they_resync(self) -> None:
        self.fleet = Fleet(self, 2)
        a, b = await self.replicas(2)
        self.redis.kill()
        down = time.monotonic()

        async def fell_back() -> bool:
            return not (await self.status(a))["shared_state"]["connected"]

        for sent in range(MAX_REQUESTS):
            code, _ = await self.small_request((a, b)[sent % 2])
            self.assertEqual(code, 200)
            if sent >= 20 and not await fell_back():
                continue
            if sent >= 20:
                break
        self.assertLess(time.monotonic() - down, 5)
        state = (await self.status(a))["shared_state"]
        self.assertFalse(state["connected"])
        self.assertTrue(state["last_error"])
        self.assertEqual(a.output().count("uses its local view"), 1, a.output())
        self.redis.start()

        async def back() -> bool:
            return all([(await self.status(p))["shared_state"]["connected"] for p in (a, b)])

        await _until(back, "both replicas to reconnect", timeout=15)
        # resynchronised: a drain on B after the outage reaches A
        drained = self.fleet.keys[1]
        await self.client.fetch(b.admin_url + f"/backends/{drained}/drain", b"POST")

        async def on_a() -> bool:
            return any(x["backend"] == drained and x["draining"]
                       for x in (await self.status(a))["backends"])

        await _until(on_a, "B's drain to reach A")
        # and both subscribed again to the freed slots' channel
        await wait_until(lambda: self.redis.command("PUBSUB", "NUMSUB", "txlb:freed")
                         .endswith(b":2\r\n"), timeout=10, what="both to resubscribe")


    async def drained_on(self, process: TwistdProcess, key: str) -> bool:
        return any(x["backend"] == key and x["draining"]
                   for x in (await self.status(process))["backends"])

    async def test_a_drain_outlives_redis_restarted_empty(self) -> None:
        # Redis restarts with nothing; a replica starting after it must not undrain
        self.fleet = Fleet(self, 2)
        a, b = await self.replicas(2)
        drained = self.fleet.keys[0]
        await self.client.fetch(a.admin_url + f"/backends/{drained}/drain", b"POST")
        await _until(self.drained_on, "the drain to reach B", b, drained)
        self.redis.kill()
        self.redis.start()

        async def back() -> bool:
            return all([(await self.status(p))["shared_state"]["connected"] for p in (a, b)])

        await _until(back, "both replicas to reconnect", timeout=15)
        c = await self.replica()
        await wait_until(lambda: "shared state: connected" in c.output(), timeout=10)
        await _until(self.drained_on, "C to take the drain A and B wrote back", c, drained)
        for process in (a, b):
            self.assertTrue(await self.drained_on(process, drained))

    async def test_a_drain_while_redis_was_unreachable_since_start_wins(self) -> None:
        self.fleet = Fleet(self, 2)
        (b,) = await self.replicas(1)  # Redis holds both backends, not drained
        self.redis.pause()
        a = await self.replica()
        drained = self.fleet.keys[0]
        response, _ = await self.client.fetch(
            a.admin_url + f"/backends/{drained}/drain", b"POST")
        self.assertEqual(response.code, 200)
        self.redis.resume()
        await _until(self.drained_on, "A's drain to reach B", b, drained, timeout=10)
        self.assertTrue(await self.drained_on(a, drained))

    async def test_a_stalled_redis_is_left_within_a_second(self) -> None:
        self.fleet = Fleet(self, 2)
        a, b = await self.replicas(2, "--rate-limit", "1000/s")
        self.redis.pause()  # SIGSTOP: connections stay open, nothing answers
        stalled = time.time()

        async def fell_back() -> bool:
            return not (await self.status(a))["shared_state"]["connected"]

        await _until(fell_back, "A to fall back", timeout=5)
        # when A itself noticed (its own clock, to the millisecond), however slow the
        # test's own status requests are on a loaded machine
        since = (await self.status(a))["shared_state"]["since"]
        noticed = datetime.datetime.fromisoformat(since.replace("Z", "+00:00")).timestamp()
        self.assertLess(noticed - stalled, 1.0)
        for sent in range(20):  # served meanwhile, rate limit and all, without waiting
            began = time.monotonic()
            code, _ = await self.small_request((a, b)[sent % 2])
            self.assertEqual(code, 200)
            # never the 0.5 s a Redis call may take: nothing waits for one
            self.assertLess(time.monotonic() - began, 0.5)
        self.redis.resume()

        async def back() -> bool:
            return bool((await self.status(a))["shared_state"]["connected"])

        await _until(back, "A to reconnect", timeout=10)


    async def max_conns_peaks(self, gap: float) -> list[int]:
        """12 long streams over three replicas in turn, ``gap`` apart, on 2 x max_conns 2."""
        from twisted.internet import reactor, task

        self.fleet = Fleet(self, 2, tokens_per_second=20)
        config = os.path.abspath(self.mktemp())
        with open(config, "w") as handle:
            handle.write("backends = [" + ", ".join(
                f'{{url = "http://{key}", max_conns = 2}}' for key in self.fleet.keys) + "]\n")
        replicas = await self.replicas(3, "--config", config, "--queue-timeout", "60")
        pending = []
        for sent in range(12):
            pending.append(defer.ensureDeferred(self.client.request(
                replicas[sent % 3].url + "/v1/chat/completions", b"POST", chat_body(),
                {**JSON, b"x-sim-tokens": [b"60"]})))
            if gap:
                await task.deferLater(reactor, gap, lambda: None)
        await wait_until(lambda: sum(sim.started for sim in self.fleet.sims) >= 4,
                         timeout=10, what="the first streams")
        await task.deferLater(reactor, 0.5, lambda: None)
        for response in await defer.gatherResults(pending):
            response.deliverBody(Chunks())
        return [sim.peak_running for sim in self.fleet.sims]

    async def test_max_conns_holds_with_arrivals_apart(self) -> None:
        # arrivals 0.2 s apart: a freed slot wakes the queued requests of several
        # replicas at once, and the slot script lets only one of them have it
        peaks = await self.max_conns_peaks(0.2)
        print(f"max_conns 2, 12 streams 0.2 s apart over 3 replicas: peaks {peaks}")
        self.assertEqual(peaks, [2, 2])

    async def test_max_conns_holds_in_a_simultaneous_burst(self) -> None:
        # all at once: every replica's view says both engines are free, and only the
        # slot script (one at a time in Redis) keeps each engine at its max_conns
        peaks = await self.max_conns_peaks(0)
        print(f"max_conns 2, 12 streams at once over 3 replicas: peaks {peaks}")
        self.assertEqual(peaks, [2, 2])


    async def test_a_slot_freed_on_a_wakes_bs_queue_at_once(self) -> None:
        # one engine, max_conns 1: A streams, B's request queues behind it (B's view or
        # the slot script says full); when A's stream ends, A announces the freed slot
        # and B's queued request reaches the engine within milliseconds -- the 0.1 s
        # poll alone would take 50 ms on average, over 50 ms in about half the rounds
        from twisted.internet import task

        self.fleet = Fleet(self, 1, tokens_per_second=20)
        sim = self.fleet.sims[0]
        config = os.path.abspath(self.mktemp())
        with open(config, "w") as handle:
            handle.write(f'backends = [{{url = "http://{self.fleet.keys[0]}", '
                         "max_conns = 1}]\n")
        a, b = await self.replicas(2, "--config", config)
        ended: list[float] = []
        started: list[float] = []
        seen = [sim.completed, sim.started]

        def watch() -> None:
            # the engine's own view, looked at every millisecond (the engine runs in
            # this process: no clock but this one)
            now = time.monotonic()
            if sim.completed > seen[0]:
                ended.append(now)
            if sim.started > seen[1]:
                started.append(now)
            seen[:] = [sim.completed, sim.started]

        watcher = task.LoopingCall(watch)
        watcher.start(0.001)
        self.addCleanup(lambda: watcher.running and watcher.stop())
        gaps = []
        for _ in range(4):
            _, stream = await self.open_stream(a, tokens=8)
            del ended[:], started[:]
            waiting = defer.ensureDeferred(self.small_request(b))
            await stream.done
            code, _ = await waiting
            self.assertEqual(code, 200)
            self.assertEqual((len(ended) >= 1, len(started)), (True, 1), (ended, started))
            gaps.append(started[0] - ended[0])
        watcher.stop()
        print("slot freed on A -> B's queued request on the engine: "
              + ", ".join(f"{gap * 1e3:.1f} ms" for gap in gaps))
        self.assertLess(max(gaps), 0.05, gaps)
        slots = (await self.status(b))["shared_state"]["slots"]
        self.assertGreaterEqual(slots["wakes_heard"], 4, slots)


async def _until(condition: Any, what: str, *args: Any, timeout: float = 5.0) -> None:
    """Ask an async ``condition`` until it holds, bounded in time."""
    from twisted.internet import reactor, task

    deadline = time.monotonic() + timeout
    while not await condition(*args):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await task.deferLater(reactor, 0.05, lambda: None)


def vm_rss_kib(pid: int) -> int:
    """A process's resident memory (``VmRSS``), in KiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


class HostileRedisTests(TestCase):
    """
    A real ``twistd -n llmlb`` whose ``--shared-state`` is a hostile server: it keeps
    serving, its memory stays put, and ``/status`` says the store is down and why.
    """

    timeout = 60
    #: Reconnections to the hostile server the test lets happen: each is one more attack.
    ATTACKS = 5
    #: Growth of RSS allowed over them (txredisapi alone buffered hundreds of MiB).
    MAX_GROWTH_KIB = 30 * 1024

    async def attacked(self, kind: str, last_error: str) -> None:
        from bench.hostile_redis import HostileRedis

        hostile = HostileRedis(kind, time.monotonic() + self.timeout)
        self.addCleanup(hostile.stop)
        self.fleet = Fleet(self, 1)
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)
        process = TwistdProcess("--admin", "tcp:0:interface=127.0.0.1",
                                "--shared-state", f"redis://127.0.0.1:{hostile.port}",
                                "--backends", self.fleet.keys[0])
        self.addCleanup(lambda: defer.ensureDeferred(process.stop()))
        await process.started()
        await wait_until(lambda: hostile.connections >= 1, timeout=10,
                         what="txlb to connect to the hostile server")
        before = vm_rss_kib(process.pid)
        seen = hostile.connections
        served = 0
        deadline = time.monotonic() + 30
        while (hostile.connections < seen + self.ATTACKS or served < 20) \
                and served < MAX_REQUESTS and time.monotonic() < deadline:
            response, _ = await client.fetch(
                process.url + "/v1/chat/completions", b"POST", chat_body(stream=False),
                {**JSON, b"x-sim-tokens": [b"1"]})
            self.assertEqual(response.code, 200)
            served += 1
        self.assertGreaterEqual(hostile.connections, seen + self.ATTACKS,
                                f"{served} requests served meanwhile")
        grown = vm_rss_kib(process.pid) - before
        print(f"{kind}: {served} requests served over {hostile.connections - seen} "
              f"attacks; RSS grew {grown} KiB")
        self.assertLess(grown, self.MAX_GROWTH_KIB)
        _, body = await client.fetch(process.admin_url + "/status")
        shared = json.loads(body.body)["shared_state"]
        self.assertFalse(shared["connected"], shared)
        self.assertIn(last_error, str(shared["last_error"]))
        self.assertGreaterEqual(shared["fallbacks"], 1)

    async def test_a_server_answering_ok_to_everything_is_down(self) -> None:
        await self.attacked("ok", "the poll script answered 'OK'")

    async def test_endless_bytes_after_a_huge_bulk_length_are_never_read(self) -> None:
        await self.attacked("endless", "a string of 99999999999 bytes")
