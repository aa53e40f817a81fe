"""A missing part skips loudly on a developer's machine and fails CI (:mod:`tests.parts`)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from unittest import mock

from twisted.trial.unittest import FailTest, SkipTest, SynchronousTestCase

from .. import parts


class MissingPartTests(SynchronousTestCase):
    def environment(self, **values: str) -> None:
        patcher = mock.patch.dict(os.environ, values)
        patcher.start()
        self.addCleanup(patcher.stop)
        for name in ("CI", "TXLB_REQUIRE_ALL_PARTS"):
            if name not in values:
                os.environ.pop(name, None)

    def test_a_developer_gets_a_not_run_skip(self) -> None:
        self.environment()
        error = self.assertRaises(SkipTest, parts.missing, "nginx", "nginx is not installed")
        self.assertEqual(str(error), "NOT RUN: nginx is not installed")

    def test_ci_fails_on_a_missing_required_part(self) -> None:
        for values in ({"CI": "true"}, {"TXLB_REQUIRE_ALL_PARTS": "1"}):
            self.environment(**values)
            for part in sorted(parts.REQUIRED):
                error = self.assertRaises(FailTest, parts.missing, part, "gone")
                self.assertIn(f"MISSING REQUIRED PART {part}", str(error))

    def test_an_optional_part_only_skips_even_in_ci(self) -> None:
        self.environment(CI="true")
        self.assertRaises(SkipTest, parts.missing, "something-optional", "not here")

    def test_opting_out_explicitly(self) -> None:
        self.environment(TXLB_REQUIRE_ALL_PARTS="0")
        self.assertRaises(SkipTest, parts.missing, "nginx", "not here")

    def test_every_not_run_skip_goes_through_the_helper(self) -> None:
        """A new test that raised its own NOT RUN skip would go green in CI without its part."""
        tests = Path(__file__).resolve().parents[1]
        offenders = [
            path.name for path in sorted(tests.rglob("*.py"))
            if path.name not in ("parts.py", Path(__file__).name)
            and re.search(r"SkipTest\(\s*f?[\"']NOT RUN", path.read_text())
        ]
        self.assertEqual(offenders, [])

    def test_find_program(self) -> None:
        self.assertIsNone(parts.find_program("no-such-program-txlb", "/nonexistent/x"))
        self.assertIsNotNone(parts.find_program("sh"))

    def test_real_engine_from_the_environment(self) -> None:
        self.environment(TXLB_REALENGINE="/opt/engine")
        self.assertEqual(parts.real_engine_dir(), Path("/opt/engine"))
        self.environment(TXLB_REALENGINE="")
        self.assertEqual(parts.real_engine_dir(), parts.ROOT.parent / "shared" / "realengine")
