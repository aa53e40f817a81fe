"""
What is kept of an answer, read back: an SSE answer summarised as it passes
(:class:`StreamCapture`), and the raw capture's chunked framing undone (:func:`dechunk`) and
its tail's whole lines (:func:`tail_lines`) for the summary at the end.

Kept apart from the record that fills it (:class:`~txlb._records.record.RequestRecord`) and
from the summary that reads it, so that the incremental reading of a stream -- the part of
the summary that runs per chunk -- is one module, beside the splitter it feeds
(:mod:`txlb._records.sse`) and the folds it feeds into (:mod:`txlb._records.answers`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import orjson

from txlb._json_body import stdlib_loads
from txlb._records.answers.chat import ChatFold
from txlb._records.answers.completion import Completion
from txlb._records.answers.messages import MessagesFold
from txlb._records.answers.responses import ResponsesFold
from txlb._records.sse import EventSplitter

#: the APIs whose streams are summarised as they pass, and the fold of each
STREAM_FOLDS: dict[str, Callable[[], ChatFold | ResponsesFold | MessagesFold]] = {
    "chat": ChatFold,
    "responses": ResponsesFold,
    "messages": MessagesFold,
}
#: what an event must hold to be parsed when only the answer's counts are read
#: (:attr:`Needs.USAGE`): ``usage`` (every API puts its token counts there) or llama.cpp's
#: ``timings``
_COUNTS = (b"usage", b"timings")


class StreamCapture:
    """
    An SSE answer summarised as it passes, so its end costs no more than its last line.

    Fed the captured bytes (``feed``, per chunk: the splitter's own), it splits them into
    events (:class:`~txlb._records.sse.EventSplitter`) and parses and folds in each at once
    -- when the texts are read (``texts``: the result log); otherwise only the events that
    hold ``usage`` or ``timings``, the counts the other readers use, and none is kept.
    :meth:`finish` gives the completion :func:`~txlb._records.summary.summarize` reads of
    a whole capture (the tail's whole lines included).  ``parsed`` and ``parsed_at_end``
    count the payload bytes parsed (all of them, and in :meth:`finish`): what the summary
    cost, observable.
    """

    __slots__ = ("_fold", "_splitter", "_result", "parsed", "parsed_at_end", "feed")

    def __init__(self, api: str, chunked: bool, texts: bool) -> None:
        self._fold = STREAM_FOLDS[api]()
        self._splitter = EventSplitter(self._parse if texts else self._counts, chunked)
        self._result: Completion | None = None
        self.parsed = 0
        self.parsed_at_end = 0
        self.feed = self._splitter.feed

    def _parse(self, payload: bytes) -> None:
        self.parsed += len(payload)
        if payload[:2] != b" {" and payload.lstrip()[:1] != b"{":
            return
        try:
            event = orjson.loads(payload)
        except ValueError:
            event = stdlib_loads(payload)
        if event.__class__ is dict:
            self._fold.add(event)

    def _counts(self, payload: bytes) -> None:
        """Only the counts are read: an event without them is passed over, unparsed."""
        if _COUNTS[0] in payload or _COUNTS[1] in payload:
            self._parse(payload)
        else:
            self._fold.skip()

    def finish(self, tail: bytes | None) -> Completion:
        """
        The completion, once the answer is over: the line the feed ended in (or, when the
        capture stopped part-way, the whole lines of ``tail``, the bytes past it) -- a
        bounded amount parsed here, whatever the answer's length.  Idempotent.
        """
        if self._result is not None:
            return self._result
        before = self.parsed
        if tail is None:
            self._splitter.close()
        else:
            self._splitter.drop_partial()
            self._splitter.lines(tail)
        self.parsed_at_end = self.parsed - before
        self._result = self._fold.end()
        return self._result


def dechunk(framed: bytes) -> bytes:
    """
    The payload of a chunked body (as far as it is complete and well formed: the capture
    may stop mid-chunk).  Runs once per request, in the summary, so that the relay itself
    can pass chunks through without decoding them.
    """
    parts = []
    position = 0
    size = len(framed)
    while position < size:
        end = framed.find(b"\r\n", position)
        if end < 0:
            break
        try:
            length = int(framed[position:end].split(b";", 1)[0], 16)
        except ValueError:
            break
        if length <= 0:
            break
        start = end + 2
        parts.append(framed[start:start + length])
        position = start + length + 2
    return b"".join(parts)


def tail_lines(tail: Sequence[bytes]) -> bytes | None:
    """
    The whole lines of the bytes past the capture (``None`` if it held the whole answer):
    the first and last may be cut, and are left out, so every event parsed is whole.
    """
    if not tail:
        return None
    joined = b"".join(tail)
    return joined[joined.find(b"\n") + 1:joined.rfind(b"\n") + 1]
