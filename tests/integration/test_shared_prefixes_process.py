"""
The cache-aware index shared through ``--shared-state``, for real: a real ``redis-server``,
two real ``twistd -n llmlb --policy cache-aware`` replicas and four simulated engines with
a prefix cache.  A long prompt sent to replica A and then, with a question added, to
replica B reaches the engine that holds its prefix -- and finds it cached there; without
shared state B does not know where A sent it.
"""

from __future__ import annotations

import json
import time
from typing import Any

from twisted.internet import defer
from twisted.trial.unittest import TestCase

from ..processes import Client, TwistdProcess, header, wait_until
from ..redis import RedisServer
from .test_integration import JSON, Fleet
from .test_shared_state_process import _until


def completion(text: str) -> bytes:
    return json.dumps({"model": "sim-model", "prompt": text, "max_tokens": 1,
                       "stream": False}).encode()


#: ~1,000 tokens of a shared system prompt, several of txlb's 256-character blocks.
SYSTEM = "You are the support assistant of an imaginary company. " * 72


class SharedPrefixIndexProcessTests(TestCase):
    timeout = 60

    def setUp(self) -> None:
        self.redis = RedisServer()
        self.addCleanup(self.redis.stop)
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)
        self.fleet = Fleet(self, 4, kv_cache_blocks=4096)

    async def replica(self, shared: bool) -> TwistdProcess:
        state = ["--shared-state", self.redis.url] if shared else []
        process = TwistdProcess("--admin", "tcp:0:interface=127.0.0.1",
                                "--health-interval", "0.5", "--shutdown-timeout", "2",
                                "--policy", "cache-aware",
                                "--backends", ",".join(self.fleet.keys), *state)
        self.addCleanup(lambda: defer.ensureDeferred(process.stop()))
        await process.started()
        return process

    async def status(self, process: TwistdProcess) -> dict[str, Any]:
        _, body = await self.client.fetch(process.admin_url + "/status")
        result: dict[str, Any] = json.loads(body.body)
        return result

    async def send(self, process: TwistdProcess, text: str) -> tuple[str | None, int]:
        """One completion: the engine it reached and the prompt tokens found cached."""
        response, body = await self.client.fetch(
            process.url + "/v1/completions", b"POST", completion(text),
            {**JSON, b"x-sim-tokens": [b"1"]})
        self.assertEqual(response.code, 200)
        usage = json.loads(body.body)["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return header(response, b"x-backend"), int(cached)

    async def shares(self, process: TwistdProcess) -> dict[str, Any]:
        index: dict[str, Any] = (await self.status(process))["shared_state"]["prefix_index"]
        return index

    async def idle(self, process: TwistdProcess) -> None:
        """Until ``process`` counts no request in flight anywhere (its own and, shared, the
        others' as last read): the load bound and least-conn's ties then see what the test
        means them to."""
        async def nothing_running() -> bool:
            status = await self.status(process)
            return sum(b["active"] for b in status["backends"]) == 0
        await _until(nothing_running, "no request in flight")

    async def a_then_b(self, shared: bool) -> tuple[str | None, str | None, int]:
        """Three other prompts and the long one to A, then the long one plus more to B."""
        a, b = await self.replica(shared), await self.replica(shared)
        await wait_until(lambda: all(
            "shared state: connected" in p.output() or not shared for p in (a, b)),
            timeout=10, what="both replicas to reach Redis")
        if shared:
            async def keyed() -> bool:
                return all([(await self.shares(p))["shared"] for p in (a, b)])
            await _until(keyed, "both replicas to hash with the fleet's key")
        # A spreads its first three prompts over three engines (least-conn's ties), so the
        # fourth lands on an engine a fresh B would not choose by itself
        for n in range(3):
            await self.idle(a)
            await self.send(a, f"tenant {n}: " + "an unrelated prompt " * 60)
        await self.idle(a)
        where, _ = await self.send(a, SYSTEM + "first question")
        if shared:
            async def heard() -> bool:
                return bool((await self.shares(b))["applied"] >= 4)
            await _until(heard, "B to apply A's four sends")
        await self.idle(b)  # B's view of A's counts no longer shows A's last request
        there, cached = await self.send(b, SYSTEM + "a follow-up question from elsewhere")
        return where, there, cached

    async def test_b_sends_as_prompt_to_the_engine_that_holds_it(self) -> None:
        began = time.monotonic()
        where, there, cached = await self.a_then_b(shared=True)
        self.assertIsNotNone(where)
        self.assertEqual(there, where)
        self.assertGreater(cached, 500)  # the engine really had the prefix
        self.assertLess(time.monotonic() - began, 20)

    async def test_without_shared_state_b_does_not_know(self) -> None:
        # the other way round: the test above is only worth something if this one holds
        where, there, cached = await self.a_then_b(shared=False)
        self.assertNotEqual(there, where)
        self.assertEqual(cached, 0)
