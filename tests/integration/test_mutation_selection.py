"""bench.mutation's "who tests what": a real coverage run over real trial tests."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

from twisted.trial.unittest import TestCase

from bench.mutation import who_tests_what

MODULE = '''
def double(x):
    return x * 2


def halve(x):
    return x / 2
'''

TESTS = '''
from twisted.trial.unittest import SynchronousTestCase

from txlb._tiny.mod import double, halve


class Tiny(SynchronousTestCase):
    def test_double(self):
        self.assertEqual(double(2), 4)

    def test_halve(self):
        self.assertEqual(halve(2), 1)
'''


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


class WhoTestsWhatTests(TestCase):
    def test_each_line_names_the_tests_that_ran_it_even_inside_a_measured_run(self) -> None:
        """
        CI measures its whole run (COVERAGE_FILE, COVERAGE_PROCESS_START set): the mapping
        must still be made, into its own data file, and leave CI's alone.
        """
        copy = Path(self.mktemp()).resolve()
        (copy / "txlb" / "_tiny").mkdir(parents=True)
        (copy / "tests").mkdir()
        for package in (copy / "txlb", copy / "txlb" / "_tiny", copy / "tests"):
            (package / "__init__.py").write_text("")
        (copy / "txlb" / "_tiny" / "mod.py").write_text(textwrap.dedent(MODULE))
        (copy / "tests" / "test_tiny.py").write_text(textwrap.dedent(TESTS))
        outer = copy / "outer.coverage"
        for name, value in (("COVERAGE_FILE", str(outer)),
                            ("COVERAGE_PROCESS_START", str(copy / "missing.rc"))):
            self.addCleanup(_restore, name, os.environ.get(name))
            os.environ[name] = value
        lines = who_tests_what("_tiny/mod", copy, 60.0, ("tests.test_tiny",))
        self.assertEqual(lines.get(3), frozenset({"tests.test_tiny.Tiny.test_double"}))
        self.assertEqual(lines.get(7), frozenset({"tests.test_tiny.Tiny.test_halve"}))
        self.assertFalse(outer.exists())
