"""
txlb against nginx and against no proxy at all, side by side, in one run (``python -m bench``).

Three targets, measured one after the other with the same clients and the same backend:
**direct** (client -> backend), **nginx** (the configuration ``python -m txlb.nginx
--standalone`` generates, one worker) and **txlb** (``twistd -n llmlb`` from this source
tree, ``--admin none --log-file none``).  The backend is :mod:`bench.backend`, a small raw
asyncio HTTP/1.1 server much cheaper per chunk than either proxy; the clients are
:mod:`bench.loadgen` (raw asyncio) and ``wrk``.  With two or more CPUs the proxy gets CPU 0
and the backend + clients CPU 1 (``taskset``), so proxy CPU time is the proxy's alone.

Scenarios (``--only NAME`` runs one; repeat it for several):

``paced``  SSE streams of ~250-byte events (one HTTP chunk each, like vLLM's token events) at
           a fixed pace (40 events/s per stream) for a fixed window, at 64 and 256 streams:
           proxy CPU µs per relayed chunk (utime+stime from /proc, all the proxy's processes)
           and added per-chunk latency (receive time minus the send time embedded in the
           event, minus the same for direct).
``bulk``   A few SSE streams written as fast as the path takes them: chunks/s.
``rps``    Small JSON requests with ``wrk -t1 -c32`` (a Python client if wrk is missing):
           requests/s, latency, and requests per proxy CPU-second (throughput per core).
``ttfb``   Sequential single requests at idle: time to first byte, fresh connection and
           keep-alive; added = target - direct.
``hold``   RSS idle and per held stream (an event every 3 s) at 1,000 and 10,000 streams,
           each level on a freshly started proxy; whether every stream was held.
``slow``   A 1 GiB stream read at 64 MiB/s through each proxy: peak RSS growth (bounded
           means the proxy passed the backpressure on instead of buffering).

The Markdown table goes to stdout and ``bench/results/proxy.md`` (raw figures in
``proxy.json``, plots in ``proxy.png`` and ``proxy_slow.png``).  ``--quick`` is a ~1-minute
smoke run with shorter windows and smaller levels; it writes nothing unless ``--save``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import (
    HOST,
    NGINX,
    ROOT,
    Child,
    Children,
    Target,
    core_times,
    cpu_ns,
    cpu_seconds,
    nofile_limit,
    pinned,
    start_backend,
    start_nginx,
    start_txlb,
    wait_for,
)

RESULTS = ROOT / "bench" / "results"
SCENARIOS = ("paced", "bulk", "rps", "ttfb", "hold", "slow")
MiB = 1 << 20

#: Edits to the generated nginx.conf, each documented in the report.
#: ``--txlb-reactor``: the reactor txlb runs under (None: Twisted's default).
TXLB_REACTOR: str | None = None
#: ``--pypy``: the PyPy interpreter for the ``txlb-pypy`` target (None: ``pypy3`` on PATH).
PYPY: str | None = None
#: ``--warm-up``: seconds of paced SSE and of small requests each proxy gets before the
#: scenarios (a JIT's warm-up; 0: only the short warm-up every proxy always gets).
WARM_SECONDS = 0.0

NGINX_PATCHES: tuple[tuple[str, str, str], ...] = (
    (r"access_log \S+ txlb_results;", "access_log off;",
     "access_log off (txlb runs with --log-file none)"),
)


@dataclass
class Config:
    """Sizes and durations of one run."""

    paced_levels: list[int]
    paced_rate: float  # events/s per stream
    paced_seconds: float
    bulk_streams: int
    bulk_seconds: float
    rps_connections: int
    rps_seconds: float
    ttfb_count: int
    hold_levels: list[int]
    hold_interval_ms: float
    slow_bytes: int
    slow_rate: float  # bytes/s


FULL = Config([64, 256], 40.0, 10.0, 4, 5.0, 32, 10.0, 300, [1000, 10000], 3000.0,
              1 << 30, 64 * MiB)
QUICK = Config([64], 40.0, 3.0, 4, 2.0, 32, 3.0, 60, [1000], 2000.0, 128 * MiB, 64 * MiB)


@dataclass
class Bench:
    """Everything the scenarios share."""

    children: Children
    workdir: Path
    backend: Child
    backends: str
    targets: list[Target]
    proxy_core: int | None
    client_core: int | None
    config: Config
    nofile: int
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def proxies(self) -> list[Target]:
        """The targets that are proxies (not direct)."""
        return [t for t in self.targets if t.child is not None]


def log(message: str) -> None:
    """Progress line on stdout, flushed."""
    print(message, flush=True)


# -- running one load-generator process -------------------------------------------------------


class Meter:
    """CPU of the proxy, the backend and reaped children, and every core's load, over a run."""

    def __init__(self, bench: Bench, target: Target) -> None:
        self.target = target
        self.backend_pid = bench.backend.process.pid
        self.proxy0 = target.cpu()
        self.proxy_ns0 = cpu_ns(target.pids())
        self.backend0 = cpu_seconds([self.backend_pid])
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.children0 = usage.ru_utime + usage.ru_stime
        self.cores0 = core_times()
        self.t0 = time.monotonic()

    def stop(self) -> dict[str, Any]:
        """The deltas: ``proxy_cpu``/``backend_cpu``/``reaped_cpu`` (s), ``wall``, ``%``s."""
        wall = time.monotonic() - self.t0
        proxy = self.target.cpu() - self.proxy0
        proxy_ns = cpu_ns(self.target.pids()) - self.proxy_ns0
        backend = cpu_seconds([self.backend_pid]) - self.backend0
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        reaped = usage.ru_utime + usage.ru_stime - self.children0
        busy = []
        for (b0, t0), (b1, t1) in zip(self.cores0, core_times(), strict=False):
            busy.append((b1 - b0) / (t1 - t0) * 100 if t1 > t0 else math.nan)
        return {
            "proxy_cpu": proxy, "proxy_cpu_ns": proxy_ns, "backend_cpu": backend,
            "reaped_cpu": reaped, "wall": wall,
            "proxy_cpu_pct": proxy / wall * 100 if self.target.child else math.nan,
            "backend_cpu_pct": backend / wall * 100,
            "core_busy_pct": busy,
        }


