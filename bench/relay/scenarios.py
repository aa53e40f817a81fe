"""
The scenarios of ``python -m bench relay``: what each measures through every target, and the
load-generator runs and CPU readings they are made of.

Each scenario is a function of the :class:`Bench` (the started backend and targets, the
sizes of the run) returning its raw figures; :data:`RUNNERS` names them for ``--only``.
"""

from __future__ import annotations

import json
import math
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chat import CHAT_PATH, Instruction, chat_body
from bench.harness import (
    HOST,
    Child,
    Children,
    Target,
    core_times,
    cpu_ns,
    cpu_seconds,
    log,
    pinned,
    wait_for,
)
from bench.relay.targets import ROUTERS, start_target

SCENARIOS = ("paced", "get-paced", "bulk", "rps", "ttfb", "hold", "slow")


#: Scenarios about memory, not CPU: measured once, in the last round.
LAST_ROUND_ONLY = ("hold", "slow")


MiB = 1 << 20


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
