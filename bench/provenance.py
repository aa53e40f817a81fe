"""
Where a results page's figures come from: the tree they were measured from, its revision,
and the machine -- the lines every benchmark's page opens with.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
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
    """This tree's short commit (and whether its ``txlb/`` has local changes), or ``unknown``."""
    found = revision()
    return "unknown" if found.startswith("?") else found


def command_output(argv: Sequence[str]) -> str:
    """A command's stdout + stderr, or ``?`` if it cannot run."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=10)
        return (done.stdout + done.stderr).strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def twisted_version() -> str:
    """The Twisted version CPython's txlb runs with."""
    return command_output([sys.executable, "-c", "import twisted; print(twisted.__version__)"])


def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def revision(root: Path = ROOT) -> str:
    """A txlb checkout's short commit, and whether its ``txlb/`` has local changes."""
    head = command_output(["git", "-C", str(root), "rev-parse", "--short", "HEAD"])
    if not re.fullmatch(r"[0-9a-f]+", head):
        return "? (not a git checkout)"
    dirty = command_output(["git", "-C", str(root), "status", "--porcelain", "--", "txlb"])
    return head + (" + uncommitted changes to txlb/" if dirty else "")


def cpu_steal() -> tuple[int, int]:
    """(steal, total) jiffies from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def loadavg() -> str:
    """The 1/5/15-minute load averages."""
    with open("/proc/loadavg") as avg:
        return " ".join(avg.read().split()[:3])