def run_client(bench: Bench, target: Target, args: Sequence[str], timeout: float,
               name: str = "load") -> tuple[dict[str, Any], dict[str, Any]]:
    """One ``bench.loadgen`` run against ``target``: (its result, the :class:`Meter` deltas)."""
    meter = Meter(bench, target)
    child = bench.children.spawn(f"{name}-{target.name}", pinned(bench.client_core, [
        sys.executable, "-m", "bench.loadgen", *args, "--port", str(target.port)]))
    try:
        child.process.wait(timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{child.name} timed out:\n{child.text()[-2000:]}") from None
    finally:
        bench.children.stop(child)
    measured = meter.stop()
    match = re.search(r"^RESULT (.*)$", child.text(), re.M)
    if child.process.returncode != 0 or not match:
        raise RuntimeError(f"{child.name} failed:\n{child.text()[-2000:]}")
    return json.loads(match.group(1)), measured


def per_unit(cpu: float, count: int, target: Target) -> float:
    """Proxy CPU µs per chunk/request (NaN for direct, which has no proxy)."""
    return cpu / count * 1e6 if count and target.child is not None else math.nan


# -- scenarios ----------------------------------------------------------------------------------


def scenario_paced(bench: Bench) -> dict[str, Any]:
    """Paced SSE at each level against each target: CPU per chunk, chunk latency."""
    cfg = bench.config
    interval = 1000.0 / cfg.paced_rate
    count = int(cfg.paced_rate * cfg.paced_seconds)
    out: dict[str, Any] = {}
    for streams in cfg.paced_levels:
        level: dict[str, Any] = {}
        for target in bench.targets:
            result, measured = run_client(bench, target, [
                "paced", "--streams", str(streams), "--count", str(count),
                "--interval", f"{interval:g}", "--size", "250",
                "--timeout", str(cfg.paced_seconds + 30)], cfg.paced_seconds + 60)
            events = result["events"]
            row = dict(result, **measured,
                       us_per_chunk=per_unit(measured["proxy_cpu"], events, target),
                       client_cpu_pct=result["cpu"] / result["wall"] * 100)
            level[target.name] = row
            log(f"paced {streams:4d} {target.name:10s} {events}/{result['expected']} events,"
                f" {row['us_per_chunk']:.1f} µs/chunk, p50 {result['p50_us'] / 1000:.2f} ms,"
                f" p99 {result['p99_us'] / 1000:.2f} ms, errors {result['errors']},"
                f" client CPU {row['client_cpu_pct']:.0f} %")
        out[str(streams)] = level
    return out


def scenario_bulk(bench: Bench) -> dict[str, Any]:
    """Bulk SSE against each target: chunks/s and proxy CPU per chunk."""
    cfg = bench.config
    out: dict[str, Any] = {}
    for target in bench.targets:
        result, measured = run_client(bench, target, [
            "bulk", "--streams", str(cfg.bulk_streams), "--seconds", str(cfg.bulk_seconds)],
            cfg.bulk_seconds + 30)
        out[target.name] = dict(
            result, **measured,
            us_per_chunk=per_unit(measured["proxy_cpu"], result["events"], target),
            client_cpu_pct=result["cpu"] / result["wall"] * 100,
        )
        log(f"bulk {target.name:10s} {result['rate']:,.0f} chunks/s,"
            f" {out[target.name]['us_per_chunk']:.2f} µs/chunk, errors {result['errors']}")
    return out


_WRK_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6}


