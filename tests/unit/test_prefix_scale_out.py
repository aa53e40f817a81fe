"""
The prefix bench's fleet index shared through a store (``python -m bench.prefix
--scale-out``): a replica's lookups see the others' sends from its copy's next refresh on,
and sharing an index pays off only when the replicas hash prompts alike.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from bench.prefix import virtual
from bench.prefix.scale_out import label, scenarios
from bench.prefix.synced_index import SharedIndex, StaleView
from bench.prefix.workloads import Options
from txlb import BackendSpec, Pool


class StaleViewTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.shared = SharedIndex(self.clock, 10_000, 1_000)
        self.a = StaleView(self.shared, 0)
        self.b = StaleView(self.shared, 1)
        self.backend = next(iter(Pool((BackendSpec("10.0.0.1", 8000),))))

    def test_own_sends_are_seen_at_once_the_others_at_the_next_refresh(self) -> None:
        self.clock.advance(1)
        self.a.sent(self.backend, [1, 2, 3])
        self.assertEqual(self.a.match(self.backend, [1, 2, 3, 4]), 3)
        self.assertEqual(self.b.match(self.backend, [1, 2, 3, 4]), 0)
        self.clock.advance(0.5)
        self.b.refresh()
        self.assertEqual(self.b.match(self.backend, [1, 2, 3, 4]), 3)

    def test_a_copy_sees_the_blocks_listed_before_its_refresh_only(self) -> None:
        self.a.sent(self.backend, [1, 2])
        self.clock.advance(1)
        self.b.refresh()
        self.clock.advance(1)
        self.a.sent(self.backend, [1, 2, 3])  # block 3 is new since b's refresh
        self.assertEqual(self.b.match(self.backend, [1, 2, 3]), 2)
        self.assertEqual(self.a.match(self.backend, [1, 2, 3]), 3)


class ScaleOutRunTests(SynchronousTestCase):
    def test_a_copy_refreshed_every_second_keeps_the_shared_index_hit_rate(self) -> None:
        """tenants, 4 engines, 2 replicas, 600 requests: the stale copy wins over own indexes."""
        options = Options(seed=1, requests=600, burst=32, tenants=24, active=32)

        def run(**how: object) -> virtual.VirtualResult:
            return virtual.run(virtual.Scenario(
                "tenants", engines=4, requests=600, replicas=2, options=options,
                shared_counts=True, **how), "cache-aware")  # type: ignore[arg-type]

        own, stale, one = run(), run(index_refresh=1.0), run(shared_index=True)
        self.assertGreater(stale.hit_rate, own.hit_rate + 0.03)
        self.assertGreater(stale.hit_rate, one.hit_rate - 0.03)
        self.assertEqual(label(stale), "shared counts, index every 1000 ms")

    def test_every_variant_is_run_once_per_replica_count(self) -> None:
        jobs = scenarios(["tenants"], 8, 100, 0.8, 1, [2, 4], [0.1, 1.0])
        labels = [(s.replicas, label(_fake(s, p))) for s, p in jobs]
        self.assertEqual(len(labels), len(set(labels)))
        self.assertEqual(len(jobs), 1 + 2 * (4 + 2))  # 4 variants + 2 refreshes


def _fake(scenario: virtual.Scenario, policy: str) -> virtual.VirtualResult:
    return virtual.VirtualResult(
        workload=scenario.workload, policy=policy, engines=scenario.engines,
        replicas=scenario.replicas, shared_index=scenario.shared_index,
        shared_counts=scenario.shared_counts, requests=0, refused=0, hit_rate=0.0,
        ttft_p50=0.0, ttft_p99=0.0, ttft_mean=0.0, rps=0.0, output_tps=0.0,
        max_in_flight=0, sim_seconds=0.0, wall_seconds=0.0,
        index_refresh=scenario.index_refresh)
