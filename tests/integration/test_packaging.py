"""
The wheel, installed for real: ``twistd`` and ``twist`` must find the ``llmlb`` plugin.

Twisted discovers plugins by scanning ``twisted/plugins`` directories on ``sys.path``; an
``__init__.py`` in the wrong place, or a packaging rule that drops the plugin file, breaks
``twistd llmlb`` only after installation -- an editable checkout would never show it.  So
this test builds the wheel, installs it non-editable into a fresh virtualenv and asks the
installed commands.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

from twisted.trial.unittest import TestCase

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str | Path, cwd: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LB_PORT")}
    result = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0:
        raise AssertionError(f"{argv} failed ({result.returncode}):\n{result.stdout}\n"
                             f"{result.stderr}")
    return result.stdout + result.stderr


class WheelInstallTests(TestCase):
    timeout = 900  # a fresh venv installs Twisted, treq and klein

    def test_installed_wheel_registers_plugin(self) -> None:
        work = Path(self.mktemp()).resolve()
        work.mkdir()
        run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "-q", "-w", work / "dist", ROOT)
        wheels = list((work / "dist").glob("txlb-*.whl"))
        self.assertEqual(len(wheels), 1)
        names = zipfile.ZipFile(wheels[0]).namelist()
        self.assertIn("twisted/plugins/txlb_llmlb.py", names)
        self.assertIn("twisted/plugins/txlb_reactor.py", names)
        self.assertIn("txlb/_admin/dashboard.html", names)
        self.assertNotIn("twisted/__init__.py", names)
        self.assertNotIn("twisted/plugins/__init__.py", names)
        self.assertIn("txlb/py.typed", names)
        self.assertFalse([n for n in names if n.startswith("tests/")])

        env_dir = work / "venv"
        venv.create(env_dir, with_pip=True)
        bin_dir = env_dir / "bin"
        run(bin_dir / "python", "-m", "pip", "install", "-q", wheels[0])
        # Run from a directory without the source tree, so only the installed copy counts.
        self.assertIn("llmlb", run(bin_dir / "twistd", "--help", cwd=work))
        self.assertIn("llmlb", run(bin_dir / "twist", "--help", cwd=work))
        self.assertIn("--backends", run(bin_dir / "twistd", "llmlb", "--help", cwd=work))
        self.assertIn("vllm-sim", run(bin_dir / "twistd", "--help", cwd=work))
        self.assertIn("txlb-epoll", run(bin_dir / "twistd", "--help-reactors", cwd=work))


class RepositoryTests(TestCase):
    def test_the_repository_tracks_no_test_leftovers(self) -> None:
        """Trial's temporary paths and a twistd pid file are never committed."""
        if not (ROOT / ".git").exists():
            self.skipTest("NOT RUN: not a git checkout")
        tracked = run("git", "-C", ROOT, "ls-files").splitlines()
        leftovers = [path for path in tracked
                     if path.split("/")[0].startswith("tests.") or "_trial_temp" in path
                     or path.endswith("twistd.pid")]
        self.assertEqual(leftovers, [])
