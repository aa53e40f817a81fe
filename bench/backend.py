"""
A small, fast HTTP/1.1 backend for the proxy benchmark (``python -m bench.backend``).

It is not an inference server: it serves exactly what the benchmark needs, from raw asyncio
protocols with pre-built byte strings, so that it costs far less CPU per chunk than any proxy
in front of it.  Every listening port runs in this one process (one event loop); the port
numbers are printed as one JSON line, ``{"ports": [...]}``, once all are listening.

Endpoints (keep-alive as HTTP/1.1 does by default):

``POST /v1/chat/completions``
    What every scenario of ``python -m bench relay`` sends: the body is read whole (sized or
    chunked) and the last message's content says what to answer (:mod:`bench.chat`: a
    small ``chat.completion``, paced or bulk ``chat.completion.chunk`` events ending with a
    usage event and ``data: [DONE]``, or a large stream); anything else there is a ``400``.
``/health``, ``/server_info``, ``/model_info``, ``/v1/models``
    ``200`` with a tiny JSON body: the probes txlb, vllm-router and sglang-router make of a
    worker before they route to it.

The ``GET`` endpoints below take their instructions from the query string (the non-LLM
path the bench keeps as one line for continuity; any request body is skipped):

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

from bench.chat import (
    CHAT_PATH,
    MODEL,
    completion_body,
    instruction_from_body,
    stream_end,
    token_event_template,
)

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
BAD_REQUEST = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: 23\r\n"
               b"\r\nnot a bench instruction")
TOO_LARGE = (b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\nConnection: close\r\n"
             b"\r\n")
#: The largest chat request body the backend buffers (the bench's are a few hundred bytes).
MAX_BODY = 1 << 20


def _json_response(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"\r\n%s" % (len(body), body))


CHAT_RESPONSE = _json_response(completion_body())
#: The worker probes of the routers: what they read is that the answer is a 200 JSON.
PROBES = {
    b"/health": HEALTH_RESPONSE,
    b"/server_info": _json_response(json.dumps(
        {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}).encode()),
    b"/model_info": _json_response(json.dumps(
        {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}).encode()),
    b"/v1/models": _json_response(json.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}
    ).encode()),
}
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
            target = head.split(b" ", 2)[1] if b" " in head else b"/"
            path, _, query = target.partition(b"?")
            if path == CHAT_PATH.encode():
                if not self._chat_request(head, end + 4):
                    return
                continue
            self.buffer = self.buffer[end + 4 :]
            length = _content_length(head)
            if length:
                take = min(length, len(self.buffer))
                self.buffer = self.buffer[take:]
                self.skip = length - take
            if path == b"/json":
                self.transport.write(JSON_RESPONSE)
            elif path in PROBES:
                self.transport.write(PROBES[path])
            elif path == b"/sse":
                params = _params(query)
                self._start_paced(int(params.get("n", 10)), params.get("interval", 25.0),
                                  params.get("delay", 0.0),
                                  event_template(int(params.get("size", 250))), LAST_CHUNK)
            elif path == b"/bulk":
                params = _params(query)
                self._start_bulk(params.get("seconds", 10.0),
                                 event_template(int(params.get("size", 250))), LAST_CHUNK)
            elif path == b"/big":
                params = _params(query)
                self._start_big(int(params.get("bytes", 1 << 30)),
                                int(params.get("chunk", 65536)))
            else:
                self.transport.write(NOT_FOUND)

    # -- the chat path ---------------------------------------------------------------------

    def _chat_request(self, head: bytes, body_at: int) -> bool:
        """
        A ``POST /v1/chat/completions`` whose head ends at ``body_at``: once its body is all
        here, consume it and answer as its instruction says.  False while the body is still
        arriving (or the connection was closed for a body too large).
        """
        assert self.transport is not None
        if _is_chunked(head):
            decoded = _dechunk(self.buffer, body_at)
            if decoded is None:
                return self._still_arriving()
            body, consumed = decoded
        else:
            length = _content_length(head)
            if length > MAX_BODY:
                return self._too_large()
            if len(self.buffer) < body_at + length:
                return self._still_arriving()
            body, consumed = self.buffer[body_at : body_at + length], body_at + length
        self.buffer = self.buffer[consumed:]
        instruction = instruction_from_body(body)
        if instruction is None:
            self.transport.write(BAD_REQUEST)
        elif instruction.kind == "json":
            self.transport.write(CHAT_RESPONSE)
        elif instruction.kind == "paced":
            self._start_paced(instruction.count, instruction.interval_ms, instruction.delay_ms,
                              token_event_template(instruction.size),
                              stream_end(instruction.count))
        elif instruction.kind == "bulk":
            self._start_bulk(instruction.seconds, token_event_template(instruction.size),
                             stream_end(0))
        else:
            self._start_big(instruction.total_bytes, instruction.chunk)
        return True

    def _still_arriving(self) -> bool:
        """The body is incomplete: wait for more, unless more than ``MAX_BODY`` is buffered."""
        if len(self.buffer) > MAX_BODY + 65536:
            return self._too_large()
        return False

    def _too_large(self) -> bool:
        assert self.transport is not None
        self.transport.write(TOO_LARGE)
        self.transport.close()
        self.closed = True
        return False

    # -- paced SSE ------------------------------------------------------------------------

    def _start_paced(self, count: int, interval_ms: float, delay_ms: float, template: bytes,
                     end: bytes) -> None:
        """Head now, then one event per interval on an absolute schedule, then ``end``."""
        assert self.transport is not None
        self.busy = True
        interval = interval_ms / 1000
        delay = delay_ms / 1000
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
            self.transport.write(template % (time.monotonic_ns(), i % 1_000_000))
            i += 1
            state["i"] = i
            if i >= count:
                self.transport.write(end)
                self._done()
                return
            self.timer = loop.call_at(start + i * interval, tick)

        if count <= 0:
            self.transport.write(end)
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

    def _start_bulk(self, seconds: float, template: bytes, end: bytes) -> None:
        """Events in batches as fast as the connection takes them, for a while, then ``end``."""
        deadline = time.monotonic() + seconds

        def block() -> bytes | None:
            now = time.monotonic_ns()
            if now / 1e9 >= deadline:
                return None
            return (template % (now, 0)) * BULK_BATCH

        self._start_pump(PumpState(block, end))

    def _start_big(self, total: int, chunk: int) -> None:
        """A fixed number of bytes in large chunks, as fast as the connection allows."""
        remaining = [total]
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
                self.transport.write(pump.end)
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
    end: bytes = LAST_CHUNK


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


def _is_chunked(head: bytes) -> bool:
    """Whether the request's body is chunked (``Transfer-Encoding: chunked``)."""
    lower = head.lower()
    at = lower.find(b"\r\ntransfer-encoding:")
    if at < 0:
        return False
    end = lower.find(b"\r\n", at + 2)
    return b"chunked" in lower[at : end if end >= 0 else len(lower)]


def _dechunk(buffer: bytes, start: int) -> tuple[bytes, int] | None:
    """
    The chunked body at ``buffer[start:]`` decoded, and where it ends; None until all of it
    (through the last chunk and the trailers' blank line) has arrived.  A malformed size
    line counts as an empty body ending there, which the instruction check then refuses.
    """
    parts: list[bytes] = []
    pos = start
    while True:
        eol = buffer.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            size = int(buffer[pos:eol].split(b";", 1)[0], 16)
        except ValueError:
            return b"", eol + 2
        pos = eol + 2
        if size == 0:
            end = buffer.find(b"\r\n\r\n", pos - 2)
            return (b"".join(parts), end + 4) if end >= 0 else None
        if len(buffer) < pos + size + 2:
            return None
        parts.append(buffer[pos : pos + size])
        pos += size + 2


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
