"""
The load generator's streaming modes: ``paced`` (SSE at an LLM's pace), ``bulk`` (as fast as
the path takes them), ``hold`` (many long-lived streams) and ``slow`` (one stream read
slowly).  See :mod:`bench.loadgen` for what each measures.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from array import array
from dataclasses import dataclass, field

from bench.chat import (
    TRAILING_EVENTS,
    Instruction,
    phase_split,
    send_time,
    stream_counts,
    timeline,
)
from bench.loadgen_http import HOST, ResponseParser, api_request, percentile


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
