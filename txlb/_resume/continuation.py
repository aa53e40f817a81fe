"""
The request that continues a stream on another engine: the original body, with the text
the client already has as the answer's start, and what is left of its token limits.

Whether a request can be continued at all is decided from its body (:func:`refusal_of`):
txlb continues only what it can continue exactly -- one streamed answer of plain text, with
no token probabilities, no constrained output (a JSON schema, a grammar, a required tool
call), no thinking (llama.cpp refuses to prefill with it), and no stop sequence the cut
could split (:func:`stop_spans`).
"""

from __future__ import annotations

from typing import Any

import orjson

from txlb._resume.progress import NotResumable, Progress

#: the fields that constrain the output to a schema, a grammar or a choice (OpenAI's,
#: vLLM's older guided decoding and newer structured outputs, llama.cpp's)
_CONSTRAINED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs", "json_schema", "grammar")


def refusal_of(payload: dict[str, Any], chat: bool) -> str | None:
    """Why a request of ``payload`` cannot be resumed (a metric's label), or ``None``."""
    if payload.get("stream") is not True:
        return "not_streamed"
    if payload.get("n", 1) not in (1, None) or payload.get("best_of", 1) not in (1, None):
        return "n"
    if payload.get("logprobs") or payload.get("top_logprobs") or payload.get("echo"):
        return "logprobs" if not payload.get("echo") else "echo"
    response_format = payload.get("response_format")
    if (isinstance(response_format, dict) and response_format.get("type") not in (None, "text")
            or any(payload.get(name) for name in _CONSTRAINED)):
        return "structured"
    tool_choice = payload.get("tool_choice")
    if tool_choice == "required" or isinstance(tool_choice, dict):
        return "tool_choice"
    if chat:
        if not isinstance(payload.get("messages"), list) or not payload["messages"]:
            return "unreadable"
        kwargs = payload.get("chat_template_kwargs")
        if isinstance(kwargs, dict) and kwargs.get("enable_thinking"):
            return "reasoning"
    elif not isinstance(payload.get("prompt"), str):
        return "prompt_shape"  # token ids, or a batch of prompts
    return None


def stop_spans(text: str, stop: object) -> bool:
    """
    Whether a stop sequence of ``stop`` (a string, or a list of them) could be split by a
    cut after ``text``: the text ends with the start of one, which the next engine, seeing
    the text as given, would not complete into a stop.
    """
    sequences = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    for sequence in sequences:
        if not isinstance(sequence, str):
            continue
        for length in range(1, len(sequence)):
            if text.endswith(sequence[:length]):
                return True
    return False


def continuation_body(payload: dict[str, Any], chat: bool, progress: Progress) -> bytes:
    """
    The body that continues ``payload``'s answer after ``progress``: a chat's messages end
    in the text so far as the assistant's, with ``continue_final_message`` (vLLM and
    SGLang; llama.cpp continues a final assistant message by itself) and
    ``add_generation_prompt: false`` (which vLLM requires with it); a completion's prompt
    ends in it.  ``max_tokens``, ``max_completion_tokens`` and ``min_tokens`` lose the
    tokens generated; an answer that already had all of them is finished, and one with no
    token yet is not continued (:class:`NotResumable`).
    """
    if not progress.text:
        # the engine had the whole request and may have done its work: not a resume but
        # a second generation, which the retry rules forbid
        raise NotResumable("before_first_token")
    if stop_spans(progress.text, payload.get("stop")):
        raise NotResumable("stop_sequence")
    body = dict(payload)
    generated = progress.tokens
    if chat:
        body["messages"] = [*payload["messages"],
                            {"role": "assistant", "content": progress.text}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        body["prompt"] = payload["prompt"] + progress.text
    for name in ("max_tokens", "max_completion_tokens"):
        limit = payload.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - generated < 1:
                raise NotResumable("finished")
            body[name] = limit - generated
    least = payload.get("min_tokens")
    if isinstance(least, int) and not isinstance(least, bool) and least:
        body["min_tokens"] = max(0, least - generated)
    return orjson.dumps(body)
