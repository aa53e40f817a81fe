"""
The Anthropic-style Messages API's answers (``/v1/messages``, which vLLM and llama.cpp
serve): content blocks, a stop reason, and a prompt counted in three parts.
"""

from __future__ import annotations

from typing import Any

from txlb._json_body import parse_json_object
from txlb._records.answers.completion import (
    Completion,
    int_or_none,
    is_stream,
    prompt_counts,
    sse_payloads,
    sum_counts,
    token_count,
)

#: the Messages API's three parts of a prompt: uncached, read from the cache, written to it
_MESSAGES_INPUTS = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


class MessagesFold:
    """
    A Messages API (Anthropic-style) answer: ``text`` and ``thinking`` content blocks,
    ``stop_reason`` and ``usage.output_tokens``; streamed as ``content_block_*`` events,
    with the stop reason and final usage in ``message_delta``.  Its ``usage.input_tokens``
    are the prompt tokens *not* read from the cache: the prompt is those plus
    ``cache_read_input_tokens`` and ``cache_creation_input_tokens``, the cached part
    ``cache_read_input_tokens`` (each taken from the last event that says it: a stream's
    ``message_start``, then its ``message_delta``).
    """

    __slots__ = ("completion", "_inputs")

    def __init__(self, stream: bool = True) -> None:
        self.completion = Completion(stream=stream)
        self._inputs: dict[str, int] = {}

    def add(self, event: dict[str, Any]) -> None:
        """One event of a stream."""
        kind = event.get("type")
        if kind == "message_start" and isinstance(event.get("message"), dict):
            self._end_part(event["message"])
        elif kind in ("content_block_start", "content_block_delta"):
            self._block(event.get("content_block") or event.get("delta"))
        elif kind == "message_delta":
            delta = event.get("delta")
            self._end_part({**(delta if isinstance(delta, dict) else {}),
                            "usage": event.get("usage")})

    def add_answer(self, answer: dict[str, Any]) -> None:
        """The whole JSON answer."""
        content = answer.get("content")
        for block in content if isinstance(content, list) else ():
            self._block(block)
        self._end_part(answer)

    def _block(self, block: object) -> None:
        if not isinstance(block, dict):
            return
        kind = block.get("type")
        if kind in ("text", "text_delta") and isinstance(block.get("text"), str):
            self.completion.content.append(block["text"])
        if kind in ("thinking", "thinking_delta") and isinstance(block.get("thinking"), str):
            self.completion.reasoning.append(block["thinking"])

    def _end_part(self, end: dict[str, Any]) -> None:
        """What holds stop_reason and usage: a message, or a stream's message_delta."""
        completion = self.completion
        if isinstance(end.get("stop_reason"), str):
            completion.finish = end["stop_reason"]
        usage = end.get("usage")
        if isinstance(usage, dict):
            tokens = int_or_none(usage.get("output_tokens"))
            if tokens is not None:
                completion.completion_tokens = tokens
            for name in _MESSAGES_INPUTS:
                tokens = token_count(int_or_none(usage.get(name)))
                if tokens is not None:
                    self._inputs[name] = tokens

    def skip(self) -> None:
        """An event passed over unparsed: nothing to do."""

    def end(self) -> Completion:
        completion, inputs = self.completion, self._inputs
        if "input_tokens" in inputs:
            read = inputs.get("cache_read_input_tokens")
            completion.prompt_tokens, completion.cached_prompt_tokens = prompt_counts(
                sum_counts(inputs["input_tokens"], read or 0,
                            inputs.get("cache_creation_input_tokens", 0)), read)
        return completion


def parse_messages(body: bytes, content_type: bytes | None) -> Completion:
    """A Messages API answer: a whole JSON object, or its stream (:class:`MessagesFold`)."""
    if is_stream(body, content_type):
        fold = MessagesFold()
        for event in sse_payloads(body):
            fold.add(event)
        return fold.end()
    fold = MessagesFold(stream=False)
    answer = parse_json_object(body)
    if answer is not None:
        fold.add_answer(answer)
    return fold.end()
