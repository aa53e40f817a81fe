"""
The survivors of full mutation runs of ``--policy cache-aware``'s modules
(``_scheduling/policies/cache_aware``, ``_scheduling/prefix_index``, ``_scheduling/prefix``),
each pinned by the behaviour a user relies on.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from txlb import BackendSpec, Pool, RequestOutcome, RoutingRequest
from txlb._cluster.backend import Backend
from txlb._cluster.slots import Lease
from txlb._scheduling.policies import cache_aware
from txlb._scheduling.policies.cache_aware import CacheAware
from txlb._scheduling.prefix import PrefixHasher
from txlb._scheduling.prefix_index import BackendIndex, FleetIndex

SECRET = b"m" * 32
#: characters per block (the first holds the 20 of "<|model|>\n<|prompt|>"): short prompts
BLOCK = 32


def fleet(*weights: int) -> tuple[Pool, list[Backend]]:
    pool = Pool(tuple(BackendSpec("127.0.0.1", 9000 + i, weight=w)
                      for i, w in enumerate(weights)))
    return pool, list(pool)


def prompt(tag: str, blocks: int) -> RoutingRequest:
    """A completion whose rendered prompt is exactly ``blocks`` whole blocks."""
    head = "<|model|>\n<|prompt|>"
    text = (tag * BLOCK * blocks)[:BLOCK * blocks - len(head)]
    return RoutingRequest(json={"prompt": text})


def outcome(backend: Backend, request: RoutingRequest, prompt_tokens: int | None,
            cached: int | None) -> RequestOutcome:
    return RequestOutcome(backend=backend.key, status=200, answered=True, ttfb=0.1,
                          duration=1.0, prompt_tokens=prompt_tokens,
                          cached_prompt_tokens=cached, routing=request)


class ChoiceTests(SynchronousTestCase):
    """Which backend a prompt goes to, as the gain, the room and the load decide."""

    def setUp(self) -> None:
        self.leases: list[Lease] = []

    def tearDown(self) -> None:
        for lease in self.leases:
            lease.release()

    def policy(self, capacity: int = 2048) -> CacheAware:
        return CacheAware(block_chars=BLOCK, capacity_blocks=capacity, secret=SECRET)

    def chain(self, policy: CacheAware, request: RoutingRequest) -> list[int]:
        assert request.json is not None
        chain = policy.hasher.key(request.json, None)[0]
        return chain

    def busy(self, pool: Pool, backend: Backend, n: int) -> None:
        self.leases += [pool.slots.acquire(backend) for _ in range(n)]

    def test_one_request_in_flight_is_not_busy_beside_an_idle_backend(self) -> None:
        """
        The idle backend takes the request from the holders only once one of them has
        more than one in flight: a holder with one is still the prefix's home.
        """
        pool, (idle, home) = fleet(1, 1)
        policy = self.policy()
        request = prompt("a", 4)
        policy.index.sent(home, self.chain(policy, request)[:2])
        self.busy(pool, home, 1)
        self.assertIs(policy.choose([idle, home], request), home)

    def test_two_in_flight_beside_an_idle_backend_are_busy(self) -> None:
        pool, (idle, home) = fleet(1, 4)  # home's weight keeps it under the load bound
        policy = self.policy()
        request = prompt("b", 4)
        policy.index.sent(home, self.chain(policy, request)[:2])
        self.busy(pool, home, 2)
        self.assertLess(home.counts.active, cache_aware.load_bound(home, [idle, home], 1.25))
        self.assertIs(policy.choose([idle, home], request), idle)

    def test_a_one_block_match_is_a_gain(self) -> None:
        """One block held is worth going to a busier backend for (over least-conn)."""
        pool, (other, home) = fleet(1, 1)
        policy = self.policy()
        request = prompt("c", 4)
        policy.index.sent(home, self.chain(policy, request)[:1])
        self.busy(pool, home, 1)
        self.assertIs(policy.choose([other, home], request), home)

    def test_the_longer_match_wins_over_a_less_loaded_shorter_one(self) -> None:
        pool, (short, long_) = fleet(1, 1)
        policy = self.policy()
        request = prompt("d", 4)
        chain = self.chain(policy, request)
        policy.index.sent(long_, chain[:2])
        policy.index.sent(short, chain[:1])
        self.busy(pool, long_, 1)
        self.assertIs(policy.choose([short, long_], request), long_)

    def test_a_home_too_full_for_the_rest_gains_nothing_room_elsewhere_wins(self) -> None:
        """
        The home holds 2 blocks of a 5-block prompt but has room for 1 more: placing it
        there evicts 2 -- no gain.  The busier backend with room for it all takes it, not
        the idle full one.
        """
        pool, (full, roomy) = fleet(1, 1)
        policy = self.policy(capacity=8)
        request = prompt("e", 5)
        policy.index.sent(full, self.chain(policy, prompt("z", 5)))  # 5 other blocks
        policy.index.sent(full, self.chain(policy, request)[:2])     # then the prefix's 2
        self.assertEqual(policy.index.of(full).room, 1)
        self.busy(pool, roomy, 1)
        self.assertIs(policy.choose([full, roomy], request), roomy)

    def test_room_beyond_what_the_prompt_needs_earns_nothing(self) -> None:
        """Equal matches, one backend's room just enough, the other's ample: a tie."""
        pool, (snug, ample) = fleet(1, 1)
        policy = self.policy(capacity=8)
        request = prompt("f", 5)
        chain = self.chain(policy, request)
        policy.index.sent(snug, self.chain(policy, prompt("y", 3)))  # 3 other blocks
        policy.index.sent(snug, chain[:1])
        policy.index.sent(ample, chain[:1])
        self.assertEqual(policy.index.of(snug).room, 4)  # exactly the 4 blocks to add
        self.busy(pool, ample, 1)
        self.assertIs(policy.choose([snug, ample], request), snug)

    def test_a_kv_cache_at_the_saturation_mark_counts_as_saturated(self) -> None:
        pool, (other, home) = fleet(1, 1)
        policy = self.policy()
        request = prompt("g", 4)
        policy.index.sent(home, self.chain(policy, request)[:3])
        self.busy(pool, home, 1)
        pool.set_engine_depth(home, 1, 0, kv_cache=0.89)
        self.assertIs(policy.choose([other, home], request), home)
        pool.set_engine_depth(home, 1, 0, kv_cache=cache_aware.KV_SATURATED)
        self.assertIs(policy.choose([other, home], request), other)

    def test_a_match_counts_its_trust_times_its_blocks(self) -> None:
        """
        An engine that reported nothing cached for a predicted hit is trusted 0.8: its
        4 blocks are worth 3.2, less than another's 4 trusted ones.
        """
        pool, (doubted, trusted) = fleet(1, 1)
        policy = self.policy()
        first = prompt("h", 6)
        chain = self.chain(policy, first)
        policy.index.sent(doubted, chain)
        self.assertIs(policy.choose([doubted], first), doubted)
        policy.observe(doubted, outcome(doubted, first, 100, 0))
        self.assertEqual(policy.describe(doubted)["prefix_cache"]["trust"],  # type: ignore[index]
                         0.8)
        self.assertEqual(policy.index.match(doubted, chain), 6)
        policy.index.sent(trusted, chain[:4])
        assert first.json is not None
        text = str(first.json["prompt"])
        again = RoutingRequest(json={"prompt": text[:BLOCK * 4 - 20] + "Q" * BLOCK})
        self.assertEqual(self.chain(policy, again)[:4], chain[:4])
        self.assertEqual(policy.index.match(doubted, self.chain(policy, again)), 4)
        self.assertIs(policy.choose([doubted, trusted], again), trusted)

    def test_gains_within_rounding_of_the_best_tie(self) -> None:
        pool, (exact, rounded) = fleet(1, 1)
        policy = self.policy()
        request = prompt("i", 4)
        chain = self.chain(policy, request)
        policy.index.sent(exact, chain[:1])
        policy.index.sent(rounded, chain[:1])
        policy.index.of(rounded).trust = 1.0 - 1e-9  # a learned trust a hair under 1
        self.busy(pool, exact, 1)
        self.assertIs(policy.choose([exact, rounded], request), rounded)

    def test_a_saturated_holder_ties_with_a_best_gain_of_almost_nothing(self) -> None:
        """
        An engine trusted almost nothing (a hundred predicted hits missed) has a best gain
        within rounding of 0: a saturated holder of the same blocks -- gain 0 -- ties with
        it, and the less loaded of them takes the request.
        """
        pool, (doubted, saturated) = fleet(1, 1)
        policy = self.policy()
        request = prompt("s", 4)
        chain = self.chain(policy, request)
        policy.index.sent(doubted, chain[:1])
        policy.index.sent(saturated, chain[:1])
        policy.index.of(doubted).trust = 0.8 ** 100
        pool.set_engine_depth(saturated, 0, 0, kv_cache=0.95)
        self.busy(pool, doubted, 1)
        self.assertIs(policy.choose([doubted, saturated], request), saturated)


class PendingTests(SynchronousTestCase):
    def test_past_the_bound_the_oldest_prediction_goes_not_the_newest(self) -> None:
        self.patch(cache_aware, "MAX_PENDING", 2)
        pool, (backend,) = fleet(1)
        policy = CacheAware(block_chars=BLOCK, secret=SECRET)
        requests = [prompt(tag, 3) for tag in "jkl"]
        for request in requests:
            self.assertIs(policy.choose([backend], request), backend)

        def reports() -> Any:
            return policy.describe(backend)["prefix_cache"]["reports"]  # type: ignore[index]

        policy.observe(backend, outcome(backend, requests[0], 12, 0))
        self.assertEqual(reports(), 0)  # forgotten: the oldest of three
        policy.observe(backend, outcome(backend, requests[2], 12, 0))
        self.assertEqual(reports(), 1)
        policy.observe(backend, outcome(backend, requests[1], 12, 0))
        self.assertEqual(reports(), 2)



def indexed(capacity: int, blocks: int) -> BackendIndex:
    """An index of ``capacity`` blocks listing ``blocks`` of them (256 characters each)."""
    index = BackendIndex(capacity)
    index.sent(list(range(blocks)))
    return index


class LearnedTests(SynchronousTestCase):
    """What one answer's report does to a backend's index (256-character blocks, 4 per token)."""

    def facts(self, index: BackendIndex) -> dict[str, Any]:
        return index.describe()

    def test_a_full_index_lists_its_capacity(self) -> None:
        index = indexed(4, 4)
        self.assertEqual(index.match([0, 1, 2, 3]), 4)
        self.assertEqual(self.facts(index)["index_blocks"], 4)

    def test_a_confirmed_hit_is_counted_in_tokens(self) -> None:
        index = indexed(100, 40)
        index.learned(256, 0, 2, 1000, 128, 2048)  # 2 blocks predicted = 128 tokens: there
        facts = self.facts(index)
        self.assertEqual((facts["predicted_hit_rate"], facts["reported_hit_rate"]),
                         (0.128, 0.128))
        self.assertEqual((facts["trust"], facts["capacity_blocks"], facts["misses"]),
                         (1.0, 100, 0))

    def test_a_quarter_short_is_no_eviction(self) -> None:
        index = indexed(100, 40)
        index.learned(256, 0, 4, 1000, 192, 2048)  # 3 of 4 blocks
        facts = self.facts(index)
        self.assertEqual((facts["misses"], facts["capacity_blocks"], facts["trust"]),
                         (0, 100, 0.95))

    def test_an_eviction_shrinks_the_capacity_to_what_was_still_there(self) -> None:
        index = indexed(100, 40)
        index.learned(256, 0, 20, 2000, 640, 2048)  # 10 of 20 blocks: 10 were evicted
        facts = self.facts(index)
        self.assertEqual((facts["misses"], facts["capacity_blocks"], facts["index_blocks"]),
                         (1, 30, 30))

    def test_more_cached_than_predicted_grows_the_capacity_by_the_difference(self) -> None:
        index = indexed(100, 40)
        index.learned(256, 0, 2, 1000, 320, 2048)  # 5 blocks where 2 were predicted
        self.assertEqual(self.facts(index)["capacity_blocks"], 103)

    def test_a_prediction_holding_on_a_full_index_grows_it_by_one(self) -> None:
        index = indexed(40, 40)
        index.learned(256, 0, 2, 1000, 128, 2048)
        self.assertEqual(self.facts(index)["capacity_blocks"], 41)

    def test_a_full_index_does_not_grow_on_an_answer_nothing_was_predicted_for(self) -> None:
        index = indexed(40, 40)
        index.learned(256, 0, 0, 1000, 0, 2048)
        self.assertEqual(self.facts(index)["capacity_blocks"], 40)

    def test_a_report_of_exactly_the_prediction_grows_a_full_index_by_one(self) -> None:
        index = indexed(40, 40)
        index.learned(256, 0, 3, 1000, 192, 2048)
        self.assertEqual(self.facts(index)["capacity_blocks"], 41)
        index.learned(256, 0, 3, 1000, 192, 41)  # never past the fleet's cap
        self.assertEqual(self.facts(index)["capacity_blocks"], 41)


class CountedTests(SynchronousTestCase):
    """The engine's prefix-cache counters compared with the hits predicted since."""

    def test_a_prediction_is_its_blocks_in_tokens(self) -> None:
        index = indexed(100, 40)
        self.assertEqual(index.predicted(2, 256), 128.0)

    def test_most_hits_counted_lower_the_trust_a_little(self) -> None:
        index = indexed(100, 40)
        index.counted((50.0, 500.0), 256)
        index.predicted(2, 256)  # 128 tokens
        index.counted((150.0, 1500.0), 256)  # 100 of them
        self.assertAlmostEqual(index.trust, 1 + 0.2 * (100 / 128 - 1))
        facts = index.describe()
        self.assertEqual((facts["counter_checks"], facts["misses"], facts["capacity_blocks"]),
                         (1, 0, 100))

    def test_three_quarters_of_the_hits_is_no_eviction(self) -> None:
        index = indexed(100, 40)
        index.counted((50.0, 500.0), 256)
        index.predicted(2, 256)
        index.counted((146.0, 1500.0), 256)  # 96 of 128
        self.assertEqual((index.misses, index.capacity), (0, 100))

    def test_too_few_hits_shrink_the_capacity_by_the_blocks_missing(self) -> None:
        index = indexed(100, 40)
        index.counted((50.0, 500.0), 256)
        index.predicted(20, 256)  # 1280 tokens
        index.counted((370.0, 1500.0), 256)  # 320 of them: 15 blocks missing
        facts = index.describe()
        self.assertEqual((facts["misses"], facts["capacity_blocks"], facts["index_blocks"]),
                         (1, 25, 25))

    def test_no_hits_at_all_is_a_miss_not_a_restart(self) -> None:
        index = indexed(100, 40)
        index.counted((50.0, 500.0), 256)
        index.predicted(20, 256)
        index.counted((50.0, 600.0), 256)
        facts = index.describe()
        self.assertEqual((facts["restarts"], facts["misses"], facts["trust"]), (0, 1, 0.8))
        self.assertEqual(len(index), 20)

    def test_counters_moving_with_nothing_predicted_teach_nothing(self) -> None:
        index = indexed(100, 40)
        index.counted((0.0, 0.0), 256)
        index.counted((10.0, 100.0), 256)
        facts = index.describe()
        self.assertEqual((facts["counter_checks"], facts["trust"], facts["misses"]),
                         (0, 1.0, 0))

    def test_a_withdrawn_prediction_is_not_expected_of_the_counters(self) -> None:
        """A retry took its request elsewhere: the engine's missing hits are no eviction."""
        index = indexed(100, 40)
        index.counted((0.0, 0.0), 256)
        tokens = index.predicted(20, 256)
        index.withdraw([], tokens)
        index.counted((0.0, 100.0), 256)
        self.assertEqual((index.misses, index.trust, index.capacity), (0, 1.0, 100))


