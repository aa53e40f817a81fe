"""
``--workers``: txlb with 1 and with 2 worker processes, side by side in one run
(``python -m bench.workers``).

Both balancers run at once from this source tree in front of the same :mod:`bench.backend`
(4 ports), and are measured in alternation, round after round, so slow drifts of a shared
machine hit both alike.  Nothing is pinned: the point is what a second process buys on
the whole machine, where the backend and the load generators need CPU too (on 2 cores
they compete with the proxy; read the CPU columns).

Per round and balancer:

``rps``    ``wrk -t2 -c64`` on ``/json`` (small JSON answers): requests/s, latency, and proxy
           CPU per request, the supervisor's share apart.
``bulk``   8 SSE streams written as fast as the path takes them: chunks/s.
``paced``  256 SSE streams of 250-byte events at 40 events/s each: proxy CPU per relayed
           chunk and the chunk latency (the load is fixed, so this shows the cost of the
           extra process and its messages, and what spreading the load does to latency).

Writes ``bench/results/workers.md`` (and ``workers.json``) with ``--save``, prints the
table and the 2-worker/1-worker ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import (
    CLK_TCK,
    HOST,
    ROOT,
    TWISTD,
    Children,
    Target,
    core_times,
    cpu_seconds,
    descendants,
    start_backend,
    wait_for,
    wait_ready,
)

RESULTS = ROOT / "bench" / "results"


def start_txlb(children: Children, backends: str, workers: int,
               reactor: str | None) -> Target:
    """``twistd -n llmlb --workers N`` on a free port; returns once every worker serves."""
    selected = ["--reactor", reactor] if reactor else []
    name = f"txlb-{workers}w"
    child = children.spawn(name, [
        TWISTD, *selected, "-n", "--pidfile=", "llmlb", "--workers", str(workers),
        "--listen", f"tcp:0:interface={HOST}", "--backends", backends,
        "--admin", "none", "--log-file", "none", "--read-timeout", "600",
        "--health-interval", "30"])
    port = int(wait_for(child, r"ProxySite starting on (\d+)").group(1))
    if workers > 1:
        deadline = time.monotonic() + 30
        while child.text().count(") serving") < workers:
            if time.monotonic() > deadline or child.process.poll() is not None:
                raise RuntimeError(f"{name} workers did not start:\n{child.text()[-3000:]}")
            time.sleep(0.05)
    wait_ready(port, alive=lambda: child.process.poll() is None)
    target = Target(name, port, child)
    target.pids_cache = descendants(child.process.pid)
    return target


class Meter:
    """CPU of the balancer's processes (supervisor apart), the backend and reaped clients."""

    def __init__(self, target: Target, backend_pid: int) -> None:
        assert target.child is not None
        self.target = target
        self.main = target.child.process.pid
        self.backend_pid = backend_pid
        self.t0 = time.monotonic()
        self.total0 = target.cpu()
        self.main0 = cpu_seconds([self.main])
        self.backend0 = cpu_seconds([backend_pid])
        self.reaped0 = _reaped()
        self.cores0 = core_times()

    def stop(self) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        total = self.target.cpu() - self.total0
        main = cpu_seconds([self.main]) - self.main0
        busy = sum(b1 - b0 for (b1, _), (b0, _) in zip(core_times(), self.cores0, strict=True))
        machine = busy / CLK_TCK / wall * 100
        measured = {
            "wall": wall, "proxy_cpu": total, "supervisor_cpu": main,
            "proxy_cpu_pct": total / wall * 100,
            "backend_cpu_pct": (cpu_seconds([self.backend_pid]) - self.backend0) / wall * 100,
            "client_cpu_pct": (_reaped() - self.reaped0) / wall * 100,
        }
        # CPU used by anything else on the machine (other jobs sharing it): the noise
        measured["other_cpu_pct"] = max(0.0, machine - measured["proxy_cpu_pct"]
                                        - measured["backend_cpu_pct"]
                                        - measured["client_cpu_pct"])
        return measured


def _reaped() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


_WRK_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6}


