"""
The cache-aware policy's view of each engine's cache (:mod:`txlb._scheduling.prefix_index`):
what one answer's report, or the engine's hit counters, do to a backend's index (its trust,
its capacity, evictions and restarts), the fleet-wide cap on entries, and the index's
constants and edges as ``/__lb_status`` and the choices show them.

Written for the survivors of ``_scheduling/prefix_index``'s full mutation run
(bench/results/mutation.md), each pinned by the behaviour a user relies on.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from txlb._scheduling.prefix import PrefixHasher
from txlb._scheduling.prefix_index import BackendIndex, FleetIndex

from .test_cache_aware_choice import SECRET, fleet


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
