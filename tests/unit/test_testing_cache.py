"""
The simulated vLLM with a prefix cache (``kv_cache_blocks``), prefill time and a decode
batch slowdown: what a client sees in ``usage`` and in the timing of the first token, what
``/metrics`` says, and that hostile bodies get a refusal rather than a crash.  On a
task.Clock throughout, so every time is exact.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.task import Clock
from twisted.python import usage
from twisted.trial import unittest

from txlb import simtap
from txlb.testing import BLOCK_TOKENS, count_tokens, render_prompt

from ..parts import missing
from .test_testing import _Connection, _events, _Fixture, _split_response

SYSTEM = "You are a careful assistant. " * 70  # about 2,000 characters: 31 whole blocks


def _chat(system: str = SYSTEM, question: str = "what is 2+2?", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sim-model",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    }
    body.update(extra)
    return body


def _tokens(body: dict[str, Any], chat: bool = True) -> int:
    return count_tokens(render_prompt(body, chat))


class _CacheFixture(_Fixture):
    def make_cached(self, **kwargs: Any) -> None:
        options: dict[str, Any] = dict(
            kv_cache_blocks=256, prefill_tokens_per_second=1000.0, ttft=0.1
        )
        options.update(kwargs)
        self.make(**options)

    def ask(self, body: dict[str, Any], path: str = "/v1/chat/completions") -> Any:
        """A one-token answer, so it arrives exactly at the first token."""
        return self.request("POST", path, body, headers={"X-Sim-Tokens": "1"})

    def arrival(self, d: Any, step: float = 0.001, limit: float = 10.0) -> float:
        """The clock time at which ``d``'s response arrived, stepping the clock."""
        start = self.clock.seconds()
        arrived: list[object] = []
        d.addBoth(lambda result: arrived.append(result) or result)
        while not arrived:
            self.advance(step)
            if self.clock.seconds() - start > limit:
                raise AssertionError("no answer")
        return round(self.clock.seconds() - start, 6)

    def metric(self, name: str) -> float:
        _, _, body = self.result(self.request("GET", "/metrics"))
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
        raise AssertionError(f"no {name} in /metrics")


