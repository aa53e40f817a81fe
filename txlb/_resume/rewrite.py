"""
A continuation's events made the first try's, so the client reads one stream: each event
gets the first try's ``id``, ``created`` and ``model``; a chat's role-only first chunk is
dropped (the client had one); the usage chunk counts the original prompt and every
completion token of both tries.  Only a resumed stream pays for the parsing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import orjson

from txlb._json_body import parse_json_object
from txlb._resume.progress import Progress

#: the most of one event held while it is incomplete (a continuation that sends more without
#: ending it is cut): the bound on what a stream keeps for a resume
EVENT_LIMIT = 512 * 1024


class ContinuationRewriter:
    """
    Fed the continuation's body (``feed``, its bytes unframed, in any chunking), it gives
    ``emit`` whole SSE events, rewritten: one ``emit`` per event the continuation sent.
    """

    def __init__(self, progress: Progress, chat: bool, emit: Callable[[bytes], object],
                 overflowed: Callable[[], object] = lambda: None) -> None:
        self._progress = progress
        self._emit = emit
        #: told once when an event outgrows :data:`EVENT_LIMIT` (nothing more is kept)
        self._overflowed = overflowed
        #: a byte of the continuation came
        self.fed = False
        self._first = chat  # a chat's first chunk may be the role alone
        self._partial: bytes | None = b""
        self._pending: list[bytes] = []

    def recount(self, tokens: int) -> None:
        """The first try's tokens, as the continuing engine counted them (``/tokenize``)."""
        self._progress = attrs.evolve(self._progress, tokens=tokens)

    def feed(self, data: bytes) -> None:
        if self._partial is None:
            return  # overflowed: the stream is being cut
        self.fed = True
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) + sum(map(len, self._pending)) > EVENT_LIMIT:
            self._partial = None
            self._pending = []
            self._overflowed()
            return
        out = []
        for line in lines:
            line = line.rstrip(b"\r")
            if not line:
                if self._pending:
                    out.append(b"\n".join(self._pending) + b"\n\n")
                    self._pending = []
                continue
            if line[:5] == b"data:":
                rewritten = self._data(line[5:].strip())
                if rewritten is not None:
                    self._pending.append(b"data: " + rewritten)
            else:
                self._pending.append(line)  # an SSE field other than data (a comment)
        if out:
            self._emit(b"".join(out))

    def close(self) -> None:
        """The continuation ended: an event it did not end with a blank line still goes."""
        if self._partial is None:
            return
        if self._partial:
            self.feed(b"\n")
        if self._pending:
            self._emit(b"\n".join(self._pending) + b"\n\n")
            self._pending = []

    def _data(self, payload: bytes) -> bytes | None:
        if payload == b"[DONE]":
            return payload
        event = parse_json_object(payload)
        if event is None:
            return payload  # not ours to judge: the client gets it as sent
        first, self._first = self._first, False
        if first and _role_only(event):
            return None
        progress = self._progress
        for name, value in (("id", progress.ident), ("created", progress.created),
                            ("model", progress.model)):
            if value is not None and name in event:
                event[name] = value
        usage = event.get("usage")
        if isinstance(usage, dict):
            event["usage"] = _usage(usage, progress)
        return orjson.dumps(event)


def _role_only(event: dict[str, Any]) -> bool:
    """A chat chunk that says only the role (and empty content): the client had one."""
    choices = event.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta")
    return (isinstance(delta, dict) and "role" in delta
            and not any(v for k, v in delta.items() if k != "role")
            and choices[0].get("finish_reason") is None)


def _usage(usage: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """
    The continuation's usage counted for the whole answer: its prompt held the text so far
    (the first try's completion), which counts as completion again, once.
    """
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not (isinstance(prompt, int) and isinstance(completion, int)):
        return usage
    generated = progress.tokens if progress.text else 0
    prompt = max(0, prompt - generated)
    completion += generated
    return {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
