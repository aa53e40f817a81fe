"""
The tokens a stream's first try generated, counted by the engine that continues it: its
``POST /tokenize`` (vLLM: ``{"model", "prompt"}`` answered ``{"count", "tokens", ...}``;
llama.cpp: ``{"content"}`` answered ``{"tokens"}``; one body carries both fields, which
each ignores the other's).  Chunks are not tokens -- an engine may stream several a chunk
(vLLM's stream interval, speculative decoding) -- and a dead engine sent no usage: the
count is what makes the continuation's token limits and the usage exact.  An engine that
has no ``/tokenize`` (or answers nonsense) leaves the count of events that carried text.
"""

from __future__ import annotations

import orjson
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.python.failure import Failure

#: the most an answer of ``/tokenize`` is read: 512 KiB of text is ~130,000 tokens, a
#: list of them well under this
TOKENIZE_ANSWER_LIMIT = 4 * 1024 * 1024
#: seconds the count may take before the continuation goes without it
TOKENIZE_TIMEOUT = 1.0


def tokenize_body(model: object, text: str) -> bytes:
    """The ``/tokenize`` request for ``text`` alone, no special tokens added."""
    body: dict[str, object] = {"prompt": text, "content": text, "add_special_tokens": False}
    if isinstance(model, str):
        body["model"] = model
    return orjson.dumps(body)


def count_of(answer: bytes, text_length: int) -> int | None:
    """
    The token count of a ``/tokenize`` answer, or ``None`` when it does not say one an
    engine could mean (at least one token, at most one a character of ``text_length``).
    """
    try:
        parsed = orjson.loads(answer)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    count = parsed.get("count")
    if not isinstance(count, int) or isinstance(count, bool):
        tokens = parsed.get("tokens")
        count = len(tokens) if isinstance(tokens, list) else None
    if count is None or not 1 <= count <= max(1, text_length):
        return None
    return count


class WholeAnswer:
    """
    A small answer's body read whole (an ``IRelayOwner``): ``done`` fires with its bytes,
    or ``None`` when it failed or grew past :data:`TOKENIZE_ANSWER_LIMIT` (then it is
    stopped: nothing more is read).
    """

    def __init__(self) -> None:
        #: cancelled (a timeout, the client gone): the answer's read is stopped
        self.done: Deferred[bytes | None] = Deferred(lambda _: self._stop())
        self._parts: list[bytes] = []
        self._size = 0
        self._producer: IPushProducer | None = None

    def body_started(self, producer: IPushProducer) -> None:
        self._producer = producer

    def _stop(self) -> None:
        if self._producer is not None:
            producer, self._producer = self._producer, None
            producer.stopProducing()

    def body_chunk(self, data: bytes) -> None:
        if self.done.called:
            return
        self._size += len(data)
        if self._size > TOKENIZE_ANSWER_LIMIT:
            self._stop()
            self.done.callback(None)
            return
        self._parts.append(data)

    def body_ended(self, failure: Failure | None) -> None:
        if not self.done.called:
            self.done.callback(None if failure is not None else b"".join(self._parts))
