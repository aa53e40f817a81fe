"""
A small, fast HTTP/1.1 backend for the proxy benchmark (``python -m bench.backend``).

It is not an inference server: it serves exactly what the benchmark needs, from raw asyncio
protocols with pre-built byte strings, so that it costs far less CPU per chunk than any proxy
in front of it.  Every listening port runs in this one process (one event loop); the port
numbers are printed as one JSON line, ``{"ports": [...]}``, once all are listening.

Endpoints (all ``GET``; any request body is skipped; keep-alive as HTTP/1.1 does by default):

``/health``
    ``200`` with a tiny JSON body (txlb probes it).
``/json``
    ``200`` with a small JSON body and ``Content-Length`` (the wrk target).
``/sse?n=N&interval=MS&size=B&delay=MS``
    Paced SSE, like vLLM's token events: the response head at once, then ``N`` events of
    exactly ``B`` bytes, the first after ``delay`` ms and then one every ``interval`` ms
    (absolute schedule, no drift), each written separately as its own HTTP chunk.  Every
    event is ``data: {"t":<19-digit CLOCK_MONOTONIC ns at the write>,"i":<index>,"p":"xx…"}``
    followed by a blank line, so a client on the same machine can compute each chunk's
    latency.
``/bulk?seconds=S&size=B``
    Bulk SSE: the same events, written as fast as the connection takes them (batches of
    events per ``write``, bounded by the transport's write-buffer limits) for ``S`` seconds
    or until the client leaves.
``/big?bytes=N&chunk=B``
    ``N`` bytes of SSE payload in chunks of ``B`` bytes, as fast as the connection takes
    them (the slow-client test: a proxy must pass the backpressure on, not buffer it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs

HOST = "127.0.0.1"
#: Events per ``write`` in bulk mode.
BULK_BATCH = 64
#: The transport's write buffer above which the pumps stop writing (``pause_writing``).
HIGH_WATER = 256 * 1024

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"Content-Type: text/event-stream\r\n"
    b"Cache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_JSON_BODY = b'{"id":"bench","object":"text_completion","choices":[{"text":"ok","index":0}]}'
JSON_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    % (len(_JSON_BODY), _JSON_BODY)
)
HEALTH_RESPONSE = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n'
    b'{"status":"ok"}'
)
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"
EVENT_PREFIX = b'data: {"t":'
#: Offset and length of the timestamp's digits inside an event (after ``data: {"t":``).
T_OFFSET, T_DIGITS = len(EVENT_PREFIX), 19


def event_template(size: int) -> bytes:
    """A ``%``-template (``t``, ``i``) for one SSE event of exactly ``size`` bytes, chunked."""
    head = b'data: {"t":%019d,"i":%06d,"p":"'
    tail = b'"}\n\n'
    fixed = len(head % (0, 0)) + len(tail)
    pad = max(0, size - fixed)
    event_len = fixed + pad
    return b"%x\r\n" % event_len + head + b"x" * pad + tail + b"\r\n"


class Handler(asyncio.Protocol):
    """One client connection: parse request heads, answer them one at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.skip = 0  # request-body bytes still to discard
        self.busy = False  # a streaming response is being written
        self.paused = False
        self.closed = False
        self.pump: PumpState | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.pump is not None and not self.closed:
            self._run_pump()

    def data_received(self, data: bytes) -> None:
        if self.skip:
            take = min(self.skip, len(data))
            self.skip -= take
            data = data[take:]
        self.buffer += data
        self._serve()

    def _serve(self) -> None:
        """Answer the buffered requests until one starts a streaming response."""
        assert self.transport is not None
        while not self.busy and not self.closed:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end]
            self.buffer = self.buffer[end + 4 :]
            length = _content_length(head)
            if length:
                take = min(length, len(self.buffer))
                self.buffer = self.buffer[take:]
                self.skip = length - take
            target = head.split(b" ", 2)[1] if b" " in head else b"/"
            path, _, query = target.partition(b"?")
            if path == b"/json":
                self.transport.write(JSON_RESPONSE)
            elif path == b"/health":
                self.transport.write(HEALTH_RESPONSE)
            elif path == b"/sse":
                self._start_paced(_params(query))
            elif path == b"/bulk":
                self._start_bulk(_params(query))
            elif path == b"/big":
                self._start_big(_params(query))
            else:
                self.transport.write(NOT_FOUND)

    # -- paced SSE ------------------------------------------------------------------------

    def _start_paced(self, params: dict[str, float]) -> None:
        """Head now, then one event per interval on an absolute schedule."""
        assert self.transport is not None
        self.busy = True
        count = int(params.get("n", 10))
        interval = params.get("interval", 25.0) / 1000
        delay = params.get("delay", 0.0) / 1000
        template = event_template(int(params.get("size", 250)))
        self.transport.write(SSE_HEAD)
        loop = asyncio.get_running_loop()
        start = loop.time() + delay
        state = {"i": 0}

        def tick() -> None:
            self.timer = None
            if self.closed:
                return
            assert self.transport is not None
            i = state["i"]
            self.transport.write(template % (time.monotonic_ns(), i))
            i += 1
            state["i"] = i
            if i >= count:
                self.transport.write(LAST_CHUNK)
                self._done()
                return
            self.timer = loop.call_at(start + i * interval, tick)

        if count <= 0:
            self.transport.write(LAST_CHUNK)
            self._done()
        elif delay <= 0:
            tick()
        else:
            self.timer = loop.call_at(start, tick)

    def _done(self) -> None:
        """The response is complete: serve any request that arrived meanwhile."""
        self.busy = False
        self.pump = None
        if self.buffer:
            asyncio.get_running_loop().call_soon(self._serve)

    # -- as fast as the connection takes it ------------------------------------------------

    def _start_bulk(self, params: dict[str, float]) -> None:
        """Events in batches as fast as the connection takes them, for a while."""
        template = event_template(int(params.get("size", 250)))
        deadline = time.monotonic() + params.get("seconds", 10.0)

        def block() -> bytes | None:
            now = time.monotonic_ns()
            if now / 1e9 >= deadline:
                return None
            return (template % (now, 0)) * BULK_BATCH

        self._start_pump(PumpState(block))

    def _start_big(self, params: dict[str, float]) -> None:
        """A fixed number of bytes in large chunks, as fast as the connection allows."""
        chunk = int(params.get("chunk", 65536))
        remaining = [int(params.get("bytes", 1 << 30))]
        payload = b"data: " + b"y" * max(0, chunk - 8) + b"\n\n"
        framed = b"%x\r\n%s\r\n" % (len(payload), payload)

        def block() -> bytes | None:
            if remaining[0] <= 0:
                return None
            if remaining[0] >= len(payload):
                remaining[0] -= len(payload)
                return framed
            last = b"y" * remaining[0]
            remaining[0] = 0
            return b"%x\r\n%s\r\n" % (len(last), last)

        self._start_pump(PumpState(block))

    def _start_pump(self, pump: PumpState) -> None:
        """Send the head, then write blocks until paused, done or closed."""
        assert self.transport is not None
        self.busy = True
        self.pump = pump
        self.transport.write(SSE_HEAD)
        self._run_pump()

    def _run_pump(self) -> None:
        """Write blocks until the transport pauses us; yield to the loop every 64."""
        assert self.transport is not None and self.pump is not None
        pump = self.pump
        writes = 0
        while not self.paused and not self.closed:
            data = pump.next_block()
            if data is None:
                self.transport.write(LAST_CHUNK)
                self._done()
                return
            self.transport.write(data)
            writes += 1
            if writes >= 64:  # let other connections run; continue on the next turn
                asyncio.get_running_loop().call_soon(self._continue_pump)
                return

    def _continue_pump(self) -> None:
        """The pump's next turn, unless paused or closed meanwhile."""
        if self.pump is not None and not self.paused and not self.closed:
            self._run_pump()