class CachedPromptTests(_CacheFixture):
    def test_repeated_prompt_is_served_from_cache_and_answers_sooner(self) -> None:
        self.make_cached()
        body = _chat()
        tokens = _tokens(body)
        cached = (tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        self.assertGreater(cached, 400)

        first = self.ask(body)
        self.assertEqual(self.arrival(first), round(0.1 + tokens / 1000, 6))
        _, answer = self.json_result(first)
        self.assertEqual(answer["usage"]["prompt_tokens"], tokens)
        self.assertEqual(answer["usage"]["prompt_tokens_details"], {"cached_tokens": 0})

        second = self.ask(body)
        self.assertEqual(self.arrival(second), round(0.1 + (tokens - cached) / 1000, 6))
        _, answer = self.json_result(second)
        self.assertEqual(answer["usage"]["prompt_tokens_details"], {"cached_tokens": cached})
        self.assertEqual(answer["usage"]["total_tokens"], tokens + 1)

    def test_same_system_prompt_other_question_shares_the_prefix(self) -> None:
        self.make_cached()
        self.arrival(self.ask(_chat(question="first question")))
        d = self.ask(_chat(question="a different second question"))
        self.arrival(d)
        _, answer = self.json_result(d)
        one = render_prompt(_chat(question="first question"), True)
        two = render_prompt(_chat(question="a different second question"), True)
        shared = next(i for i, (x, y) in enumerate(zip(one, two, strict=False)) if x != y)
        self.assertGreater(shared, len(SYSTEM))
        self.assertEqual(
            answer["usage"]["prompt_tokens_details"]["cached_tokens"],
            shared // (BLOCK_TOKENS * 4) * BLOCK_TOKENS,
        )

    def test_a_prompt_differing_in_its_first_block_shares_nothing(self) -> None:
        self.make_cached()
        self.arrival(self.ask(_chat()))
        d = self.ask(_chat(system="X" + SYSTEM[1:]))
        self.arrival(d)
        _, answer = self.json_result(d)
        self.assertEqual(answer["usage"]["prompt_tokens_details"], {"cached_tokens": 0})

    def test_completions_are_cached_too(self) -> None:
        self.make_cached()
        body = {"model": "sim-model", "prompt": SYSTEM}
        self.arrival(self.ask(body, "/v1/completions"))
        d = self.ask(body, "/v1/completions")
        self.arrival(d)
        _, answer = self.json_result(d)
        tokens = _tokens(body, chat=False)
        self.assertEqual(answer["usage"]["prompt_tokens"], tokens)
        self.assertEqual(
            answer["usage"]["prompt_tokens_details"]["cached_tokens"],
            (tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS,
        )

    def test_evicted_prompt_misses_again(self) -> None:
        blocks = len(SYSTEM) // 64 + 1
        self.make_cached(kv_cache_blocks=blocks)
        self.arrival(self.ask(_chat()))
        self.arrival(self.ask(_chat(system="Z" + SYSTEM[1:])))  # takes every block
        d = self.ask(_chat())
        self.arrival(d)
        _, answer = self.json_result(d)
        self.assertEqual(answer["usage"]["prompt_tokens_details"], {"cached_tokens": 0})

    def test_stream_reports_cached_tokens_only_in_the_usage_chunk_asked_for(self) -> None:
        self.make_cached()
        self.arrival(self.ask(_chat()))
        asked = _Connection(self.sim)
        asked.post(
            "/v1/chat/completions",
            _chat(stream=True, max_tokens=2, stream_options={"include_usage": True}),
        )
        silent = _Connection(self.sim)
        silent.post("/v1/chat/completions", _chat(stream=True, max_tokens=2))
        self.clock.advance(5)
        events = _events(_split_response(asked.transport.value())[1])
        self.assertEqual(events[-1], "[DONE]")
        details = events[-2]["usage"]["prompt_tokens_details"]
        self.assertEqual(details["cached_tokens"], (_tokens(_chat()) - 1) // 16 * 16)
        events = _events(_split_response(silent.transport.value())[1])
        self.assertFalse(any("usage" in e for e in events if isinstance(e, dict)))

    def test_without_a_cache_nothing_changes(self) -> None:
        self.make(ttft=0.1, prefill_tokens_per_second=1000.0)
        d = self.ask(_chat())
        self.arrival(d)
        _, answer = self.json_result(d)
        words = len(SYSTEM.split()) + 3
        self.assertEqual(answer["usage"]["prompt_tokens"], words)
        self.assertIsNone(answer["usage"]["prompt_tokens_details"])
        self.assertEqual(self.metric("vllm:prefix_cache_queries_total"), 0)


class TimingTests(_CacheFixture):
    def test_prefill_rate_zero_or_infinite_means_no_prefill_time(self) -> None:
        for rate in (0.0, float("inf")):
            self.make_cached(prefill_tokens_per_second=rate)
            self.assertEqual(self.arrival(self.ask(_chat())), 0.1)

    def test_batch_slowdown_slows_every_sequence_with_the_batch(self) -> None:
        # Alone in a batch of 2: 10 x (1 - 0.5 x 1/2) = 7.5 tokens/s.
        self.make(ttft=0, tokens_per_second=10, max_num_seqs=2, batch_slowdown=0.5)
        alone = self.request("POST", "/v1/chat/completions", _chat(), {"X-Sim-Tokens": "4"})
        self.assertEqual(self.arrival(alone), round(3 / 7.5, 3))
        # Two together: 10 x (1 - 0.5) = 5 tokens/s from the moment the second joins.
        one = self.request("POST", "/v1/chat/completions", _chat(), {"X-Sim-Tokens": "4"})
        two = self.request("POST", "/v1/chat/completions", _chat(), {"X-Sim-Tokens": "4"})
        self.assertEqual(self.arrival(one), round(3 / 5, 3))
        self.assertTrue(two.called)

    def test_peak_running(self) -> None:
        self.make(ttft=1, max_num_seqs=2)
        for _ in range(3):
            self.request("POST", "/v1/chat/completions", _chat())
        self.advance(30)  # the first two end; the third starts at 30 and ends at 31.3
        self.advance(30)
        self.request("POST", "/v1/chat/completions", _chat())
        self.assertEqual((self.sim.peak_running, self.sim.running), (2, 1))
        self.assertEqual(self.metric("txlb_sim_peak_requests_running"), 2)


class CacheMetricsTests(_CacheFixture):
    def test_queries_hits_and_usage(self) -> None:
        self.make_cached()
        body = _chat()
        tokens = _tokens(body)
        self.arrival(self.ask(body))
        running = self.request("POST", "/v1/chat/completions", body)  # 16 tokens: stays
        self.advance(0.2)
        self.assertNoResult(running)
        blocks = len(render_prompt(body, True)) // (BLOCK_TOKENS * 4)
        self.assertEqual(self.metric("vllm:kv_cache_usage_perc"), blocks / 256)
        self.assertEqual(self.metric("vllm:prefix_cache_queries_total"), 2 * tokens)
        cached = (tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        self.assertEqual(self.metric("vllm:prefix_cache_hits_total"), cached)
        self.advance(5)
        self.successResultOf(running)
        self.assertEqual(self.metric("vllm:kv_cache_usage_perc"), 0.0)  # cached, unpinned

    def test_disconnect_unpins(self) -> None:
        self.make_cached()
        conn = _Connection(self.sim)
        conn.post("/v1/chat/completions", _chat(max_tokens=100))
        self.clock.advance(1)
        assert self.sim.cache is not None
        self.assertGreater(self.sim.cache.pinned, 0)
        conn.disconnect()
        self.assertEqual((self.sim.cache.pinned, self.sim.aborted), (0, 1))
        self.assertGreater(self.sim.cache.resident, 0)

    def test_exposition_types_and_promtool(self) -> None:
        self.make_cached()
        self.arrival(self.ask(_chat()))
        _, _, body = self.result(self.request("GET", "/metrics"))
        types = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
        self.assertEqual(types["vllm:prefix_cache_queries"], "counter")
        self.assertEqual(types["vllm:prefix_cache_hits"], "counter")
        self.assertEqual(types["vllm:kv_cache_usage_perc"], "gauge")
        self.assertEqual(types["txlb_sim_peak_requests_running"], "gauge")
        self.assertIn(b'vllm:prefix_cache_queries_total{model_name="sim-model"}', body)
        promtool = shutil.which("promtool")
        if promtool is None:
            missing("promtool", "promtool is not installed (apt-get install prometheus)")
        done = subprocess.run(
            [promtool, "check", "metrics"], input=body, capture_output=True, timeout=60
        )
        # vLLM's own names have colons, which promtool's naming lint dislikes (exit 3);
        # anything else -- a parse error, a counter without _total -- is a failure.
        problems = (done.stdout + done.stderr).decode().splitlines()
        self.assertIn(done.returncode, (0, 3))
        self.assertEqual(
            [p for p in problems if not p.endswith("metric names should not contain ':'")], []
        )
        self.assertTrue(all(p.startswith("vllm:") for p in problems), problems)


class HostileBodyTests(_CacheFixture):
    def post_raw(self, data: bytes) -> tuple[int, Any]:
        d = self.request("POST", "/v1/chat/completions", data=data, headers={"X-Sim-Tokens": "1"})
        self.arrival(d)
        return self.json_result(d)

    def test_deep_json_is_a_400_with_or_without_a_cache(self) -> None:
        for blocks in (0, 64):
            self.make_cached(kv_cache_blocks=blocks)
            code, answer = self.post_raw(b"[" * 100_000 + b"]" * 100_000)
            self.assertEqual(code, 400)
            self.assertIn("JSON", answer["message"])
            deep = b'{"messages": [{"role": "user", "content": ' + b"[" * 900
            code, _ = self.post_raw(deep + b'"x"' + b"]" * 900 + b"}]}")
            self.assertEqual(code, 200)

    def test_odd_content_is_answered(self) -> None:
        self.make_cached()
        for messages in (
            [{"role": "user", "content": 42}],
            [{"role": "user", "content": None}],
            [{"role": "user", "content": {"text": ["a", {"text": 3}]}}],
            [{"role": None, "content": [{"type": "image_url", "image_url": None}]}],
            ["not a message", 7, None],
            [{"role": "user", "content": "\ud800 lone surrogate " * 50}],
        ):
            code, answer = self.post_raw(json.dumps({"messages": messages}).encode())
            self.assertEqual(code, 200, messages)
            self.assertIn("cached_tokens", answer["usage"]["prompt_tokens_details"])

    def test_huge_prompt_is_refused_before_touching_the_cache(self) -> None:
        self.make_cached(max_model_len=4096)
        code, answer = self.post_raw(json.dumps(_chat(system="x" * 200_000)).encode())
        self.assertEqual(code, 400)
        self.assertIn("maximum context length", answer["message"])
        assert self.sim.cache is not None
        self.assertEqual((self.sim.cache.queries, self.sim.cache.resident), (0, 0))


    def test_huge_prompt_within_the_context_is_cached_as_far_as_the_cache_goes(self) -> None:
        self.make_cached(max_model_len=1_000_000, kv_cache_blocks=1000, prefill_tokens_per_second=0)
        huge = _chat(system="y" * 1_000_000)
        body = json.dumps(huge).encode()
        for expected in (0, 1000 * BLOCK_TOKENS):
            code, answer = self.post_raw(body)
            self.assertEqual(code, 200)
            self.assertEqual(answer["usage"]["prompt_tokens"], _tokens(huge))
            self.assertEqual(answer["usage"]["prompt_tokens_details"]["cached_tokens"], expected)
        assert self.sim.cache is not None
        self.assertEqual((self.sim.cache.resident, self.sim.cache.pinned), (1000, 0))


class SimTapCacheTests(unittest.TestCase):
    def parse(self, *args: str) -> simtap.Options:
        options = simtap.Options()
        options.parseOptions(list(args))
        return options

    def test_defaults_have_no_cache(self) -> None:
        sim = simtap.simulator_from_options(self.parse(), Clock())
        self.assertEqual(
            (sim.kv_cache_blocks, sim.block_tokens, sim.prefill_tokens_per_second),
            (0, 16, 0.0),
        )
        self.assertEqual(sim.batch_slowdown, 0.0)
        self.assertIsNone(sim.cache)

    def test_options(self) -> None:
        options = self.parse(
            "--kv-cache-blocks", "512", "--block-size", "32", "--prefill-rate", "2000",
            "--batch-slowdown", "0.3",
        )  # fmt: skip
        sim = simtap.simulator_from_options(options, Clock())
        self.assertEqual(
            (sim.kv_cache_blocks, sim.block_tokens, sim.prefill_tokens_per_second),
            (512, 32, 2000.0),
        )
        self.assertEqual(sim.batch_slowdown, 0.3)
        assert sim.cache is not None
        self.assertEqual((sim.cache.blocks, sim.cache.block_tokens), (512, 32))

    def test_bad_values(self) -> None:
        for args, option in [
            (("--kv-cache-blocks", "-1"), "kv-cache-blocks"),
            (("--kv-cache-blocks", "many"), "kv-cache-blocks"),
            (("--block-size", "0"), "block-size"),
            (("--prefill-rate", "-5"), "prefill-rate"),
            (("--prefill-rate", "nan"), "prefill-rate"),
            (("--batch-slowdown", "1"), "batch-slowdown"),
            (("--batch-slowdown", "-0.1"), "batch-slowdown"),
        ]:
            e = self.assertRaises(usage.UsageError, self.parse, *args)
            self.assertIn(f"--{option}", str(e))

    def test_help_names_the_new_options(self) -> None:
        text = str(simtap.Options())
        for option in ("--kv-cache-blocks", "--block-size", "--prefill-rate", "--batch-slowdown"):
            self.assertIn(option, text)


class BatchSlowdownScheduleTests(_CacheFixture):
    def test_the_schedule_follows_the_batch_as_it_grows_and_shrinks(self) -> None:
        # 10 tokens/s, a batch of 2, slowdown 0.5: 7.5 tokens/s alone, 5 with company.
        self.make(ttft=0, tokens_per_second=10, max_num_seqs=2, batch_slowdown=0.5)
        long = self.request("POST", "/v1/chat/completions", _chat(), {"X-Sim-Tokens": "10"})
        # Tokens 0-4 alone, at k / 7.5 s (the last at 0.5333).
        self.advance(0.5)
        short = self.request("POST", "/v1/chat/completions", _chat(), {"X-Sim-Tokens": "3"})
        # The short one's tokens at 0.5, 0.7, 0.9; the long one's 5 and 6 at 0.7333 and
        # 0.9333 (5/s), then 7-9 alone again, 1/7.5 s apart: the last at 1.3333.
        self.advance(0.399)
        self.assertNoResult(short)
        self.advance(0.002)
        self.successResultOf(short)
        self.advance(1.3333 - 0.901)
        self.assertNoResult(long)
        self.advance(0.0001)
        self.successResultOf(long)
