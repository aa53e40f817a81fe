"""
The bound bench.classes measured: a batch flood does not raise the interactive class's p99
TTFT past it when classes are on.  Virtual time (a Clock), so the test is not timed.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from bench.classes import run
from bench.sim_engines import Params

#: 4,000 requests (20% interactive, 80% batch) at 110% of the fleet's full-batch capacity
FLOOD = Params(seed=1, requests=4000, load=1.1)
#: interactive p99 TTFT with classes under that flood, seconds (measured: 0.91 s; the
#: 20,000-request runs of bench/results/priority-classes.md give 1.1-1.2 s)
BOUND = 1.0


class BatchFloodTests(SynchronousTestCase):
    def test_interactive_p99_ttft_stays_under_the_bound_with_classes(self) -> None:
        with_classes = run(FLOOD, classes=True)
        self.assertLessEqual(with_classes.interactive.p99_ttft, BOUND)
        self.assertEqual(with_classes.interactive.refused, 0)
        # what it costs the batch class: slower, but every batch request still completes
        self.assertEqual(with_classes.batch.completed, with_classes.batch.sent)

    def test_without_classes_the_flood_raises_it_far_past_the_bound(self) -> None:
        """The workload is a real flood: one FIFO queue makes everyone wait."""
        without = run(FLOOD, classes=False)
        self.assertGreater(without.interactive.p99_ttft, 5 * BOUND)
