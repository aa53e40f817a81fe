"""
Each policy on its own: least-connections' choices, the contract every built-in policy
keeps (:class:`PolicyContract`, one test class per policy module -- a new policy's test
class can inherit it too), and the choices of p2c, peak-EWMA and queue-depth at their edges
(:class:`PolicyChoiceTests`).  Their other behaviour is tested in test_scheduling.
"""

from __future__ import annotations

import json
import math
import random
import weakref
from collections.abc import Sequence

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from txlb import (
    BackendSpec,
    IPolicy,
    LeastConnections,
    Policy,
    Pool,
    RequestOutcome,
    RoutingRequest,
)
from txlb._cluster.backend import Backend
from txlb._cluster.backend_engine import EngineReading
from txlb._scheduling.policies import (
    IPolicyFactory,
    least_conn,
    p2c,
    peak_ewma,
    queue_depth,
    round_robin,
    weighted_random,
)
from txlb._scheduling.policies.cache_aware import CacheAware
from txlb._scheduling.policies.registry import find_factory


def pool_of(*weights: int) -> Pool:
    return Pool(tuple(BackendSpec("127.0.0.1", 9000 + n, weight=w) for n, w in enumerate(weights)))


class LeastConnectionsTests(SynchronousTestCase):
    def test_fewest_in_flight_wins(self) -> None:
        pool = pool_of(1, 1, 1)
        a, b, c = list(pool)
        for backend, active in ((a, 3), (b, 1), (c, 2)):
            backend.counts.counted(active)
        self.assertIs(LeastConnections().choose([a, b, c]), b)

    def test_ties_rotate(self) -> None:
        backends = list(pool_of(1, 1, 1, 1))
        policy = LeastConnections()
        chosen = [policy.choose(backends).spec.port for _ in range(8)]
        self.assertEqual(chosen, [9000, 9001, 9002, 9003] * 2)

    def test_rotation_skips_busier_backends(self) -> None:
        backends = list(pool_of(1, 1, 1))
        backends[1].counts.counted(1)
        policy = LeastConnections()
        self.assertEqual([policy.choose(backends).spec.port for _ in range(4)],
                         [9000, 9002, 9000, 9002])

    def test_weight_divides_in_flight(self) -> None:
        heavy, light = list(pool_of(4, 1))
        heavy.counts.counted(3)
        light.counts.counted(1)  # 0.75 < 1
        self.assertIs(LeastConnections().choose([heavy, light]), heavy)

    def test_ipv6_key_is_bracketed(self) -> None:
        spec = BackendSpec("::1", 8002)
        self.assertEqual(spec.key, "[::1]:8002")


class PolicyContract:
    """What every policy module must give: set ``module`` in a SynchronousTestCase."""

    module: object
    #: learns from what it observes (so an outcome may change its later choices)
    learns = False
    needs_engine_metrics = False

    def make(self) -> IPolicy:
        factory: IPolicyFactory = self.module.factory  # type: ignore[attr-defined]
        return factory(Clock(), random.Random(3))

    def test_its_factory_is_registered_under_its_name(self) -> None:
        factory = self.module.factory  # type: ignore[attr-defined]
        case: SynchronousTestCase = self  # type: ignore[assignment]
        case.assertTrue(verifyObject(IPolicyFactory, factory))
        case.assertIs(find_factory(factory.name), factory)
        policy = self.make()
        case.assertTrue(verifyObject(IPolicy, policy))
        case.assertEqual(policy.name, factory.name)
        case.assertEqual(policy.needs_engine_metrics, self.needs_engine_metrics)
        case.assertTrue(factory.summary)

    def test_chooses_among_the_candidates(self) -> None:
        case: SynchronousTestCase = self  # type: ignore[assignment]
        backends = list(pool_of(1, 2, 1))
        policy = self.make()
        for _ in range(20):
            case.assertIn(policy.choose(backends), backends)
        case.assertIs(policy.choose(backends[1:2]), backends[1])

    def test_the_routing_request_changes_nothing(self) -> None:
        case: SynchronousTestCase = self  # type: ignore[assignment]
        backends = list(pool_of(1, 2, 1))
        plain, given = self.make(), self.make()
        request = RoutingRequest(model="m", session="s", client="ip:1", body=b"{}", json={})
        case.assertEqual([plain.choose(backends).key for _ in range(20)],
                         [given.choose(backends, request).key for _ in range(20)])

    def test_observe_and_describe(self) -> None:
        case: SynchronousTestCase = self  # type: ignore[assignment]
        backends = list(pool_of(1, 1))
        told, untold = self.make(), self.make()
        outcome = RequestOutcome(backend=backends[0].key, status=200, answered=True,
                                 ttfb=5.0, duration=9.0)
        told.observe(backends[0], outcome)
        same = ([told.choose(backends).key for _ in range(10)]
                == [untold.choose(backends).key for _ in range(10)])
        case.assertEqual(same, not self.learns)
        case.assertEqual(dict(untold.describe(backends[0])), dict(untold.describe(backends[1])))