def _wrk_latency(text: str, label: str) -> float:
    match = re.search(rf"^\s*{label}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
    return float(match.group(1)) * _WRK_UNITS[match.group(2)] if match else math.nan


def run_rps(children: Children, target: Target, backend_pid: int,
            seconds: float) -> dict[str, Any]:
    meter = Meter(target, backend_pid)
    child = children.spawn(f"wrk-{target.name}", [
        "wrk", "-t2", "-c64", f"-d{seconds:g}s", "--latency",
        f"http://{HOST}:{target.port}/json"])
    try:
        child.process.wait(seconds + 30)
    finally:
        children.stop(child)
    measured = meter.stop()
    text = child.text()
    requests = re.search(r"(\d+) requests in", text)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", text)
    if not requests or not rate:
        raise RuntimeError(f"wrk failed:\n{text}")
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    count = int(requests.group(1))
    return dict(measured, requests=count, rate=float(rate.group(1)),
                errors=int(non2xx.group(1)) if non2xx else 0,
                p50_us=_wrk_latency(text, "50"), p99_us=_wrk_latency(text, "99"),
                us_per_request=measured["proxy_cpu"] / count * 1e6,
                supervisor_us_per_request=measured["supervisor_cpu"] / count * 1e6)


def run_loadgen(children: Children, target: Target, backend_pid: int, args: list[str],
                timeout: float) -> dict[str, Any]:
    meter = Meter(target, backend_pid)
    child = children.spawn(f"load-{target.name}", [
        sys.executable, "-m", "bench.loadgen", *args, "--port", str(target.port)])
    try:
        child.process.wait(timeout)
    finally:
        children.stop(child)
    measured = meter.stop()
    match = re.search(r"^RESULT (.*)$", child.text(), re.M)
    if not match:
        raise RuntimeError(f"loadgen failed:\n{child.text()[-2000:]}")
    result = json.loads(match.group(1))
    events = result["events"]
    return dict(result, **measured, us_per_chunk=measured["proxy_cpu"] / events * 1e6
                if events else math.nan)


PROGRESS: list[str] = []


def say(line: str) -> None:
    """A progress line, printed now and kept for the report."""
    PROGRESS.append(line)
    print(line, flush=True)


def measure(children: Children, target: Target, backend_pid: int, quick: bool,
            ) -> dict[str, Any]:
    seconds = 3.0 if quick else 6.0
    rps = run_rps(children, target, backend_pid, seconds)
    say(f"  rps   {target.name}: {rps['rate']:,.0f} req/s, p50 {rps['p50_us']:.0f} µs,"
          f" other jobs {rps['other_cpu_pct']:.0f} %,"
          f" p99 {rps['p99_us']:.0f} µs, proxy CPU {rps['proxy_cpu_pct']:.0f} %"
          f" ({rps['us_per_request']:.0f} µs/request, supervisor"
          f" {rps['supervisor_us_per_request']:.0f}), errors {rps['errors']}")
    bulk = run_loadgen(children, target, backend_pid,
                       ["bulk", "--streams", "8", "--seconds", f"{seconds / 2:g}"], 60)
    say(f"  bulk  {target.name}: {bulk['rate']:,.0f} chunks/s,"
        f" proxy CPU {bulk['proxy_cpu_pct']:.0f} %, other jobs {bulk['other_cpu_pct']:.0f} %")
    count = int(40 * seconds)
    paced = run_loadgen(children, target, backend_pid, [
        "paced", "--streams", "256", "--count", str(count), "--interval", "25",
        "--size", "250", "--timeout", str(seconds + 30)], seconds + 60)
    say(f"  paced {target.name}: {paced['us_per_chunk']:.1f} µs/chunk,"
        f" p50 {paced['p50_us'] / 1000:.2f} ms, p99 {paced['p99_us'] / 1000:.2f} ms,"
        f" {paced['events']}/{paced['expected']} events,"
        f" other jobs {paced['other_cpu_pct']:.0f} %")
    return {"rps": rps, "bulk": bulk, "paced": paced}


#: A measurement counts as quiet when the rest of the machine used less than this much CPU
#: meanwhile (% of one core); the machine these figures come from rarely did less.
QUIET_OTHER_PCT = 40.0


def median(rounds: list[dict[str, Any]], scenario: str, key: str,
           quiet: bool = False) -> float:
    values = [r[scenario][key] for r in rounds
              if not quiet or r[scenario]["other_cpu_pct"] < QUIET_OTHER_PCT]
    return statistics.median(values) if values else math.nan


ROWS = (
    ("small JSON requests/s (wrk -t2 -c64)", "rps", "rate", "{:,.0f}"),
    ("  latency p50, µs", "rps", "p50_us", "{:,.0f}"),
    ("  latency p99, µs", "rps", "p99_us", "{:,.0f}"),
    ("  proxy CPU, % of one core (all processes)", "rps", "proxy_cpu_pct", "{:.0f}"),
    ("  proxy CPU per request, µs (all processes)", "rps", "us_per_request", "{:.0f}"),
    ("  of which the supervisor, µs", "rps", "supervisor_us_per_request", "{:.0f}"),
    ("  backend CPU, % / wrk CPU, %", "rps", None, ""),
    ("  other jobs on the machine meanwhile, % of one core", "rps", "other_cpu_pct", "{:.0f}"),
    ("bulk SSE chunks/s (8 streams)", "bulk", "rate", "{:,.0f}"),
    ("  proxy CPU, % of one core", "bulk", "proxy_cpu_pct", "{:.0f}"),
    ("paced SSE, 256 streams × 40/s: proxy CPU per chunk, µs", "paced", "us_per_chunk",
     "{:.1f}"),
    ("  of which the supervisor, % of proxy CPU", "paced", None, ""),
    ("  chunk latency p50, ms", "paced", "p50_us", "{:.2f}"),
    ("  chunk latency p99, ms", "paced", "p99_us", "{:.2f}"),
)


def _supervisor_share(round_: dict[str, Any]) -> float:
    paced = round_["paced"]
    return float(paced["supervisor_cpu"] / paced["proxy_cpu"] * 100)


def table(results: dict[str, list[dict[str, Any]]], quiet: bool = False) -> str:
    one, two = results["txlb-1w"], results["txlb-2w"]
    title = (f"median of quiet measurements (other jobs < {QUIET_OTHER_PCT:g} %)" if quiet
             else "median of all rounds")
    lines = [f"| figure ({title}) | 1 worker | 2 workers | 2 / 1 |",
             "|---|---:|---:|---:|"]
    for label, scenario, key, fmt in ROWS:
        if key is None and scenario == "rps":
            cells = [f"{median(r, 'rps', 'backend_cpu_pct'):.0f} / "
                     f"{median(r, 'rps', 'client_cpu_pct'):.0f}" for r in (one, two)]
            lines.append(f"| {label} | {cells[0]} | {cells[1]} | |")
            continue
        if key is None:
            cells = [f"{statistics.median(_supervisor_share(x) for x in r):.0f}"
                     for r in (one, two)]
            lines.append(f"| {label} | {cells[0]} | {cells[1]} | |")
            continue
        a, b = median(one, scenario, key, quiet), median(two, scenario, key, quiet)
        scale = 1 / 1000 if key in ("p50_us", "p99_us") and scenario == "paced" else 1
        if math.isnan(a) or math.isnan(b):
            shown = [("n/a" if math.isnan(x) else fmt.format(x * scale)) for x in (a, b)]
            lines.append(f"| {label} | {shown[0]} | {shown[1]} | n/a |")
            continue
        lines.append(f"| {label} | {fmt.format(a * scale)} | {fmt.format(b * scale)} |"
                     f" {b / a:.2f}× |")
    return "\n".join(lines)


def _describe_machine() -> list[str]:
    def output(argv: list[str]) -> str:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=10,
                                  check=False).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "?"

    commit = output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    return [
        f"- date: `{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}`",
        f"- uname -a: `{output(['uname', '-a'])}`",
        f"- nproc: `{os.cpu_count()}`",
        f"- python: `{platform.python_version()} ({sys.executable})`",
        f"- wrk: `{output(['wrk', '-v']) if shutil.which('wrk') else 'missing'}`",
        f"- txlb: `{commit}`",
        f"- load average at start: `{' '.join(f'{x:.2f}' for x in os.getloadavg())}`",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.workers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3-second windows, 1 round")
    parser.add_argument("--reactor", default=None, help="e.g. txlb-epoll")
    parser.add_argument("--save", action="store_true", help="write bench/results/workers.md")
    parser.add_argument("--save-as", default="workers",
                        help="the results' file name under bench/results/ (no extension)")
    args = parser.parse_args(argv)
    if not shutil.which("wrk"):
        raise SystemExit("wrk is required (apt-get install wrk)")
    rounds = 1 if args.quick else args.rounds
    machine = _describe_machine()
    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="txlb-bench-workers-"))
    children = Children(workdir)
    results: dict[str, list[dict[str, Any]]] = {"txlb-1w": [], "txlb-2w": []}
    try:
        backend, ports = start_backend(children, None, 4)
        backends = ",".join(f"{HOST}:{port}" for port in ports)
        targets = [start_txlb(children, backends, n, args.reactor) for n in (1, 2)]
        for target in targets:  # warm: imports, pools
            run_rps(children, target, backend.process.pid, 2)
        for index in range(rounds):
            order = targets if index % 2 == 0 else targets[::-1]
            say(f"round {index + 1}/{rounds}")
            for target in order:
                results[target.name].append(
                    measure(children, target, backend.process.pid, args.quick))
    finally:
        children.stop_all()
    text = "\n".join([
        "# `--workers`: one worker process against two, side by side",
        "",
        *machine,
        f"- command: `python -m bench.workers{' --reactor ' + args.reactor if args.reactor else ''}"
        f"{' --quick' if args.quick else ''}`",
        f"- rounds: `{rounds}` (alternating order; medians below)",
        f"- wall: `{time.monotonic() - began:.0f} s`",
        "- txlb: `twistd -n llmlb --workers N --admin none --log-file none --read-timeout 600"
        " --health-interval 30`; nothing pinned (balancer, backend and clients share both"
        " cores)",
        "- the machine is shared and noisy: treat differences under ~10–20 % as noise",
        "",
        table(results),
        "",
        "The same, counting only the measurements during which the rest of the machine was"
        " nearly idle (the fairest comparison on a shared machine; n/a: none was):",
        "",
        table(results, quiet=True),
        "",
        "Every measurement, in the order it ran (\"other jobs\": CPU the rest of the machine"
        " used meanwhile, in % of one core):",
        "",
        "```",
        *PROGRESS,
        "```",
        "",
    ])
    print(text)
    if args.save:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.save_as}.md").write_text(text)
        (RESULTS / f"{args.save_as}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
