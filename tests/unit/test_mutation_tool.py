"""bench.mutation's test selection: which tests run first against a mutant."""

from __future__ import annotations

from types import SimpleNamespace

from twisted.trial.unittest import SynchronousTestCase

from bench.mutation import MODULE_TESTS, is_equivalent, tests_for


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


class EquivalenceTests(SynchronousTestCase):
    """An equivalent mutant is left out of the kill rate: the match must be exact."""

    diff = ("--- a/txlb/_cluster/backend.py\n+++ b/txlb/_cluster/backend.py\n"
            "@@ -87,2 +87,2 @@\n"
            "-    slow_start: float = 0.0\n+    slow_start: float = 1.0\n")

    def test_an_entry_matches_its_module_operator_and_mutated_line(self) -> None:
        self.assertTrue(is_equivalent("_cluster/backend", "NumberReplacer", self.diff))
        self.assertFalse(is_equivalent("_cluster/pool", "NumberReplacer", self.diff))
        self.assertFalse(is_equivalent("_cluster/backend", "AddNot", self.diff))

    def test_the_line_the_mutant_removed_does_not_match(self) -> None:
        removed_only = self.diff.replace("+    slow_start: float = 1.0\n", "")
        self.assertFalse(is_equivalent("_cluster/backend", "NumberReplacer", removed_only))
