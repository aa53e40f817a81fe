"""
The proxies ``python -m bench relay`` measures side by side, and how each is started.

A target is a name of :data:`TARGETS` (the report's column order); the module-level
settings below are the command line's choices that shape how the txlb and router targets
start (set once by :func:`bench.relay.run.main`, read when a target starts).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from bench.harness import (
    Children,
    Target,
    log,
    start_nginx,
    start_router,
    start_txlb,
    wait_routing,
)
from bench.provenance import ROOT, command_output

#: Every target ``--targets`` knows, in the report's column order.
TARGETS = ("direct", "nginx", "txlb", "txlb-b", "txlb-pypy", "vllm-router", "sglang-router")


ROUTERS = ("vllm-router", "sglang-router")


#: The targets of a run without ``--targets`` (txlb-b with --txlb-root, txlb-pypy with --pypy).
DEFAULT_TARGETS = ("direct", "nginx", "txlb", "vllm-router", "sglang-router")


#: ``--txlb-reactor``: the reactor txlb runs under (None: Twisted's default).
TXLB_REACTOR: str | None = None


#: ``--txlb-args``: options added to txlb's command line (every txlb target).
TXLB_ARGS: list[str] = []


#: ``--txlb-root``: the other checkout the ``txlb-b`` target runs from.
TXLB_ROOT: Path | None = None


#: ``--router-policy``: the routers' policy (round_robin: the cheapest, like nginx's).
ROUTER_POLICY = "round_robin"


#: The routers' worker health probe interval once started (s): rare, so it costs nothing.
ROUTER_HEALTH_INTERVAL = 300.0


#: ``--pypy``: the PyPy interpreter for the ``txlb-pypy`` target (None: ``pypy3`` on PATH).
PYPY: str | None = None


#: Edits to the generated nginx.conf, each documented in the report.
NGINX_PATCHES: tuple[tuple[str, str, str], ...] = (
    (r"access_log \S+ txlb_results;", "access_log off;",
     "access_log off (nginx stays the floor: the routers log nothing at RUST_LOG=warn)"),
)


def chosen_targets(names: str | None, pypy: bool, other_root: bool) -> list[str]:
    """
    The targets of a run in report order: those ``--targets`` names (comma-separated), else
    the default set plus txlb-pypy (``--pypy``) and txlb-b (``--txlb-root``); direct always,
    since every *added* figure subtracts it.
    """
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in TARGETS]
        if unknown:
            raise ValueError(f"unknown target(s) {', '.join(unknown)}; known:"
                             f" {', '.join(TARGETS)}")
    else:
        wanted = [*DEFAULT_TARGETS, *(["txlb-pypy"] if pypy else []),
                  *(["txlb-b"] if other_root else [])]
    return [t for t in TARGETS if t == "direct" or t in wanted]


def start_target(children: Children, core: int | None, backends: str, workdir: Path,
                 name: str) -> Target:
    """
    Start target ``name`` (a proxy of :data:`TARGETS` but direct) on a free port, pinned to
    ``core``; return once it routes requests.  Every txlb target runs its default command
    line plus ``--txlb-args``, with its result log on (a file of its own in ``workdir``).
    """
    if name == "nginx":
        patches = [(p, r) for p, r, _ in NGINX_PATCHES]
        nginx = start_nginx(children, core, backends, workdir, patches)
        wait_routing(nginx.port)
        return nginx
    if name in ROUTERS:
        return start_router(children, core, name, backends, ROUTER_POLICY,
                            ROUTER_HEALTH_INTERVAL)
    python = _pypy_twistd() if name == "txlb-pypy" else None
    if name == "txlb-pypy" and python is None:
        raise RuntimeError(f"txlb-pypy: PyPy with Twisted not found ({pypy_status()})")
    source = ROOT
    if name == "txlb-b":
        if TXLB_ROOT is None:
            raise RuntimeError("txlb-b needs --txlb-root PATH")
        source = TXLB_ROOT
    target = start_txlb(children, core, backends, python, name=name, reactor=TXLB_REACTOR,
                        source=source, extra=TXLB_ARGS,
                        log_file=str(workdir / f"{name}-results.log"))
    wait_routing(target.port)  # --txlb-args may have changed what it routes
    return target


def start_all(children: Children, core: int | None, backends: str, workdir: Path,
              names: Sequence[str], direct_port: int, notes: list[str]) -> list[Target]:
    """Start every target named; one that cannot start is left out and the report says so."""
    targets = []
    for name in names:
        if name == "direct":
            targets.append(Target("direct", direct_port, None))
            continue
        try:
            targets.append(start_target(children, core, backends, workdir, name))
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
            log(f"target {name} did not start: {exc}")
            notes.append(f"target `{name}` did not start, left out: {str(exc)[:300]}")
    return targets


def _pypy() -> str | None:
    """The PyPy interpreter: ``--pypy``, else ``pypy3`` on PATH."""
    return shutil.which(PYPY) if PYPY else shutil.which("pypy3")


def _pypy_twistd() -> list[str] | None:
    """``pypy3 -c <run twistd>`` when PyPy with Twisted is installed, else None."""
    pypy = _pypy()
    if not pypy:
        return None
    check = subprocess.run([pypy, "-c", "import twisted, attr"], capture_output=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if check.returncode != 0:
        return None
    return [pypy, "-c", "import sys; from twisted.scripts.twistd import run; run()"]


_VERSIONS = ("import sys, platform, twisted; v = sys.pypy_version_info;"
             " print(f'PyPy {v.major}.{v.minor}.{v.micro} (Python {platform.python_version()}),"
             " Twisted {twisted.__version__}')")


def pypy_status() -> str:
    """What the report says about PyPy: its version and Twisted's, or why it was skipped."""
    pypy = _pypy()
    if not pypy:
        return "not installed (skipped)"
    if not _pypy_twistd():
        return f"installed ({pypy}), but cannot import Twisted (skipped)"
    return f"{command_output([pypy, '-c', _VERSIONS])} ({pypy})"
