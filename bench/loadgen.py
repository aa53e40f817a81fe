"""
The benchmark's load generator (``python -m bench.loadgen MODE ...``), one process per run.

Raw asyncio protocols (or blocking sockets where one request at a time is the point) with
hand-written HTTP/1.1 parsing, so the client spends as little CPU per chunk as it can.  Each
run prints one JSON line with what it saw, including its own CPU time, for the harness.

Every mode sends ``POST /v1/chat/completions`` (``--api chat``, the default: the request of
:mod:`bench.chat`, its instruction in the message content) or the non-LLM ``GET`` with the
instruction in the query string (``--api get``: ``/sse``, ``/bulk``, ``/json``, ``/big``).

Modes:

``paced``
    ``--streams`` SSE streams at once, starts staggered over one interval, stream ``i``
    ``--spread × count × i / streams`` events shorter so that streams end one by one over the
    last part of the run; de-chunks every response and records, per token event, receive
    time minus the send time the backend embedded (both ``CLOCK_MONOTONIC``).  The first
    event of each stream (which includes connection setup) is counted but left out of the
    latency percentiles.  Latencies are also given by phase (streams starting, steady,
    streams ending: :func:`bench.chat.phase_split`) and over time (``--bucket`` ms).
``bulk``
    ``--streams`` streams from ``/bulk`` for ``--seconds``; events are counted as the blank
    lines that end them (``\\n\\n``, carrying one byte across reads), which chunk framing can
    neither add nor remove, so no de-chunking is needed at a million events per second.
``ttfb``
    ``--count`` sequential requests, each on a fresh connection (``--fresh``) or all on one
    keep-alive connection; time from ``connect`` (fresh) or from sending the request
    (keep-alive) to the response's first byte.
``rps``
    The Python stand-in for wrk: ``--connections`` keep-alive connections sending small
    requests back to back for ``--seconds``.
``hold``
    ``--streams`` long-lived SSE streams (one event every ``--interval`` ms), opened with at
    most ``--connect-parallel`` setups in flight; once every stream has its first event and
    one more interval has passed, prints a ``HELD`` line (the harness then samples the
    proxy's memory), holds for ``--linger`` seconds more, then closes everything.
``slow``
    One stream from ``/big`` read at ``--rate`` bytes/s at most, on a blocking socket.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import sys
import time
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.chat import (
    TRAILING_EVENTS,
    Instruction,
    chat_request,
    phase_split,
    send_time,
    stream_counts,
    timeline,
)

HOST = "127.0.0.1"


def request_bytes(port: int, target: str) -> bytes:
    """A minimal HTTP/1.1 GET."""
    return (
        f"GET {target} HTTP/1.1\r\nHost: {HOST}:{port}\r\nAccept: text/event-stream\r\n"
        f"User-Agent: bench\r\n\r\n"
    ).encode()


def api_request(api: str, port: int, instruction: Instruction) -> bytes:
    """The request asking for ``instruction``'s answer on the chat path or the ``GET`` path."""
    if api == "chat":
        return chat_request(HOST, port, instruction)
    if instruction.kind == "paced":
        target = (f"/sse?n={instruction.count}&interval={instruction.interval_ms:g}"
                  f"&size={instruction.size}&delay={instruction.delay_ms:.3f}")
    elif instruction.kind == "bulk":
        target = f"/bulk?seconds={instruction.seconds:g}&size={instruction.size}"
    elif instruction.kind == "big":
        target = f"/big?bytes={instruction.total_bytes}&chunk={instruction.chunk}"
    else:
        target = "/json"
    return request_bytes(port, target)


def percentile(sorted_values: Any, q: float) -> float:
    """The ``q``-quantile (0..1) of an already sorted sequence, nearest rank; NaN if empty."""
    n = len(sorted_values)
    if not n:
        return float("nan")
    return float(sorted_values[min(n - 1, max(0, round(q * (n - 1))))])


# -- a de-chunking response reader --------------------------------------------------------------


