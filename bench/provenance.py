"""
Where a results page's figures come from: the tree they were measured from, its revision,
and the machine -- the lines every benchmark's page opens with.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

#: the repository root, and where the results pages go
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def machine() -> dict[str, str]:
    try:
        uname = subprocess.run(["uname", "-a"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        uname = platform.platform()
    return {
        "uname -a": uname,
        "nproc": str(os.cpu_count()),
        "python": f"{platform.python_version()} ({sys.executable})",
    }


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "txlb"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + (" + uncommitted changes to txlb/" if dirty else "")