class LeastConnectionsContractTests(PolicyContract, SynchronousTestCase):
    module = least_conn


class RoundRobinContractTests(PolicyContract, SynchronousTestCase):
    module = round_robin


class WeightedRandomContractTests(PolicyContract, SynchronousTestCase):
    module = weighted_random


class PowerOfTwoChoicesContractTests(PolicyContract, SynchronousTestCase):
    module = p2c


class PeakEwmaContractTests(PolicyContract, SynchronousTestCase):
    module = peak_ewma
    learns = True

    def test_describe_shows_the_estimate(self) -> None:
        (backend,) = list(pool_of(1))
        policy = self.make()
        self.assertEqual(policy.describe(backend), {"latency_peak_ewma_s": None})
        policy.observe(backend, RequestOutcome(backend=backend.key, status=200,
                                               answered=True, ttfb=0.123456, duration=1.0))
        self.assertEqual(policy.describe(backend), {"latency_peak_ewma_s": 0.1235})


    def test_the_decay_counts_from_the_last_sample(self) -> None:
        clock = Clock()
        clock.advance(100)  # not at 0: elapsed is now - then, whatever the epoch
        policy = peak_ewma.PeakEwmaLatency(clock, decay=10)
        (backend,) = list(pool_of(1))
        policy.sample(backend, 1.0)
        clock.advance(10)
        policy.sample(backend, 0.0)
        self.assertAlmostEqual(policy.estimate(backend), math.exp(-1))  # type: ignore


    def test_the_default_decay_is_ten_seconds(self) -> None:
        clock = Clock()
        policy = peak_ewma.factory(clock, random.Random())  # as --policy latency makes it
        (backend,) = list(pool_of(1))
        policy.observe(backend, RequestOutcome(backend.key, 200, True, ttfb=1.0, duration=1.0))
        clock.advance(10)
        policy.observe(backend, RequestOutcome(backend.key, 200, True, ttfb=0.0, duration=1.0))
        self.assertAlmostEqual(policy.describe(backend)["latency_peak_ewma_s"],  # type: ignore
                               round(math.exp(-1), 4))

    def test_a_short_or_backward_step_of_the_clock(self) -> None:
        clock = Clock()
        clock.advance(100)
        policy = peak_ewma.PeakEwmaLatency(clock, decay=0.5)  # a decay under a second works
        (backend,) = list(pool_of(1))
        policy.sample(backend, 1.0)
        clock.advance(0.25)
        policy.sample(backend, 0.0)
        self.assertAlmostEqual(policy.estimate(backend), math.exp(-0.5))  # type: ignore
        clock.rightNow -= 5  # a clock stepped back: no time passed, the estimate holds
        policy.sample(backend, 0.0)
        self.assertAlmostEqual(policy.estimate(backend), math.exp(-0.5))  # type: ignore

    def test_the_cost_is_latency_times_in_flight_plus_one(self) -> None:
        a, b = list(pool_of(1, 1))
        policy = peak_ewma.PeakEwmaLatency(Clock())
        policy.sample(a, 0.1)
        policy.sample(b, 0.3)
        a.counts.counted(1)  # 0.1 * 2 < 0.3 * 1
        self.assertEqual({policy.choose([a, b]).key for _ in range(3)}, {a.key})
        a.counts.counted(2)  # 0.1 * 3 = 0.3 * 1: a tie, which the fewer in flight wins
        self.assertEqual({policy.choose([a, b]).key for _ in range(3)}, {b.key})
        a.counts.counted(3)  # 0.1 * 4 > 0.3 * 1
        self.assertEqual({policy.choose([a, b]).key for _ in range(3)}, {b.key})

    def test_a_zero_latency_sample(self) -> None:
        a, b = list(pool_of(1, 1))
        policy = peak_ewma.PeakEwmaLatency(Clock())
        policy.sample(a, 0.0)  # an answer at once (the same clock tick): cost 0
        policy.sample(b, 0.2)
        self.assertIs(policy.choose([a, b]), a)

    def test_a_lower_cost_is_not_a_tie(self) -> None:
        a, b = list(pool_of(1, 1))
        policy = peak_ewma.PeakEwmaLatency(Clock())
        policy.sample(a, 0.1)
        policy.sample(b, 0.15)
        self.assertEqual({policy.choose([a, b]).key for _ in range(4)}, {a.key})


