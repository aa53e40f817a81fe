"""
What every mode of the load generator (:mod:`bench.loadgen`) shares: the request bytes of
each API, and the hand-written HTTP/1.1 response parser that keeps the client's CPU per
chunk low.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.chat import (
    Instruction,
    chat_request,
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