def _wrk_latency(text: str, label: str) -> float:
    """A percentile from wrk's ``--latency`` distribution, in µs (NaN if absent)."""
    match = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
    return float(match.group(1)) * _WRK_UNITS[match.group(2)] if match else math.nan


def run_wrk(bench: Bench, target: Target) -> dict[str, Any]:
    """``wrk -t1 -cC -dSs --latency`` on ``/json`` through ``target``, parsed."""
    cfg = bench.config
    meter = Meter(bench, target)
    child = bench.children.spawn(f"wrk-{target.name}", pinned(bench.client_core, [
        "wrk", "-t1", f"-c{cfg.rps_connections}", f"-d{cfg.rps_seconds:g}s", "--latency",
        f"http://{HOST}:{target.port}/json"]))
    try:
        child.process.wait(cfg.rps_seconds + 30)
    finally:
        bench.children.stop(child)
    measured = meter.stop()
    text = child.text()
    requests = re.search(r"(\d+) requests in ([\d.]+)(m?s)", text)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", text)
    if not requests or not rate:
        raise RuntimeError(f"wrk failed:\n{text}")
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                     text)
    errors = (int(non2xx.group(1)) if non2xx else 0) + (
        sum(int(x) for x in sock.groups()) if sock else 0)
    count = int(requests.group(1))
    proxy_cpu = measured["proxy_cpu"]
    return dict(
        measured, requests=count, rate=float(rate.group(1)), errors=errors,
        p50_us=_wrk_latency(text, "50"), p99_us=_wrk_latency(text, "99"),
        client_cpu_pct=measured["reaped_cpu"] / measured["wall"] * 100,
        per_cpu_second=count / proxy_cpu if proxy_cpu > 0 else math.nan,
        us_per_request=per_unit(proxy_cpu, count, target), client="wrk",
    )


