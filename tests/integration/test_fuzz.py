"""
The raw-socket fuzz of ``bench/fuzz.py``, bounded for the suite: ~20 s of hostile
connections against the real ``twistd -n llmlb`` while well-behaved clients stream chat
completions through it; ``python -m bench.fuzz`` is the multi-minute run of the same code.

The seed is fresh each run and printed (and in any failure message); set
``TXLB_FUZZ_SEED`` to replay one.
"""

from __future__ import annotations

import os
import random
from typing import Any

from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase

from bench.fuzz import fuzz, problems, settled_status

from ..processes import TwistdProcess
from .test_integration import Fleet

DURATION = 20.0


class FuzzTests(TestCase):
    timeout = 120

    @defer.inlineCallbacks
    def test_hostile_traffic_costs_well_behaved_streams_nothing(self) -> Any:
        seed = int(os.environ.get("TXLB_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
        print(f"\nfuzz seed {seed} (replay with TXLB_FUZZ_SEED={seed})")
        fleet = Fleet(self, 2, tokens_per_second=200.0)
        lb = TwistdProcess("--backends", ",".join(fleet.keys), "--header-timeout", "2",
                           "--max-body", "1MiB")
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        yield defer.ensureDeferred(lb.started())
        report = yield defer.ensureDeferred(fuzz(reactor, lb.port, DURATION, seed,
                                                 hostile=12, streams=3))
        status = yield defer.ensureDeferred(settled_status(reactor, lb.port))
        found = problems(report, status, lb.process.poll() is None, lb.output(),
                         fleet.sims)
        print(report.summary())
        self.assertEqual(found, [], report.summary())
        self.assertGreater(sum(report.hostile.values()), 100, report.summary())
