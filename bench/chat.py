"""
The chat path of the proxy bench: the request every LLM client sends, and what the backend
answers, shared by :mod:`bench.loadgen` (the clients) and :mod:`bench.backend` (the server).

Every scenario of ``python -m bench relay`` sends ``POST /v1/chat/completions`` with a small,
realistic JSON body.  The Rust routers route only the OpenAI paths, drop the query string and
re-serialise the body without the fields they do not know, so the backend takes its
instruction from the one place every router passes on untouched: the last message's content.
An instruction is a few words:

``json``
    a small ``chat.completion`` answer (``"stream": false``).
``paced SIZE INTERVAL_MS COUNT [DELAY_MS]``
    ``COUNT`` SSE token events of ``SIZE`` bytes, one every ``INTERVAL_MS`` on an absolute
    schedule, the first after ``DELAY_MS``; then a usage event and ``data: [DONE]``.
``bulk SIZE SECONDS``
    the same events as fast as the connection takes them, for ``SECONDS``.
``big BYTES CHUNK``
    ``BYTES`` of SSE payload in ``CHUNK``-byte chunks (the slow-client test).

Each token event is shaped like vLLM's (``chat.completion.chunk`` with a ``delta``); its
``id`` carries the backend's ``CLOCK_MONOTONIC`` nanoseconds at the write and the event's
index, at a fixed offset, so the client computes each chunk's latency without parsing JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CHAT_PATH = "/v1/chat/completions"
MODEL = "bench"
#: The longest instruction the backend reads (anything longer is not one).
MAX_INSTRUCTION = 200
#: Limits that keep a hostile or mistyped instruction from asking for the impossible.
MAX_SIZE = 1 << 20
MAX_COUNT = 10_000_000
MAX_SECONDS = 3600.0
MAX_BYTES = 1 << 40

#: Where the send time sits in a token event: after ``data: {"id":"chatcmpl-``.
EVENT_PREFIX = b'data: {"id":"chatcmpl-'
T_OFFSET, T_DIGITS = len(EVENT_PREFIX), 19
#: The same in the non-LLM ``GET /sse`` events (``data: {"t":<19 digits>``).
GET_EVENT_PREFIX = b'data: {"t":'
GET_T_OFFSET = len(GET_EVENT_PREFIX)
#: Events a chat stream sends after its token events: the usage event and ``[DONE]``.
TRAILING_EVENTS = 2


@dataclass(frozen=True)
class Instruction:
    """What the backend is to answer one chat request with."""

    kind: str  # "json", "paced", "bulk" or "big"
    size: int = 250
    interval_ms: float = 25.0
    count: int = 10
    delay_ms: float = 0.0
    seconds: float = 10.0
    total_bytes: int = 1 << 30
    chunk: int = 65536

    def text(self) -> str:
        """The message content that asks for this answer (:func:`parse_instruction`'s input)."""
        if self.kind == "paced":
            return (f"paced {self.size} {self.interval_ms:g} {self.count}"
                    f" {self.delay_ms:.3f}")
        if self.kind == "bulk":
            return f"bulk {self.size} {self.seconds:g}"
        if self.kind == "big":
            return f"big {self.total_bytes} {self.chunk}"
        return "json"

    @property
    def streams(self) -> bool:
        """Whether the answer is an SSE stream (the request then says ``"stream": true``)."""
        return self.kind != "json"


def _number(word: str, low: float, high: float) -> float | None:
    """``word`` as a finite number within [low, high], else None."""
    try:
        value = float(word)
    except ValueError:
        return None
    if not math.isfinite(value) or not low <= value <= high:
        return None
    return value


def parse_instruction(text: object) -> Instruction | None:
    """
    The instruction in a message's content, or None when it is not one (wrong type, unknown
    word, too few or too many numbers, a number out of range): the backend then answers 400.
    """
    if not isinstance(text, str) or len(text) > MAX_INSTRUCTION:
        return None
    words = text.split()
    if not words:
        return None
    kind, numbers = words[0], words[1:]
    shapes: dict[str, tuple[tuple[float, float], ...]] = {
        "json": (),
        "paced": ((1, MAX_SIZE), (0, 3.6e6), (0, MAX_COUNT), (0, 3.6e6)),
        "bulk": ((1, MAX_SIZE), (0, MAX_SECONDS)),
        "big": ((0, MAX_BYTES), (1, MAX_SIZE)),
    }
    shape = shapes.get(kind)
    optional = 1 if kind == "paced" else 0
    if shape is None or not len(shape) - optional <= len(numbers) <= len(shape):
        return None
    values = [_number(w, low, high) for w, (low, high) in zip(numbers, shape, strict=False)]
    if any(v is None for v in values):
        return None
    v = [float(x) for x in values if x is not None]
    if kind == "paced":
        return Instruction("paced", size=int(v[0]), interval_ms=v[1], count=int(v[2]),
                           delay_ms=v[3] if len(v) > 3 else 0.0)
    if kind == "bulk":
        return Instruction("bulk", size=int(v[0]), seconds=v[1])
    if kind == "big":
        return Instruction("big", total_bytes=int(v[0]), chunk=int(v[1]))
    return Instruction("json")


def instruction_from_body(body: bytes) -> Instruction | None:
    """
    The instruction a chat request's JSON body carries in its last message, or None (not
    JSON, no messages, content not an instruction).  ``"stream": false`` with a streaming
    instruction is answered as asked by the content: the routers keep ``stream`` as sent.
    """
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(payload, dict):
        return None
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    return parse_instruction(messages[-1].get("content"))


def chat_body(instruction: Instruction) -> bytes:
    """A small, realistic chat request body asking for ``instruction``'s answer."""
    payload: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": instruction.text()},
        ],
        "stream": instruction.streams,
        "max_tokens": max(1, instruction.count if instruction.kind == "paced" else 256),
        "temperature": 0.7,
    }
    if instruction.streams:
        payload["stream_options"] = {"include_usage": True}
    return json.dumps(payload, separators=(",", ":")).encode()


