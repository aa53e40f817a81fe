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
import asyncio
import datetime
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.harness import Child, Children, pinned, stop_on_signals, wait_for

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "relay_log.md"
TWISTD = str(Path(sys.executable).with_name("twistd"))
CLK_TCK = os.sysconf("SC_CLK_TCK")
HOST = "127.0.0.1"
MODEL = "sim-model"
#: Seconds the generator waits for in-flight requests after the duration, before aborting.
DRAIN_GRACE = 20.0
#: Seconds allowed for a child process to report its port(s).

# -- the simulators (child process) -----------------------------------------------------------


def run_simulators(count: int, tokens_per_second: float, max_num_seqs: int) -> None:
    """Serve ``count`` simulated vLLM backends in this process; print their ports as JSON."""
    from twisted.internet import reactor

    from txlb.testing import SimulatedVLLM, listen_simulated

    ports = []
    for _ in range(count):
        sim = SimulatedVLLM(
            reactor,
            models=(MODEL,),
            tokens_per_second=tokens_per_second,
            ttft=0.05,
            max_num_seqs=max_num_seqs,
        )
        ports.append(listen_simulated(reactor, sim, port=0).getHost().port)
    print(json.dumps({"ports": ports}), flush=True)
    reactor.run()  # type: ignore[attr-defined]


# -- the load generator (child process) -------------------------------------------------------


@dataclass
class LoadStats:
    """What the load generator saw; printed as JSON for the parent."""

    started: int = 0
    completed: int = 0
    errors: int = 0
    aborted: int = 0
    events: int = 0
    bytes: int = 0
    wall: float = 0.0
    cpu: float = 0.0


