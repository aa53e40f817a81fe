"""bench.mutation's own logic: which tests run first against a mutant, equivalence, replay."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from twisted.trial.unittest import SynchronousTestCase

import bench.mutation
from bench.mutation import (
    MODULE_TESTS,
    ROOT,
    StaleMutant,
    apply_diff,
    baseline,
    copy_tree,
    is_equivalent,
    tests_for,
    who_tests_what,
)


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


class SlowMapTests(SynchronousTestCase):
    def test_tests_too_slow_to_map_leave_no_map_and_the_run_goes_on(self) -> None:
        """
        _server/site's full run died here: its tests (an integration module among them)
        ran past ten timeouts under coverage, and the ``TimeoutExpired`` ended the whole
        run before its first mutant.  Without a map, each mutant runs every test.
        """
        def slow(command: list[str], **kwargs: object) -> None:
            raise subprocess.TimeoutExpired(command, 600.0)

        self.patch(subprocess, "run", slow)
        copy = Path(self.mktemp())
        copy.mkdir()
        self.assertEqual(who_tests_what("_server/site", copy, 60.0), {})
        self.assertEqual(tests_for(item(10, 10), "_server/site", {}), MODULE_TESTS["_server/site"])


class EquivalenceTests(SynchronousTestCase):
    """An equivalent mutant is left out of the kill rate: the match must be exact."""

    diff = ("--- a/txlb/_cluster/slow_start.py\n+++ b/txlb/_cluster/slow_start.py\n"
            "@@ -25,2 +25,2 @@\n"
            "-    _length: float = 0.0\n+    _length: float = 1.0\n")

    def test_an_entry_matches_its_module_operator_and_mutated_line(self) -> None:
        self.assertTrue(is_equivalent("_cluster/slow_start", "NumberReplacer", self.diff))
        self.assertFalse(is_equivalent("_cluster/pool", "NumberReplacer", self.diff))
        self.assertFalse(is_equivalent("_cluster/slow_start", "AddNot", self.diff))

    def test_the_line_the_mutant_removed_does_not_match(self) -> None:
        removed_only = self.diff.replace("+    _length: float = 1.0\n", "")
        self.assertFalse(is_equivalent("_cluster/slow_start", "NumberReplacer", removed_only))


class ReplayTests(SynchronousTestCase):
    """
    ``--replay`` applies a recorded survivor by its diff: it must apply the very change
    recorded wherever the lines moved to, and refuse (stale) rather than guess when the
    lines are gone or ambiguous.
    """

    diff = ("--- mutation diff ---\n"
            "--- a//tmp/copy0/txlb/_scheduling/router.py\n"
            "+++ b//tmp/copy0/txlb/_scheduling/router.py\n"
            "@@ -186,4 +186,4 @@\n"
            "             lease = self._take(serving, request)\n"
            "-            if lease is not None:\n"
            "+            if lease is None:\n"
            "                 self._leave(waiter)\n")
    source = ("def acquire():\n"
              "            lease = self._take(serving, request)\n"
              "            if lease is not None:\n"
              "                self._leave(waiter)\n"
              "    return waiting\n")

    def test_the_recorded_change_applies_where_its_lines_are_now(self) -> None:
        moved = "# a line added above\n" * 40 + self.source
        mutated = apply_diff(moved, self.diff)
        self.assertIn("            if lease is None:\n", mutated)
        self.assertNotIn("if lease is not None", mutated)
        self.assertTrue(mutated.startswith("# a line added above\n"))
        self.assertTrue(mutated.endswith("    return waiting\n"))

    def test_lines_that_are_gone_make_the_mutant_stale(self) -> None:
        changed = self.source.replace("if lease is not None:", "if lease:")
        self.assertRaises(StaleMutant, apply_diff, changed, self.diff)

    def test_lines_found_twice_are_not_guessed_at(self) -> None:
        self.assertRaises(StaleMutant, apply_diff, self.source * 2, self.diff)

    def test_a_change_on_the_modules_last_lines_applies(self) -> None:
        """cosmic-ray's diff there ends on a blank context line the file does not have."""
        at_the_end = self.diff + " \n"
        last = self.source.rsplit("    return waiting\n", 1)[0]
        mutated = apply_diff(last, at_the_end)
        self.assertTrue(mutated.endswith("            if lease is None:\n"
                                         "                self._leave(waiter)\n"))
        # a blank line that is there is matched as it is
        self.assertEqual(apply_diff(last + "\n", at_the_end).count("if lease is None"), 1)

    def test_a_diff_that_changes_nothing_is_refused(self) -> None:
        header_only = "\n".join(self.diff.splitlines()[:3])
        self.assertRaises(StaleMutant, apply_diff, self.source, header_only)