@dataclass
class PumpState:
    """Where the next block of a response written as fast as the connection allows comes from."""

    next_block: Callable[[], bytes | None]


def _content_length(head: bytes) -> int:
    """The request's Content-Length (0 if absent or malformed)."""
    lower = head.lower()
    at = lower.find(b"\r\ncontent-length:")
    if at < 0:
        return 0
    end = lower.find(b"\r\n", at + 2)
    value = lower[at + 17 : end if end >= 0 else len(lower)]
    try:
        return int(value.strip())
    except ValueError:
        return 0


def _params(query: bytes) -> dict[str, float]:
    """Query parameters as floats (the last value of each; non-numbers dropped)."""
    out: dict[str, float] = {}
    for key, values in parse_qs(query.decode("latin-1")).items():
        try:
            out[key] = float(values[-1])
        except ValueError:
            continue
    return out


async def serve(count: int, ports: list[int]) -> None:
    """Listen on ``count`` ports (or the given ones), print them, serve until cancelled."""
    loop = asyncio.get_running_loop()
    servers = []
    wanted = ports or [0] * count
    for port in wanted:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))
        server = await loop.create_server(Handler, sock=sock, backlog=4096)
        servers.append(server)
    bound = [s.sockets[0].getsockname()[1] for s in servers]
    print(json.dumps({"ports": bound, "pid": os.getpid()}), flush=True)
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    await stop
    for server in servers:
        server.close()


def main() -> None:
    """Parse the options, raise RLIMIT_NOFILE, serve."""
    parser = argparse.ArgumentParser(prog="python -m bench.backend", description=__doc__)
    parser.add_argument("--count", type=int, default=2, help="listening ports")
    parser.add_argument("--port", type=int, action="append", default=[],
                        help="listen on this port (repeatable; default: free ports)")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(serve(args.count, args.port))


if __name__ == "__main__":
    main()
