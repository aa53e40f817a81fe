"""
txlb against the balancers users would pick instead, on the path LLM clients use
(``python -m bench``).

Targets (``--targets`` picks some, e.g. ``--targets nginx,txlb,vllm-router``; direct always
runs, as every *added* figure subtracts it): **direct** (client -> backend), **nginx** (the
configuration ``python -m txlb.nginx --standalone`` generates, one worker, access log off),
**txlb** (``twistd -n llmlb`` from this source tree with its default command line: default
reactor, result log on; ``--txlb-args`` adds options), **vllm-router** and
**sglang-router** (the Rust routers from PyPI, installed on first use into
``bench/.venv-routers`` by :mod:`bench.routers`; ``round_robin``; ``RUST_LOG=warn``; worker
health probes every 300 s), and with ``--txlb-root PATH`` **txlb-b**, txlb run from another
checkout (an A/B of two revisions in one run).  The backend is :mod:`bench.backend`, a small
raw asyncio HTTP/1.1 server much cheaper per chunk than any proxy; the clients are
:mod:`bench.loadgen` (raw asyncio) and ``wrk``.  With two or more CPUs the proxy gets CPU 0
and the backend + clients CPU 1 (``taskset``), so proxy CPU time is the proxy's alone.

Every scenario sends ``POST /v1/chat/completions`` with a small JSON body; the backend takes
its instruction from the message content (:mod:`bench.chat`), as the routers pass nothing
else on.  Scenarios (``--only NAME`` runs one; repeat it for several):

``paced``      SSE streams of ~250-byte ``chat.completion.chunk`` events (one HTTP chunk
               each, then a usage event and ``data: [DONE]``) at 40 events/s per stream, at
               64 and 256 streams, the streams ending one by one over the last quarter of
               the run: proxy CPU µs per relayed chunk and added per-chunk latency, overall,
               by phase (starting, steady, ending) and over time.
``get-paced``  The same at 256 streams on the old non-LLM ``GET /sse`` path (continuity with
               ``bench/results/proxy.md``; not the routers, which route only OpenAI paths).
``bulk``       A few SSE streams written as fast as the path takes them: chunks/s.
``rps``        Small chat requests (``"stream": false``) with ``wrk -t1 -c32`` (a Lua script
               posts the body; the Python client if wrk is missing): requests per proxy
               CPU-second.
``ttfb``       Sequential single requests at idle: time to first byte, fresh connection and
               keep-alive; added = target - direct.
``hold``       RSS idle and per held stream (an event every 3 s) at 1,000 and 9,900
               streams, each level on a freshly started proxy (last round only).
``slow``       A 1 GiB stream read at 64 MiB/s through each proxy: peak RSS growth (last
               round only).

``--rounds N`` (default 2) runs every scenario on every target once per round, the targets
in a rotated order each round, after waiting (at most ``--quiet-wait`` s) for the load
average to fall under 0.7.  The Markdown report goes to stdout and ``bench/results/chat.md``
(raw figures in ``chat.json``, plots in ``chat.png`` when matplotlib is installed): the
headline figures of every round, their range, and txlb's ratios to vllm-router and to
nginx.  ``--quick`` is a ~2-minute smoke run (one round, shorter windows, smaller levels);
it writes nothing unless ``--save``.
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
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
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
    start_router,
    start_txlb,
    wait_for,
    wait_routing,
)
from bench.rounds import QUIET_LOAD, rotated, wait_quiet

RESULTS = ROOT / "bench" / "results"
SCENARIOS = ("paced", "get-paced", "bulk", "rps", "ttfb", "hold", "slow")
#: Scenarios about memory, not CPU: measured once, in the last round.
LAST_ROUND_ONLY = ("hold", "slow")
#: Every target ``--targets`` knows, in the report's column order.
TARGETS = ("direct", "nginx", "txlb", "txlb-b", "txlb-pypy", "vllm-router", "sglang-router")
ROUTERS = ("vllm-router", "sglang-router")
#: The targets of a run without ``--targets`` (txlb-b with --txlb-root, txlb-pypy with --pypy).
DEFAULT_TARGETS = ("direct", "nginx", "txlb", "vllm-router", "sglang-router")
MiB = 1 << 20

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
#: ``--warm-up``: seconds of paced SSE and of small requests each proxy gets before the
#: scenarios (a JIT's warm-up; 0: only the short warm-up every proxy always gets).
WARM_SECONDS = 0.0

#: Edits to the generated nginx.conf, each documented in the report.
NGINX_PATCHES: tuple[tuple[str, str, str], ...] = (
    (r"access_log \S+ txlb_results;", "access_log off;",
     "access_log off (nginx stays the floor: the routers log nothing at RUST_LOG=warn)"),
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
    #: the paced streams end one by one over this last fraction of the run
    paced_spread: float = 0.25
    #: levels of the non-LLM GET paced line
    get_paced_levels: list[int] = field(default_factory=lambda: [256])
    rounds: int = 2


FULL = Config([64, 256], 40.0, 8.0, 4, 4.0, 32, 8.0, 300, [1000, 10000], 3000.0,
              512 * MiB, 64 * MiB)
QUICK = Config([64], 40.0, 3.0, 4, 2.0, 32, 3.0, 60, [1000], 2000.0, 128 * MiB, 64 * MiB,
               get_paced_levels=[64], rounds=1)


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


def paced_levels(bench: Bench, levels: Sequence[int], api: str, spread: float,
                 targets: Sequence[Target], name: str) -> dict[str, Any]:
    """Paced SSE at each level against each target: CPU per chunk, chunk latency."""
    cfg = bench.config
    interval = 1000.0 / cfg.paced_rate
    count = int(cfg.paced_rate * cfg.paced_seconds)
    out: dict[str, Any] = {}
    for streams in levels:
        level: dict[str, Any] = {}
        for target in targets:
            result, measured = run_client(bench, target, [
                "paced", "--streams", str(streams), "--count", str(count),
                "--interval", f"{interval:g}", "--size", "250", "--api", api,
                "--spread", f"{spread:g}",
                "--timeout", str(cfg.paced_seconds + 30)], cfg.paced_seconds + 60)
            events = result["events"]
            row = dict(result, **measured,
                       us_per_chunk=per_unit(measured["proxy_cpu"], events, target),
                       client_cpu_pct=result["cpu"] / result["wall"] * 100)
            level[target.name] = row
            ending = result.get("phases", {}).get("ending", {})
            log(f"{name} {streams:4d} {target.name:13s} {events}/{result['expected']} events,"
                f" {row['us_per_chunk']:.1f} µs/chunk, p50 {result['p50_us'] / 1000:.2f} ms,"
                f" p99 {result['p99_us'] / 1000:.2f} ms (ending"
                f" {ending.get('p99_us', math.nan) / 1000:.2f}), errors {result['errors']},"
                f" client CPU {row['client_cpu_pct']:.0f} %")
        out[str(streams)] = level
    return out


def scenario_paced(bench: Bench) -> dict[str, Any]:
    """Paced chat streams at each level against each target, ending one by one."""
    return paced_levels(bench, bench.config.paced_levels, "chat", bench.config.paced_spread,
                        bench.targets, "paced")


def scenario_get_paced(bench: Bench) -> dict[str, Any]:
    """The non-LLM ``GET /sse`` line, as before (all streams end together); not the routers,
    which route only the OpenAI paths."""
    targets = [t for t in bench.targets if t.name not in ROUTERS]
    return paced_levels(bench, bench.config.get_paced_levels, "get", 0.0, targets,
                        "get-paced")


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
        log(f"bulk {target.name:13s} {result['rate']:,.0f} chunks/s,"
            f" {out[target.name]['us_per_chunk']:.2f} µs/chunk, errors {result['errors']}")
    return out


_WRK_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6}


def _wrk_latency(text: str, label: str) -> float:
    """A percentile from wrk's ``--latency`` distribution, in µs (NaN if absent)."""
    match = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
    return float(match.group(1)) * _WRK_UNITS[match.group(2)] if match else math.nan


