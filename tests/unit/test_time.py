"""
One idiom for time: whatever waits or stamps takes an injected ``IReactorTime`` and asks it
``seconds()`` -- never a bare callable, never the wall clock -- so a test's ``Clock`` drives
all of it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from treq.testing import StubTreq
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from txlb import BackendSpec, LoadBalancer
from txlb._cluster.local_store import TokenBuckets
from txlb._cluster.pool import Pool

from ..helpers import FakeUpstream

TXLB = Path(__file__).resolve().parents[2] / "txlb"

#: Modules whose ``clock`` is annotated otherwise, and why.
OTHER_CLOCKS = {
    "testing/filler.py": "a typing Protocol of IReactorTime's seconds/callLater, so the public "
                         "testing package type-checks without the zope plugin",
}


def _clock_annotations() -> list[tuple[str, int, str]]:
    """Every parameter or attribute named ``clock`` in txlb/, with its annotation."""
    found = []
    for path in sorted(TXLB.rglob("*.py")):
        module = path.relative_to(TXLB).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.arg == "clock":
                        found.append((module, node.lineno, ast.unparse(arg.annotation)
                                      if arg.annotation else ""))
            elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                  and node.target.id == "clock"):
                found.append((module, node.lineno, ast.unparse(node.annotation)))
    return found


class OneIdiomTests(SynchronousTestCase):
    def test_every_clock_is_an_ireactortime(self) -> None:
        wrong = [(module, line, annotation)
                 for module, line, annotation in _clock_annotations()
                 if "IReactorTime" not in annotation and module not in OTHER_CLOCKS]
        self.assertEqual(wrong, [])

    def test_the_exceptions_are_still_exceptions(self) -> None:
        """An allowance nobody needs any more must go, or it would excuse the next one."""
        other_modules = {module for module, _, annotation in _clock_annotations()
                            if "IReactorTime" not in annotation}
        self.assertEqual(set(OTHER_CLOCKS) - other_modules, set())


class InjectedClockTests(SynchronousTestCase):
    def test_the_pool_measures_slow_start_on_its_clock(self) -> None:
        clock = Clock()
        pool = Pool((BackendSpec("127.0.0.1", 8002),), clock=clock, slow_start=10)
        backend = pool.get("127.0.0.1:8002")
        assert backend is not None
        pool.mark_down(backend, "test")
        clock.advance(100)
        pool.mark_up(backend)
        self.assertEqual(backend.slow_start.up_since, 100)
        clock.advance(5)
        self.assertEqual(backend.slow_start.ramp, 0.5)

    def test_a_retuned_slow_start_continues_the_ramp_at_the_new_length(self) -> None:
        """A reloaded ``--slow-start`` reaches every backend: a ramp under way stretches."""
        clock = Clock()
        pool = Pool((BackendSpec("127.0.0.1", 8002),), clock=clock, slow_start=10)
        backend = pool.get("127.0.0.1:8002")
        assert backend is not None
        pool.mark_down(backend, "test")
        pool.mark_up(backend)
        clock.advance(5)
        self.assertEqual((backend.slow_start.length, backend.slow_start.ramp), (10, 0.5))
        pool.retune(pool.outliers, 20)
        self.assertEqual((backend.slow_start.length, backend.slow_start.ramp), (20, 0.25))

    def test_a_pool_without_a_clock_stands_at_zero(self) -> None:
        pool = Pool((BackendSpec("127.0.0.1", 8002),))
        self.assertEqual(pool.clock.seconds(), 0)

    def test_token_buckets_refill_on_their_clock(self) -> None:
        clock = Clock()
        buckets = TokenBuckets(rate=2, burst=1, clock=clock)
        self.assertEqual(buckets.take("k"), 0)
        self.assertEqual(buckets.take("k"), 0.5)
        clock.advance(0.5)
        self.assertEqual(buckets.take("k"), 0)

    def test_the_admin_uptime_is_on_the_balancers_clock(self) -> None:
        clock = Clock()
        clock.advance(1000)
        lb = LoadBalancer(["127.0.0.1:8002"], reactor=clock, agent=FakeUpstream(),
                          probe_agent=FakeUpstream(), log_file="none")
        admin = StubTreq(lb.admin_resource())
        clock.advance(42)
        response = self.successResultOf(admin.get("http://127.0.0.1/status"))
        body = self.successResultOf(response.json())
        self.assertEqual(body["uptime_s"], 42)
