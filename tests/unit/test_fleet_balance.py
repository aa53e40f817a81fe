"""
The fleet-balance simulation (``python -m bench.policies --replicas``): what it models of
replicas sharing in-flight counts, and the qualitative result bench/results/scale-out.md
reports, pinned on small seeded runs.  Virtual time (a Clock): nothing here is timed.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr
from pathlib import Path

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from bench import policies
from bench.fleet_balance import (
    FleetCounts,
    FleetParams,
    ReplicaCounts,
    Variant,
    expected_unread,
    make_fleet_workload,
    run_fleet,
)
from bench.sections import replace_section, section

#: 3,000 requests at 90 % of the fleet's full-batch capacity, 16 engines
SMALL = FleetParams(seed=3, requests=3000, load=0.9)


class ReplicaCountsTests(SynchronousTestCase):
    """What a replica's pool reads as a backend's in-flight count."""

    def fleet(self, delay: float | None) -> tuple[Clock, ReplicaCounts, ReplicaCounts]:
        clock = Clock()
        fleet = FleetCounts(2)
        a = ReplicaCounts(fleet, 0, clock, delay)
        b = ReplicaCounts(fleet, 1, clock, delay, phase=0.0)
        for view in (a, b):
            view.register("e1")
            view.register("e2")
        clock.advance(0)  # the first reads
        return clock, a, b

    def test_independent_replicas_see_only_their_own_requests(self) -> None:
        _, a, b = self.fleet(None)
        a.take("e1")
        a.take("e1")
        self.assertEqual(list(a.totals()), [2, 0])
        self.assertEqual(list(b.totals()), [0, 0])
        b.take("e1")  # b believed e1 was idle: it held two requests b had not seen
        self.assertEqual(a.fleet.overshoot, [0, 0, 2])

    def test_a_zero_delay_reads_the_others_at_every_choice(self) -> None:
        _, a, b = self.fleet(0.0)
        a.take("e1")
        self.assertEqual(list(b.totals()), [1, 0])
        b.take("e2")
        a.give_back("e1")
        self.assertEqual(list(b.totals()), [0, 1])
        self.assertEqual(a.fleet.overshoot, [0, 0])

    def test_a_delayed_view_sees_the_others_at_its_next_read(self) -> None:
        clock, a, b = self.fleet(0.1)
        a.take("e1")
        self.assertEqual(list(b.totals()), [0, 0], "seen before b's next read")
        self.assertEqual(b.total("e1"), 0)
        clock.advance(0.1)
        self.assertEqual(list(b.totals()), [1, 0])
        self.assertEqual(b.mine("e1"), 0)
        self.assertEqual(a.mine("e1"), 1)

    def test_the_unread_picks_bound_the_overshoot(self) -> None:
        clock, a, b = self.fleet(0.1)
        a.take("e1")
        a.take("e1")
        b.take("e1")  # b missed 2: both are a's picks since b's last read
        self.assertEqual(a.fleet.unread[-1], 2)
        self.assertEqual(a.fleet.overshoot[-1], 2)
        clock.advance(0.1)
        b.take("e1")  # read meanwhile: nothing unread, nothing missed
        self.assertEqual((a.fleet.unread[-1], a.fleet.overshoot[-1]), (0, 0))
        self.assertEqual(a.fleet.beyond_bound, 0)


class FleetBalanceTests(SynchronousTestCase):
    """The qualitative result of bench/results/scale-out.md, on a small seeded run."""

    def test_shared_counts_balance_the_fleet_better_than_independent_replicas(self) -> None:
        for traffic in ("skewed", "bursts"):
            params = FleetParams(seed=SMALL.seed, requests=SMALL.requests, load=SMALL.load,
                                 traffic=traffic)
            alone = run_fleet(params, Variant(8, False))
            shared = run_fleet(params, Variant(8, True, 0.01))
            single = run_fleet(params, Variant(1, False))
            self.assertLess(shared.imbalance, alone.imbalance - 0.03, traffic)
            self.assertLessEqual(shared.over_batch, alone.over_batch, traffic)
            self.assertLess(shared.overshoot_max, alone.overshoot_max, traffic)
            # and shared counts come close to one balancer
            self.assertLess(shared.imbalance, single.imbalance + 0.02, traffic)
            self.assertEqual(alone.completed + shared.completed, 2 * params.requests)

    def test_a_zero_delay_is_as_good_as_one_balancer(self) -> None:
        exact = run_fleet(SMALL, Variant(4, True, 0.0))
        single = run_fleet(SMALL, Variant(1, False))
        self.assertEqual(exact.overshoot_max, 0)
        self.assertLess(abs(exact.imbalance - single.imbalance), 0.01)

    def test_the_overshoot_stays_within_the_unread_picks(self) -> None:
        for n in (2, 8):
            result = run_fleet(SMALL, Variant(n, True, 0.1))
            self.assertEqual(result.beyond_bound, 0)
            self.assertGreater(result.overshoot_max, 0, "a 100 ms view does miss picks")
            predicted = expected_unread(SMALL, Variant(n, True, 0.1), result.rate)
            self.assertLess(abs(result.unread_mean - predicted), 0.15 * predicted)

    def test_the_workload_is_the_same_for_every_replica_count_but_the_replicas(self) -> None:
        two = make_fleet_workload(SMALL, 2)
        eight = make_fleet_workload(SMALL, 8)
        self.assertEqual([a[:3] for a in two.arrivals], [a[:3] for a in eight.arrivals])
        share = sum(1 for a in eight.arrivals if a[3] == 0) / len(eight.arrivals)
        self.assertLess(abs(share - SMALL.skew), 0.03)
        self.assertEqual(make_fleet_workload(SMALL, 8), eight)


class CommandLineTests(SynchronousTestCase):
    def refused(self, *argv: str) -> str:
        err = io.StringIO()
        with redirect_stderr(err), self.assertRaises(SystemExit) as raised:
            policies.main(["--replicas", *argv])
        self.assertEqual(raised.exception.code, 2)
        return err.getvalue()

    def test_bad_values_are_refused_by_name(self) -> None:
        self.assertIn("--replicas", self.refused("1"))
        self.assertIn("--replicas", self.refused("two"))
        self.assertIn("--publish-delay", self.refused("2", "--publish-delay", "-1"))
        self.assertIn("--publish-delay", self.refused("2", "--publish-delay", "nan"))
        self.assertIn("--loads", self.refused("2", "--loads", "0"))
        self.assertIn("--traffic", self.refused("2", "--traffic", "flood"))

    def test_a_run_writes_its_section_of_the_page(self) -> None:
        out = Path(self.mktemp())
        with redirect_stderr(io.StringIO()):
            code = policies.main(["--replicas", "2", "--publish-delay", "0.01",
                                  "--requests", "300", "--loads", "0.5", "--jobs", "1",
                                  "--traffic", "skewed", "--out", str(out)])
        self.assertEqual(code, 0)
        text = section(out / "scale-out.md", "balance")
        assert text is not None
        self.assertIn("| 2 | shared, delay 10 ms |", text)
        self.assertIn("| 1 | single balancer |", text)


class SectionsTests(SynchronousTestCase):
    def test_each_bench_rewrites_only_its_own_section(self) -> None:
        page = Path(self.mktemp())
        replace_section(page, "one", "first", "Title")
        replace_section(page, "two", "second", "Title")
        replace_section(page, "one", "first again", "Title")
        self.assertEqual(section(page, "one"), "first again")
        self.assertEqual(section(page, "two"), "second")
        self.assertTrue(page.read_text().startswith("# Title\n"))
        self.assertIsNone(section(page, "three"))


class FourStreamsTests(SynchronousTestCase):
    """Replica A holds 4 long streams, then replica B takes 4: where do B's go?"""

    def engines_taken(self, delay: float | None) -> tuple[set[str], set[str]]:
        import random

        from txlb import BackendSpec, Pool
        from txlb._scheduling.policies.registry import make_policy
        from txlb._scheduling.router import Router

        clock = Clock()
        fleet = FleetCounts(2)
        specs = tuple(BackendSpec("10.0.0.1", 8000 + n) for n in range(8))
        routers = []
        for replica in range(2):
            pool = Pool(specs, clock=clock, shared=ReplicaCounts(fleet, replica, clock, delay))
            routers.append(Router(pool, make_policy("least-conn", clock, random.Random(1)),
                                  clock))
        taken: list[set[str]] = []
        for router in routers:
            keys = set()
            for _ in range(4):
                leases: list[object] = []
                router.acquire().addCallback(leases.append)
                keys.add(leases[0].backend.key)  # type: ignore[attr-defined]
            taken.append(keys)
        return taken[0], taken[1]

    def test_with_shared_counts_the_eight_land_on_eight_engines(self) -> None:
        a, b = self.engines_taken(0.0)
        self.assertEqual(len(a | b), 8)

    def test_independent_replicas_reuse_the_same_four(self) -> None:
        a, b = self.engines_taken(None)
        self.assertEqual(a, b)
