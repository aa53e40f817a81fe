"""
The prefix bench's client: streamed chat requests with bounded concurrency, TTFT measured
at the client.

Each of ``concurrency`` workers keeps one keep-alive HTTP/1.1 connection and sends the
workload's requests in order, as each previous one ends; requests that carry a burst number
(``hot-burst``) are sent one whole burst at a time instead: every request of a burst at the
same instant, the next burst once the last one ended.  TTFT is the time from writing the
request to the first SSE event whose ``delta.content`` (or ``text``) is not empty.  What
the answer says about the cache is read from it: ``usage.prompt_tokens`` and
``usage.prompt_tokens_details.cached_tokens`` (vLLM, the simulator, SGLang), and
llama.cpp's ``timings.prompt_n`` / ``timings.cache_n``.  An answer that is not a 200, or
a stream that breaks, is counted as an error (with its status) and the connection is
opened again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.prefix.workloads import PrefixRequest

HOST = "127.0.0.1"
#: Longest wait for one request, start to end: a stuck target is an error, not a hang.
REQUEST_TIMEOUT = 120.0


@dataclass
class Answer:
    """What one request saw."""

    index: int
    status: int = 0
    ttft: float | None = None
    duration: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    backend: str | None = None
    error: str = ""


@dataclass
class Run:
    """Every answer of one run, and its wall time."""

    answers: list[Answer] = field(default_factory=list)
    wall: float = 0.0


def _request_bytes(port: int, path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json"
            f"\r\nAccept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


def read_event(answer: Answer, event: dict[str, Any], started: float) -> None:
    """Take what one SSE event says into ``answer`` (first content, usage, timings)."""
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(text, str) and text:
            if answer.ttft is None:
                answer.ttft = time.perf_counter() - started
            answer.output_tokens += 1
    usage = event.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            answer.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            answer.cached_tokens = details["cached_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            answer.output_tokens = max(answer.output_tokens, usage["completion_tokens"])
    timings = event.get("timings")
    if isinstance(timings, dict):
        cache_n, prompt_n = timings.get("cache_n"), timings.get("prompt_n")
        if isinstance(cache_n, int) and isinstance(prompt_n, int):
            # llama.cpp: prompt_n is what it evaluated, cache_n what it reused
            answer.cached_tokens = cache_n
            answer.prompt_tokens = cache_n + prompt_n


class _Connection:
    """One keep-alive connection that sends a request and reads a chunked SSE answer."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None

    async def send(self, request: PrefixRequest, path: str) -> Answer:
        answer = Answer(request.index)
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self._exchange(request, path, answer, started),
                                   REQUEST_TIMEOUT)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
            answer.error = answer.error or f"{type(e).__name__}: {e}"
            await self.close()
        answer.duration = time.perf_counter() - started
        return answer

    async def _exchange(self, request: PrefixRequest, path: str, answer: Answer,
                        started: float) -> None:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(HOST, self.port)
        assert self.reader is not None
        body = json.dumps(request.body, separators=(",", ":")).encode()
        self.writer.write(_request_bytes(self.port, path, body))
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        answer.status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        answer.backend = headers.get("x-backend")
        events = _Events(answer, started)
        await self._body(headers, events)
        if headers.get("connection", "").lower() == "close":
            await self.close()
        if answer.status != 200:
            answer.error = f"HTTP {answer.status}: {events.raw[:200]!r}"

    async def _body(self, headers: dict[str, str], events: _Events) -> None:
        """Read the whole body into ``events``, chunk by chunk as it arrives."""
        assert self.reader is not None
        if "content-length" in headers:
            events.feed(await self.reader.readexactly(int(headers["content-length"])))
            events.feed(b"\n")
            return
        if headers.get("transfer-encoding", "").lower() != "chunked":
            events.feed(await self.reader.read())
            events.feed(b"\n")
            await self.close()
            return
        while True:
            size_line = await self.reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                events.feed(b"\n")
                return
            events.feed(chunk[:-2])


class _Events:
    """SSE ``data:`` lines parsed as they complete, so the first content is timed on arrival."""

    def __init__(self, answer: Answer, started: float) -> None:
        self.answer = answer
        self.started = started
        self.buffer = b""
        self.raw = b""

    def feed(self, data: bytes) -> None:
        if len(self.raw) < 4096:
            self.raw += data[:4096]
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if not payload or payload == b"[DONE]":
                continue
            event = json.loads(payload)
            if isinstance(event, dict):
                read_event(self.answer, event, self.started)


async def drive(port: int, requests: Sequence[PrefixRequest], concurrency: int,
                path: str = "/v1/chat/completions") -> Run:
    """Send ``requests`` to ``port`` (see the module docstring); every answer, in order."""
    run = Run()
    answers: dict[int, Answer] = {}
    started = time.perf_counter()
    if requests and requests[0].burst >= 0:
        bursts: dict[int, list[PrefixRequest]] = {}
        for request in requests:
            bursts.setdefault(request.burst, []).append(request)
        pool = [_Connection(port) for _ in range(max(len(b) for b in bursts.values()))]
        for burst in bursts.values():
            results = await asyncio.gather(*(
                pool[i].send(request, path) for i, request in enumerate(burst)))
            answers.update((a.index, a) for a in results)
        connections = pool
    else:
        queue = list(reversed(requests))
        connections = [_Connection(port) for _ in range(concurrency)]

        async def worker(connection: _Connection) -> None:
            while queue:
                answer = await connection.send(queue.pop(), path)
                answers[answer.index] = answer

        await asyncio.gather(*(worker(c) for c in connections))
    run.wall = time.perf_counter() - started
    for connection in connections:
        await connection.close()
    run.answers = [answers[r.index] for r in requests]
    return run
