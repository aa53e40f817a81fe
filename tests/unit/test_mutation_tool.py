"""bench.mutation's test selection: which tests run first against a mutant."""

from __future__ import annotations

from types import SimpleNamespace

from twisted.trial.unittest import SynchronousTestCase

from bench.mutation import MODULE_TESTS, tests_for


def item(first: int, last: int) -> object:
    spec = SimpleNamespace(start_pos=(first, 4), end_pos=(last, 20))
    return SimpleNamespace(mutations=[spec])


class SelectionTests(SynchronousTestCase):
    module = "_scheduling/router"

    def test_the_tests_that_ran_any_mutated_line(self) -> None:
        coverage = {10: frozenset({"tests.unit.test_a.A.test_one"}),
                    11: frozenset({"tests.unit.test_b.B.test_two"}),
                    12: frozenset({"tests.unit.test_c.C.test_three"})}
        self.assertEqual(tests_for(item(10, 11), self.module, coverage),
                         ("tests.unit.test_a.A.test_one", "tests.unit.test_b.B.test_two"))

    def test_every_test_of_the_module_when_no_test_ran_the_line(self) -> None:
        """A line reached only from setUp (no test context) must not go untested."""
        coverage = {10: frozenset({"tests.unit.test_a.A.test_one"})}
        self.assertEqual(tests_for(item(30, 30), self.module, coverage),
                         MODULE_TESTS[self.module])
