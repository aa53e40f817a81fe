"""
The Responses API's answers (``/v1/responses``): a whole response object, or a stream of
typed events whose last carries that object.
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
)


def _texts(blocks: object, kinds: tuple[str, ...], field: str = "text") -> list[str]:
    """The ``field`` strings of the blocks (dicts) in a list whose ``type`` is in ``kinds``."""
    if not isinstance(blocks, list):
        return []
    return [block[field] for block in blocks
            if isinstance(block, dict) and block.get("type") in kinds
            and isinstance(block.get(field), str)]


def _fold_response(completion: Completion, response: dict[str, Any], texts: bool) -> None:
    """A whole Responses API object: status, usage and (``texts``) the output's texts."""
    status = response.get("status")
    details = response.get("incomplete_details")
    reason = details.get("reason") if details.__class__ is dict else None
    if reason.__class__ is str:
        completion.finish = reason
    elif status.__class__ is str:
        completion.finish = status
    usage = response.get("usage")
    if usage.__class__ is dict:
        tokens = int_or_none(usage.get("output_tokens"))
        if tokens is not None:
            completion.completion_tokens = tokens
        details = usage.get("input_tokens_details")
        completion.prompt_tokens, completion.cached_prompt_tokens = prompt_counts(
            int_or_none(usage.get("input_tokens")),
            int_or_none(details.get("cached_tokens")) if details.__class__ is dict else None)
    if not texts:
        return
    output = response.get("output")
    for item in output if output.__class__ is list else ():
        if item.__class__ is not dict:
            continue
        if item.get("type") == "message":
            completion.content.extend(_texts(item.get("content"), ("output_text",)))
        elif item.get("type") == "reasoning":
            completion.reasoning.extend(_texts(item.get("content"), ("reasoning_text",)))
            completion.reasoning.extend(_texts(item.get("summary"), ("summary_text",)))


#: Responses API stream events that end it, carrying the whole response object
_RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})
_REASONING_DELTAS = frozenset({"response.reasoning_text.delta",
                               "response.reasoning_summary_text.delta"})


class ResponsesFold:
    """
    A Responses API stream, one event at a time.  Its stream is typed events, not chat's
    choices: the text comes in ``response.output_text.delta`` events (reasoning in
    ``response.reasoning_*``) and status and usage in the final ``response.completed`` (or
    ``.incomplete``, ``.failed``), whose full output is used only when no delta was kept
    (the capture may have cut them).
    """

    __slots__ = ("completion", "_final")

    def __init__(self) -> None:
        self.completion = Completion(stream=True)
        self._final: dict[str, Any] | None = None

    def add(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind.__class__ is not str:
            return  # a list or an object cannot even be looked up among the kinds
        delta = event.get("delta")
        if kind == "response.output_text.delta" and delta.__class__ is str:
            self.completion.content.append(delta)
        elif kind in _REASONING_DELTAS and delta.__class__ is str:
            self.completion.reasoning.append(delta)
        elif kind in _RESPONSE_ENDS and event.get("response").__class__ is dict:
            self._final = event["response"]

    def skip(self) -> None:
        """An event passed over unparsed: nothing to do."""

    def end(self) -> Completion:
        completion = self.completion
        if self._final is not None:
            texts = not completion.content and not completion.reasoning
            _fold_response(completion, self._final, texts)
            self._final = None
        return completion


def parse_responses(body: bytes, content_type: bytes | None) -> Completion:
    """A Responses API answer: a whole JSON object, or its stream (:class:`ResponsesFold`)."""
    if not is_stream(body, content_type):
        completion = Completion()
        answer = parse_json_object(body)
        if answer is not None:
            _fold_response(completion, answer, texts=True)
        return completion
    fold = ResponsesFold()
    for event in sse_payloads(body):
        fold.add(event)
    return fold.end()