class ResponseParser:
    """
    Incremental HTTP/1.1 response parser: head, then a chunked or sized body.

    ``on_body(bytes)`` gets the de-chunked body as it arrives; ``on_end()`` is called once
    the body is complete.  ``status`` is the response's status code (0 until the head).
    """

    def __init__(self, on_body: Callable[[bytes], None], on_end: Callable[[], None]) -> None:
        self.on_body = on_body
        self.on_end = on_end
        self.reset()

    def reset(self) -> None:
        """Ready for the next response on the same connection."""
        self.buffer = b""
        self.state = "head"
        self.remaining = 0
        self.chunked = False
        self.status = 0

    def feed(self, data: bytes) -> None:
        """Parse ``data``, calling ``on_body`` / ``on_end`` as the response progresses."""
        buf = self.buffer + data if self.buffer else data
        pos, end = 0, len(buf)
        while pos < end:
            state = self.state
            if state == "data":
                take = min(self.remaining, end - pos)
                self.on_body(buf[pos : pos + take])
                pos += take
                self.remaining -= take
                if self.remaining == 0:
                    if self.chunked:
                        self.state = "crlf"
                    else:
                        self.state = "done"
                        self.on_end()
            elif state == "crlf":
                if end - pos < 2:
                    break
                pos += 2
                self.state = "size"
            elif state == "size":
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
            elif state == "trailer":
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                blank = eol == pos
                pos = eol + 2
                if blank:
                    self.state = "done"
                    self.on_end()
            elif state == "head":
                eoh = buf.find(b"\r\n\r\n", pos)
                if eoh < 0:
                    break
                lines = buf[pos:eoh].decode("latin-1").lower().split("\r\n")
                pos = eoh + 4
                self.status = int(lines[0].split(" ", 2)[1])
                self.chunked = any(
                    line.startswith("transfer-encoding:") and "chunked" in line
                    for line in lines
                )
                length = 0
                for line in lines:
                    if line.startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                if self.chunked:
                    self.state = "size"
                elif length:
                    self.state = "data"
                    self.remaining = length
                else:
                    self.state = "done"
                    self.on_end()
            else:  # "done": bytes after the response (none expected)
                pos = end
        self.buffer = buf[pos:]


# -- paced ----------------------------------------------------------------------------------


@dataclass
class PacedStats:
    """What the paced client saw (latencies in µs)."""

    streams: int = 0
    complete: int = 0
    errors: int = 0
    events: int = 0
    expected: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    p50_us: float = float("nan")
    p90_us: float = float("nan")
    p99_us: float = float("nan")
    max_us: float = float("nan")
    tokens: int = 0  # token events (the ones carrying a send time)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    timeline: list[dict[str, float]] = field(default_factory=list)


class PacedClient(asyncio.Protocol):
    """One paced SSE stream: record each event's latency and receive time, count events."""

    def __init__(self, request: bytes, stats: PacedStats, latencies: array[int],
                 received: array[int], done: asyncio.Future[None]) -> None:
        self.request = request
        self.stats = stats
        self.latencies = latencies
        self.received = received
        self.first_at = 0  # receive time of the first event (ns; 0: none yet)
        self.ended_at = 0  # when the response ended (ns; 0: not yet)
        self.done = done
        self.pending = b""
        self.seen = 0
        self.ended = False
        self.parser = ResponseParser(self._body, self._end)
        self.transport: asyncio.Transport | None = None
        self.now = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.now = time.monotonic_ns()
        self.parser.feed(data)

    def _body(self, data: bytes) -> None:
        buf = self.pending + data if self.pending else data
        parts = buf.split(b"\n\n")
        self.pending = parts.pop()
        now = self.now
        if parts and not self.first_at:
            self.first_at = now
        for part in parts:
            sent = send_time(part)
            if sent is None:
                continue
            if self.seen:
                self.latencies.append(now - sent)
                self.received.append(now)
            self.seen += 1
            self.stats.tokens += 1
        self.stats.events += len(parts)

    def _end(self) -> None:
        self.ended = True
        self.ended_at = time.monotonic_ns()
        if self.parser.status == 200:
            self.stats.complete += 1
        else:
            self.stats.errors += 1
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended:
            self.stats.errors += 1
        if not self.done.done():
            self.done.set_result(None)


