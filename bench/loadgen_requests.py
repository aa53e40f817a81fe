"""
The load generator's request modes: ``ttfb`` (sequential requests at idle) and ``rps`` (the
Python stand-in for wrk).  See :mod:`bench.loadgen` for what each measures.
"""

from __future__ import annotations

import asyncio
import socket
import time
from array import array
from dataclasses import dataclass

from bench.chat import (
    Instruction,
)
from bench.loadgen_http import HOST, ResponseParser, api_request, percentile


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