def scenario_rps(bench: Bench) -> dict[str, Any]:
    """Small JSON requests against each target (wrk, or the Python client)."""
    cfg = bench.config
    out: dict[str, Any] = {}
    have_wrk = shutil.which("wrk") is not None
    if not have_wrk:
        bench.notes.append("wrk is not installed: small requests measured with the Python"
                           " client (bench.loadgen rps), which is slower than wrk.")
    for target in bench.targets:
        if have_wrk:
            row = run_wrk(bench, target)
        else:
            result, measured = run_client(bench, target, [
                "rps", "--connections", str(cfg.rps_connections),
                "--seconds", str(cfg.rps_seconds)], cfg.rps_seconds + 30)
            proxy_cpu = measured["proxy_cpu"]
            row = dict(result, **measured,
                       client_cpu_pct=result["cpu"] / result["wall"] * 100,
                       per_cpu_second=result["requests"] / proxy_cpu if proxy_cpu else math.nan,
                       us_per_request=per_unit(proxy_cpu, result["requests"], target),
                       client="python")
        out[target.name] = row
        log(f"rps {target.name:10s} {row['rate']:,.0f} req/s, p50 {row['p50_us']:.0f} µs,"
            f" proxy CPU {row['proxy_cpu_pct']:.0f} %, errors {row['errors']}")
    return out


def scenario_ttfb(bench: Bench) -> dict[str, Any]:
    """Sequential TTFB at idle, fresh connections then keep-alive, per target."""
    cfg = bench.config
    out: dict[str, Any] = {"fresh": {}, "keepalive": {}}
    for mode in ("fresh", "keepalive"):
        for target in bench.targets:
            args = ["ttfb", "--count", str(cfg.ttfb_count)]
            if mode == "fresh":
                args.append("--fresh")
            result, measured = run_client(bench, target, args, 60)
            requests = result["count"] + result["errors"]
            out[mode][target.name] = dict(  # schedstat: too few ticks for /proc/PID/stat
                result, us_per_request=per_unit(measured["proxy_cpu_ns"] / 1e9, requests,
                                                target))
            log(f"ttfb {mode:9s} {target.name:10s} p50 {result['p50_us']:.0f} µs,"
                f" p99 {result['p99_us']:.0f} µs, errors {result['errors']}")
    return out


def warm_up(bench: Bench, target: Target) -> None:
    """A few requests of each kind: imports, connection pools, allocator pools."""
    run_client(bench, target, ["ttfb", "--count", "20", "--gap", "0"], 30, name="warm")
    run_client(bench, target, ["paced", "--streams", "16", "--count", "5", "--interval", "20",
                               "--timeout", "10"], 30, name="warm")


def warm_up_long(bench: Bench, target: Target, seconds: float) -> None:
    """``--warm-up``: the paced and small-request paths driven for ``seconds`` each, so a
    JIT (PyPy) has compiled them before anything is measured.  Every proxy gets the same."""
    interval = 1000.0 / bench.config.paced_rate
    run_client(bench, target, [
        "paced", "--streams", "64", "--count", str(int(bench.config.paced_rate * seconds)),
        "--interval", f"{interval:g}", "--size", "250", "--timeout", str(seconds + 30)],
        seconds + 60, name="warm")
    run_client(bench, target, ["rps", "--connections", "8", "--seconds", f"{seconds:g}"],
               seconds + 30, name="warm")


def fresh_proxy(bench: Bench, name: str) -> Target:
    """A newly started proxy of the same kind as the one called ``name``."""
    patches = [(p, r) for p, r, _ in NGINX_PATCHES]
    if name == "nginx":
        return start_nginx(bench.children, bench.proxy_core, bench.backends, bench.workdir,
                           patches)
    python = _pypy_twistd() if name == "txlb-pypy" else None
    return start_txlb(bench.children, bench.proxy_core, bench.backends, python, name=name,
                      reactor=TXLB_REACTOR)