def chat_request(host: str, port: int, instruction: Instruction) -> bytes:
    """The whole ``POST /v1/chat/completions`` request (head and body) for ``instruction``."""
    body = chat_body(instruction)
    accept = "text/event-stream" if instruction.streams else "application/json"
    return (
        f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: bench\r\n"
        f"Accept: {accept}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


# -- what the backend writes ----------------------------------------------------------------

CREATED = 1764633600


def chunked(payload: bytes) -> bytes:
    """``payload`` as one HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def token_event_template(size: int) -> bytes:
    """
    A ``%``-template (send time ns, index) for one token event of exactly ``size`` bytes
    (longer if ``size`` is below the fixed part), framed as its own HTTP chunk.
    """
    head = EVENT_PREFIX + b'%019d-%06d","object":"chat.completion.chunk","created":' + (
        b"%d" % CREATED) + b',"model":"' + MODEL.encode() + (
        b'","choices":[{"index":0,"delta":{"content":"')
    tail = b'"},"finish_reason":null}]}\n\n'
    fixed = len(head % (0, 0)) + len(tail)
    payload = head + b"x" * max(0, size - fixed) + tail
    return b"%x\r\n" % len(payload % (0, 0)) + payload + b"\r\n"


def stream_end(count: int) -> bytes:
    """The usage event and ``data: [DONE]``, each its own chunk, then the last chunk."""
    usage = json.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": CREATED,
        "model": MODEL, "choices": [],
        "usage": {"prompt_tokens": 16, "completion_tokens": count,
                  "total_tokens": 16 + count},
    }, separators=(",", ":")).encode()
    return chunked(b"data: " + usage + b"\n\n") + chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def completion_body() -> bytes:
    """The small ``chat.completion`` answer to ``json``."""
    return json.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": CREATED,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 16, "completion_tokens": 1, "total_tokens": 17},
    }, separators=(",", ":")).encode()


def send_time(event: bytes) -> int | None:
    """The send time (ns) embedded in a token event of either path, None for other events."""
    if event.startswith(EVENT_PREFIX):
        digits = event[T_OFFSET : T_OFFSET + T_DIGITS]
    elif event.startswith(GET_EVENT_PREFIX):
        digits = event[GET_T_OFFSET : GET_T_OFFSET + T_DIGITS]
    else:
        return None
    return int(digits) if digits.isdigit() else None


# -- the paced scenario's schedule and phases ---------------------------------------------------


def stream_counts(streams: int, count: int, spread: float) -> list[int]:
    """
    Token events per stream: stream ``i`` is ``spread × count × i / streams`` events shorter
    than ``count``, so streams end one after the other over the last ``spread`` of the run
    (while the others still stream) instead of all within one interval.
    """
    cut = max(0.0, min(spread, 0.9)) * count
    return [max(1, count - int(cut * i / streams)) for i in range(streams)]


PHASES = ("starting", "steady", "ending")


def phase_of(received: int, all_started: int, first_end: int) -> str:
    """
    The phase an event received at ``received`` (ns) belongs to: ``ending`` once any stream
    has ended (``first_end``), else ``starting`` until ``all_started`` (the client's choice:
    every stream has had its first event, and a settling time), else ``steady``.
    """
    if received >= first_end:
        return "ending"
    if received <= all_started:
        return "starting"
    return "steady"


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of sorted values, nearest rank; NaN if empty."""
    n = len(sorted_values)
    if not n:
        return math.nan
    return float(sorted_values[min(n - 1, max(0, round(q * (n - 1))))])


def phase_split(received: Sequence[int], latency: Sequence[int], all_started: int,
                first_end: int) -> dict[str, dict[str, float]]:
    """Per phase: how many events, and their latency p50/p99 in µs."""
    groups: dict[str, list[int]] = {phase: [] for phase in PHASES}
    for at, lat in zip(received, latency, strict=True):
        groups[phase_of(at, all_started, first_end)].append(lat)
    out = {}
    for phase, values in groups.items():
        values.sort()
        out[phase] = {"count": len(values), "p50_us": percentile(values, 0.5) / 1000,
                      "p99_us": percentile(values, 0.99) / 1000}
    return out


def timeline(received: Sequence[int], latency: Sequence[int], start: int,
             bucket_ns: int) -> list[dict[str, float]]:
    """Latency p50/p99 (µs) of the events received in each ``bucket_ns`` since ``start``."""
    buckets: dict[int, list[int]] = {}
    for at, lat in zip(received, latency, strict=True):
        buckets.setdefault(max(0, at - start) // bucket_ns, []).append(lat)
    out = []
    for index in sorted(buckets):
        values = sorted(buckets[index])
        out.append({"t_s": index * bucket_ns / 1e9, "count": len(values),
                    "p50_us": percentile(values, 0.5) / 1000,
                    "p99_us": percentile(values, 0.99) / 1000})
    return out
