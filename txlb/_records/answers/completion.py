"""
What every API's reader hands the summary (:class:`Completion`), and the readings the
readers share: the integers a backend's counts may be, counts as a summary keeps them, and
a whole body's events.
"""

from __future__ import annotations

from typing import Any

import attrs

from txlb._json_body import parse_json_object
from txlb._records.sse import data_payload


@attrs.define
class Completion:
    """
    What a completion's answer said, as its API's reader found it: the texts (in pieces,
    joined only when a reader of the texts needs them), the finish reason and the counts.
    """

    content: list[str] = attrs.field(factory=list)
    reasoning: list[str] = attrs.field(factory=list)
    finish: str | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    #: the answer was a stream (SSE), as the parser found it
    stream: bool = False


def int_or_none(value: object) -> int | None:
    """
    ``value`` if it is an integer in the 64-bit range any engine's counts fit in: JSON
    allows 4,300 digits, which would bloat the line and overflow the metrics' floats.
    """
    if isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63:
        return value
    return None


def token_count(value: int | None) -> int | None:
    """A count of tokens a backend reported: a negative one is none (the metrics' counters
    refuse a negative increment)."""
    return None if value is None or value < 0 else value


def sum_counts(*counts: int | None) -> int | None:
    """The sum of counts that are all known, if it is still in the 64-bit range."""
    if any(value is None for value in counts):
        return None
    total = sum(value for value in counts if value is not None)
    return total if total < 2**63 else None


def prompt_counts(prompt: int | None, cached: int | None) -> tuple[int | None, int | None]:
    """
    A prompt and cached-prompt count as a summary keeps them: each a count (a negative one
    is none), a cached count only beside a prompt count, and never above it -- a backend
    claiming more cache hits than prompt tokens gets the whole prompt, not a hit rate
    above 1.
    """
    prompt, cached = token_count(prompt), token_count(cached)
    if prompt is None:
        return None, None
    return prompt, None if cached is None else min(cached, prompt)


def sse_payloads(data: bytes) -> list[dict[str, Any]]:
    """
    The JSON objects of every ``data:`` line of a whole body; ``[DONE]`` and broken events
    are skipped.  Each is parsed on its own (:func:`~txlb._json_body.parse_json_object`), as
    a stream summarised while it passes parses it (:class:`~txlb._records.capture.
    StreamCapture`).
    """
    events = []
    for line in data.split(b"\n"):
        payload = data_payload(line)
        if payload is not None:
            event = parse_json_object(payload)
            if event is not None:
                events.append(event)
    return events


def is_stream(body: bytes, content_type: bytes | None) -> bool:
    """The answer is an SSE stream: by its type, or by its first line."""
    stripped = body.lstrip()
    return ((content_type or b"").startswith(b"text/event-stream")
            or stripped.startswith((b"data:", b"event:")))
