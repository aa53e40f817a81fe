"""
OpenAI's chat completions and completions answers (``/v1/chat/completions``,
``/v1/completions``): one shape, ``choices`` -- a ``message`` or a stream's ``delta`` for
chat, a ``text`` for completions -- with ``usage`` (and llama.cpp's ``timings``) beside.
"""

from __future__ import annotations

from typing import Any

from txlb._json_body import parse_json_object
from txlb._records.answers.completion import (
    Completion,
    int_or_none,
    prompt_counts,
    sse_payloads,
    sum_counts,
    token_count,
)


def _openai_prompt(usage: object, timings: object) -> tuple[int | None, int | None]:
    """
    The prompt and cached-prompt tokens of an OpenAI-style answer: ``usage.prompt_tokens``
    and ``usage.prompt_tokens_details.cached_tokens`` (vLLM with
    ``--enable-prompt-tokens-details``, SGLang, llama.cpp), else llama.cpp's ``timings``:
    ``cache_n`` tokens reused from its prompt cache plus ``prompt_n`` evaluated.
    """
    prompt = cached = None
    if isinstance(usage, dict):
        prompt = token_count(int_or_none(usage.get("prompt_tokens")))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached = int_or_none(details.get("cached_tokens"))
    if isinstance(timings, dict) and (prompt is None or cached is None):
        reused = token_count(int_or_none(timings.get("cache_n")))
        if prompt is None:
            prompt = sum_counts(reused, token_count(int_or_none(timings.get("prompt_n"))))
        if cached is None:
            cached = reused
    return prompt_counts(prompt, cached)


#: how many events at a stream's end are searched for llama.cpp's ``timings``: it sends
#: them with the final chunk, and with ``include_usage`` once more on the usage chunk after
_TIMINGS_TAIL = 3


class ChatFold:
    """
    An OpenAI chat or completions answer, one event (or the whole JSON answer, with
    ``part="message"``) at a time.  Only the first choice counts.  The prompt's counts are
    read once, at the end, from the last ``usage`` seen and the ``timings`` of the last
    :data:`_TIMINGS_TAIL` events (where llama.cpp puts them), not looked up per event.
    """

    __slots__ = ("completion", "_part", "_last_usage", "_timings", "_timings_at", "_seen")

    def __init__(self, part: str = "delta", stream: bool = True) -> None:
        self.completion = Completion(stream=stream)
        self._part = part
        self._last_usage: object = None
        self._timings: object = None
        self._timings_at = 0
        self._seen = 0

    def add(self, event: dict[str, Any]) -> None:
        completion = self.completion
        self._seen += 1
        choices = event.get("choices")
        if choices.__class__ is list:
            for choice in choices:
                if choice.__class__ is not dict or choice.get("index", 0) != 0:
                    continue
                holder = choice.get(self._part)
                if holder.__class__ is dict:
                    text = holder.get("content")
                    if text.__class__ is str:
                        completion.content.append(text)
                    text = holder.get("reasoning_content") or holder.get("reasoning")
                    if text.__class__ is str:
                        completion.reasoning.append(text)
                text = choice.get("text")  # /v1/completions
                if text.__class__ is str:
                    completion.content.append(text)
                finish = choice.get("finish_reason")
                if finish.__class__ is str:
                    completion.finish = finish
        usage = event.get("usage")
        if usage.__class__ is dict:
            self._last_usage = usage
            tokens = int_or_none(usage.get("completion_tokens"))
            if tokens is not None:
                completion.completion_tokens = tokens
        found = event.get("timings")
        if found.__class__ is dict:
            self._timings, self._timings_at = found, self._seen

    def skip(self) -> None:
        """An event passed over unparsed (it holds no counts): it still moves the window
        in which ``timings`` are read."""
        self._seen += 1

    def end(self) -> Completion:
        completion = self.completion
        timings = self._timings if self._seen - self._timings_at < _TIMINGS_TAIL else None
        if self._last_usage is not None or timings is not None:
            completion.prompt_tokens, completion.cached_prompt_tokens = _openai_prompt(
                self._last_usage, timings)
        return completion


def parse_completion(body: bytes, content_type: bytes | None) -> Completion:
    """Content, reasoning, finish reason and usage from a plain JSON or an SSE response."""
    stripped = body.lstrip()
    if (content_type or b"").startswith(b"text/event-stream") or stripped.startswith(b"data:"):
        fold = ChatFold()
        for event in sse_payloads(body):
            fold.add(event)
        return fold.end()
    fold = ChatFold("message", stream=False)
    answer = parse_json_object(body)
    if answer is not None:
        fold.add(answer)
    return fold.end()