def wrk_script(directory: Path) -> Path:
    """The Lua script that makes wrk post the small chat request (``"stream": false``)."""
    from bench.chat import CHAT_PATH, Instruction, chat_body

    body = chat_body(Instruction("json")).decode()
    path = directory / "chat.lua"
    path.write_text(
        'wrk.method = "POST"\n'
        f"wrk.path = \"{CHAT_PATH}\"\n"
        f"wrk.body = [[{body}]]\n"
        'wrk.headers["Content-Type"] = "application/json"\n')
    return path


def run_wrk(bench: Bench, target: Target) -> dict[str, Any]:
    """``wrk -t1 -cC -dSs --latency`` posting small chat requests through ``target``."""
    cfg = bench.config
    meter = Meter(bench, target)
    from bench.chat import CHAT_PATH

    child = bench.children.spawn(f"wrk-{target.name}", pinned(bench.client_core, [
        "wrk", "-t1", f"-c{cfg.rps_connections}", f"-d{cfg.rps_seconds:g}s", "--latency",
        "-s", str(wrk_script(bench.workdir)), f"http://{HOST}:{target.port}{CHAT_PATH}"]))
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
        log(f"rps {target.name:13s} {row['rate']:,.0f} req/s, p50 {row['p50_us']:.0f} µs,"
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
            log(f"ttfb {mode:9s} {target.name:13s} p50 {result['p50_us']:.0f} µs,"
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


def fresh_proxy(bench: Bench, name: str) -> Target:
    """A newly started proxy of the same kind as the one called ``name``."""
    return start_target(bench.children, bench.proxy_core, bench.backends, bench.workdir, name)


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
            log(f"hold {streams:6d} {target.name:13s} held {row['held']}/{streams},"
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
        log(f"slow {target.name:13s} {result['bytes'] / MiB:.0f} MiB in {result['wall']:.1f} s,"
            f" complete {result['complete']}, RSS {base / 1024:.1f} -> peak"
            f" {peak / 1024:.1f} MiB {result['error']}")
    return out


RUNNERS: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "paced": scenario_paced, "get-paced": scenario_get_paced, "bulk": scenario_bulk,
    "rps": scenario_rps, "ttfb": scenario_ttfb, "hold": scenario_hold, "slow": scenario_slow,
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


def revision(root: Path = ROOT) -> str:
    """A txlb checkout's short commit, and whether its ``txlb/`` has local changes."""
    head = _output(["git", "-C", str(root), "rev-parse", "--short", "HEAD"])
    if not re.fullmatch(r"[0-9a-f]+", head):
        return "? (not a git checkout)"
    dirty = _output(["git", "-C", str(root), "status", "--porcelain", "--", "txlb"])
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


def system_info(args: argparse.Namespace, multi: bool, nofile: int,
                names: Sequence[str]) -> dict[str, Any]:
    """The report's header: the machine, its load, and every version measured."""
    from bench.routers import router_version

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
        "txlb command": "twistd -n llmlb --listen tcp:0 --backends B1,B2 --admin none"
        " --log-file FILE --read-timeout 600 --health-interval 30"
        + (f" --reactor {TXLB_REACTOR}" if TXLB_REACTOR else "")
        + (f" {shlex.join(TXLB_ARGS)}" if TXLB_ARGS else ""),
    }
    if "txlb-b" in names and TXLB_ROOT is not None:
        info["txlb-b"] = f"{revision(TXLB_ROOT)} ({TXLB_ROOT})"
    for router in ROUTERS:
        if router in names:
            info[router] = (f"{router_version(router)} (PyPI), --policy {ROUTER_POLICY},"
                            f" health probes every {ROUTER_HEALTH_INTERVAL:g} s, RUST_LOG=warn")
    if "txlb-pypy" in names:
        info["PyPy"] = pypy_status()
    info.update({
        "command": shlex.join(["python", "-m", "bench", *args.argv]),
        "pinning": ("proxy on CPU 0; backend, load generator and wrk on CPU 1 (taskset)"
                    if multi else "none (one CPU or no taskset)"),
        "RLIMIT_NOFILE": nofile,
        "load average at start": loadavg(),
    })
    return info


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


def run_round(bench: Bench, index: int, rounds: int, only: Sequence[str],
              quiet_wait: float) -> dict[str, Any]:
    """One round: wait for a quiet machine, then every scenario, targets in rotated order."""
    quiet = wait_quiet(quiet_wait)
    order = rotated(bench.proxies(), index)
    direct = [t for t in bench.targets if t.child is None]
    bench.targets = [*direct, *order]
    log(f"== round {index + 1}/{rounds}: {quiet.describe(QUIET_LOAD)};"
        f" order {' -> '.join(t.name for t in bench.targets)}")
    data: dict[str, Any] = {}
    for name in only:
        if name in LAST_ROUND_ONLY and index != rounds - 1:
            continue
        log(f"-- {name}")
        try:
            data[name] = RUNNERS[name](bench)
        except (RuntimeError, OSError, ValueError, KeyError) as exc:
            # one broken scenario should not cost the others; the report says so
            log(f"scenario {name} FAILED: {exc}")
            bench.notes.append(f"round {index + 1}: scenario `{name}` FAILED:"
                               f" {str(exc)[:300]}")
    return {"order": [t.name for t in bench.targets], "quiet": quiet.describe(QUIET_LOAD),
            "load": quiet.load, "waited_s": quiet.waited_s, "data": data}


def orchestrate(config: Config, only: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    """Start backend and proxies, run the rounds, stop everything; the raw results."""
    multi = (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None
    proxy_core, client_core = (0, 1) if multi else (None, None)
    nofile = nofile_limit()
    names = chosen_targets(args.targets, args.pypy is not None, TXLB_ROOT is not None)
    info = system_info(args, multi, nofile, names)
    notes: list[str] = []
    rounds: list[dict[str, Any]] = []
    steal0 = cpu_steal()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="txlb-bench.") as tmp:
        children = Children(Path(tmp))
        try:
            backend, ports = start_backend(children, client_core, 2)
            backends = ",".join(f"{HOST}:{port}" for port in ports)
            targets = start_all(children, proxy_core, backends, Path(tmp), names, ports[0],
                                notes)
            bench = Bench(children, Path(tmp), backend, backends, targets, proxy_core,
                          client_core, config, nofile, notes=notes)
            log(f"backend ports {ports}; " + ", ".join(
                f"{t.name} :{t.port} pids {t.pids()}" for t in targets if t.child))
            for target in targets:
                if target.name.startswith("txlb") and target.child is not None:
                    logged = re.search(r"reactor class: ([\w.]+)", target.child.text())
                    info[f"{target.name} reactor"] = (logged.group(1).rstrip(".") if logged
                                                      else "? (not in its start-up log)")
            for target in targets:
                warm_up(bench, target)
            if WARM_SECONDS > 0:
                for target in bench.proxies():
                    log(f"warm-up {target.name}: {WARM_SECONDS:g} s paced + {WARM_SECONDS:g} s"
                        " small requests")
                    warm_up_long(bench, target, WARM_SECONDS)
            for index in range(config.rounds):
                rounds.append(run_round(bench, index, config.rounds, only, args.quiet_wait))
        finally:
            children.stop_all()
    steal1 = cpu_steal()
    total = steal1[1] - steal0[1]
    info["load average at end"] = loadavg()
    info["CPU steal during run"] = (f"{(steal1[0] - steal0[0]) / total * 100:.1f} %"
                                    if total else "?")
    info["wall"] = f"{time.monotonic() - started:.0f} s"
    ran = {t.name for t in targets}
    return {"info": info, "config": config.__dict__, "rounds": rounds, "notes": notes,
            "targets": [n for n in names if n in ran]}


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM/SIGHUP: unwind through the ``finally`` that stops the children."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the options, run, print the report, save it (full runs, or ``--save``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description=(__doc__ or "").split("\n\n")[0].strip())
    parser.add_argument("--quick", action="store_true", help="~2-minute smoke run, one round")
    parser.add_argument("--only", action="append", choices=SCENARIOS, metavar="NAME",
                        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}")
    parser.add_argument("--targets", metavar="A,B,...",
                        help=f"the targets to measure (direct always runs): {', '.join(TARGETS)}"
                             f" (default: {','.join(DEFAULT_TARGETS)})")
    parser.add_argument("--rounds", type=int, metavar="N",
                        help="rounds, targets in rotated order each (default 2; --quick 1)")
    parser.add_argument("--quiet-wait", type=float, metavar="SECONDS",
                        help=f"before each round, wait at most this long for the load average"
                             f" to fall under {QUIET_LOAD:g} (default 60; --quick 10)")
    parser.add_argument("--save", action="store_true",
                        help="write bench/results/ even with --quick or --only")
    parser.add_argument("--no-save", action="store_true", help="never write bench/results/")
    parser.add_argument("--txlb-args", default="", metavar="'ARGS'",
                        help="extra options for every txlb target, e.g. '--reactor txlb-epoll'"
                             " or '--log-file none'")
    parser.add_argument("--txlb-reactor", metavar="NAME",
                        help="run txlb under this reactor (e.g. txlb-epoll)")
    parser.add_argument("--txlb-root", type=Path, metavar="PATH",
                        help="add target txlb-b: txlb run from this other checkout (its"
                             " .venv's twistd if it has one), for an A/B in one run")
    parser.add_argument("--router-policy", default="round_robin", metavar="NAME",
                        help="the Rust routers' --policy (default round_robin)")
    parser.add_argument("--pypy", metavar="PATH",
                        help="add target txlb-pypy, run by this PyPy interpreter (with "
                             "Twisted & co.), e.g. a venv's bin/pypy3")
    parser.add_argument("--warm-up", type=float, default=0.0, metavar="SECONDS",
                        help="drive every proxy with paced SSE and small requests for this "
                             "long each before measuring (lets PyPy's JIT compile; default 0)")
    parser.add_argument("--note", action="append", default=[], metavar="TEXT",
                        help="a note for the report (repeatable)")
    parser.add_argument("--save-as", metavar="STEM",
                        help="save as bench/results/STEM.* (default chat)")
    args = parser.parse_args(argv)
    global TXLB_REACTOR, TXLB_ARGS, TXLB_ROOT, ROUTER_POLICY, PYPY, WARM_SECONDS
    TXLB_REACTOR = args.txlb_reactor
    TXLB_ARGS = shlex.split(args.txlb_args)
    TXLB_ROOT = args.txlb_root.resolve() if args.txlb_root else None
    ROUTER_POLICY = args.router_policy
    PYPY = args.pypy
    WARM_SECONDS = args.warm_up
    args.argv = argv
    try:
        chosen_targets(args.targets, False, True)
    except ValueError as exc:
        parser.error(str(exc))
    only = [name for name in SCENARIOS if name in (args.only or SCENARIOS)]
    config = QUICK if args.quick else FULL
    if args.quiet_wait is None:
        args.quiet_wait = 10.0 if args.quick else 60.0
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error("--rounds must be at least 1")
        config = replace(config, rounds=args.rounds)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    from bench.chat_report import render, save

    raw = orchestrate(config, only, args)
    raw["notes"] = [*args.note, *raw["notes"]]
    if WARM_SECONDS > 0:
        raw["info"]["warm-up"] = (f"{WARM_SECONDS:g} s of paced SSE (64 streams) and"
                                  f" {WARM_SECONDS:g} s of small requests per proxy")
    raw["nginx_patches"] = [why for _, _, why in NGINX_PATCHES]
    report = render(raw)
    print()
    print(report)
    full = not args.quick and not args.only
    if (full or args.save) and not args.no_save:
        written = save(raw, report, RESULTS, args.save_as or "chat")
        for path in written:
            print(f"written: {path}")
        if not any(path.suffix == ".png" for path in written):
            print("no plot: matplotlib is not installed in this environment")


if __name__ == "__main__":
    main()
