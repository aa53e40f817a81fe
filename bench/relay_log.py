"""
Does the per-request result log cost the relay path anything measurable?

What is measured
----------------
Two real ``twistd llmlb`` processes run side by side in front of the same four simulated
vLLM backends: one with the result log on (``--log-file`` pointing into a temporary
directory) and one with it off (``--log-file none``).  Nothing else differs.  A load
generator keeps ``C`` streaming chat completions in flight against one balancer at a time
for a fixed duration; each completion streams ``X-Sim-Tokens`` SSE events (plus the role,
finish and ``[DONE]`` events), so every request exercises the per-chunk relay path a few
hundred times and the per-request log path once.

For each measurement the balancer's own CPU time (``utime + stime`` from
``/proc/PID/stat``, a delta over the run) is divided by the number of SSE events the
client received through it, giving **CPU µs per relayed event**.  The ratio of that
figure, log on / log off, is the answer: whatever per-request work ``--log-file none``
skips (writing the line, and summarising the captured response if nothing else needs
the summary), amortised over the events of the request, plus anything the log might add
per chunk.  CPU per event rather than throughput is the headline because the offered
load is capped by the simulators' decode speed, so both balancers relay the same rate
and a difference shows up as CPU, not events per second.

Two checks go with it.  The log-on balancer's file must grow by exactly one line per
request sent (counted per run).  And the two per-request steps of the log --
``summarize`` and ``ResultLog.write`` -- are timed in process on a real simulator
response, which predicts the ratio the process runs should find and shows how it
compares with the run-to-run noise.  ``--source DIR`` runs the balancers from another
checkout (for instance an older revision exported with ``git archive``), to compare
revisions with the same harness.

Why it is set up this way
-------------------------
* **Real processes, real sockets.**  The balancer is started exactly as operators start
  it, so the measurement includes Twisted's HTTP parsing, chunked encoding and the
  file writes, not a mocked-out path.
* **Alternating runs** (on, off, on, off, ...) after a short warm-up of each, so drift
  on a shared, noisy machine affects both variants alike; every run is reported, and the
  ratio is given per round as well as pooled, so the spread is visible.
* **Pinning.**  With ``taskset`` available, the balancers get CPU 0 and the simulators
  plus load generator CPU 1, so the client side does not steal the proxy's CPU.  The
  client side's own CPU use is reported to show whether it kept up.
* **Drain, then stop.**  After the duration, the generator starts no new requests and
  lets the ones in flight finish (bounded by a grace period), so every request it counts
  is complete, the CPU delta covers exactly the work counted, and the log-on balancer's
  file must have grown by exactly one line per request sent (checked per round).

Run from the repository root::

    python -m bench.relay_log            # about two minutes (3 rounds of 15 s each)
    python -m bench.relay_log --help

The table is printed and written to ``bench/results/relay_log.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness import (
    HOST,
    TWISTD,
    Child,
    Children,
    cpu_seconds,
    free_port,
    pinned,
    stop_on_signals,
    wait_for,
)
from bench.relay_log_children import DRAIN_GRACE, MODEL, LoadStats, run_load, run_simulators
from bench.relay_log_report import LogCost, Measurement, render, system_info

ROOT = Path(__file__).resolve().parent.parent


RESULTS = ROOT / "bench" / "results" / "relay_log.md"


def count_lines(log: Path) -> int:
    """Lines in the result log and its rotated backups (``log.1``, ``log.2``, ...)."""
    total = 0
    for path in [log, *sorted(log.parent.glob(log.name + ".*"))]:
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                total += chunk.count(b"\n")
    return total


@dataclass
class Balancer:
    label: str
    child: Child
    port: int
    log: Path | None


def measure(children: Children, balancer: Balancer, sims_pid: int, args: argparse.Namespace,
            round_: int, duration: float) -> Measurement:
    """One load run against ``balancer``; CPU deltas bracket the whole generator run."""
    lines_before = count_lines(balancer.log) if balancer.log else 0
    proxy0, sims0 = cpu_seconds([balancer.child.process.pid]), cpu_seconds([sims_pid])
    load = children.spawn(
        f"load-{balancer.label}-{round_}",
        pinned(args.client_core, [
            sys.executable, "-m", "bench.relay_log", "_load", "--port", str(balancer.port),
            "--concurrency", str(args.concurrency), "--duration", str(duration),
            "--tokens", str(args.tokens),
        ]),
    )
    try:
        load.process.wait(duration + DRAIN_GRACE + 15)
    finally:
        children.stop(load)
    proxy1, sims1 = cpu_seconds([balancer.child.process.pid]), cpu_seconds([sims_pid])
    last = load.output.read_text().strip().splitlines()
    if load.process.returncode != 0 or not last:
        raise RuntimeError(f"load generator failed:\n{load.output.read_text()}")
    stats = LoadStats(**json.loads(last[-1]))
    lines = None
    if balancer.log:
        time.sleep(0.2)  # the last lines are written as the last requests end
        lines = count_lines(balancer.log) - lines_before
    return Measurement(balancer.label, round_, proxy1 - proxy0, sims1 - sims0, stats, lines)


def balancer_options(source: Path) -> set[str]:
    """The long options ``twistd llmlb`` accepts, from its ``--help``."""
    help_text = subprocess.run(
        [TWISTD, "llmlb", "--help"], capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=str(source)), cwd=tempfile.gettempdir(),
    ).stdout
    return set(re.findall(r"--([a-z][a-z-]*)", help_text))


def start_balancer(children: Children, label: str, backends: str, log: Path | None,
                   core: int | None, source: Path, options: set[str]) -> Balancer:
    """
    ``twistd -n llmlb`` on a free loopback port, log on (``log``) or off (``None``).

    Side ports the balancer may open (an admin API) are switched off, so two balancers can
    run at once and nothing but the relay path differs.
    """
    port = free_port()
    extra = ["--admin", "none"] if "admin" in options else []
    child = children.spawn(
        f"llmlb-{label}",
        pinned(core, [
            TWISTD, "-n", "--pidfile=", "llmlb",
            "--listen", f"tcp:{port}:interface={HOST}",
            "--backends", backends,
            "--log-file", str(log) if log else "none",
            "--log-max-bytes", "1GiB",
            *extra,
        ]),
        source=source,
    )
    wait_for(child, rf"starting on {port}\b")
    return Balancer(label, child, port, log)


def log_cost_in_process(sim_port: int, tokens: int, workdir: Path, core: int | None,
                        repeat: int = 1000) -> LogCost:
    """
    Time, in this process, what logging one request costs: ``summarize`` over the response
    a simulator really sends (captured the way the proxy captures it, one piece per
    event), then ``ResultLog.write`` of the summary (format one line, write it).  Pinned
    to the balancers' CPU.  Which of the two steps the log-off balancer skips depends on
    the balancer (it may summarise every request anyway, for metrics), so both are shown.
    """
    import http.client

    from twisted.internet.task import Clock

    from txlb._records.record import RequestRecord
    from txlb._records.resultlog import ResultLog
    from txlb._records.summary import summarize

    body = json.dumps({
        "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}],
    }).encode()
    connection = http.client.HTTPConnection(HOST, sim_port, timeout=30)
    connection.request("POST", "/v1/chat/completions", body,
                       {"Content-Type": "application/json", "X-Sim-Tokens": str(tokens)})
    response = connection.getresponse()
    stream, content_type = response.read(), response.getheader("content-type", "")
    connection.close()
    events = [event + b"\n\n" for event in stream.split(b"\n\n") if event]

    def record() -> RequestRecord:
        r = RequestRecord(started=1.0, method=b"POST", path=b"/v1/chat/completions",
                          orid_header=None, request_body=body)
        r.backend, r.status, r.content_type = f"{HOST}:{sim_port}", 200, content_type.encode()
        r.first_byte, r.ended = 1.05, 2.1
        for event in events:
            r.capture(event)
        return r

    records = [record() for _ in range(repeat)]
    log = ResultLog(str(workdir / "in-process.log"), 1 << 30, 1, "text", Clock())
    affinity = os.sched_getaffinity(0)
    try:
        if core is not None:
            os.sched_setaffinity(0, {core})
        start = time.process_time()
        summaries = [summarize(r) for r in records]
        middle = time.process_time()
        for summary in summaries:
            log.write(summary)
        end = time.process_time()
    finally:
        os.sched_setaffinity(0, affinity)
        log.close()
    return LogCost((middle - start) / repeat * 1e6, (end - middle) / repeat * 1e6, len(events))


def orchestrate(args: argparse.Namespace) -> str:
    core_proxy, core_client = (0, 1) if shutil.which("taskset") and (os.cpu_count() or 1) >= 2 \
        else (None, None)
    args.client_core = core_client
    pinning = ("balancers on CPU 0, simulators + load generator on CPU 1 (taskset)"
               if core_proxy is not None else "none (taskset missing or a single CPU)")
    with tempfile.TemporaryDirectory(prefix="relay_log.") as tmp:
        children = Children(Path(tmp))
        try:
            sims = children.spawn("sims", pinned(core_client, [
                sys.executable, "-m", "bench.relay_log", "_sims",
                "--tokens-per-second", str(args.tokens_per_second),
                "--max-num-seqs", str(args.max_num_seqs),
            ]))
            ports = json.loads(wait_for(sims, r"(\{.*\})").group(1))["ports"]
            backends = ",".join(f"{HOST}:{port}" for port in ports)
            log = Path(tmp) / "results.log"
            source = args.source.resolve()
            options = balancer_options(source)
            balancers = {
                label: start_balancer(children, label, backends, path, core_proxy, source,
                                      options)
                for label, path in (("on", log), ("off", None))
            }
            print(f"simulators on {ports}; balancers: log on :{balancers['on'].port},"
                  f" log off :{balancers['off'].port}", flush=True)
            for label, balancer in balancers.items():  # connection pools, imports, caches
                warm = measure(children, balancer, sims.process.pid, args, 0, args.warmup)
                print(f"warm-up {label}: {warm.load.events} events, {warm.requests} requests",
                      flush=True)
            results = []
            for round_ in range(1, args.rounds + 1):
                for label in ("on", "off"):
                    m = measure(children, balancers[label], sims.process.pid, args, round_,
                                args.duration)
                    print(f"round {round_} log {label}: {m.us_per_event:.1f} µs/event,"
                          f" {m.load.events} events, {m.requests} requests,"
                          f" proxy CPU {m.proxy_cpu:.2f} s, log lines {m.log_lines}",
                          flush=True)
                    results.append(m)
            cost = log_cost_in_process(ports[0], args.tokens, Path(tmp), core_proxy)
            with open(log, errors="replace") as lines:
                sample = lines.readline().strip()
        finally:
            children.stop_all()
    return render(results, cost, sample, args, system_info(), pinning)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench.relay_log", description=__doc__.split("\n\n")[0].strip()
    )
    parser.add_argument("--concurrency", type=int, default=64, help="streams in flight")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per variant")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of warm-up each")
    parser.add_argument("--tokens", type=int, default=200, help="X-Sim-Tokens per request")
    parser.add_argument("--tokens-per-second", type=float, default=200.0,
                        help="simulated decode speed per stream")
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--source", type=Path, default=ROOT,
                        help="txlb checkout the balancers run from (default: this one)")
    parser.add_argument("--no-save", action="store_true", help=f"do not write {RESULTS}")
    sub = parser.add_subparsers(dest="role")
    sims = sub.add_parser("_sims", help=argparse.SUPPRESS)
    sims.add_argument("--count", type=int, default=4)
    sims.add_argument("--tokens-per-second", type=float, default=200.0)
    sims.add_argument("--max-num-seqs", type=int, default=1024)
    load = sub.add_parser("_load", help=argparse.SUPPRESS)
    load.add_argument("--port", type=int, required=True)
    load.add_argument("--concurrency", type=int, required=True)
    load.add_argument("--duration", type=float, required=True)
    load.add_argument("--tokens", type=int, required=True)
    args = parser.parse_args(argv)
    if args.role == "_sims":
        run_simulators(args.count, args.tokens_per_second, args.max_num_seqs)
        return
    if args.role == "_load":
        run_load(args.port, args.concurrency, args.duration, args.tokens)
        return
    args.argv = argv
    stop_on_signals()
    report = orchestrate(args)
    print()
    print(report)
    if not args.no_save:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(report)
        print(f"written to {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