async def run_paced(port: int, streams: int, count: int, interval: float, size: int,
                    timeout: float, api: str = "chat", spread: float = 0.0,
                    bucket_ms: float = 500.0) -> PacedStats:
    """Open ``streams`` paced SSE streams, staggered over one interval; wait for all."""
    loop = asyncio.get_running_loop()
    counts = stream_counts(streams, count, spread)
    trailing = TRAILING_EVENTS if api == "chat" else 0
    stats = PacedStats(streams=streams, expected=sum(counts) + trailing * streams)
    latencies: array[int] = array("q")
    received: array[int] = array("q")
    cpu0, start = time.process_time(), time.monotonic()
    start_ns = time.monotonic_ns()
    waits: list[asyncio.Future[None]] = []
    clients: list[PacedClient] = []
    for i in range(streams):
        delay = interval * i / streams
        done: asyncio.Future[None] = loop.create_future()
        request = api_request(api, port, Instruction(
            "paced", size=size, interval_ms=interval, count=counts[i], delay_ms=delay))
        try:
            _, client = await loop.create_connection(
                lambda d=done, r=request: PacedClient(r, stats, latencies, received, d),
                HOST, port
            )
        except OSError:
            stats.errors += 1
            continue
        clients.append(client)
        waits.append(done)
    if waits:
        _, pending = await asyncio.wait(waits, timeout=timeout)
        for client in clients:
            if client.transport is not None and not client.ended:
                client.transport.abort()
        if pending:
            await asyncio.sleep(0.1)
    stats.wall = time.monotonic() - start
    stats.cpu = time.process_time() - cpu0
    ordered = sorted(latencies)
    for name, q in (("p50_us", 0.5), ("p90_us", 0.9), ("p99_us", 0.99), ("max_us", 1.0)):
        setattr(stats, name, percentile(ordered, q) / 1000)
    never = 1 << 62
    # "starting" lasts until every stream has had its first event and two intervals more
    all_started = max((c.first_at for c in clients), default=0) + int(2 * interval * 1e6)
    first_end = min((c.ended_at for c in clients if c.ended_at), default=never)
    stats.phases = phase_split(received, latencies, all_started, first_end)
    stats.timeline = timeline(received, latencies, start_ns, int(bucket_ms * 1e6))
    return stats


# -- bulk -----------------------------------------------------------------------------------


@dataclass
class BulkStats:
    """What the bulk client saw: events counted between the first byte and the end."""

    streams: int = 0
    errors: int = 0
    events: int = 0
    bytes: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    rate: float = 0.0


