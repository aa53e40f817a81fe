"""
The routers users would pick instead of txlb, installed the way a fresh clone gets them.

``vllm-router`` and ``sglang-router`` are Rust binaries published on PyPI.  They are bench
targets, never dependencies of txlb, so they live in a virtual environment of their own,
``bench/.venv-routers`` (ignored by git), made on first use by :func:`router_venv` with the
ordinary ``python -m venv`` and ``pip``.  Delete the directory to start again.

Both benches start them the same way (:func:`router_argv`): the proxy bench
(``python -m bench relay``) and the cache-aware bench (``python -m bench.prefix``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "bench" / ".venv-routers"

#: What is installed there: the versions the results were measured with.
PACKAGES = ("vllm-router==0.1.17", "sglang-router==0.3.2")

#: package -> the console script it installs.
SCRIPTS = {"vllm-router": "vllm-router", "sglang-router": "sglang-router"}


def _marker(venv: Path) -> Path:
    return venv / "installed.txt"


def router_venv(venv: Path = VENV, packages: tuple[str, ...] = PACKAGES) -> Path:
    """
    The routers' venv, created and filled when it is missing or holds other versions.

    A half-made venv (an install that failed) has no marker and is made again; the marker is
    written only after every package installed.
    """
    wanted = "\n".join(packages) + "\n"
    marker = _marker(venv)
    if marker.exists() and marker.read_text() == wanted:
        return venv
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *packages],
                   check=True)
    marker.write_text(wanted)
    return venv


def router_binary(name: str, venv: Path = VENV) -> Path:
    """The path of router ``name`` (``vllm-router`` or ``sglang-router``), installed if need be."""
    if name not in SCRIPTS:
        raise ValueError(f"unknown router {name!r}; known: {', '.join(SCRIPTS)}")
    return router_venv(venv) / "bin" / SCRIPTS[name]


#: vllm-router 0.1.17 logs every request at its default level; both routers are quiet at warn.
ROUTER_ENV = {"RUST_LOG": "warn"}


def router_argv(kind: str, port: int, urls: Sequence[str], policy: str, metrics_port: int,
                *, host: str = "127.0.0.1", startup_check_interval: float = 1,
                health_interval: float | None = None, venv: Path = VENV) -> list[str]:
    """
    The command line of router ``kind`` on ``host:port`` in front of the workers at ``urls``.

    Both probe every worker at start-up (``/health``; sglang-router also ``/server_info`` and
    ``/model_info``) every ``startup_check_interval`` seconds until it answers, then every
    ``health_interval`` seconds at run time (their default when None: vllm-router's is 60).
    Their Prometheus exporter gets a port of its own, as it always listens.
    """
    binary = str(router_binary(kind, venv))
    common = ["--host", host, "--port", str(port), "--worker-urls", *urls,
              "--policy", policy, "--prometheus-port", str(metrics_port),
              "--worker-startup-check-interval", f"{startup_check_interval:g}"]
    if health_interval is not None:
        common += ["--health-check-interval-secs", f"{health_interval:g}"]
    if kind == "vllm-router":
        return [binary, *common, "--log-level", "warning"]
    return [binary, "launch", *common, "--log-level", "warn"]


def router_version(kind: str, venv: Path = VENV) -> str:
    """The installed version of router ``kind``, from the venv's marker (what was asked for)."""
    marker = _marker(venv)
    if not marker.exists():
        return "not installed"
    for line in marker.read_text().splitlines():
        name, _, version = line.partition("==")
        if name == kind:
            return version
    return "?"


def main() -> int:
    """``python -m bench.routers``: make the venv and show each router's --help head."""
    for name in SCRIPTS:
        path = router_binary(name)
        out = subprocess.run([str(path), "--help"], capture_output=True, text=True)
        print(f"== {name}: {path}\n{(out.stdout or out.stderr)[:1500]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
