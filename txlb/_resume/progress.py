"""
What a stream's client has of its answer, read back from the bytes relayed to it: the text
so far and the first try's ``id``, ``created`` and ``model``, or why the stream cannot be
continued from there (:class:`NotResumable`).

Runs once, when the stream's engine failed: the relay only kept the bytes.  Everything is
checked, since the bytes are an engine's: a cut inside a chunk or an event (the client holds
half of it: nothing can complete it), an answer that is not the first choice alone, a tool
call or reasoning in progress, an answer that had already finished.
"""

from __future__ import annotations

from typing import Any

import attrs

from txlb._json_body import parse_json_object


class NotResumable(Exception):
    """A stream that is cut as it was, for ``reason`` (a metric's label)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@attrs.frozen
class Progress:
    """The answer a client holds: its text, and what its events said they were."""

    #: the first try's ``id``, ``created`` and ``model`` (``None`` when it sent none)
    ident: object
    created: object
    model: object
    #: the text relayed so far
    text: str
    #: events that carried text: the tokens generated (an engine streams one an event)
    tokens: int


def unframed(relayed: bytes) -> bytes:
    """
    The payload of a chunked body, which must end where a chunk does (the client's framing
    is whole); raises :class:`NotResumable` ``"mid_chunk"`` otherwise.
    """
    parts = []
    position, size = 0, len(relayed)
    while position < size:
        end = relayed.find(b"\r\n", position)
        if end < 0:
            raise NotResumable("mid_chunk")
        try:
            length = int(relayed[position:end].split(b";", 1)[0], 16)
        except ValueError:
            raise NotResumable("unreadable") from None
        start = end + 2
        if length <= 0:
            raise NotResumable("finished")  # the last chunk: the body was over
        if start + length + 2 > size:
            raise NotResumable("mid_chunk")
        parts.append(relayed[start:start + length])
        position = start + length + 2
    return b"".join(parts)


def read_progress(relayed: bytes, chunked: bool, chat: bool) -> Progress:
    """
    The answer in ``relayed`` (the body bytes the client got, in chunked framing when
    ``chunked``), of a chat completion or, unless ``chat``, a completion.
    """
    body = unframed(relayed) if chunked else relayed
    body = body.replace(b"\r\n", b"\n")
    if body and not body.endswith(b"\n\n"):
        raise NotResumable("mid_event")
    reader = _Reader(chat)
    for line in body.split(b"\n"):
        if line[:5] != b"data:":
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            raise NotResumable("finished")
        reader.add(_loads(payload))
    return reader.progress()


def _loads(payload: bytes) -> dict[str, Any]:
    event = parse_json_object(payload)
    if event is None:
        raise NotResumable("unreadable")
    return event


class _Reader:
    """The events folded into a :class:`Progress`, refusing what cannot be continued."""

    def __init__(self, chat: bool) -> None:
        self._chat = chat
        self._text: list[str] = []
        self._tokens = 0
        self._head: dict[str, object] = {}

    def add(self, event: dict[str, Any]) -> None:
        if "error" in event:
            raise NotResumable("engine_error")
        for name in ("id", "created", "model"):
            if name not in self._head and name in event:
                self._head[name] = event[name]
        choices = event.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                raise NotResumable("n")
            if choice.get("finish_reason") is not None:
                raise NotResumable("finished")
            if choice.get("logprobs") is not None:
                raise NotResumable("logprobs")
            text = self._text_of(choice)
            if text:
                self._text.append(text)
                self._tokens += 1

    def _text_of(self, choice: dict[str, Any]) -> str:
        if not self._chat:
            text = choice.get("text")
            return text if isinstance(text, str) else ""
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return ""
        if delta.get("tool_calls") or delta.get("function_call"):
            raise NotResumable("tool_call")
        if delta.get("reasoning_content") or delta.get("reasoning"):
            raise NotResumable("reasoning")
        text = delta.get("content")
        return text if isinstance(text, str) else ""

    def progress(self) -> Progress:
        head = self._head
        return Progress(head.get("id"), head.get("created"), head.get("model"),
                        "".join(self._text), self._tokens)
