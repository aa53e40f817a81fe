"""
Parts of the machine some tests need (a browser, nginx, a Python package), and what a test
does when one is missing.

On a developer's machine a missing part skips the test with a loud ``NOT RUN:`` reason.
In CI (``CI=true``) or with ``TXLB_REQUIRE_ALL_PARTS=1`` a missing *required* part fails the
test instead: otherwise a failed ``apt-get install`` turns the browser and nginx suites into
skips, trial exits 0, and CI goes green having run neither.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import NoReturn

from twisted.trial.unittest import FailTest, SkipTest

#: Parts whose absence fails a run that requires every part.  ``redis-server`` and
#: ``llama-server`` (the real engine, from ``../shared/realengine`` beside the project) join
#: this set when a test uses them: add the name here and call :func:`missing` in that test.
REQUIRED: frozenset[str] = frozenset({
    "chromium", "chromedriver", "selenium", "nginx", "openai", "promtool", "curl",
    "llama-server", "gguf", "redis-server", "redis-server-tls",
})

ROOT = Path(__file__).resolve().parent.parent


def all_required() -> bool:
    """Whether this run must have every required part (CI, or asked for explicitly)."""
    return (os.environ.get("CI", "").lower() == "true"
            or os.environ.get("TXLB_REQUIRE_ALL_PARTS", "") not in ("", "0"))


def missing(part: str, why: str) -> NoReturn:
    """
    Leave the calling test because ``part`` is missing: a ``NOT RUN`` skip, or a failure
    when this run requires every part and ``part`` is one of :data:`REQUIRED`.
    """
    if part in REQUIRED and all_required():
        raise FailTest(f"MISSING REQUIRED PART {part}: {why} (CI=true or "
                       "TXLB_REQUIRE_ALL_PARTS=1 makes every part required)")
    raise SkipTest(f"NOT RUN: {why}")


def find_program(name: str, *extra: str) -> str | None:
    """``name`` on PATH, else the first of ``extra`` (absolute paths) that exists."""
    found = shutil.which(name)
    if found:
        return found
    for candidate in extra:
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def real_engine_dir() -> Path:
    """
    Where the real inference engine (llama.cpp's ``llama-server``, its ``make_model.py``)
    is: the directory ``TXLB_REALENGINE`` names, else ``../shared/realengine`` beside the
    project (where CI has it).  A test that needs it calls ``missing("llama-server", ...)``
    when ``real_engine_dir() / "llama-server"`` is not there.
    """
    configured = os.environ.get("TXLB_REALENGINE")
    return Path(configured) if configured else ROOT.parent / "shared" / "realengine"
