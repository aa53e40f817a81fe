"""
bench.policies' virtual-clock engine with and without the simulator's prefix cache: a
request carrying a block chain prefills only what the engine does not hold, and without a
cache (or without a chain) every prompt is prefilled whole, as before.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial import unittest

from bench.sim_engines import ENGINE_CLASSES, Engine, Params, Request
from txlb.testing import BLOCK_TOKENS, block_chain

FAST = ENGINE_CLASSES[0]
PROMPT = 800  # tokens: 50 whole blocks
CHAIN = block_chain("s" * PROMPT * 4)


class EngineCacheTests(unittest.TestCase):
    def engine(self, **params: int) -> Engine:
        self.clock = Clock()
        self.first: list[Request] = []
        self.done: list[Request] = []
        return Engine(self.clock, "e", FAST, Params(**params), self.first.append,
                      self.done.append)

    def ttft(self, engine: Engine, blocks: tuple[int, ...] = CHAIN) -> float:
        """Submit one request now and run it to the end; its time to first token."""
        request = Request(len(self.done), self.clock.seconds(), PROMPT, 3, 0, blocks=blocks)
        start = self.clock.seconds()
        engine.submit(request)
        while request.done is None:
            self.clock.advance(0.001)
        assert request.first_token is not None
        return round(request.first_token - start, 6)

    def test_without_a_cache_every_prompt_is_prefilled_whole(self) -> None:
        engine = self.engine()
        self.assertIsNone(engine.cache)
        whole = round(PROMPT / FAST.prefill_rate, 6)
        self.assertEqual((self.ttft(engine), self.ttft(engine)), (whole, whole))
        self.assertEqual(self.done[1].cached_tokens, 0)

    def test_a_repeated_chain_prefills_only_what_is_not_cached(self) -> None:
        engine = self.engine(kv_cache_blocks=64)
        self.assertEqual(self.ttft(engine), round(PROMPT / FAST.prefill_rate, 6))
        cached = (PROMPT - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        self.assertEqual(self.ttft(engine), round((PROMPT - cached) / FAST.prefill_rate, 6))
        self.assertEqual([r.cached_tokens for r in self.done], [0, cached])
        assert engine.cache is not None
        self.assertEqual((engine.cache.hits, engine.cache.queries), (cached, 2 * PROMPT))
        self.assertEqual(engine.cache.pinned, 0)  # released when each request ended
        self.assertTrue(all(r.cache_lease is None for r in self.done))

    def test_a_request_without_a_chain_shares_nothing(self) -> None:
        engine = self.engine(kv_cache_blocks=64)
        self.ttft(engine, blocks=())
        self.assertEqual(self.ttft(engine, blocks=()), round(PROMPT / FAST.prefill_rate, 6))
        assert engine.cache is not None
        self.assertEqual((engine.cache.queries, engine.cache.resident), (0, 0))

    def test_a_cache_too_small_for_two_prompts_thrashes(self) -> None:
        engine = self.engine(kv_cache_blocks=len(CHAIN))
        other = block_chain("o" * PROMPT * 4)
        for _ in range(2):
            self.ttft(engine)
            self.ttft(engine, blocks=other)
        self.assertEqual([r.cached_tokens for r in self.done], [0, 0, 0, 0])

    def test_peak_running(self) -> None:
        engine = self.engine()
        for index in range(3):
            engine.submit(Request(index, 0.0, PROMPT, 3, 0))
        self.assertEqual(engine.peak_running, 3)

    def test_kv_usage_is_what_the_simulator_would_report(self) -> None:
        cached = self.engine(kv_cache_blocks=100)
        cached.submit(Request(0, 0.0, PROMPT, 3, 0, blocks=CHAIN))
        self.assertEqual(cached.kv_usage(), len(CHAIN) / 100)
        while not self.done:
            self.clock.advance(0.01)
        self.assertEqual(cached.kv_usage(), 0.0)
        plain = self.engine()
        for index in range(8):
            plain.submit(Request(index, 0.0, PROMPT, 3, 0))
        self.assertEqual(plain.kv_usage(), 8 / Params().max_num_seqs)
