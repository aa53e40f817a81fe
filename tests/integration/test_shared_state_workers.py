"""
``--workers`` with ``--shared-state`` for real: a real ``redis-server``, a single-process
replica A and a replica B of two worker processes (``--workers 2``), over the same simulated
engines.  B's supervisor is its host's one replica in Redis: least-connections in B's
workers counts A's streams and A counts B's, a drain on A reaches B's workers' traffic
within a second, and ``--rate-limit`` is the fleet's, B's two workers included.
"""

from __future__ import annotations

import json
import os
import time

from twisted.internet import defer
from twisted.trial.unittest import TestCase

from ..processes import TwistdProcess, wait_until
from ..redis import RedisServer
from . import test_shared_state_process as single
from .test_integration import JSON, Fleet
from .test_shared_state_process import MAX_REQUESTS, _until


class WorkersSharedStateTests(TestCase):
    timeout = 120

    setUp = single.SharedStateProcessTests.setUp
    replica = single.SharedStateProcessTests.replica
    status = single.SharedStateProcessTests.status
    in_flight = single.SharedStateProcessTests.in_flight
    open_stream = single.SharedStateProcessTests.open_stream
    small_request = single.SharedStateProcessTests.small_request
    redis: RedisServer

    async def pair(self, *args: str) -> tuple[TwistdProcess, TwistdProcess]:
        """A (one process) and B (``--workers 2``), both connected to Redis."""
        a = await self.replica(*args)
        b = await self.replica("--workers", "2", *args)
        for process in (a, b):
            await wait_until(lambda p=process: "shared state: connected" in p.output(),
                             timeout=10, what="the replica to reach Redis")
        await wait_until(lambda: b.output().count("serving") >= 2, timeout=20,
                         what="B's two workers")
        return a, b

    async def test_streams_through_both_land_on_distinct_engines(self) -> None:
        self.fleet = Fleet(self, 8, tokens_per_second=20)
        a, b = await self.pair("--policy", "least-conn")

        async def sees(process: TwistdProcess, count: int) -> bool:
            return sum((await self.in_flight(process)).values()) == count

        landed = [(await self.open_stream(a))[0] for _ in range(2)]
        # B's workers see A's two (the remote row), then A sees B's workers' four (B's row)
        await _until(sees, "B to count A's streams", b, 2)
        landed += [(await self.open_stream(b))[0] for _ in range(4)]
        await _until(sees, "A to count B's workers' streams", a, 6)
        landed += [(await self.open_stream(a))[0] for _ in range(2)]
        self.assertEqual(len(set(landed)), 8, landed)
        state = (await self.status(b))["shared_state"]
        self.assertEqual((state["connected"], state["replicas"]), (True, 2))

    async def test_a_drain_on_a_reaches_bs_workers_within_a_second(self) -> None:
        self.fleet = Fleet(self, 2)
        a, b = await self.pair()
        drained = self.fleet.keys[0]
        response, _ = await self.client.fetch(
            a.admin_url + f"/backends/{drained}/drain", b"POST")
        self.assertEqual(response.code, 200)
        began = time.monotonic()

        async def drained_on_b() -> bool:
            return any(x["backend"] == drained and x["draining"]
                       for x in (await self.status(b))["backends"])

        await _until(drained_on_b, "the drain to reach B", timeout=5)
        self.assertLess(time.monotonic() - began, 1.0)
        # B's supervisor pushed it to both workers: none of them sends there any more
        for _ in range(12):
            self.assertEqual(await self.small_request(b), (200, self.fleet.keys[1]))

    async def test_rate_limit_is_the_fleets_workers_included(self) -> None:
        self.fleet = Fleet(self, 2)
        a, b = await self.pair("--rate-limit", "10/s")
        seconds, began = 3.0, time.monotonic()
        codes: list[int] = []

        async def client(process: TwistdProcess) -> None:
            for _ in range(MAX_REQUESTS):
                if time.monotonic() - began >= seconds:
                    return
                codes.append((await self.small_request(process))[0])

        # one client on A, two on B (its connections spread over both workers)
        await defer.gatherResults([defer.ensureDeferred(client(p)) for p in (a, b, b)])
        elapsed = time.monotonic() - began
        allowed = codes.count(200)
        self.assertEqual(allowed + codes.count(429), len(codes))
        expected = 10 + 10 * elapsed
        self.assertGreater(len(codes), 1.5 * expected, "too few sent to test the limit")
        self.assertTrue(0.7 * expected <= allowed <= 1.3 * expected,
                        f"{allowed} of {len(codes)} let through in {elapsed:.1f}s, "
                        f"expected ~{expected:.0f}")

    async def test_a_token_budget_spent_through_a_is_refused_by_bs_workers(self) -> None:
        self.fleet = Fleet(self, 1, tokens_per_second=2000)  # each answer in milliseconds
        config = os.path.abspath(self.mktemp())
        with open(config, "w") as handle:
            handle.write(f'backends = ["{self.fleet.keys[0]}"]\n[[budgets]]\n'
                         'name = "per-client"\nkey = "ip"\ntokens_per_minute = 600\n')
        a, b = await self.pair("--config", config)
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
        # B's first reservation's answer brings the fleet's level to both its workers
        codes = [await post(b) for _ in range(4)]
        self.assertIn(429, codes[:2], codes)
        self.assertEqual(codes[2:], [429, 429], codes)

    async def test_redis_killed_costs_b_no_request_and_it_resyncs(self) -> None:
        self.fleet = Fleet(self, 2)
        a, b = await self.pair("--rate-limit", "1000/s")
        # (a first poll slower than its bound on a loaded machine is said at start too)
        said = b.output().count("uses its local view")
        self.redis.kill()

        async def b_fell_back() -> bool:
            return not (await self.status(b))["shared_state"]["connected"]

        for sent in range(MAX_REQUESTS):  # served by both workers meanwhile, every one
            self.assertEqual((await self.small_request(b))[0], 200)
            if sent >= 20 and await b_fell_back():
                break
        self.assertTrue(await b_fell_back())
        self.assertEqual(b.output().count("uses its local view"), said + 1, b.output())
        self.redis.start()

        async def back() -> bool:
            return all([(await self.status(p))["shared_state"]["connected"] for p in (a, b)])

        await _until(back, "both replicas to reconnect", timeout=15)
        # resynchronised: a drain on B (its supervisor) after the outage reaches A
        drained = self.fleet.keys[1]
        await self.client.fetch(b.admin_url + f"/backends/{drained}/drain", b"POST")

        async def on_a() -> bool:
            return any(x["backend"] == drained and x["draining"]
                       for x in (await self.status(a))["backends"])

        await _until(on_a, "B's drain to reach A")
