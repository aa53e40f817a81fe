"""
No module of txlb/ or bench/ over 600 lines: a unit a reader can hold.

A module that grows past it has taken a second job; split it along its jobs (see
docs/architecture.md).  A module that is one job reading best whole may be listed in
:data:`WHOLE`, with why -- the list is empty today.
"""

from __future__ import annotations

from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 600

#: modules allowed past the limit, each with why it reads best whole
WHOLE: dict[str, str] = {}


def lengths() -> dict[str, int]:
    return {path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
            for package in ("txlb", "bench") for path in sorted((ROOT / package).rglob("*.py"))}


class ModuleSizeTests(SynchronousTestCase):

    def test_no_module_is_over_the_limit(self) -> None:
        over = {name: count for name, count in lengths().items()
                if count > LIMIT and name not in WHOLE}
        self.assertEqual(over, {})

    def test_every_listed_module_is_still_long(self) -> None:
        found = lengths()
        self.assertEqual([name for name in WHOLE if found.get(name, 0) <= LIMIT], [])

    def test_the_count_sees_the_package(self) -> None:
        found = lengths()
        self.assertIn("txlb/_balancer.py", found)
        self.assertGreater(found["txlb/_balancer.py"], 100)