class FleetCapTests(SynchronousTestCase):
    def test_the_cap_holds_after_a_retry_withdrew_blocks(self) -> None:
        pool, (one, two) = fleet(1, 1)
        index = FleetIndex(max_entries=10, capacity=10)
        index.sent(one, [1, 2, 3, 4, 5, 6])
        index.withdraw(index.of(one), [1, 2, 3], 0.0)
        index.sent(two, list(range(10, 20)))
        self.assertEqual(index.entries, 10)
        index.sent(two, [20, 21, 22])
        self.assertEqual(index.entries, 10)
        self.assertEqual(index.match(one, [4, 5, 6]), 3)


def nested(value: object, depth: int) -> object:
    """``value`` inside ``depth`` lists."""
    for _ in range(depth):
        value = [value]
    return value


class RenderTests(SynchronousTestCase):
    """What the hasher renders of a body: the budget of characters and looks, the depth."""

    def test_the_looks_allowed_are_four_per_character_of_the_budget(self) -> None:
        hasher = PrefixHasher(4, 8, SECRET)  # 32 characters, 128 looks
        self.assertEqual(hasher.render({"prompt": ["a"] * 20}, None),
                         "<|model|>\n<|prompt|>" + "a\n" * 6)
        # 125 empty parts and one more: the 128th look renders, the 129th does not
        body = {"messages": [{"role": "u", "content": [""] * 125 + ["X"]}]}
        self.assertEqual(hasher.render(body, None), "<|model|>\n<|u|>X")
        body = {"messages": [{"role": "u", "content": [""] * 126 + ["X"]}]}
        self.assertEqual(hasher.render(body, None), "<|model|>\n<|u|>")

    def test_a_media_part_costs_a_look_for_its_payload_and_one_for_its_name(self) -> None:
        hasher = PrefixHasher(4, 8, SECRET)  # 128 looks
        media = {"image_url": "u"}
        body = {"messages": [{"role": "u", "content": [""] * 124 + [media]}]}
        self.assertTrue(hasher.render(body, None).startswith("<|model|>\n<|u|><media:"))
        body = {"messages": [{"role": "u", "content": [""] * 125 + [media]}]}
        self.assertEqual(hasher.render(body, None), "<|model|>\n<|u|>")

    def test_a_media_name_is_96_bits(self) -> None:
        hasher = PrefixHasher(secret=SECRET)
        body = {"messages": [{"role": "u", "content": [{"image_url": "u"}]}]}
        self.assertRegex(hasher.render(body, None), r"^<\|model\|>\n<\|u\|><media:[0-9a-f]{24}>$")

    def test_json_is_rendered_sixteen_levels_deep_and_no_deeper(self) -> None:
        hasher = PrefixHasher(secret=SECRET)
        self.assertIn("deep", hasher.render({"tools": nested("deep", 16)}, None))
        self.assertNotIn("deeper", hasher.render({"tools": nested("deeper", 17)},
                                                 None))
        keyed: object = "deep"
        for _ in range(16):
            keyed = {"k": keyed}
        self.assertIn("deep", hasher.render({"tools": keyed}, None))
        self.assertNotIn("deep", hasher.render({"tools": {"k": keyed}}, None))

    def test_media_is_named_by_its_payload_sixteen_levels_deep_and_no_deeper(self) -> None:
        hasher = PrefixHasher(secret=SECRET)

        def name(payload: object) -> str:
            body = {"messages": [{"role": "user", "content": [{"image_url": payload}]}]}
            return hasher.render(body, None)

        self.assertNotEqual(name(nested("a", 16)), name(nested("b", 16)))
        self.assertEqual(name(nested("a", 17)), name(nested("b", 17)))
        one: object = "a"
        other: object = "b"
        for _ in range(16):
            one, other = {"k": one}, {"k": other}
        self.assertNotEqual(name(one), name(other))
        self.assertEqual(name({"k": one}), name({"k": other}))

    def test_the_smallest_blocks_and_secrets_are_allowed(self) -> None:
        self.assertEqual(len(PrefixHasher(1, 1, b"k").chain("abc")), 1)
        self.assertEqual(len(PrefixHasher(secret=b"k" * 64).chain("x" * 512)), 2)
        for bad in ({"block_chars": 0}, {"max_blocks": 0}, {"secret": b""},
                    {"secret": b"k" * 65}):
            self.assertRaises(ValueError, PrefixHasher, **bad)


