"""
``--policy cache-aware``: prefix matches under a bounded load and each engine's cache room,
least-conn without a match, and the closed loop that corrects the index from what the
engines report.
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import weakref
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from txlb import (
    BackendSpec,
    LeastConnections,
    LoadBalancer,
    Pool,
    RequestOutcome,
    RoutingRequest,
)
from txlb._cluster import engines
from txlb._cluster.backend import Backend
from txlb._cluster.slots import Lease
from txlb._config import ConfigError, build_config
from txlb._scheduling.affinity import BoundedLoadRing
from txlb._scheduling.policies import cache_aware
from txlb._scheduling.policies.cache_aware import MAX_PENDING, CacheAware, load_bound
from txlb._scheduling.router import Router

from ..helpers import FakeUpstream
from .test_engines import RecognitionTests
from .test_policies import PolicyContract

SECRET = b"k" * 32
TOOLS = [{"type": "function", "function": {"name": "lookup_invoice", "description": "x" * 600}}]


def fleet(n: int = 4) -> tuple[Pool, list[Backend]]:
    pool = Pool(tuple(BackendSpec("127.0.0.1", 9000 + i) for i in range(n)))
    return pool, list(pool)


def tenant_prompt(tenant: int, chars: int = 3200) -> str:
    """One tenant's system prompt: ~800 tokens, distinct from its first character."""
    words = f"Tenant {tenant} rules: answer about account {tenant * 7919}. "
    return (words * (chars // len(words) + 1))[:chars]


def chat(system: str, question: str = "hi", tools: Any = None) -> RoutingRequest:
    body: dict[str, Any] = {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]}
    if tools is not None:
        body["tools"] = tools
    return RoutingRequest(model="m", body=json.dumps(body).encode(), json=body)


def facts(policy: CacheAware, backend: Backend) -> dict[str, Any]:
    """What /status shows of ``backend`` under the policy: its ``prefix_cache`` object."""
    described = policy.describe(backend)
    assert set(described) == {"prefix_cache"}
    return dict(described["prefix_cache"])  # type: ignore[call-overload]


def outcome(backend: Backend, request: RoutingRequest, prompt_tokens: int | None,
            cached: int | None) -> RequestOutcome:
    return RequestOutcome(backend=backend.key, status=200, answered=True, ttfb=0.1,
                          duration=1.0, prompt_tokens=prompt_tokens,
                          cached_prompt_tokens=cached, routing=request)


class CacheAwareContractTests(PolicyContract, SynchronousTestCase):
    module = cache_aware
    needs_engine_metrics = True  # the engines' KV cache usage


class MatchTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.pool, self.backends = fleet()
        self.policy = CacheAware(secret=SECRET)

    def route(self, request: RoutingRequest) -> Lease:
        chosen = self.policy.choose(self.backends, request)
        return self.pool.slots.acquire(chosen)

    def test_same_prefix_same_backend_while_under_the_bound(self) -> None:
        prompt = tenant_prompt(1)
        home = self.route(chat(prompt, "first"))
        home.release()
        for n in range(20):
            lease = self.route(chat(prompt, f"question {n}"))
            self.assertIs(lease.backend, home.backend)
            lease.release()
        # with the others busier too, still home while home is under ceil(1.25 x share)
        others = [self.pool.slots.acquire(b) for b in self.backends if b is not home.backend
                  for _ in range(2)]
        held = [self.route(chat(prompt, f"busy {n}")) for n in range(2)]
        self.assertEqual({lease.backend for lease in held}, {home.backend})
        for lease in others + held:
            lease.release()

    def test_a_hot_prefix_spreads_once_the_bound_is_reached(self) -> None:
        prompt = tenant_prompt(2)
        held: list[Lease] = []
        for n in range(40):
            held.append(self.route(chat(prompt, f"burst {n}")))
            in_flight = sum(b.counts.active for b in self.backends)
            for backend in self.backends:
                # never above the bound as it stood when that request was placed
                self.assertLessEqual(backend.counts.active, math.ceil(1.25 * in_flight / 4))
        self.assertEqual({lease.backend for lease in held}, set(self.backends))
        counts = sorted(b.counts.active for b in self.backends)
        self.assertLessEqual(counts[-1], math.ceil(1.25 * 40 / 4))

    def test_an_idle_backend_takes_a_hot_prefix_the_others_hold(self) -> None:
        """
        Every backend but one holds the hot prefix and is busy: the idle one takes the next
        request. (Under the bound alone, the holders would stay preferred as the in-flight
        grew, the one without the prefix idle for good: 1.9 x least-conn's p99 TTFT on
        bench.prefix's hot-burst workload.)
        """
        prompt = tenant_prompt(3)
        idle = self.backends[-1]
        held = []
        for backend in self.backends[:-1]:
            self.policy.index.sent(backend, self.policy.hasher.key(chat(prompt).json, "m")[0])
            held += [self.pool.slots.acquire(backend) for _ in range(3)]
        lease = self.route(chat(prompt, "next"))
        self.assertIs(lease.backend, idle)
        # it holds the prefix now too: the next ones go by the gain again, ties by least-conn
        more = [self.route(chat(prompt, f"then {n}")) for n in range(2)]
        self.assertEqual({m.backend for m in more}, {idle})
        for each in held + more + [lease]:
            each.release()

    def test_eight_tenants_spread_two_per_backend_when_two_fit(self) -> None:
        """Shared tools would draw every tenant to the first engine; its room says no."""
        policy = CacheAware(secret=SECRET, capacity_blocks=36)  # ~2.5 tenants' prompts
        homes: dict[int, Backend] = {}
        for round_ in range(3):
            for tenant in range(8):
                request = chat(tenant_prompt(tenant), f"r{round_}", tools=TOOLS)
                chosen = policy.choose(self.backends, request)
                self.pool.slots.acquire(chosen).release()
                if round_ == 0:
                    homes[tenant] = chosen
                else:
                    self.assertIs(chosen, homes[tenant], f"tenant {tenant} moved")
        per_backend = sorted(list(homes.values()).count(b) for b in self.backends)
        self.assertEqual(per_backend, [2, 2, 2, 2])

    def test_without_room_counted_they_would_cluster(self) -> None:
        """The same workload with room for all: the shared tools pull them onto one."""
        homes = set()
        for tenant in range(8):
            chosen = self.policy.choose(self.backends,
                                        chat(tenant_prompt(tenant), "r", tools=TOOLS))
            self.pool.slots.acquire(chosen).release()
            homes.add(chosen)
        self.assertEqual(len(homes), 1)

    def test_no_shared_prefix_chooses_exactly_as_least_conn(self) -> None:
        rng = random.Random(5)
        pool, backends = fleet(5)
        # small caches: every index fills, so room could sway a choice -- and must not
        mine, reference = CacheAware(secret=SECRET, capacity_blocks=20), LeastConnections()
        held: list[Lease] = []
        for n in range(300):
            request = chat(f"unique {n} {rng.random()} " + "x" * rng.randrange(0, 3000), "q")
            ours, theirs = mine.choose(backends, request), reference.choose(backends, request)
            self.assertIs(ours, theirs, f"request {n}")
            held.append(pool.slots.acquire(ours))
            if held and rng.random() < 0.5:
                held.pop(rng.randrange(len(held))).release()

    def test_a_request_without_a_prompt_is_least_conn(self) -> None:
        reference = LeastConnections()
        for request in (RoutingRequest(), RoutingRequest(json={"model": "m"}),
                        chat("short")):
            self.assertIs(self.policy.choose(self.backends, request),
                          reference.choose(self.backends, request))

    def test_a_kv_saturated_engine_loses_its_preference(self) -> None:
        prompt = tenant_prompt(3)
        home = self.route(chat(prompt))
        home.release()
        self.pool.set_engine_depth(home.backend, 1, 0, kv_cache=0.97)
        moved = self.policy.choose(self.backends, chat(prompt, "again"))
        self.assertIsNot(moved, home.backend)
        self.pool.set_engine_depth(home.backend, 1, 0, kv_cache=0.5)
        self.assertIs(self.policy.choose(self.backends, chat(prompt, "later")), home.backend)

    def test_the_load_bound_is_affinitys(self) -> None:
        ring = BoundedLoadRing(epsilon=0.25)
        pool = Pool(tuple(BackendSpec("127.0.0.1", 9000 + i, weight=w)
                          for i, w in enumerate((1, 2, 3))))
        backends = list(pool)
        for backend, active in zip(backends, (3, 1, 4), strict=True):
            backend.counts.counted(active)
        for backend in backends:
            self.assertEqual(load_bound(backend, backends, 1.25),
                             ring.capacity(backend, backends))

    def test_nonsense_load_factor_is_refused(self) -> None:
        with self.assertRaises(ValueError):
            CacheAware(load_factor=0.9)


class AffinityTests(SynchronousTestCase):
    def test_a_session_key_follows_affinity(self) -> None:
        pool, backends = fleet()
        policy = CacheAware(secret=SECRET)
        router = Router(pool, policy, Clock(), affinity=BoundedLoadRing())
        prompt = tenant_prompt(4)
        first = self.successResultOf(router.acquire(chat(prompt)))
        home = first.backend
        first.release()
        ring_choice = BoundedLoadRing().choose("sess-9", backends)
        for n in range(3):
            request = chat(prompt, f"q{n}")
            with_session = RoutingRequest(model="m", session="sess-9", json=request.json)
            lease = self.successResultOf(router.acquire(with_session))
            self.assertIs(lease.backend, ring_choice)
            lease.release()
        # without the session, the prefix's home
        lease = self.successResultOf(router.acquire(chat(prompt, "no session")))
        self.assertIs(lease.backend, home)


class LoopTests(SynchronousTestCase):
    """What the engines report corrects the index: capacity, trust, ratio."""

    def setUp(self) -> None:
        self.pool, self.backends = fleet(2)
        self.policy = CacheAware(secret=SECRET)

    def sent(self, request: RoutingRequest) -> Backend:
        backend = self.policy.choose(self.backends, request)
        self.pool.slots.acquire(backend).release()
        return backend

    def test_an_engine_that_evicted_corrects_the_index_and_loses_trust(self) -> None:
        prompt = tenant_prompt(5)
        first = chat(prompt, "one")
        home = self.sent(first)
        self.policy.observe(home, outcome(home, first, 820, 0))  # nothing predicted
        for n in range(12):  # unrelated traffic fills the index
            self.sent(chat(tenant_prompt(100 + n), "x"))
        before = dict(facts(self.policy, home))
        again = chat(prompt, "two")
        self.assertIs(self.sent(again), home)
        # predicted ~12 blocks (~800 tokens); the engine had kept nothing
        self.policy.observe(home, outcome(home, again, 820, 0))
        after = dict(facts(self.policy, home))
        self.assertLess(after["capacity_blocks"], before["capacity_blocks"])
        self.assertLessEqual(after["index_blocks"], after["capacity_blocks"])
        self.assertLess(after["index_blocks"], before["index_blocks"])
        self.assertLess(after["trust"], before["trust"])
        self.assertEqual(after["misses"], 1)
        self.assertEqual(after["reported_hit_rate"], 0.0)
        self.assertGreater(after["predicted_hit_rate"], 0.4)

    def test_repeated_misses_downgrade_the_backends_matches(self) -> None:
        prompt = tenant_prompt(6)
        home = self.sent(chat(prompt, "0"))
        for n in range(15):
            request = chat(prompt, f"{n + 1}")
            chosen = self.sent(request)
            self.policy.observe(chosen, outcome(chosen, request, 820, 0))
        self.assertLess(facts(self.policy, home)["trust"], 0.1)

    def test_hits_that_hold_keep_trust_and_more_than_predicted_grows_capacity(self) -> None:
        policy = CacheAware(secret=SECRET, capacity_blocks=20)
        prompt = tenant_prompt(7)
        home = policy.choose(self.backends, chat(prompt, "0"))
        request = chat(prompt, "1")
        self.assertIs(policy.choose(self.backends, request), home)
        # predicted 12-13 blocks; the engine says it had all of the prompt but the question
        policy.observe(home, outcome(home, request, 805, 800))
        described = facts(policy, home)
        self.assertEqual(described["trust"], 1.0)
        self.assertEqual(described["misses"], 0)
        self.assertGreaterEqual(described["capacity_blocks"], 20)

    def test_more_cached_than_the_index_knew_grows_the_capacity(self) -> None:
        policy = CacheAware(secret=SECRET, capacity_blocks=20)
        request = chat(tenant_prompt(8), "0")
        home = policy.choose(self.backends, request)  # predicted: 0 blocks
        policy.observe(home, outcome(home, request, 805, 800))
        self.assertGreater(facts(policy, home)["capacity_blocks"], 20)

    def test_the_characters_per_token_ratio_is_learned(self) -> None:
        request = chat(tenant_prompt(9), "0")
        home = self.sent(request)
        for _ in range(30):
            again = chat(tenant_prompt(9), "0")
            chosen = self.sent(again)
            self.policy.observe(chosen, outcome(chosen, again, 1600, None))
        ratio = facts(self.policy, home)["chars_per_token"]
        self.assertTrue(1.9 < ratio < 2.1, ratio)
        self.assertEqual(facts(self.policy, home)["unreported"], 30)

    def test_a_prompt_longer_than_the_rendering_teaches_no_ratio(self) -> None:
        """Its tokens count all of it, its characters only what was rendered."""
        request = chat("z" * 100_000)
        home = self.sent(request)
        self.policy.observe(home, outcome(home, request, 25_000, 0))
        self.assertEqual(facts(self.policy, home)["chars_per_token"], 4.0)
        self.assertEqual(facts(self.policy, home)["reports"], 1)

    def test_outcomes_that_do_not_match_a_prediction_teach_nothing(self) -> None:
        request = chat(tenant_prompt(10), "0")
        home = self.sent(request)
        other = next(b for b in self.backends if b is not home)
        untouched = dict(facts(self.policy, other))
        # served elsewhere (a retry), a request never routed here, and no request at all
        self.policy.observe(other, outcome(other, request, 800, 0))
        self.policy.observe(home, outcome(home, chat(tenant_prompt(10), "?"), 800, 0))
        self.policy.observe(home, RequestOutcome(backend=home.key, status=200, answered=True,
                                                 ttfb=0.1, duration=1.0))
        self.assertEqual(dict(facts(self.policy, other)), untouched)
        self.assertEqual(facts(self.policy, home)["reports"], 0)

    def test_a_retry_takes_its_prediction_along(self) -> None:
        """
        The backend a request left (refused, or answered 502/503) never prefilled it: its
        index keeps none of the blocks that request added, and the prediction is not
        counted against its engine's counters.  Before, those blocks stayed, the next
        request of the prefix could go there, and its report of nothing cached shrank a
        healthy engine's capacity as an eviction.
        """
        request = chat(tenant_prompt(13), "0")
        first = self.sent(request)
        other = next(b for b in self.backends if b is not first)
        self.assertIs(self.policy.choose([other], request), other)  # the retry
        self.policy.observe(other, outcome(other, request, 820, 0))
        self.assertEqual(facts(self.policy, first)["index_blocks"], 0)
        first_index = self.policy.index.get(first)
        assert first_index is not None
        self.assertEqual(first_index.predicted_since, 0.0)
        self.assertGreater(facts(self.policy, other)["index_blocks"], 0)
        for n in range(6):  # the prefix is at home where it was served
            again = chat(tenant_prompt(13), f"{n + 1}")
            self.assertIs(self.sent(again), other)
        self.assertEqual(facts(self.policy, first)["misses"], 0)

    def test_a_retry_keeps_what_the_backend_it_left_already_held(self) -> None:
        request = chat(tenant_prompt(14), "0")
        home = self.sent(request)
        held = facts(self.policy, home)["index_blocks"]
        again = chat(tenant_prompt(14), "1" * 600)  # the prefix, and more of its own
        self.assertIs(self.sent(again), home)
        other = next(b for b in self.backends if b is not home)
        self.policy.choose([other], again)  # retried elsewhere
        self.assertEqual(facts(self.policy, home)["index_blocks"], held)
        self.assertEqual(self.policy.index.match(home, self.policy.hasher.key(
            request.json, "m")[0]), held)

    def test_an_engine_back_up_starts_with_an_empty_index_not_a_collapsed_capacity(
            self) -> None:
        """
        A backend that went down and came back (a restart, a deploy, an OOM) has an empty
        cache: its index starts again, and its first answers -- honestly nothing cached --
        are no evictions.  Before, each tenant's first miss there shrank the capacity as
        an eviction and cut the trust: one round of 8 tenants took the engine from 2,048
        blocks to 24 (its index's size less the misses) and its trust from 1 to 0.64.
        """
        pool, backends = fleet(2)
        policy = CacheAware(secret=SECRET)
        served: dict[str, int] = {}

        def ask(tenant: int, n: int) -> Backend:
            request = chat(tenant_prompt(tenant), f"question {n}")
            chosen = policy.choose(backends, request)
            pool.slots.acquire(chosen).release()
            cached = 800 if served.get(chosen.key + str(tenant)) else 0  # an engine's truth
            served[chosen.key + str(tenant)] = 1
            policy.observe(chosen, outcome(chosen, request, 820, cached))
            return chosen

        for n in range(3):
            for tenant in range(8):
                ask(tenant, n)
        restarted = backends[0]
        before = facts(policy, restarted)
        self.assertGreater(before["index_blocks"], 0)
        pool.mark_down(restarted, "restarted")
        pool.mark_up(restarted)
        served = {k: v for k, v in served.items() if not k.startswith(restarted.key)}
        self.assertEqual(facts(policy, restarted)["index_blocks"], before["index_blocks"])
        for tenant in range(8):
            ask(tenant, 9)
        after = facts(policy, restarted)
        self.assertEqual(after["misses"], before["misses"])
        self.assertGreaterEqual(after["capacity_blocks"], before["capacity_blocks"])
        self.assertGreater(after["trust"], 0.9)

    def test_counters_that_start_again_empty_the_index(self) -> None:
        """An engine that restarted between two probes shows it in its counters only."""
        pool, backends = fleet(1)
        policy = CacheAware(secret=SECRET)
        home = backends[0]
        pool.set_engine_depth(home, 0, 0, prefix_cache=(5000.0, 9000.0))
        policy.choose(backends, chat(tenant_prompt(1), "a"))
        self.assertGreater(facts(policy, home)["index_blocks"], 0)
        pool.set_engine_depth(home, 0, 0, prefix_cache=(0.0, 100.0))  # started again
        request = chat(tenant_prompt(2), "b")
        policy.choose(backends, request)
        # what is listed now is the one prompt sent since the restart
        self.assertEqual(policy.index.match(home, policy.hasher.key(
            chat(tenant_prompt(1), "a").json, "m")[0]), 0)

    def test_hostile_reports_are_clamped(self) -> None:
        request = chat(tenant_prompt(11), "0")
        home = self.sent(request)
        self.policy.observe(home, outcome(home, request, 1, 10**12))
        described = self.policy.describe(home)
        self.assertLessEqual(described["prefix_cache"]["reported_hit_rate"], 1.0)
        self.assertLessEqual(described["prefix_cache"]["chars_per_token"], 32.0)
        again = chat(tenant_prompt(11), "1")
        self.sent(again)
        self.policy.observe(home, outcome(home, again, -5, -7))
        json.dumps(dict(facts(self.policy, home)))

    def test_predictions_are_forgotten_with_their_requests(self) -> None:
        request = chat(tenant_prompt(12), "0")
        self.sent(request)
        self.assertEqual(len(self.policy._pending), 1)
        ref = weakref.ref(request)
        del request
        self.assertIsNone(ref())
        self.assertEqual(len(self.policy._pending), 0)
        self.assertEqual(MAX_PENDING, 65_536)
        self.patch(cache_aware, "MAX_PENDING", 500)  # the same bound, smaller
        kept = [RoutingRequest(json={"prompt": f"{n} " + "p" * 300}) for n in range(510)]
        for request in kept:
            self.policy.choose(self.backends, request)
        self.assertEqual(len(self.policy._pending), 500)

    def test_describe_is_json_ready_in_the_shape_status_keeps(self) -> None:
        for backend in self.backends:
            json.dumps(dict(self.policy.describe(backend)))
            self.assertIn("prefix_cache", backend.detailed_status())  # null elsewhere
        self.sent(chat(tenant_prompt(13)))
        for backend in self.backends:
            json.dumps(dict(self.policy.describe(backend)))


class MemoryBoundTests(SynchronousTestCase):
    def test_entries_never_exceed_the_cap_over_100000_distinct_prompts(self) -> None:
        pool, backends = fleet(4)
        policy = CacheAware(secret=SECRET, max_entries=5000, capacity_blocks=4000)
        for n in range(100_000):
            body = {"prompt": f"{n}:" + "z" * 300}
            chosen = policy.choose(backends, RoutingRequest(json=body))
            if n % 997 == 0:
                self.assertLessEqual(policy.index.entries, 5000)
        self.assertLessEqual(policy.index.entries, 5000)
        self.assertGreater(policy.index.entries, 4000)
        for backend in backends:
            self.assertLessEqual(len(policy.index.of(backend)), 4000)
        del chosen, pool


class OptionTests(SynchronousTestCase):
    """--cache-block and --cache-entries: from every source, validated, read by the policy."""

    def test_the_defaults(self) -> None:
        policy = CacheAware()
        config = build_config({}, {})
        self.assertEqual((config.cache_block, config.cache_entries, config.cache_load),
                         (256, 200_000, 1.25))
        self.assertEqual((policy.hasher.block_chars, policy.index.max_entries), (256, 200_000))

    def test_the_balancer_builds_the_policy_with_them(self) -> None:
        lb = LoadBalancer(["127.0.0.1:9000"], reactor=Clock(), agent=FakeUpstream(),
                          probe_agent=FakeUpstream(), log_file="none", policy="cache-aware",
                          cache_block=64, cache_entries=5000, cache_load=2)
        policy = lb.policy
        assert isinstance(policy, CacheAware)
        self.assertEqual((policy.hasher.block_chars, policy.index.max_entries,
                          policy.load_factor), (64, 5000, 2.0))
        self.assertTrue(lb.health.scrape_engine_queue)  # the engines' KV cache usage

    def test_from_the_environment_and_the_config_file(self) -> None:
        # a file of its own in the system's temporary directory: trial's mktemp() is relative
        # to the working directory, which only trial itself moves into _trial_temp
        handle, path = tempfile.mkstemp(suffix=".toml")
        os.close(handle)
        self.addCleanup(os.remove, path)
        with open(path, "w") as toml:
            toml.write('backends = ["h:1"]\npolicy = "cache-aware"\ncache-block = 128\n'
                       'cache-entries = 9000\n')
        config = build_config({"config": path}, {"LB_CACHE_ENTRIES": "3000",
                                                 "LB_CACHE_LOAD": "1.5"})
        self.assertEqual((config.cache_block, config.cache_entries, config.cache_load),
                         (128, 3000, 1.5))

    def test_nonsense_is_refused_by_name(self) -> None:
        for given, said in (({"cache-block": "8"}, "--cache-block: '8' must be from 16"),
                            ({"cache-block": "1e9"}, "--cache-block: '1e9' is not a whole"),
                            ({"cache-entries": "10"}, "--cache-entries: '10' must be at least"),
                            ({"cache-entries": "-5"}, "--cache-entries: '-5' is not a whole"),
                            ({"cache-load": "0.5"}, "--cache-load: '0.5' must be a number"),
                            ({"cache-load": "nan"}, "--cache-load: 'nan' must be a number"),
                            ({"cache-load": "x"}, "--cache-load: 'x' is not a number")):
            with self.assertRaises(ConfigError) as raised:
                build_config(given, {})
            self.assertIn(said, str(raised.exception))


class RandomisedTests(SynchronousTestCase):
    def test_any_sequence_of_choices_and_reports_keeps_the_invariants(self) -> None:
        """Random fleets, prompts and (hostile) reports: a candidate always, bounds always."""
        rng = random.Random(11)
        pool = Pool(tuple(BackendSpec("127.0.0.1", 9000 + i, weight=rng.choice((1, 2, 5)))
                          for i in range(6)))
        backends = list(pool)
        policy = CacheAware(secret=SECRET, max_entries=1000, capacity_blocks=300)
        prefixes = [tenant_prompt(t, rng.randrange(200, 6000)) for t in range(12)]
        held: list[tuple[Lease, RoutingRequest]] = []
        for step in range(3000):
            candidates = [b for b in backends if rng.random() < 0.8] or backends[:1]
            request = chat(rng.choice(prefixes), f"{step} " * rng.randrange(0, 40))
            chosen = policy.choose(candidates, request)
            self.assertIn(chosen, candidates)
            held.append((pool.slots.acquire(chosen), request))
            if rng.random() < 0.3:
                pool.set_engine_depth(rng.choice(backends), 1, 0, kv_cache=rng.random())
            while held and (len(held) > 20 or rng.random() < 0.4):
                lease, done = held.pop(rng.randrange(len(held)))
                lease.release()
                tokens = rng.choice((None, -3, 0, 50, 900, 10**9))
                cached = rng.choice((None, -1, 0, 10, 800, 10**12))
                policy.observe(lease.backend, outcome(lease.backend, done, tokens, cached))
            self.assertLessEqual(policy.index.entries, 1000)
            for backend in backends:
                index = policy.index.get(backend)
                if index is not None:
                    self.assertLessEqual(len(index), index.capacity)
                    self.assertTrue(0.0 <= index.trust <= 1.0)
        for backend in backends:
            json.dumps(dict(policy.describe(backend)))


VLLM_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 1.0
vllm:num_requests_waiting{engine="0"} 0.0
vllm:kv_cache_usage_perc{engine="0"} 0.25
vllm:prefix_cache_queries_total{engine="0"} 9000.0
vllm:prefix_cache_queries_total{engine="1"} 1000.0
vllm:prefix_cache_hits_total{engine="0"} 4000.0
vllm:prefix_cache_hits_total{engine="1"} 500.0
"""


class CounterFallbackTests(SynchronousTestCase):
    """Answers without cached tokens: the engines' /metrics prefix-cache counters instead."""

    def test_vllms_counters_are_read_summed_over_cores(self) -> None:
        reading = engines.read(VLLM_METRICS, engines.BY_NAME["vllm"])
        self.assertEqual(reading.prefix_cache, (4500.0, 10000.0))
        older = VLLM_METRICS.replace("vllm:prefix_cache", "vllm:gpu_prefix_cache")
        self.assertEqual(engines.read(older, engines.BY_NAME["vllm"]).prefix_cache,
                         (4500.0, 10000.0))

    def test_counters_no_cache_could_show_are_ignored(self) -> None:
        vllm = engines.BY_NAME["vllm"]
        for text in (VLLM_METRICS.replace("4000.0", "1e308").replace("9000.0", "1e308"),
                     VLLM_METRICS.replace("4000.0", "40000.0"),  # more hits than queries
                     VLLM_METRICS.replace("4000.0", "-9000.0"),
                     "vllm:prefix_cache_hits_total 5\n"):  # no queries
            self.assertIsNone(engines.read(text, vllm).prefix_cache, text)

    def test_workers_see_the_counters(self) -> None:
        supervisor, _ = fleet(1)
        worker, (mirrored,) = fleet(1)
        supervisor.set_engine_depth(list(supervisor)[0], 1, 0, 0.5, (10.0, 20.0))
        worker.mirror(json.loads(json.dumps(supervisor.shared_state())))
        self.assertEqual(mirrored.engine.prefix_cache_counts, (10.0, 20.0))

    def scenario(self, hits_per_round: float, reported: bool = False) -> dict[str, Any]:
        pool, backends = fleet(2)
        policy = CacheAware(secret=SECRET)
        prompt = tenant_prompt(20)
        home = policy.choose(backends, chat(prompt, "0"))
        counters = (0.0, 0.0)
        pool.set_engine_depth(home, 0, 0, None, counters)
        for n in range(8):
            request = chat(prompt, f"{n + 1}")
            self.assertIs(policy.choose(backends, request), home)
            if reported:
                policy.observe(home, outcome(home, request, 820, 800))
            counters = (counters[0] + hits_per_round, counters[1] + 820)
            pool.set_engine_depth(home, 0, 0, None, counters)
        return facts(policy, home)

    def test_hits_the_engine_counted_confirm_the_predictions(self) -> None:
        described = self.scenario(hits_per_round=800)
        self.assertEqual(described["counter_checks"], 7)
        self.assertEqual((described["trust"], described["misses"]), (1.0, 0))

    def test_hits_the_engine_never_counted_correct_the_index(self) -> None:
        described = self.scenario(hits_per_round=0)
        self.assertEqual(described["counter_checks"], 7)
        self.assertLess(described["trust"], 0.3)
        self.assertGreater(described["misses"], 0)
        self.assertLess(described["capacity_blocks"], 2048)

    def test_answers_that_report_win_over_the_counters(self) -> None:
        described = self.scenario(hits_per_round=0, reported=True)
        self.assertEqual(described["counter_checks"], 0)
        self.assertEqual(described["trust"], 1.0)

    def test_counters_that_start_again_teach_nothing(self) -> None:
        pool, backends = fleet(1)
        policy = CacheAware(secret=SECRET)
        (home,) = backends
        prompt = tenant_prompt(21)
        policy.choose(backends, chat(prompt, "0"))
        pool.set_engine_depth(home, 0, 0, None, (5000.0, 9000.0))
        policy.choose(backends, chat(prompt, "1"))
        pool.set_engine_depth(home, 0, 0, None, (0.0, 100.0))  # the engine restarted
        policy.choose(backends, chat(prompt, "2"))
        described = facts(policy, home)
        self.assertEqual((described["counter_checks"], described["trust"]), (0, 1.0))


class ProbedCountersTests(RecognitionTests):
    """The prober hands the counters it scrapes to the pool (RecognitionTests' harness)."""

    def test_the_prober_reads_the_counters_each_probe(self) -> None:
        self.build(BackendSpec("127.0.0.1", 8002), queue_depth=True)
        self.probe(VLLM_METRICS)
        self.assertEqual(self.backend.engine.prefix_cache_counts, (4500.0, 10000.0))
        self.clock.advance(2)
        self.answer(b"/health", "")
        self.answer(b"/metrics", VLLM_METRICS.replace("4000.0", "6000.0"))
        self.assertEqual(self.backend.engine.prefix_cache_counts, (6500.0, 10000.0))