class QueueDepthContractTests(PolicyContract, SynchronousTestCase):
    module = queue_depth
    needs_engine_metrics = True

    def test_the_engine_queue_is_divided_by_weight(self) -> None:
        pool = pool_of(2, 1)
        heavy, light = list(pool)
        pool.set_engine_depth(heavy, running=4, waiting=0)  # 4 / 2 < 3 / 1
        pool.set_engine_depth(light, running=3, waiting=0)
        self.assertIs(self.make().choose([heavy, light]), heavy)

    def test_unscraped_in_flight_is_divided_by_weight(self) -> None:
        heavy, light = list(pool_of(4, 1))
        heavy.counts.counted(3)
        light.counts.counted(1)  # 0.75 < 1
        self.assertIs(self.make().choose([heavy, light]), heavy)

    def test_more_ended_than_the_engine_held_counts_as_empty_not_below(self) -> None:
        pool = pool_of(1, 1)
        drained, empty = list(pool)
        for _ in range(3):
            drained.counts.took_slot()  # started before the scrape ...
        pool.set_engine_depth(drained, running=1, waiting=0)
        pool.set_engine_depth(empty, running=0, waiting=0)
        for _ in range(3):
            drained.counts.gave_slot()  # ... ended here since: 1 - 3 -> 0, not -2
        self.assertEqual(drained.counts.finished_since_scrape, 3)
        policy = self.make()
        self.assertEqual({policy.choose([drained, empty]).key for _ in range(2)},
                         {drained.key, empty.key})  # a tie: they take turns


class PolicyChoiceTests(SynchronousTestCase):
    def backends(self, *weights: int) -> list[Backend]:
        return [Backend(BackendSpec("127.0.0.1", 8002 + n, weight=w))
                for n, w in enumerate(weights)]

    def test_p2c_gives_an_idle_heavier_backend_its_share(self) -> None:
        import random

        from txlb._scheduling.policies.p2c import PowerOfTwoChoices

        policy = PowerOfTwoChoices(random.Random(4))
        heavy, light = self.backends(3, 1)
        picks = [policy.choose([heavy, light]) for _ in range(400)]
        self.assertGreater(picks.count(heavy), 250)  # ties go to the first drawn (3:1)

    def test_latency_prefers_the_heavier_of_equal_backends(self) -> None:
        from txlb._scheduling.policies.peak_ewma import PeakEwmaLatency

        policy = PeakEwmaLatency(Clock())
        light, heavy = self.backends(1, 2)
        for backend in (light, heavy):
            policy.sample(backend, 0.5)
            backend.counts.counted(1)
        self.assertIs(policy.choose([light, heavy]), heavy)

    def test_latency_without_decay_takes_the_last_sample(self) -> None:
        from txlb._scheduling.policies.peak_ewma import PeakEwmaLatency

        policy = PeakEwmaLatency(Clock(), decay=0)
        (backend,) = self.backends(1)
        policy.sample(backend, 2.0)
        policy.sample(backend, 1.0)
        self.assertEqual(policy.estimate(backend), 1.0)

    def test_every_policy_provides_the_interface(self) -> None:
        from zope.interface.verify import verifyObject

        from txlb._scheduling.policies import IPolicy
        from txlb._scheduling.policies.registry import BUILT_IN, make_policy

        for name in (factory.name for factory in BUILT_IN):
            self.assertTrue(verifyObject(IPolicy, make_policy(name, Clock(), None)), name)

    def test_queue_depth_prefers_the_emptier_engine(self) -> None:
        from txlb._scheduling.policies.registry import make_policy

        policy = make_policy("queue-depth", Clock(), None)
        empty, busy = (Backend(BackendSpec("127.0.0.1", p),
                               engine=EngineReading(depth=depth))
                       for p, depth in ((8002, 0.0), (8003, 0.5)))
        self.assertEqual({policy.choose([empty, busy]).key for _ in range(4)}, {empty.key})

    def test_p2c_with_one_candidate(self) -> None:
        import random

        from txlb._scheduling.policies.p2c import PowerOfTwoChoices

        (only,) = [Backend(BackendSpec("127.0.0.1", 8002))]
        self.assertIs(PowerOfTwoChoices(random.Random(1)).choose([only]), only)


