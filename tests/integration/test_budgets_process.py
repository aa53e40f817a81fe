"""
Token budgets through the real ``twistd -n llmlb`` over a real ``twistd vllm-sim``: a
budget exhausted mid-minute gives 429 (``Retry-After``, the OpenAI error, never forwarded)
and refills; the official openai client sees ``RateLimitError``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor, task, threads
from twisted.trial.unittest import TestCase

from ..parts import missing
from ..processes import Client, TwistdProcess, header
from .test_faults import SimProcess

#: 10 tokens a second come back: a request of ~40 tokens fits again within seconds
TOKENS_PER_MINUTE = 600
MAX_TOKENS = 30


def completion_body() -> bytes:
    return json.dumps({"model": "sim-model", "prompt": "hello there",
                       "max_tokens": MAX_TOKENS}).encode()


class _BudgetProcess(TestCase):
    """Starts a simulated engine and the balancer, with one budget per client address."""

    timeout = 120

    async def start(self, *args: str,
                    window: str = f"tokens_per_minute = {TOKENS_PER_MINUTE}") -> TwistdProcess:
        sim = SimProcess(0, "--tokens-per-second", "2000", "--ttft", "0")
        self.addCleanup(sim.cleanup)
        await sim.started()
        config = Path(self.mktemp()).absolute()
        config.write_text(
            f'backends = ["{sim.key}"]\n'
            '[[budgets]]\nname = "per-client"\nkey = "ip"\n'
            f"{window}\n")
        lb = TwistdProcess("--config", str(config), "--log-file", "-", *args)
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        await lb.started()
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)
        return lb

    async def post(self, lb: TwistdProcess) -> tuple[Any, bytes]:
        response, chunks = await self.client.fetch(
            lb.url + "/v1/completions", b"POST", completion_body(),
            {b"content-type": [b"application/json"]})
        return response, chunks.body

    async def exhaust(self, lb: TwistdProcess) -> tuple[Any, bytes, list[int]]:
        """Send until the budget refuses (bounded: the budget holds ~15 of them)."""
        remaining: list[int] = []
        for _ in range(60):
            response, body = await self.post(lb)
            if response.code == 429:
                return response, body, remaining
            self.assertEqual(response.code, 200, body)
            remaining.append(int(header(response, b"x-ratelimit-remaining-tokens") or -1))
        raise AssertionError(f"60 requests and no 429: {remaining}")



class BudgetProcessTests(_BudgetProcess):
    @defer.inlineCallbacks
    def test_a_budget_exhausted_mid_minute_gives_429_and_refills(self) -> Any:
        lb = yield defer.ensureDeferred(self.start())
        refused, body, remaining = yield defer.ensureDeferred(self.exhaust(lb))
        # each answer said what was left, and it went down as the budget was used
        self.assertGreater(len(remaining), 3)
        self.assertEqual(remaining, sorted(remaining, reverse=True))
        self.assertLess(remaining[-1], 100)
        retry_after = int(header(refused, b"retry-after") or 0)
        self.assertGreaterEqual(retry_after, 1)
        self.assertLessEqual(retry_after, 10)
        error = json.loads(body)["error"]
        self.assertEqual(error["type"], "rate_limit_exceeded")
        self.assertIn("token budget 'per-client' exceeded", error["message"])
        self.assertIsNone(header(refused, b"x-backend"))  # txlb answered, not the backend
        # it refills: poll, bounded in count and time, until a request fits again
        deadline = time.monotonic() + 30
        for _ in range(200):
            response, _ = yield defer.ensureDeferred(self.post(lb))
            if response.code == 200:
                break
            self.assertEqual(response.code, 429)
            self.assertLess(time.monotonic(), deadline, "the budget never refilled")
            yield task.deferLater(reactor, 0.25)
        else:
            raise AssertionError("the budget never refilled")
        yield defer.ensureDeferred(lb.stop())
        log = lb.final_output
        refusals = [line for line in log.splitlines() if "status=429" in line]
        self.assertTrue(refusals)
        self.assertTrue(all("token budget 'per-client' exceeded" in line
                            for line in refusals))

    @defer.inlineCallbacks
    def test_the_openai_client_sees_rate_limit_error(self) -> Any:
        try:
            import openai  # noqa: F401
        except ImportError:
            missing("openai", "the openai package is not installed")
        # a day's budget: it comes back at 1/86,400 of itself a second, so however slowly
        # the client starts on a loaded machine, the budget is still spent when it asks
        lb = yield defer.ensureDeferred(self.start(
            window=f"tokens_per_day = {TOKENS_PER_MINUTE}"))
        yield defer.ensureDeferred(self.exhaust(lb))
        seen = yield threads.deferToThread(ask_openai, lb.url)
        self.assertEqual(seen[0], "RateLimitError")
        self.assertEqual(seen[1], 429)
        self.assertGreaterEqual(int(seen[2]), 1)
        self.assertIn("token budget", seen[3])


class BudgetWorkersProcessTests(_BudgetProcess):
    """``--workers 2``: one budget for the fleet, not one per worker."""

    @defer.inlineCallbacks
    def test_a_client_spread_over_the_workers_gets_one_budget(self) -> Any:
        lb = yield defer.ensureDeferred(self.start(
            "--workers", "2", "--admin", "tcp:0:interface=127.0.0.1"))
        deadline = time.monotonic() + 30
        while lb.output().count(") serving") < 2:
            self.assertLess(time.monotonic(), deadline, "both workers never served")
            yield task.deferLater(reactor, 0.05)
        started = time.monotonic()
        admitted = 0
        for _ in range(30):  # batches of 4 at once, on 4 connections: both workers take some
            results = yield defer.gatherResults([
                defer.ensureDeferred(self.post(lb)) for _ in range(4)])
            codes = [response.code for response, _ in results]
            self.assertEqual(set(codes) - {200, 429}, set(), codes)
            admitted += codes.count(200)
            if 429 in codes:
                break
        else:
            raise AssertionError(f"{admitted} requests and no 429")
        elapsed = time.monotonic() - started
        _, status = yield defer.ensureDeferred(self.client.fetch(lb.admin_url + "/status"))
        workers = json.loads(status.body)["workers"]
        self.assertTrue(all(row["requests"] > 0 for row in workers), workers)
        # each answer costs 32 tokens (2 of prompt, 30 generated); a budget per worker would
        # have let about twice as many through
        allowed = (TOKENS_PER_MINUTE + elapsed * TOKENS_PER_MINUTE / 60) / 32 + 4
        self.assertLessEqual(admitted, allowed)
        self.assertGreater(admitted, TOKENS_PER_MINUTE / 47 - 4)


def ask_openai(base: str) -> tuple[str, int, str, str]:
    """One completion through the official client: the error it raised."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0)
    try:
        client.completions.create(model="sim-model", prompt="hello there",
                                  max_tokens=MAX_TOKENS)
    except openai.APIStatusError as error:
        return (type(error).__name__, error.status_code,
                error.response.headers.get("retry-after", ""), str(error))
    return ("no error", 200, "", "")