class CopyTests(SynchronousTestCase):
    """
    A mutant is killed when its module's tests fail in a copy of the tree: a test that
    fails in the copy anyway makes every mutant "killed".  (The copy once lacked docs/,
    which test_failures, test_resultlog and test_fields read: the full runs of
    _proxy/failures and _records/summary counted every mutant killed.)
    """

    def test_the_copy_has_the_docs_the_tests_read(self) -> None:
        copy = copy_tree(Path(self.mktemp()))
        for name in ("reliability.md", "result-log.md"):
            self.assertTrue((copy / "docs" / name).is_file(), name)

    def test_the_copy_has_every_bench_module_a_test_imports(self) -> None:
        """test_fields imports bench.formats: without bench/ it failed in every copy."""
        copy = copy_tree(Path(self.mktemp()))
        imported = set()
        for test in (ROOT / "tests").rglob("*.py"):
            imported |= set(re.findall(r"^\s*(?:from|import) (bench(?:\.\w+)*)",
                                       test.read_text(), re.M))
        self.assertIn("bench.formats", imported)
        for module in imported:
            path = copy.joinpath(*module.split("."))
            self.assertTrue(path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(),
                            module)
        self.assertFalse(any(copy.glob("bench/.venv*")))  # not the routers' environment

    def test_tests_failing_with_no_mutant_stop_the_run(self) -> None:
        """A copy whose tests cannot even be found fails its baseline."""
        empty = Path(self.mktemp())
        empty.mkdir()
        self.patch(bench.mutation, "MODULE_TESTS", {"m": ("tests.unit.test_nothing_here",)})
        said = io.StringIO()  # the nested trial's failure words, kept out of this run's
        self.patch(sys, "stdout", said)
        self.assertFalse(baseline(empty, ["m"], timeout=30))
        self.assertIn("the tests fail with no mutant", said.getvalue())
        self.assertIn("FAILED", said.getvalue())


class TypingOnlyTests(SynchronousTestCase):
    """No mutant is made where only the type checker reads the code."""

    def positions(self, module: str) -> set[int]:
        return {item.mutations[0].start_pos[0] for item in bench.mutation.mutants(module)}

    def test_a_protocol_body_and_the_type_checking_guard_are_left_alone(self) -> None:
        source = (Path(bench.mutation.ROOT) / "txlb" / "_records" / "privacy.py").read_text()
        lines = source.splitlines()
        protocol = next(i for i, line in enumerate(lines, 1) if line.startswith("class LogOptions"))
        property_lines = [i for i, line in enumerate(lines, 1)
                          if i > protocol and line.strip() == "@property"][:4]
        self.assertEqual(len(property_lines), 4)
        self.assertEqual(self.positions("_records/privacy") & set(property_lines), set())
        guarded = (Path(bench.mutation.ROOT) / "txlb" / "_scheduling" / "policies"
                   / "least_conn.py").read_text().splitlines()
        guard = next(i for i, line in enumerate(guarded, 1) if line == "if TYPE_CHECKING:")
        self.assertNotIn(guard, self.positions("_scheduling/policies/least_conn"))

    def test_the_code_that_runs_is_still_mutated(self) -> None:
        source = (Path(bench.mutation.ROOT) / "txlb" / "_records" / "privacy.py").read_text()
        lines = source.splitlines()
        body = next(i for i, line in enumerate(lines, 1) if "def privacy_of" in line)
        self.assertTrue(any(line > body for line in self.positions("_records/privacy")))