class StreamClient(asyncio.Protocol):
    """
    One keep-alive HTTP/1.1 connection sending streaming completions back to back.

    A small state machine over the raw bytes (head, chunk size, chunk data) rather than
    an HTTP library, so the client spends as little CPU per event as it can.  Events are
    counted as ``\\n\\n`` terminators in the de-chunked body, carrying one byte across
    chunk boundaries so an event split between two chunks still counts once.
    """

    def __init__(self, request: bytes, stats: LoadStats, deadline: float,
                 done: asyncio.Future[None]) -> None:
        self.request = request
        self.stats = stats
        self.deadline = deadline
        self.done = done
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.state = "idle"
        self.remaining = 0  # bytes left in the current chunk or fixed-length body
        self.chunked = False
        self.status = 0
        self.last_newline = False
        self.in_flight = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        if time.monotonic() >= self.deadline:
            self._finish()
            return
        self.state = "head"
        self.in_flight = True
        self.last_newline = False
        self.stats.started += 1
        self.transport.write(self.request)

    def _finish(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.in_flight:
            self.in_flight = False
            self.stats.errors += 1
        if not self.done.done():
            self.done.set_result(None)

    def abort(self) -> None:
        """Out of time: drop the request still in flight (it is counted as aborted)."""
        if self.in_flight:
            self.in_flight = False
            self.stats.aborted += 1
        if self.transport is not None:
            self.transport.abort()

    def _count(self, payload: bytes) -> None:
        if not payload:
            return
        events = payload.count(b"\n\n")
        if self.last_newline and payload[0] == 10:  # b"\n"
            events += 1
        self.last_newline = payload[-1] == 10
        self.stats.events += events
        self.stats.bytes += len(payload)

    def _response_done(self) -> None:
        self.in_flight = False
        if self.status == 200:
            self.stats.completed += 1
        else:
            self.stats.errors += 1
        self._send()

    def data_received(self, data: bytes) -> None:
        buf = self.buffer + data if self.buffer else data
        pos = 0
        end = len(buf)
        while pos < end:
            state = self.state
            if state == "data":
                take = min(self.remaining, end - pos)
                self._count(buf[pos : pos + take])
                pos += take
                self.remaining -= take
                if self.remaining == 0:
                    if self.chunked:
                        self.state = "crlf"
                    else:
                        self._response_done()
                continue
            if state == "crlf":
                if end - pos < 2:
                    break
                pos += 2
                self.state = "size"
                continue
            if state == "size":
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
                pos = eol + 2
                if size:
                    self.remaining = size
                    self.state = "data"
                else:
                    self.state = "trailer"
                continue
            if state == "trailer":
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                empty = eol == pos
                pos = eol + 2
                if empty:  # the blank line after the (normally absent) trailers
                    self._response_done()
                continue
            if state == "head":
                eoh = buf.find(b"\r\n\r\n", pos)
                if eoh < 0:
                    break
                head = buf[pos:eoh].decode("latin-1").lower().split("\r\n")
                pos = eoh + 4
                self.status = int(head[0].split(" ", 2)[1])
                self.chunked = any(
                    line.startswith("transfer-encoding:") and "chunked" in line for line in head
                )
                if self.chunked:
                    self.state = "size"
                    continue
                length = next(
                    (int(line.split(":", 1)[1]) for line in head
                     if line.startswith("content-length:")),
                    None,
                )
                if length is None:  # delimited by close: not expected from txlb
                    self.state = "data"
                    self.remaining = 1 << 62
                elif length == 0:
                    self._response_done()
                else:
                    self.state = "data"
                    self.remaining = length
                continue
            # "idle": bytes with no request outstanding; discard them
            pos = end
        self.buffer = buf[pos:]


async def generate_load(port: int, concurrency: int, duration: float, tokens: int) -> LoadStats:
    """Keep ``concurrency`` streams in flight for ``duration`` seconds, then drain."""
    body = json.dumps({
        "model": MODEL,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        b"Host: %s:%d\r\n"
        b"Content-Type: application/json\r\n"
        b"Accept: text/event-stream\r\n"
        b"X-Sim-Tokens: %d\r\n"
        b"Content-Length: %d\r\n\r\n%s"
    ) % (HOST.encode(), port, tokens, len(body), body)
    loop = asyncio.get_running_loop()
    stats = LoadStats()
    cpu0 = time.process_time()
    start = time.monotonic()
    deadline = start + duration
    clients: list[StreamClient] = []
    waits: list[asyncio.Future[None]] = []
    for _ in range(concurrency):
        done: asyncio.Future[None] = loop.create_future()
        _, client = await loop.create_connection(
            lambda d=done: StreamClient(request, stats, deadline, d), HOST, port
        )
        clients.append(client)
        waits.append(done)
    _, pending = await asyncio.wait(waits, timeout=duration + DRAIN_GRACE)
    if pending:
        for client in clients:
            client.abort()
        await asyncio.sleep(0.1)
    stats.wall = time.monotonic() - start
    stats.cpu = time.process_time() - cpu0
    return stats


def run_load(port: int, concurrency: int, duration: float, tokens: int) -> None:
    stats = asyncio.run(generate_load(port, concurrency, duration, tokens))
    print(json.dumps(stats.__dict__), flush=True)


# -- the orchestrator -------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` (not its children), in seconds."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


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


@dataclass
class Measurement:
    balancer: str
    round: int
    proxy_cpu: float
    sim_cpu: float
    load: LoadStats
    log_lines: int | None  # lines the log grew by, log-on only

    @property
    def us_per_event(self) -> float:
        return self.proxy_cpu / self.load.events * 1e6 if self.load.events else float("nan")

    @property
    def requests(self) -> int:
        return self.load.started


def measure(children: Children, balancer: Balancer, sims_pid: int, args: argparse.Namespace,
            round_: int, duration: float) -> Measurement:
    """One load run against ``balancer``; CPU deltas bracket the whole generator run."""
    lines_before = count_lines(balancer.log) if balancer.log else 0
    proxy0, sims0 = cpu_seconds(balancer.child.process.pid), cpu_seconds(sims_pid)
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
    proxy1, sims1 = cpu_seconds(balancer.child.process.pid), cpu_seconds(sims_pid)
    last = load.output.read_text().strip().splitlines()
    if load.process.returncode != 0 or not last:
        raise RuntimeError(f"load generator failed:\n{load.output.read_text()}")
    stats = LoadStats(**json.loads(last[-1]))
    lines = None
    if balancer.log:
        time.sleep(0.2)  # the last lines are written as the last requests end
        lines = count_lines(balancer.log) - lines_before
    return Measurement(balancer.label, round_, proxy1 - proxy0, sims1 - sims0, stats, lines)


def free_port() -> int:
    """A port nothing listens on right now (bind to 0, read it, release it)."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


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


def _output(argv: Sequence[str]) -> str:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def system_info() -> dict[str, str]:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "uname -a": _output(["uname", "-a"]),
        "nproc": _output(["nproc"]),
        "python": f"{platform.python_version()} ({sys.executable})",
    }


def revision(source: Path) -> str:
    """`` at <commit>`` (``+ changes`` if the tree is dirty), or nothing outside git."""
    head = _output(["git", "-C", str(source), "rev-parse", "--short", "HEAD"])
    if not re.fullmatch(r"[0-9a-f]+", head):
        return ""
    dirty = _output(["git", "-C", str(source), "status", "--porcelain", "--", "txlb"])
    return f" at {head}" + (" + uncommitted changes to txlb/" if dirty else "")


def render(results: list[Measurement], cost: LogCost, sample: str, args: argparse.Namespace,
           info: dict[str, str], pinning: str) -> str:
    """The Markdown report: settings, one row per run, summary and log-line check."""
    out = [
        "# Result log cost on the relay path",
        "",
        *[f"- {key}: `{value}`" for key, value in info.items()],
        f"- command: `{' '.join(['python -m bench.relay_log', *args.argv])}`",
        f"- load: C={args.concurrency} streaming chat completions, X-Sim-Tokens: {args.tokens},"
        f" {args.duration:g} s per run + drain, {args.rounds} rounds each, alternating",
        f"- simulators: 4 backends in one process, {args.tokens_per_second:g} tokens/s per"
        f" stream, max-num-seqs {args.max_num_seqs}",
        f"- pinning: {pinning}",
        f"- balancer source: `{args.source}`{revision(args.source)}",
        "",
        "| run | log | proxy CPU s | events | CPU µs/event | requests | events/s"
        " | proxy CPU % | client-side CPU % | log lines |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in results:
        load = m.load
        client_cpu = (m.sim_cpu + load.cpu) / load.wall * 100
        out.append(
            f"| {m.round} | {m.balancer} | {m.proxy_cpu:.2f} | {load.events} |"
            f" {m.us_per_event:.1f} | {m.requests} ({load.completed} ok, {load.errors} err,"
            f" {load.aborted} aborted) | {load.events / load.wall:.0f} |"
            f" {m.proxy_cpu / load.wall * 100:.0f} | {client_cpu:.0f} |"
            f" {'-' if m.log_lines is None else m.log_lines} |"
        )
    by = {label: [m for m in results if m.balancer == label] for label in ("on", "off")}
    per_event = {label: [m.us_per_event for m in ms] for label, ms in by.items()}
    pooled = {
        label: sum(m.proxy_cpu for m in ms) / sum(m.load.events for m in ms) * 1e6
        for label, ms in by.items()
    }
    ratio = pooled["on"] / pooled["off"]
    spread = {
        label: (max(v) - min(v)) / statistics.mean(v) * 100 for label, v in per_event.items()
    }
    pair_ratios = [on / off for on, off in zip(per_event["on"], per_event["off"], strict=False)]
    requests_on = sum(m.requests for m in by["on"])

    def expect(us_per_request: float) -> float:
        return 1 + us_per_request / cost.events / pooled["off"]

    lines_on = sum(m.log_lines or 0 for m in by["on"])
    out += [
        "",
        "| log | CPU µs/event (pooled) | per-run values | spread (max-min)/mean |",
        "|---|---:|---|---:|",
        *[
            f"| {label} | {pooled[label]:.1f} | {', '.join(f'{v:.1f}' for v in per_event[label])}"
            f" | {spread[label]:.1f} % |"
            for label in ("on", "off")
        ],
        "",
        f"**Ratio log on / log off, CPU µs per relayed event: {ratio:.3f}**"
        f" ({(ratio - 1) * 100:+.1f} %); per round: "
        + ", ".join(f"{r:.3f}" for r in pair_ratios)
        + f" (median {statistics.median(pair_ratios):.3f}).",
        "",
        f"Cross-check, in process, pinned like the balancers, on one such response"
        f" ({cost.events} events): `summarize` {cost.summarize_us:.0f} µs"
        f" ({cost.summarize_us / cost.events:.2f} µs/event), `ResultLog.write` (format + write"
        f" one line) {cost.write_us:.1f} µs ({cost.write_us / cost.events:.3f} µs/event)."
        f" Expected ratio if only format + write is log-only: {expect(cost.write_us):.3f};"
        f" if summarising is log-only too: {expect(cost.summarize_us + cost.write_us):.3f}.",
        "",
        f"Sample log line: `{sample[:200]}`",
        "",
        f"Log check (log-on balancer, measured runs): {requests_on} requests sent,"
        f" {lines_on} lines written"
        + (" -- one line per request." if requests_on == lines_on else " -- MISMATCH."),
        "",
    ]
    return "\n".join(out)


@dataclass
class LogCost:
    """In-process cost of the two per-request steps of the log, as a cross-check."""

    summarize_us: float  # parse the captured response into a Summary
    write_us: float  # format the line and write it to the file
    events: int  # SSE events in the response


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

    from txlb._records.resultlog import ResultLog
    from txlb._records.summary import RequestRecord, summarize

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
