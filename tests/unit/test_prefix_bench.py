"""
The cache-aware benchmark (``python -m bench.prefix``): its workloads are what the results
page says they are, the same seed gives the same requests, and the pieces that read engines'
answers and metrics take hostile input without failing.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from bench.prefix import report
from bench.prefix.__main__ import main
from bench.prefix.client import Answer, read_event
from bench.prefix.engine_model import block_chain, render
from bench.prefix.fleet import parse_metrics
from bench.prefix.virtual import Oracle
from bench.prefix.workloads import CHARS_PER_TOKEN, WORKLOADS, Options, generate
from txlb._cluster.pool import Pool
from txlb._config import BackendSpec
from txlb._scheduling.request import RoutingRequest
from txlb.testing import BLOCK_TOKENS


def bodies(name: str, **options: Any) -> list[str]:
    """A digest of each request's body (a failing comparison stays short to print)."""
    return [hashlib.sha256(json.dumps(r.body, sort_keys=True).encode()).hexdigest()[:16]
            for r in generate(name, Options(requests=150, **options))]


class WorkloadTests(SynchronousTestCase):
    def test_same_seed_same_requests(self) -> None:
        """Anyone can rerun a published figure: a seed fixes every byte of every request."""
        for name in WORKLOADS:
            self.assertEqual(bodies(name, seed=7), bodies(name, seed=7), name)

    def test_another_seed_other_requests(self) -> None:
        for name in WORKLOADS:
            self.assertNotEqual(bodies(name, seed=1), bodies(name, seed=2), name)

    def test_unknown_workload_names_the_known_ones(self) -> None:
        error = self.assertRaises(KeyError, generate, "nope")
        self.assertIn("tenants", str(error))

    def test_tenants_share_their_system_prompt(self) -> None:
        requests = list(generate("tenants", Options(requests=300, tenants=8)))
        prompts: dict[str, str] = {}
        for r in requests:
            system = r.body["messages"][0]
            self.assertEqual(system["role"], "system")
            self.assertEqual(prompts.setdefault(r.group, system["content"]), system["content"])
        self.assertEqual(len(prompts), 8)
        self.assertEqual(len(set(prompts.values())), 8)
        for text in prompts.values():  # 800-6,000 tokens at 4 characters a token
            self.assertTrue(800 * CHARS_PER_TOKEN <= len(text) <= 6000 * CHARS_PER_TOKEN)

    def test_each_turn_extends_the_last(self) -> None:
        last: dict[str, list[dict[str, str]]] = {}
        extended = 0
        for r in generate("multiturn", Options(requests=400, active=16)):
            messages = r.body["messages"]
            if r.group in last:
                self.assertEqual(messages[:len(last[r.group])], last[r.group])
                self.assertGreater(len(messages), len(last[r.group]))
                self.assertGreater(r.shared_tokens, 0)
                extended += 1
            last[r.group] = messages
        self.assertGreater(extended, 200)

    def test_hot_burst_is_one_prefix_in_bursts(self) -> None:
        requests = list(generate("hot-burst", Options(requests=100, burst=25)))
        self.assertEqual(len({r.body["messages"][0]["content"] for r in requests}), 1)
        self.assertEqual([r.burst for r in requests], [i // 25 for i in range(100)])

    def test_unique_shares_no_block(self) -> None:
        """The no-shared-prefix workload really shares nothing a cache could reuse."""
        firsts = [block_chain(render(r.body))[0] for r in generate("unique", Options(
            requests=500))]
        self.assertEqual(len(set(firsts)), 500)

    def test_scale_shrinks_prompts(self) -> None:
        full = next(generate("tenants", Options(requests=1)))
        small = next(generate("tenants", Options(requests=1, scale=0.1)))
        self.assertLess(small.prompt_chars(), full.prompt_chars() / 5)


class AnswerTests(SynchronousTestCase):
    def test_vllm_usage(self) -> None:
        answer = Answer(0)
        read_event(answer, {"choices": [], "usage": {
            "prompt_tokens": 100, "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 64}}}, 0.0)
        self.assertEqual((answer.prompt_tokens, answer.cached_tokens, answer.output_tokens),
                         (100, 64, 5))

    def test_llama_cpp_timings(self) -> None:
        """llama.cpp's prompt_n counts only what it evaluated: the prompt is both."""
        answer = Answer(0)
        read_event(answer, {"timings": {"cache_n": 341, "prompt_n": 54}}, 0.0)
        self.assertEqual((answer.prompt_tokens, answer.cached_tokens), (395, 341))

    def test_first_content_is_the_ttft(self) -> None:
        answer = Answer(0)
        read_event(answer, {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                   0.0)
        self.assertIsNone(answer.ttft)
        read_event(answer, {"choices": [{"delta": {"content": "tok0 "}}]}, 0.0)
        self.assertIsNotNone(answer.ttft)
        self.assertEqual(answer.output_tokens, 1)

    def test_hostile_fields_are_ignored(self) -> None:
        answer = Answer(0)
        for event in ({"choices": "x"}, {"choices": [None, 3, {"delta": 5}]},
                      {"usage": "x"}, {"usage": {"prompt_tokens": "9",
                                                 "prompt_tokens_details": [1]}},
                      {"timings": {"cache_n": "1", "prompt_n": None}}, {"timings": 7}):
            read_event(answer, event, 0.0)
        self.assertEqual((answer.prompt_tokens, answer.cached_tokens, answer.ttft),
                         (None, None, None))


class MetricsTests(SynchronousTestCase):
    def test_sums_label_sets_and_skips_junk(self) -> None:
        text = ('# HELP vllm:prefix_cache_hits_total x\n'
                'vllm:prefix_cache_hits_total{model_name="a"} 10\n'
                'vllm:prefix_cache_hits_total{model_name="b b"} 5.5\n'
                'garbage line here\n'
                'vllm:num_requests_running NaNx\n'
                '\n')
        self.assertEqual(parse_metrics(text), {"vllm:prefix_cache_hits_total": 15.5})


class ModelTests(SynchronousTestCase):
    def test_chain_is_shared_only_up_to_the_first_difference(self) -> None:
        size = BLOCK_TOKENS * CHARS_PER_TOKEN
        a = block_chain("x" * size * 3)
        b = block_chain("x" * size * 2 + "y" * size)
        self.assertEqual(a[:2], b[:2])
        self.assertNotEqual(a[2], b[2])

    def test_oracle_follows_the_real_cache_under_the_bound(self) -> None:
        """The ceiling: the engine that holds the prefix, until it is over the bound."""
        from bench.prefix.engine_model import CachedEngine, EngineConfig

        clock = Clock()
        pool = Pool((BackendSpec("h", 1), BackendSpec("h", 2)), clock=clock)
        backends = list(pool)
        engines = {b.key: CachedEngine(clock, b.key, EngineConfig(), print, print)
                   for b in backends}
        body = {"messages": [{"role": "system", "content": "p" * 1000}]}
        chain = block_chain(render(body))
        cache = engines[backends[1].key].cache
        cache.release(cache.acquire(chain, 1000))
        oracle = Oracle(engines, {})
        request = RoutingRequest(json=body)
        self.assertIs(oracle.choose(backends, request), backends[1])
        leases = [pool.slots.acquire(backends[1]) for _ in range(3)]
        self.assertIs(oracle.choose(backends, request), backends[0])
        for lease in leases:
            lease.release()


class ReportTests(SynchronousTestCase):
    def virtual(self, policy: str, workload: str, **figures: float) -> dict[str, Any]:
        base = {"workload": workload, "policy": policy, "engines": 8, "replicas": 1,
                "shared_index": False, "shared_counts": False, "requests": 10, "refused": 0,
                "hit_rate": 0.5,
                "ttft_p50": 0.1, "ttft_p99": 1.0, "ttft_mean": 0.2, "rps": 10.0,
                "output_tps": 100.0, "max_in_flight": 5}
        return {**base, **figures}

    def test_targets_say_met_or_not(self) -> None:
        parts = {"virtual": {"info": {}, "results": [
            self.virtual("oracle", "tenants", hit_rate=0.9),
            self.virtual("cache-aware", "tenants", hit_rate=0.85),
            self.virtual("least-conn", "unique"),
            self.virtual("cache-aware", "unique", ttft_p99=1.05),
        ]}}
        rows = {(r[0], r[1]): r for r in report.targets(parts)}
        self.assertEqual(rows[("hit rate ≥ 90 % of the oracle: tenants",
                               "virtual, 8 engines")][3], "met")
        unique = rows[("unique: within 2 % of least-conn on every figure",
                       "virtual, 8 engines")]
        self.assertEqual(unique[3], "**not met**")
        self.assertIn("ttft_p99 5.0%", unique[2])


class SmokeTests(SynchronousTestCase):
    def test_quick_run_writes_the_page(self) -> None:
        """``python -m bench.prefix --quick``: seconds, every workload, a page and data."""
        with tempfile.TemporaryDirectory() as out:
            self.assertEqual(main(["--quick", "--jobs", "1", "--out", out]), 0)
            page = (Path(out) / "cache-aware.md").read_text()
            data = json.loads((Path(out) / "cache-aware-virtual.json").read_text())
        self.assertIn("## Targets", page)
        by = {(r["workload"], r["policy"]): r for r in data["results"]}
        self.assertEqual({w for w, _ in by}, set(WORKLOADS))
        # the model says something: knowing the caches beats ignoring them on tenants
        self.assertGreater(by[("tenants", "oracle")]["hit_rate"],
                           by[("tenants", "least-conn")]["hit_rate"] + 0.2)
        self.assertEqual(by[("unique", "oracle")]["hit_rate"], 0.0)
