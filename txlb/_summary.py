"""
What one finished request amounts to: the fields of its result-log line.

Pure functions over bytes, kept apart from the writer so they can be tested (and fuzzed) on
their own, and so nothing here runs per chunk: the proxy only collects the first
:data:`CAPTURE_LIMIT` bytes of the response, and :func:`summarize` reads them once, when
the request has ended.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

#: How much of a response is kept for the summary; the client always gets all of it.
CAPTURE_LIMIT = 512 * 1024
#: Characters of content shown after ``|``.
PREVIEW_CHARS = 200
#: Paths whose responses are LLM completions and get the full summary.
COMPLETION_PATHS = frozenset({b"/v1/chat/completions", b"/v1/completions"})

_THINK_BLOCK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)


@attrs.define
class RequestRecord:
    """
    The raw facts about one proxied request, gathered by the proxy as it runs.

    ``outcome`` says how it ended: ``ok``; ``client_abort`` (the client left first);
    ``timeout`` (the backend was silent past ``--read-timeout``); ``upstream_error`` (the
    backend failed or could not be reached); ``proxy_error`` (txlb answered by itself:
    no backend, body too large, ...).
    """

    started: float
    method: bytes
    path: bytes
    orid_header: bytes | None
    request_body: bytes
    backend: str | None = None
    status: int | None = None
    outcome: str = "ok"
    ended: float = 0.0
    first_byte: float | None = None
    content_type: bytes | None = None
    response: list[bytes] = attrs.field(factory=list)
    captured: int = 0
    truncated: bool = False
    queue_wait: float | None = None
    tries: int = 1

    def capture(self, data: bytes) -> None:
        """Keep ``data`` for the summary while under the limit (called per chunk: cheap)."""
        room = CAPTURE_LIMIT - self.captured
        if room <= 0:
            self.truncated = True
            return
        if len(data) > room:
            data = data[:room]
            self.truncated = True
        self.response.append(data)
        self.captured += len(data)


@attrs.frozen
class Summary:
    """The fields of one result-log line, in the order the text format writes them."""

    time: float
    orid: str
    backend: str
    method: str
    path: str
    status: int
    kind: str  # "completion", "error" or "other"
    outcome: str
    dur: float
    ttft: float | None = None
    finish: str | None = None
    completion_tokens: int | None = None
    max_tokens: int | None = None
    thinking: bool = False
    think: bool = False
    empty: bool = True
    clen: int = 0
    preview: str = ""
    req_keys: list[str] | None = None
    err_body: str = ""
    truncated: bool = False
    tries: int = 1


def parse_json_object(body: bytes) -> dict[str, Any] | None:
    """``body`` as a JSON object, or ``None`` if it is not one."""
    if not body or body.lstrip()[:1] != b"{":
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _sse_payloads(data: bytes) -> list[dict[str, Any]]:
    """The JSON objects of every ``data:`` line; ``[DONE]`` and broken events are skipped."""
    events = []
    for line in data.splitlines():
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            continue
        event = parse_json_object(payload)
        if event is not None:
            events.append(event)
    return events


@attrs.define
class _Completion:
    content: list[str] = attrs.field(factory=list)
    reasoning: list[str] = attrs.field(factory=list)
    finish: str | None = None
    completion_tokens: int | None = None

    def add_choice(self, choice: object, part: str) -> None:
        """One choice of a chunk (``part="delta"``) or of a whole answer (``"message"``)."""
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            return
        holder = choice.get(part)
        if isinstance(holder, dict):
            self.content.append(_text(holder.get("content")))
            self.reasoning.append(_text(holder.get("reasoning_content")))
            self.reasoning.append(_text(holder.get("reasoning")))
        self.content.append(_text(choice.get("text")))  # /v1/completions
        if isinstance(choice.get("finish_reason"), str):
            self.finish = choice["finish_reason"]

    def add(self, event: dict[str, Any], part: str) -> None:
        choices = event.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                self.add_choice(choice, part)
        usage = event.get("usage")
        if isinstance(usage, dict):
            tokens = _int_or_none(usage.get("completion_tokens"))
            if tokens is not None:
                self.completion_tokens = tokens


def parse_completion(body: bytes, content_type: bytes | None) -> _Completion:
    """Content, reasoning, finish reason and usage from a plain JSON or an SSE response."""
    completion = _Completion()
    stripped = body.lstrip()
    if (content_type or b"").startswith(b"text/event-stream") or stripped.startswith(b"data:"):
        for event in _sse_payloads(body):
            completion.add(event, "delta")
    else:
        answer = parse_json_object(body)
        if answer is not None:
            completion.add(answer, "message")
    return completion


def orid_of(header: bytes | None, request: dict[str, Any] | None) -> str:
    """``X-Orid``, else the body's ``user``, else ``-``."""
    if header:
        return header.decode("utf-8", "replace")
    if request is not None and isinstance(request.get("user"), str | int) and request["user"]:
        return str(request["user"])
    return "-"


def summarize(record: RequestRecord) -> Summary:
    """Turn what the proxy saw into the fields of the log line."""
    request = parse_json_object(record.request_body)
    body = b"".join(record.response)
    status = record.status if record.status is not None else 499
    common: dict[str, Any] = {
        "time": record.ended,
        "orid": orid_of(record.orid_header, request),
        "backend": record.backend or "-",
        "method": record.method.decode("ascii", "replace"),
        "path": record.path.decode("utf-8", "replace"),
        "status": status,
        "outcome": record.outcome,
        "dur": max(0.0, record.ended - record.started),
        "ttft": None if record.first_byte is None else record.first_byte - record.started,
        "truncated": record.truncated,
        "tries": record.tries,
    }
    if status != 200:
        keys = sorted(map(str, request)) if request is not None else None
        return Summary(kind="error", req_keys=keys,
                       err_body=body.decode("utf-8", "replace"), **common)
    if record.path not in COMPLETION_PATHS:
        return Summary(kind="other", **common)

    completion = parse_completion(body, record.content_type)
    content = "".join(completion.content)
    reasoning = "".join(completion.reasoning)
    visible = _THINK_BLOCK.sub("", content).strip()
    max_tokens = None
    thinking = False
    if request is not None:
        max_tokens = _int_or_none(request.get("max_tokens"))
        if max_tokens is None:
            max_tokens = _int_or_none(request.get("max_completion_tokens"))
        kwargs = request.get("chat_template_kwargs")
        thinking = isinstance(kwargs, dict) and kwargs.get("enable_thinking") is True
    return Summary(
        kind="completion",
        finish=completion.finish,
        completion_tokens=completion.completion_tokens,
        max_tokens=max_tokens,
        thinking=thinking,
        think=bool(reasoning) or "<think>" in content,
        empty=not visible,
        clen=len(content),
        preview=visible[:PREVIEW_CHARS],
        **common,
    )