class _Odd(dict):
    """A message no JSON parser makes, whose lookups fail as ``error``."""

    def __init__(self, error: type[BaseException]) -> None:
        super().__init__(role="user")
        self.error = error

    def __contains__(self, key: object) -> bool:
        raise self.error("odd")


class ShapeTests(SynchronousTestCase):
    """How each shape of a body is rendered."""

    def setUp(self) -> None:
        self.hasher = PrefixHasher(secret=SECRET)

    def render(self, body: dict[str, Any]) -> str:
        return self.hasher.render(body, None)

    def test_json_literals(self) -> None:
        self.assertEqual(self.render({"tools": [True, False, None, 1.5]}),
                         "<|model|>\n<|tools|>[true,false,null,1.5,]")

    def test_content_that_is_neither_text_nor_parts_is_its_json(self) -> None:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": {"a": "b"}}]}
        self.assertEqual(self.render(body), "<|model|>\n<|user|>{a:b,}")
        body = {"messages": [{"role": "user", "content": None}]}
        self.assertEqual(self.render(body), "<|model|>\n<|user|>")

    def test_messages_that_are_not_a_list(self) -> None:
        self.assertEqual(self.render({"messages": {"x": "y"}}), "<|model|>{x:y,}")
        self.assertEqual(self.render({"messages": None}), "<|model|>")

    def test_a_message_that_is_not_an_object_does_not_end_the_conversation(self) -> None:
        body = {"messages": ["hello", {"role": "user", "content": "hi"}]}
        self.assertEqual(self.render(body), "<|model|>hello\n<|user|>hi")

    def test_a_responses_item_without_content_is_its_json(self) -> None:
        body = {"input": [{"type": "function_call", "name": "f"},
                          {"type": "message", "content": "c"}, {"role": "user"}]}
        self.assertEqual(self.render(body),
                         "<|model|>\n<|input|>\n<|message|><name>f{name:f,type:function_call,}"
                         "\n<|message|>c\n<|user|>")

    def test_a_prompt_of_token_ids_and_other_items(self) -> None:
        self.assertEqual(self.render({"prompt": [1, 2, True, {"a": 1}, "s"]}),
                         "<|model|>\n<|prompt|>1 2 true{a:1,}s\n")
        self.assertEqual(self.render({"prompt": {"a": 1}}), "<|model|>\n<|prompt|>{a:1,}")
        self.assertEqual(self.render({"prompt": None}), "<|model|>\n<|prompt|>")

    def test_only_the_first_4096_items_of_a_list_are_looked_at(self) -> None:
        hasher = PrefixHasher(4096, 4, SECRET)
        text = hasher.render({"prompt": [str(n % 10) for n in range(4097)]}, None)
        self.assertEqual(text.count("\n"), 4096 + 1)

    def test_media_is_named_by_its_first_mebibyte(self) -> None:
        def name(payload: str) -> str:
            body = {"messages": [{"role": "user", "content": [{"image_url": payload}]}]}
            return self.render(body)

        head = "x" * ((1 << 20) - 1)
        self.assertNotEqual(name(head + "a" + "z"), name(head + "b" + "z"))
        self.assertEqual(name(head + "a" + "y"), name(head + "a" + "z"))

    def test_a_shape_nobody_foresaw_stops_the_rendering_there(self) -> None:
        for error in (RecursionError, TypeError, ValueError):
            body = {"messages": [{"role": "user", "content": "hi"}, _Odd(error)]}
            self.assertEqual(self.render(body), "<|model|>\n<|user|>hi\n<|user|>")


