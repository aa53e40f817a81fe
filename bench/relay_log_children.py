"""
The child processes of :mod:`bench.relay_log`: the simulated vLLM backends
(``python -m bench.relay_log _sims``) and the load generator that keeps streaming chat
completions in flight through one balancer (``_load``).  Each runs in its own process,
pinned away from the balancers, so their CPU is never the proxy's.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from bench.harness import HOST
from bench.loadgen_http import ResponseParser

MODEL = "sim-model"


#: Seconds the generator waits for in-flight requests after the duration, before aborting.
DRAIN_GRACE = 20.0


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

    The load generator's own response parser (:class:`bench.loadgen_http.ResponseParser`)
    rather than an HTTP library, so the client spends as little CPU per event as it can.  Events are
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
        self.parser = ResponseParser(self._count, self._response_done)
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
        self.parser.reset()
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
        if self.parser.status == 200:
            self.stats.completed += 1
        else:
            self.stats.errors += 1
        self._send()

    def data_received(self, data: bytes) -> None:
        self.parser.feed(data)


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
