"""
``python -m bench``: the one door to the benchmarks lists every scenario and runs each as
its own module would run.
"""

from __future__ import annotations

import importlib.util
import io
import sys
from contextlib import redirect_stdout

from twisted.trial.unittest import SynchronousTestCase

from bench.__main__ import SCENARIOS, find, listing, main


class EntryTests(SynchronousTestCase):
    """The scenario table and the door."""

    def test_every_scenario_names_a_runnable_module(self) -> None:
        for scenario in SCENARIOS:
            spec = importlib.util.find_spec(scenario.module)
            self.assertIsNotNone(spec, scenario.module)
            assert spec is not None
            if spec.submodule_search_locations is not None:  # a package: its __main__
                self.assertIsNotNone(importlib.util.find_spec(scenario.module + ".__main__"))

    def test_names_are_unique_and_each_is_listed_on_one_line(self) -> None:
        names = [s.name for s in SCENARIOS]
        self.assertEqual(len(names), len(set(names)))
        lines = listing().splitlines()
        for name in names:
            self.assertEqual(sum(1 for line in lines if line.split()[:1] == [name]), 1, name)

    def test_alone_it_lists_the_scenarios(self) -> None:
        out = io.StringIO()
        with redirect_stdout(out):
            self.assertEqual(main([]), 0)
        self.assertIn("relay", out.getvalue())
        self.assertIn("python -m bench <scenario>", out.getvalue())

    def test_an_unknown_scenario_is_refused(self) -> None:
        self.assertIsNone(find("nope"))
        self.patch(sys, "stderr", io.StringIO())
        self.assertEqual(main(["nope"]), 2)

    def test_a_scenario_runs_its_module(self) -> None:
        self.patch(sys, "argv", list(sys.argv))  # the door hands the scenario its own
        out = io.StringIO()
        with redirect_stdout(out):
            exited = self.assertRaises(SystemExit, main, ["relay", "--help"])
        self.assertEqual(exited.code, 0)
        self.assertIn("python -m bench relay", out.getvalue())
