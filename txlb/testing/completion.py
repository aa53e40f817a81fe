"""
A completion request checked the way vLLM checks it, in the same order (valid JSON, a known
model, a live engine, then its fields and the context length), and turned into the
:class:`~txlb.testing.generation.Generation` that will answer it -- or refused with the
status and message vLLM answers with (:class:`BadRequest`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

from twisted.web.server import Request

from txlb._kvcache import count_tokens, render_prompt
from txlb.testing.generation import Generation, Simulator


class Host(Simulator, Protocol):
    """What checking a completion reads of its simulator."""

    models: tuple[str, ...]
    engine_dead: bool
    max_model_len: int
    default_tokens: int
    reasoning_tokens: int


class BadRequest(Exception):
    """An invalid completion request; carries the status and message to answer with."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def count_words(value: object, depth: int = 0) -> int:
    """
    A deterministic stand-in for tokenisation: whitespace-separated words.

    Accepts what OpenAI-style requests put in ``content``/``prompt``: a string, a list of
    content parts (``{"type": "text", "text": ...}``), a list of strings, or token ids.
    Nesting deeper than any real request has is not counted, so a hostile body cannot
    exhaust the stack.
    """
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, int) and not isinstance(value, bool):
        return 1
    if depth >= 32:
        return 0
    if isinstance(value, dict):
        return count_words(value.get("text", ""), depth + 1)
    if isinstance(value, list):
        return sum(count_words(item, depth + 1) for item in value)
    return 0


def continued_from(text: object) -> int:
    """
    Where a continuation of the simulator's own answer starts: its answers are the words
    ``tok0 tok1 ...``, so a text that ends in ``tok<m>`` (its final assistant message, or
    a completions prompt) is continued from token ``m + 1``; anything else from 0.  So a
    stream resumed on another simulator reads as one uninterrupted answer.
    """
    if not isinstance(text, str):
        return 0
    words = text.split()
    last = words[-1] if words else ""
    number = last[3:]
    if last[:3] != "tok" or not number.isdigit() or len(number) > 9:
        return 0
    return int(number) + 1


def parse_completion(sim: Host, request: Request, body: bytes, chat: bool,
                     take_id: Callable[[], int]) -> Generation:
    """
    Validate a completion request the way vLLM does, in the same order; ``take_id`` numbers
    it (``chatcmpl-N``, ``cmpl-N``) once it is accepted, so a refused request takes no number.
    """
    try:
        payload = json.loads(body)
    except ValueError as e:
        raise BadRequest(400, f"JSON decode error: {e}") from None
    except RecursionError:
        raise BadRequest(400, "JSON decode error: nested too deeply") from None
    if not isinstance(payload, dict):
        raise BadRequest(400, "The request body must be a JSON object.")

    model = payload.get("model", sim.models[0])
    if model not in sim.models:
        raise BadRequest(404, f"The model `{model}` does not exist.")
    if sim.engine_dead:
        raise BadRequest(500, "Engine is dead")

    if chat:
        messages = payload.get("messages")
        if not isinstance(messages, list):
            raise BadRequest(400, "Field required: messages (a list).")
        prompt_tokens = sum(
            count_words(m.get("content")) for m in messages if isinstance(m, dict)
        )
        max_tokens = payload.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = payload.get("max_tokens")
        offset = continuation_of(payload, messages)
    else:
        if "prompt" not in payload:
            raise BadRequest(400, "Field required: prompt.")
        prompt_tokens = count_words(payload["prompt"])
        max_tokens = payload.get("max_tokens")
        offset = continued_from(payload["prompt"])
    prompt = None
    if sim.cache is not None:
        prompt = render_prompt(payload, chat)
        prompt_tokens = count_tokens(prompt)

    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise BadRequest(400, f"max_tokens must be an integer, got {max_tokens!r}.")
        if max_tokens < 1:
            raise BadRequest(400, f"max_tokens must be at least 1, got {max_tokens}.")
    if prompt_tokens >= sim.max_model_len:
        raise BadRequest(
            400,
            f"This model's maximum context length is {sim.max_model_len} tokens. "
            f"However, your request has {prompt_tokens} input tokens. "
            "Please reduce the length of the input messages.",
        )
    if max_tokens is not None and prompt_tokens + max_tokens > sim.max_model_len:
        raise BadRequest(
            400,
            f"This model's maximum context length is {sim.max_model_len} tokens. "
            f"However, you requested {prompt_tokens + max_tokens} tokens "
            f"({prompt_tokens} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.",
        )

    override = header_count(request, b"X-Sim-Tokens", least=0)
    if override is not None:
        count = override
        # the whole answer's length: a continuation makes what its first part did not
        count = max(0, count - offset)
        finish_reason = "stop"
        if max_tokens is not None and max_tokens < count:
            count, finish_reason = max_tokens, "length"
    elif max_tokens is not None:
        count, finish_reason = max_tokens, "length"
    else:
        count, finish_reason = max(0, sim.default_tokens - offset), "stop"
    available = sim.max_model_len - prompt_tokens
    if count > available:
        count, finish_reason = available, "length"

    reset_after = header_count(request, b"X-Sim-Reset-After", least=1)

    thinking = False
    if chat:
        kwargs = payload.get("chat_template_kwargs")
        thinking = isinstance(kwargs, dict) and kwargs.get("enable_thinking") is True
    stream = payload.get("stream") is True
    options = payload.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True

    number = take_id()
    return Generation(
        sim=sim,
        request=request,
        chat=chat,
        model=model,
        stream=stream,
        include_usage=stream and include_usage,
        prompt_tokens=prompt_tokens,
        reasoning_count=sim.reasoning_tokens if thinking else 0,
        content_count=count,
        finish_reason=finish_reason,
        ident=f"{'chatcmpl' if chat else 'cmpl'}-{number}",
        created=int(sim._clock.seconds()),
        prompt=prompt,
        content_offset=offset,
        reset_after=reset_after,
    )


def header_count(request: Request, name: bytes, least: int) -> int | None:
    """A test-control header's whole number, at least ``least``; 400 for anything else."""
    value = request.getHeader(name)
    if value is None:
        return None
    try:
        number = int(value)
        if number < least:
            raise ValueError(number)
    except ValueError:
        raise BadRequest(400, f"Invalid {name.decode()}: {value!r}") from None
    return number


def continuation_of(payload: dict[str, Any], messages: list[Any]) -> int:
    """
    A chat request's continuation (``continue_final_message``), checked as vLLM checks it:
    ``add_generation_prompt`` must be false with it (vLLM's default is true) and the last
    message the assistant's; the token its answer continues from
    (:func:`continued_from`), 0 for a request that continues nothing.
    """
    if payload.get("continue_final_message") is not True:
        return 0
    if payload.get("add_generation_prompt", True) is not False:
        raise BadRequest(400, "Cannot set both `continue_final_message` and "
                              "`add_generation_prompt` to True.")
    last = messages[-1] if messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        raise BadRequest(400, "continue_final_message is set but the final message is "
                              "not the assistant's.")
    return continued_from(last.get("content"))