class BulkClient(asyncio.Protocol):
    """Counts ``\\n\\n`` in the raw stream; head and chunk framing never contain one."""

    def __init__(self, request: bytes, stats: BulkStats) -> None:
        self.request = request
        self.stats = stats
        self.last = b""
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.stats.events += (self.last + data[:1]).count(b"\n\n") + data.count(b"\n\n")
        self.last = data[-1:]
        self.stats.bytes += len(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.closing:
            self.stats.errors += 1


async def run_bulk(port: int, streams: int, seconds: float, size: int,
                   api: str = "chat") -> BulkStats:
    """``streams`` bulk SSE streams for ``seconds``; count events, then abort them."""
    loop = asyncio.get_running_loop()
    stats = BulkStats(streams=streams)
    request = api_request(api, port, Instruction("bulk", size=size, seconds=seconds + 30))
    clients: list[BulkClient] = []
    cpu0, start = time.process_time(), time.monotonic()
    for _ in range(streams):
        _, client = await loop.create_connection(
            lambda: BulkClient(request, stats), HOST, port
        )
        clients.append(client)
    await asyncio.sleep(seconds)
    stats.wall = time.monotonic() - start
    stats.cpu = time.process_time() - cpu0
    for client in clients:
        client.closing = True
        if client.transport is not None:
            client.transport.abort()
    stats.rate = stats.events / stats.wall
    await asyncio.sleep(0.05)
    return stats


# -- ttfb (blocking, sequential) ----------------------------------------------------------------


@dataclass
class TtfbStats:
    """Sequential time-to-first-byte samples (µs)."""

    count: int = 0
    errors: int = 0
    fresh: bool = True
    p50_us: float = float("nan")
    p90_us: float = float("nan")
    p99_us: float = float("nan")
    cpu: float = 0.0


def _read_response(sock: socket.socket, first: bytes) -> bool:
    """Read one small chunked or sized response to its end; True if it was a 200."""
    ok = [False]
    parser = ResponseParser(lambda _: None, lambda: ok.__setitem__(0, True))
    parser.feed(first)
    deadline = time.monotonic() + 10
    while not ok[0] and time.monotonic() < deadline:
        data = sock.recv(65536)
        if not data:
            return False
        parser.feed(data)
    return ok[0] and parser.status == 200


def run_ttfb(port: int, count: int, fresh: bool, gap: float, api: str = "chat") -> TtfbStats:
    """``count`` sequential requests; time to the first response byte of each."""
    stats = TtfbStats(fresh=fresh)
    samples: list[int] = []
    request = api_request(api, port, Instruction("paced", size=250, interval_ms=1, count=1))
    cpu0 = time.process_time()
    sock: socket.socket | None = None
    for _ in range(count):
        try:
            if fresh or sock is None:
                if sock is not None:
                    sock.close()
                t0 = time.perf_counter_ns()
                sock = socket.create_connection((HOST, port), timeout=10)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not fresh:
                t0 = time.perf_counter_ns()
            sock.sendall(request)
            first = sock.recv(65536)
            t1 = time.perf_counter_ns()
            if not first or not _read_response(sock, first):
                raise OSError("bad response")
            samples.append(t1 - t0)
        except OSError:
            stats.errors += 1
            if sock is not None:
                sock.close()
            sock = None
        time.sleep(gap)
    if sock is not None:
        sock.close()
    stats.cpu = time.process_time() - cpu0
    stats.count = len(samples)
    samples.sort()
    for name, q in (("p50_us", 0.5), ("p90_us", 0.9), ("p99_us", 0.99)):
        setattr(stats, name, percentile(samples, q) / 1000)
    return stats


# -- rps (the wrk fallback) ---------------------------------------------------------------------


@dataclass
class RpsStats:
    """Requests completed by the Python wrk stand-in (latencies in µs)."""

    requests: int = 0
    errors: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    rate: float = 0.0
    p50_us: float = float("nan")
    p99_us: float = float("nan")


class RpsClient(asyncio.Protocol):
    """One keep-alive connection sending the next request as soon as a response ends."""

    def __init__(self, request: bytes, stats: RpsStats, deadline: float,
                 latencies: array[int]) -> None:
        self.request = request
        self.stats = stats
        self.deadline = deadline
        self.latencies = latencies
        self.parser = ResponseParser(lambda _: None, self._end)
        self.transport: asyncio.Transport | None = None
        self.sent = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        if time.monotonic() >= self.deadline:
            self.transport.close()
            return
        self.parser.reset()
        self.sent = time.monotonic_ns()
        self.transport.write(self.request)

    def _end(self) -> None:
        if self.parser.status == 200:
            self.stats.requests += 1
            self.latencies.append(time.monotonic_ns() - self.sent)
        else:
            self.stats.errors += 1
        asyncio.get_running_loop().call_soon(self._send)

    def data_received(self, data: bytes) -> None:
        self.parser.feed(data)


async def run_rps(port: int, connections: int, seconds: float,
                  api: str = "chat") -> RpsStats:
    """``connections`` keep-alive connections sending small requests for ``seconds``."""
    loop = asyncio.get_running_loop()
    stats = RpsStats()
    latencies: array[int] = array("q")
    request = api_request(api, port, Instruction("json"))
    cpu0, start = time.process_time(), time.monotonic()
    for _ in range(connections):
        await loop.create_connection(
            lambda: RpsClient(request, stats, start + seconds, latencies), HOST, port
        )
    await asyncio.sleep(max(0.0, start + seconds - time.monotonic()) + 0.2)
    stats.wall = time.monotonic() - start
    stats.cpu = time.process_time() - cpu0
    stats.rate = stats.requests / seconds
    ordered = sorted(latencies)
    stats.p50_us = percentile(ordered, 0.5) / 1000
    stats.p99_us = percentile(ordered, 0.99) / 1000
    return stats


# -- hold -------------------------------------------------------------------------------------


@dataclass
class HoldStats:
    """Long-lived streams: how many were established and stayed up."""

    streams: int = 0
    established: int = 0
    refused: int = 0
    failed: int = 0  # closed, reset or a non-200 answer after connecting
    ramp_s: float = 0.0
    events: int = 0
    cpu: float = 0.0
    starved: int = 0  # streams with fewer than two events when HELD was printed
    errors_detail: dict[str, int] = field(default_factory=dict)


class HoldClient(asyncio.Protocol):
    """A stream that stays open; counts events (blank lines) on the raw bytes."""

    def __init__(self, request: bytes, stats: HoldStats,
                 first: asyncio.Future[None]) -> None:
        self.request = request
        self.stats = stats
        self.first = first
        self.events = 0
        self.last = b""
        self.head_ok: bool | None = None
        self.closing = False
        self.lost = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.head_ok is None:
            self.head_ok = data.startswith(b"HTTP/1.1 200") or data.startswith(b"HTTP/1.0 200")
            if not self.head_ok:
                self._fail("status")
                return
        n = (self.last + data[:1]).count(b"\n\n") + data.count(b"\n\n")
        self.last = data[-1:]
        if n:
            self.events += n
            self.stats.events += n
            if not self.first.done():
                self.first.set_result(None)

    def _fail(self, why: str) -> None:
        self.stats.failed += 1
        self.stats.errors_detail[why] = self.stats.errors_detail.get(why, 0) + 1
        if not self.first.done():
            self.first.set_result(None)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.closing and self.head_ok is not False:
            self.stats.failed += 1
            why = type(exc).__name__ if exc else "closed"
            self.stats.errors_detail[why] = self.stats.errors_detail.get(why, 0) + 1
        if not self.first.done():
            self.first.set_result(None)


async def run_hold(port: int, streams: int, interval: float, parallel: int, linger: float,
                   ramp_timeout: float, api: str = "chat") -> HoldStats:
    """Open and hold ``streams`` long-lived streams; print HELD, linger, close."""
    loop = asyncio.get_running_loop()
    stats = HoldStats(streams=streams)
    request = api_request(api, port, Instruction("paced", size=250, interval_ms=interval,
                                                 count=100000))
    clients: list[HoldClient] = []
    gate = asyncio.Semaphore(parallel)
    cpu0, start = time.process_time(), time.monotonic()
    ramp_deadline = start + ramp_timeout

    async def open_one() -> None:
        async with gate:
            remaining = ramp_deadline - time.monotonic()
            if remaining <= 0:
                stats.refused += 1
                return
            first: asyncio.Future[None] = loop.create_future()
            try:
                _, client = await asyncio.wait_for(
                    loop.create_connection(lambda: HoldClient(request, stats, first),
                                           HOST, port),
                    remaining,
                )
            except (OSError, asyncio.TimeoutError) as exc:
                stats.refused += 1
                why = type(exc).__name__
                stats.errors_detail[why] = stats.errors_detail.get(why, 0) + 1
                return
            clients.append(client)
            try:
                await asyncio.wait_for(first, max(0.1, ramp_deadline - time.monotonic()))
            except asyncio.TimeoutError:
                stats.errors_detail["no first event"] = (
                    stats.errors_detail.get("no first event", 0) + 1
                )

    await asyncio.gather(*(open_one() for _ in range(streams)))
    stats.ramp_s = time.monotonic() - start
    stats.established = sum(1 for c in clients if c.events and not c.lost)
    # one more interval: every stream should now have had a second event
    await asyncio.sleep(interval / 1000 + 0.5)
    stats.starved = sum(1 for c in clients if c.events < 2)
    held = sum(1 for c in clients if not c.lost and c.events >= 2)
    print("HELD " + json.dumps({"held": held, "failed": stats.failed}), flush=True)
    await asyncio.sleep(linger)
    stats.cpu = time.process_time() - cpu0
    for client in clients:
        client.closing = True
        if client.transport is not None:
            client.transport.abort()
    await asyncio.sleep(0.2)
    return stats


# -- slow -------------------------------------------------------------------------------------


@dataclass
class SlowStats:
    """A large stream read at a capped rate."""

    bytes: int = 0
    complete: bool = False
    status: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    error: str = ""


def run_slow(port: int, total: int, rate: float, chunk: int, timeout: float,
             api: str = "chat") -> SlowStats:
    """Read a ``total``-byte stream at ``rate`` bytes/s at most."""
    stats = SlowStats()
    body = [0]
    ended = [False]
    parser = ResponseParser(lambda d: body.__setitem__(0, body[0] + len(d)),
                            lambda: ended.__setitem__(0, True))
    cpu0, start = time.process_time(), time.monotonic()
    deadline = start + timeout
    try:
        with socket.create_connection((HOST, port), timeout=30) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
            sock.sendall(api_request(api, port, Instruction("big", total_bytes=total,
                                                            chunk=chunk)))
            received = 0
            while not ended[0]:
                now = time.monotonic()
                if now > deadline:
                    stats.error = "timeout"
                    break
                ahead = received / rate - (now - start)
                if ahead > 0:
                    time.sleep(min(ahead, 0.05))
                data = sock.recv(256 * 1024)
                if not data:
                    stats.error = "closed early"
                    break
                received += len(data)
                parser.feed(data)
    except OSError as exc:
        stats.error = f"{type(exc).__name__}: {exc}"
    stats.bytes = body[0]
    stats.status = parser.status
    stats.complete = ended[0] and parser.status == 200
    stats.wall = time.monotonic() - start
    stats.cpu = time.process_time() - cpu0
    return stats


# -- entry point ------------------------------------------------------------------------------


def _raise_nofile() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit (10,000 sockets)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> None:
    """Run one mode and print its result as ``RESULT {json}``."""
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    paced = sub.add_parser("paced")
    paced.add_argument("--streams", type=int, required=True)
    paced.add_argument("--count", type=int, required=True, help="events per stream")
    paced.add_argument("--interval", type=float, required=True, help="ms between events")
    paced.add_argument("--size", type=int, default=250)
    paced.add_argument("--timeout", type=float, required=True)
    paced.add_argument("--spread", type=float, default=0.0,
                       help="stream i is spread*count*i/streams events shorter")
    paced.add_argument("--bucket", type=float, default=500.0, help="timeline bucket, ms")
    bulk = sub.add_parser("bulk")
    bulk.add_argument("--streams", type=int, default=4)
    bulk.add_argument("--seconds", type=float, required=True)
    bulk.add_argument("--size", type=int, default=250)
    ttfb = sub.add_parser("ttfb")
    ttfb.add_argument("--count", type=int, required=True)
    ttfb.add_argument("--fresh", action="store_true")
    ttfb.add_argument("--gap", type=float, default=0.002)
    rps = sub.add_parser("rps")
    rps.add_argument("--connections", type=int, default=32)
    rps.add_argument("--seconds", type=float, required=True)
    hold = sub.add_parser("hold")
    hold.add_argument("--streams", type=int, required=True)
    hold.add_argument("--interval", type=float, default=3000.0)
    hold.add_argument("--connect-parallel", type=int, default=32)
    hold.add_argument("--linger", type=float, default=3.0)
    hold.add_argument("--ramp-timeout", type=float, default=90.0)
    slow = sub.add_parser("slow")
    slow.add_argument("--bytes", type=int, required=True)
    slow.add_argument("--rate", type=float, required=True, help="bytes per second")
    slow.add_argument("--chunk", type=int, default=65536)
    slow.add_argument("--timeout", type=float, default=120.0)
    for p in (paced, bulk, ttfb, rps, hold, slow):
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--api", choices=("chat", "get"), default="chat",
                       help="POST /v1/chat/completions (default) or the non-LLM GET path")
    args = parser.parse_args(argv)
    _raise_nofile()
    result: Any
    if args.mode == "paced":
        result = asyncio.run(run_paced(args.port, args.streams, args.count, args.interval,
                                       args.size, args.timeout, args.api, args.spread,
                                       args.bucket))
    elif args.mode == "bulk":
        result = asyncio.run(run_bulk(args.port, args.streams, args.seconds, args.size,
                                      args.api))
    elif args.mode == "ttfb":
        result = run_ttfb(args.port, args.count, args.fresh, args.gap, args.api)
    elif args.mode == "rps":
        result = asyncio.run(run_rps(args.port, args.connections, args.seconds, args.api))
    elif args.mode == "hold":
        result = asyncio.run(run_hold(args.port, args.streams, args.interval,
                                      args.connect_parallel, args.linger, args.ramp_timeout,
                                      args.api))
    else:
        result = run_slow(args.port, args.bytes, args.rate, args.chunk, args.timeout,
                          args.api)
    print("RESULT " + json.dumps(asdict(result)), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