class IndexDetailTests(SynchronousTestCase):
    """FleetIndex's constants and edges as /status and the choices show them."""

    def test_a_fresh_index_and_its_floor(self) -> None:
        facts = BackendIndex().describe()
        self.assertEqual((facts["capacity_blocks"], facts["index_blocks"]), (2048, 0))
        index = indexed(100, 20)
        index.learned(256, 0, 20, 2000, 0, 2048)  # everything evicted
        self.assertEqual(index.capacity, 16)
        self.assertEqual((indexed(4, 4).room, indexed(4, 1).room), (0, 3))

    def test_the_oldest_entries_go_first_and_a_gap_ends_a_match(self) -> None:
        index = indexed(4, 4)  # 0 sent last (a chain's first block is the most recent)
        index.sent([10])
        self.assertEqual((index.match([0, 1, 2, 3]), index.match([10])), (3, 1))
        self.assertEqual(index.match([0, 99, 1]), 1)

    def test_the_characters_per_token_learned(self) -> None:
        def learned(chars: int, tokens: int) -> float:
            index = indexed(100, 10)
            index.learned(256, chars, 0, tokens, 0, 2048)
            return index.chars_per_token

        self.assertAlmostEqual(learned(8, 1), 4.8)
        self.assertAlmostEqual(learned(1, 1), 3.4)
        self.assertAlmostEqual(learned(1000, 10), 4 + 0.2 * 28)  # at most 32 a token
        self.assertAlmostEqual(learned(1, 10), 4 + 0.2 * (0.5 - 4))  # at least 0.5
        self.assertEqual((learned(0, 10), learned(10, 0)), (4.0, 4.0))

    def test_one_block_predicted(self) -> None:
        index = indexed(100, 10)
        index.learned(256, 0, 1, 100, 0, 2048)  # not there: trust down, no eviction counted
        self.assertEqual((index.trust, index.misses, index.capacity), (0.8, 0, 100))
        full = indexed(10, 10)
        full.learned(256, 0, 1, 100, 64, 2048)
        self.assertEqual(full.capacity, 11)

    def test_the_eviction_threshold_is_a_quarter_of_the_prediction(self) -> None:
        def misses(predicted: int, cached_blocks: int) -> int:
            index = indexed(100, 40)
            index.learned(256, 0, predicted, 5000, cached_blocks * 64, 2048)
            return index.misses

        self.assertEqual([misses(20, 15), misses(20, 14), misses(4, 2), misses(1, 0)],
                         [0, 1, 1, 0])

    def test_a_restart_forgets_what_was_predicted(self) -> None:
        index = indexed(100, 40)
        index.counted((50.0, 500.0), 256)
        index.predicted(20, 256)
        index.counted((60.0, 400.0), 256)  # queries went down: the engine started again
        self.assertEqual((index.restarts, len(index)), (1, 0))
        index.predicted(2, 256)  # 128 tokens
        index.counted((160.0, 1400.0), 256)
        self.assertAlmostEqual(index.trust, 1 + 0.2 * (100 / 128 - 1))
        index.counted((159.0, 1500.0), 256)  # a hit fewer: started again
        self.assertEqual(index.describe()["restarts"], 2)

    def test_a_withdrawal_never_leaves_less_than_nothing_predicted(self) -> None:
        index = indexed(100, 40)
        index.counted((0.0, 0.0), 256)
        index.withdraw([], 500.0)
        index.predicted(2, 256)
        index.counted((100.0, 100.0), 256)
        self.assertAlmostEqual(index.trust, 1 + 0.2 * (100 / 128 - 1))

    def test_one_token_predicted_is_checked(self) -> None:
        index = indexed(100, 40)
        index.counted((0.0, 0.0), 4)
        index.predicted(1, 4)  # one token
        index.counted((0.0, 10.0), 4)
        self.assertEqual((index.counter_checks, index.trust), (1, 0.8))

    def test_forgetting_the_blocks_keeps_the_fleet_cap(self) -> None:
        pool, (one, two) = fleet(1, 1)
        index = FleetIndex(max_entries=10, capacity=10)
        index.sent(one, [1, 2, 3])
        index.forget_blocks()
        index.sent(one, list(range(10, 20)))
        index.sent(two, [30])
        self.assertEqual(index.entries, 10)

    def test_a_media_payloads_other_values_count_by_their_first_64_characters(self) -> None:
        hasher = PrefixHasher(secret=SECRET)

        def name(number: int) -> str:
            body = {"messages": [{"role": "u", "content": [{"image_url": {"n": number}}]}]}
            return hasher.render(body, None)

        self.assertNotEqual(name(10 ** 63 + 1), name(10 ** 63 + 2))  # 64 digits
        self.assertEqual(name(10 ** 64 + 1), name(10 ** 64 + 2))  # 65: the last is not read

    def test_over_the_cap_the_largest_index_gives_way_down_to_nothing(self) -> None:
        pool, (one, two, three) = fleet(1, 1, 1)
        index = FleetIndex(max_entries=4, capacity=4)
        index.sent(one, [1, 2])
        index.sent(two, [3, 4])
        index.sent(three, [5, 6, 7, 8])
        self.assertEqual([index.match(b, chain) for b, chain in
                          ((one, [1, 2]), (two, [3, 4]), (three, [5, 6, 7, 8]))], [2, 2, 0])

    def test_hits_counted_with_queries_unchanged_are_no_restart(self) -> None:
        index = indexed(100, 40)
        index.counted((50.0, 500.0), 256)
        index.predicted(2, 256)
        index.counted((178.0, 500.0), 256)
        self.assertEqual((index.restarts, len(index), index.trust), (0, 40, 1.0))

    def test_a_block_is_named_by_64_bits(self) -> None:
        chain = PrefixHasher(secret=SECRET).chain("".join(chr(65 + n) * 256 for n in range(16)))
        self.assertEqual(len(chain), 16)
        self.assertLess(max(chain), 1 << 64)
        self.assertGreaterEqual(max(chain), 1 << 56)  # all 16 below: a chance of 2**-128