class FewestErrors(Policy):
    """docs/scheduling.md's example third-party policy, as a policy author writes it."""

    name = "fewest-errors"

    def __init__(self) -> None:
        self._errors: weakref.WeakKeyDictionary[Backend, float] = weakref.WeakKeyDictionary()

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest | None = None) -> Backend:
        return min(candidates, key=lambda b: (b.active + self._errors.get(b, 0))
                   / b.effective_weight)

    def observe(self, backend: Backend, outcome: RequestOutcome) -> None:
        errors = self._errors.get(backend, 0.0) * 0.9
        self._errors[backend] = errors + (1 if outcome.status >= 500 else 0)


class DocumentedBackendReadsTests(SynchronousTestCase):
    """
    What docs/scheduling.md promises a third-party policy can read from a backend --
    ``active``, ``effective_weight``, ``key``, ``models``, ``engine_depth``,
    ``kv_cache_usage``, ``responses`` -- reads as the value itself, not something to call.
    """

    def test_each_documented_name_reads_as_its_value(self) -> None:
        pool = pool_of(1, 1)
        busy, idle = list(pool)
        busy.counts.counted(3)
        pool.set_engine_depth(idle, 2, 1, 0.25)
        pool.record_result(busy, 503, 0.1, None)
        pool.record_result(idle, 200, 0.1, None)
        self.assertEqual((busy.active, idle.active), (3, 0))
        self.assertEqual((busy.engine_depth, idle.engine_depth), (None, 3.0))
        self.assertEqual((busy.kv_cache_usage, idle.kv_cache_usage), (None, 0.25))
        self.assertEqual((busy.responses, idle.responses), ({"5xx": 1}, {"2xx": 1}))
        self.assertEqual((idle.key, idle.models, idle.effective_weight),
                         ("127.0.0.1:9001", None, 1.0))

    def test_the_documented_example_policy_runs(self) -> None:
        pool = pool_of(1, 1)
        a, b = list(pool)
        policy = FewestErrors()
        a.counts.counted(1)
        self.assertIs(policy.choose([a, b]), b)  # fewer in flight
        for _ in range(3):
            policy.observe(b, RequestOutcome(backend=b.key, status=503, answered=True,
                                             ttfb=0.1, duration=0.1))
        self.assertIs(policy.choose([a, b]), a)  # its 5xx answers count as load


class CacheAwareCountersTests(SynchronousTestCase):
    """
    ``--policy cache-aware`` with answers that report no cached tokens checks its index
    against the engine's scraped prefix-cache counters: an engine that counts no hits where
    hits were predicted has evicted what the index lists, and loses trust.
    """

    def test_hits_the_engine_never_counted_lower_the_trust(self) -> None:
        pool = pool_of(1, 1)
        backends = list(pool)
        policy = CacheAware(secret=b"k" * 32)
        words = "Tenant 20 rules: answer about account 158380. "
        prompt = (words * 80)[:3200]

        def chat(question: str) -> RoutingRequest:
            body = {"model": "m", "messages": [{"role": "system", "content": prompt},
                                               {"role": "user", "content": question}]}
            return RoutingRequest(model="m", body=json.dumps(body).encode(), json=body)

        home = policy.choose(backends, chat("0"))
        counters = (0.0, 0.0)
        pool.set_engine_depth(home, 0, 0, None, counters)
        for n in range(8):
            self.assertIs(policy.choose(backends, chat(f"{n + 1}")), home)
            counters = (counters[0], counters[1] + 820)  # queried, never a hit
            pool.set_engine_depth(home, 0, 0, None, counters)
        facts = dict(policy.describe(home)["prefix_cache"])  # type: ignore[call-overload]
        self.assertEqual(facts["counter_checks"], 7)
        self.assertLess(facts["trust"], 0.3)
