"""
The outlier rule's verdicts (:mod:`txlb._cluster.outlier`): a 5xx streak ejects unless half
the fleet is already out (and then warns once per streak), a 5xx the request provoked never
ejects, and the cool-down grows with each ejection up to ten times its base.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from txlb import BackendSpec, Pool
from txlb._cluster.backend import Backend
from txlb._cluster.outlier import OutlierRule, fleet_can_spare, judge_answer


class OutlierVerdictTests(SynchronousTestCase):
    """Mutants of ``_cluster/outlier`` that survived its full run (mutation-full/)."""

    def fleet(self, size: int) -> Pool:
        self.clock = Clock()
        return Pool([BackendSpec("127.0.0.1", 8002 + n) for n in range(size)], clock=self.clock)

    def streak(self, pool: Pool, backend: Backend, answers: int,
               rule: OutlierRule | None = None) -> list[str | None]:
        rule = rule or OutlierRule(consecutive_5xx=5, base_cooldown=30)
        return [judge_answer(rule, backend, 500, f"client{n % 2}", list(pool),
                             self.clock.seconds()) for n in range(answers)]

    def test_a_kept_backend_is_warned_about_once_per_streak(self) -> None:
        pool = self.fleet(2)
        first, second = list(pool)
        pool.mark_down(second, "refused")  # half the fleet is out: first must stay in
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        self.assertEqual(self.streak(pool, first, 9), [None] * 9)
        warned = [e for e in events if "stays in" in str(e.get("log_format", ""))]
        self.assertEqual(len(warned), 1)
        self.assertEqual(warned[0]["count"], 5)

    def test_a_5xx_the_request_provoked_never_ejects_even_after_a_streak(self) -> None:
        pool = self.fleet(2)
        first, second = list(pool)
        pool.mark_down(second, "refused")
        self.streak(pool, first, 5)  # a streak long enough, kept in while half was out
        pool.mark_up(second)
        verdict = judge_answer(OutlierRule(5, 30), first, 500, None, list(pool),
                               self.clock.seconds())
        self.assertIsNone(verdict)

    def test_up_to_half_the_fleet_may_be_out(self) -> None:
        pool = self.fleet(4)
        backends = list(pool)
        pool.mark_down(backends[0], "refused")
        self.assertTrue(fleet_can_spare(backends))  # a second of four may go
        pool.mark_down(backends[1], "refused")
        self.assertFalse(fleet_can_spare(backends))

    def test_the_cool_down_grows_to_ten_times_the_base_and_no_further(self) -> None:
        pool = self.fleet(2)
        first = list(pool)[0]
        cooldowns = []
        for _ in range(12):
            verdict = self.streak(pool, first, 5)[-1]
            assert verdict is not None
            cooldowns.append(verdict.rsplit(" ", 1)[-1])
            self.clock.advance(1000)  # past the cool-down: back in rotation
            self.assertTrue(first.eligible)
        self.assertEqual(cooldowns, [f"{30 * n}s" for n in range(1, 11)] + ["300s", "300s"])
