"""
Which backend ``--policy cache-aware`` (:mod:`txlb._scheduling.policies.cache_aware`) sends a
prompt to, as the gain of its match, the room each engine's cache has and the load decide,
and the bound on the predictions it keeps until their answers come.

Written for the survivors of the policy's full mutation run (bench/results/mutation.md),
each pinned by the behaviour a user relies on.  :func:`fleet` and :data:`SECRET` serve
tests.unit.test_prefix_index too.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from txlb import BackendSpec, Pool, RequestOutcome, RoutingRequest
from txlb._cluster.backend import Backend
from txlb._cluster.slots import Lease
from txlb._scheduling.policies import cache_aware
from txlb._scheduling.policies.cache_aware import CacheAware

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