def hold_levels(bench: Bench) -> list[int]:
    """The configured levels, capped to what ``RLIMIT_NOFILE`` lets one proxy process hold."""
    cap = (bench.nofile - 200) // 2 // 100 * 100  # two sockets per proxied stream
    levels = []
    for level in bench.config.hold_levels:
        if level > cap:
            bench.notes.append(
                f"{level:,} streams need {2 * level:,}+ descriptors in one proxy process, but"
                f" RLIMIT_NOFILE is capped at {bench.nofile:,} here (hard limit; raising it"
                f" needs CAP_SYS_RESOURCE, which this container lacks): that level ran"
                f" with {cap:,} streams instead."
            )
            level = cap
        levels.append(level)
    return levels


def scenario_hold(bench: Bench) -> dict[str, Any]:
    """Held streams at each level, each proxy freshly started per level."""
    cfg = bench.config
    out: dict[str, Any] = {}
    for streams in hold_levels(bench):
        level: dict[str, Any] = {}
        for target in bench.targets:
            proxy = target if target.child is None else fresh_proxy(bench, target.name)
            try:
                level[target.name] = hold_one(bench, proxy, streams, cfg.hold_interval_ms)
            finally:
                if proxy.child is not None:
                    bench.children.stop(proxy.child)
            row = level[target.name]
            log(f"hold {streams:6d} {target.name:10s} held {row['held']}/{streams},"
                f" ramp {row['ramp_s']:.1f} s, idle RSS {row['idle_kb'] / 1024:.1f} MiB,"
                f" held RSS {row['held_kb'] / 1024:.1f} MiB,"
                f" {row['per_stream_kb']:.1f} KiB/stream, failed {row['failed']}")
        out[str(streams)] = level
    return out


def hold_one(bench: Bench, target: Target, streams: int, interval_ms: float) -> dict[str, Any]:
    """Idle RSS, then ``streams`` held streams: RSS while held, and how many stayed up."""
    if target.child is not None:
        warm_up(bench, target)
        time.sleep(0.5)
    idle = target.rss()
    ramp_timeout = 30 + streams / 100  # 130 s at 10,000
    child = bench.children.spawn(f"hold-{target.name}", pinned(bench.client_core, [
        sys.executable, "-m", "bench.loadgen", "hold", "--port", str(target.port),
        "--streams", str(streams), "--interval", f"{interval_ms:g}", "--linger", "2",
        "--ramp-timeout", str(ramp_timeout)]))
    try:
        held = json.loads(wait_for(child, r"HELD (\{.*\})", ramp_timeout + 30).group(1))
        samples = []
        for _ in range(4):  # during --linger
            samples.append(target.rss())
            time.sleep(0.3)
        child.process.wait(30)
    finally:
        bench.children.stop(child)
    match = re.search(r"^RESULT (.*)$", child.text(), re.M)
    if not match:
        raise RuntimeError(f"hold client failed:\n{child.text()[-2000:]}")
    result = json.loads(match.group(1))
    peak = max(samples)
    return dict(
        result, held=held["held"], idle_kb=idle, held_kb=peak,
        per_stream_kb=(peak - idle) / streams if target.child is not None else math.nan,
    )


def scenario_slow(bench: Bench) -> dict[str, Any]:
    """A large stream read slowly through each proxy; the proxy's RSS over time."""
    cfg = bench.config
    out: dict[str, Any] = {}
    for target in bench.proxies():
        base = target.rss()
        child = bench.children.spawn(f"slow-{target.name}", pinned(bench.client_core, [
            sys.executable, "-m", "bench.loadgen", "slow", "--port", str(target.port),
            "--bytes", str(cfg.slow_bytes), "--rate", str(cfg.slow_rate),
            "--timeout", str(cfg.slow_bytes / cfg.slow_rate * 3 + 30)]))
        timeline: list[tuple[float, int]] = []
        t0 = time.monotonic()
        limit = cfg.slow_bytes / cfg.slow_rate * 3 + 60
        try:
            while child.process.poll() is None and time.monotonic() - t0 < limit:
                timeline.append((time.monotonic() - t0, target.rss()))
                time.sleep(0.2)
        finally:
            bench.children.stop(child)
        match = re.search(r"^RESULT (.*)$", child.text(), re.M)
        if not match:
            raise RuntimeError(f"slow client failed:\n{child.text()[-2000:]}")
        result = json.loads(match.group(1))
        peak = max((kb for _, kb in timeline), default=base)
        out[target.name] = dict(result, base_kb=base, peak_kb=peak, growth_kb=peak - base,
                                timeline=timeline)
        log(f"slow {target.name:10s} {result['bytes'] / MiB:.0f} MiB in {result['wall']:.1f} s,"
            f" complete {result['complete']}, RSS {base / 1024:.1f} -> peak"
            f" {peak / 1024:.1f} MiB {result['error']}")
    return out


RUNNERS: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "paced": scenario_paced, "bulk": scenario_bulk, "rps": scenario_rps,
    "ttfb": scenario_ttfb, "hold": scenario_hold, "slow": scenario_slow,
}


# -- PyPy --------------------------------------------------------------------------------------


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
    return f"{_output([pypy, '-c', _VERSIONS])} ({pypy})"


# -- system information -------------------------------------------------------------------------


def _output(argv: Sequence[str]) -> str:
    """A command's stdout + stderr, or ``?`` if it cannot run."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=10)
        return (done.stdout + done.stderr).strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def twisted_version() -> str:
    """The Twisted version CPython's txlb runs with."""
    return _output([sys.executable, "-c", "import twisted; print(twisted.__version__)"])


def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def revision() -> str:
    """The txlb checkout's short commit, and whether ``txlb/`` has local changes."""
    head = _output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    if not re.fullmatch(r"[0-9a-f]+", head):
        return "?"
    dirty = _output(["git", "-C", str(ROOT), "status", "--porcelain", "--", "txlb"])
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


# -- the run ----------------------------------------------------------------------------------


def orchestrate(config: Config, only: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """Start backend and proxies, run the scenarios, stop everything; the raw results."""
    multi = (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
    proxy_core, client_core = (0, 1) if multi else (None, None)
    nofile = nofile_limit()
    info: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "uname -a": _output(["uname", "-a"]),
        "nproc": _output(["nproc"]),
        "cpu": cpu_model(),
        "python": f"{platform.python_version()} ({sys.executable}), Twisted {twisted_version()}",
        "nginx": _output([NGINX, "-v"]).replace("nginx version: ", ""),
        "wrk": (_output(["wrk", "--version"]).splitlines() or ["?"])[0]
        if shutil.which("wrk") else "not installed",
        "txlb": revision(),
        "command": " ".join(["python -m bench", *args.argv]),
        "pinning": ("proxy on CPU 0; backend, load generator and wrk on CPU 1 (taskset)"
                    if multi else "none (one CPU or no taskset)"),
        "RLIMIT_NOFILE": nofile,
        "PyPy": pypy_status(),
        "load average at start": loadavg(),
    }
    steal0 = cpu_steal()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="txlb-bench.") as tmp:
        children = Children(Path(tmp))
        try:
            backend, ports = start_backend(children, client_core, 2)
            backends = ",".join(f"{HOST}:{port}" for port in ports)
            patches = [(p, r) for p, r, _ in NGINX_PATCHES]
            targets = [
                Target("direct", ports[0], None),
                start_nginx(children, proxy_core, backends, Path(tmp), patches),
                start_txlb(children, proxy_core, backends, reactor=TXLB_REACTOR),
            ]
            pypy = _pypy_twistd()
            if pypy:
                targets.append(start_txlb(children, proxy_core, backends, pypy,
                                          name="txlb-pypy"))
            bench = Bench(children, Path(tmp), backend, backends, targets, proxy_core,
                          client_core, config, nofile)
            log(f"backend ports {ports}; " + ", ".join(
                f"{t.name} :{t.port} pids {t.pids()}" for t in targets if t.child))
            for target in targets:
                warm_up(bench, target)
            if WARM_SECONDS > 0:
                for target in bench.proxies():
                    log(f"warm-up {target.name}: {WARM_SECONDS:g} s paced + {WARM_SECONDS:g} s"
                        " small requests")
                    warm_up_long(bench, target, WARM_SECONDS)
            for name in only:
                log(f"-- {name}")
                try:
                    bench.data[name] = RUNNERS[name](bench)
                except (RuntimeError, OSError, ValueError, KeyError) as exc:
                    # one broken scenario should not cost the others; the report says so
                    log(f"scenario {name} FAILED: {exc}")
                    bench.notes.append(f"scenario `{name}` FAILED: {str(exc)[:300]}")
        finally:
            children.stop_all()
    steal1 = cpu_steal()
    total = steal1[1] - steal0[1]
    info["load average at end"] = loadavg()
    info["CPU steal during run"] = (f"{(steal1[0] - steal0[0]) / total * 100:.1f} %"
                                    if total else "?")
    info["wall"] = f"{time.monotonic() - started:.0f} s"
    return {"info": info, "config": config.__dict__, "data": bench.data,
            "notes": bench.notes, "targets": [t.name for t in targets]}


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM/SIGHUP: unwind through the ``finally`` that stops the children."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the options, run, print the report, save it (full runs, or ``--save``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description=(__doc__ or "").split("\n\n")[0].strip())
    parser.add_argument("--quick", action="store_true", help="~1-minute smoke run")
    parser.add_argument("--only", action="append", choices=SCENARIOS, metavar="NAME",
                        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}")
    parser.add_argument("--save", action="store_true",
                        help="write bench/results/ even with --quick or --only")
    parser.add_argument("--no-save", action="store_true", help="never write bench/results/")
    parser.add_argument("--txlb-reactor", metavar="NAME",
                        help="run txlb under this reactor (e.g. txlb-epoll); results are "
                             "saved as proxy-NAME.*")
    parser.add_argument("--pypy", metavar="PATH",
                        help="the PyPy interpreter (with Twisted & co.) for the txlb-pypy "
                             "target, e.g. a venv's bin/pypy3 (default: pypy3 on PATH)")
    parser.add_argument("--warm-up", type=float, default=0.0, metavar="SECONDS",
                        help="drive every proxy with paced SSE and small requests for this "
                             "long each before measuring (lets PyPy's JIT compile; default 0)")
    parser.add_argument("--note", action="append", default=[], metavar="TEXT",
                        help="a note for the report (repeatable)")
    parser.add_argument("--save-as", metavar="STEM",
                        help="save as bench/results/STEM.* (default proxy, or proxy-REACTOR)")
    args = parser.parse_args(argv)
    global TXLB_REACTOR, PYPY, WARM_SECONDS
    TXLB_REACTOR = args.txlb_reactor
    PYPY = args.pypy
    WARM_SECONDS = args.warm_up
    args.argv = argv
    only = [name for name in SCENARIOS if name in (args.only or SCENARIOS)]
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    from bench.report import render, save

    raw = orchestrate(QUICK if args.quick else FULL, only, args)
    raw["notes"] = [*args.note, *raw["notes"]]
    if WARM_SECONDS > 0:
        raw["info"]["warm-up"] = (f"{WARM_SECONDS:g} s of paced SSE (64 streams) and"
                                  f" {WARM_SECONDS:g} s of small requests per proxy")
    raw["nginx_patches"] = [why for _, _, why in NGINX_PATCHES]
    raw["info"]["txlb reactor"] = TXLB_REACTOR or "Twisted's default (epoll)"
    report = render(raw)
    print()
    print(report)
    full = not args.quick and not args.only
    if (full or args.save) and not args.no_save:
        stem = args.save_as or (f"proxy-{TXLB_REACTOR}" if TXLB_REACTOR else "proxy")
        for path in save(raw, report, RESULTS, stem):
            print(f"written: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
