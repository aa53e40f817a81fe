"""
The raw facts about one proxied request, gathered by the proxy as it runs: the
:class:`RequestRecord` a summary is made of, when the request has ended.

The proxy hands each relayed chunk to :meth:`RequestRecord.capture`, which keeps of the
first :data:`CAPTURE_LIMIT` bytes what the summary's readers need (:class:`~txlb._records.
needs.Needs`) and the last :data:`TAIL_LIMIT` beyond them (where a long stream's final
``usage`` is), and counts the stream's events when a token budget will charge them (one
``bytes.count`` per chunk).  A streamed answer is summarised as it passes
(:class:`~txlb._records.capture.StreamCapture`); a JSON answer or an error's body is kept
raw and read once, by :func:`~txlb._records.summary.summarize`.  Kept apart from the
summary so that what runs per chunk and what runs once are two modules, and the proxy needs
only this one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from txlb._http.apis import API_PATHS
from txlb._records.capture import STREAM_FOLDS, StreamCapture
from txlb._records.needs import Needs

if TYPE_CHECKING:
    from txlb._scheduling.request import RoutingRequest

#: How much of a response is kept for the summary; the client always gets all of it.
CAPTURE_LIMIT = 512 * 1024
#: How much of a response's end is kept beyond :data:`CAPTURE_LIMIT`: a stream's last
#: events, which carry its ``usage`` and finish reason.
TAIL_LIMIT = 64 * 1024


@attrs.define
class RequestRecord:
    """
    The raw facts about one proxied request, gathered by the proxy as it runs.

    ``outcome`` says how it ended: ``ok``; ``client_abort`` (the client left first);
    ``timeout`` (the backend was silent past ``--read-timeout``); ``upstream_error`` (the
    backend failed or could not be reached); ``proxy_error`` (txlb answered by itself:
    no backend, body too large, ...).
    """

    started: float
    method: bytes
    path: bytes
    orid_header: bytes | None
    request_body: bytes
    backend: str | None = None
    status: int | None = None
    outcome: str = "ok"
    ended: float = 0.0
    first_byte: float | None = None
    content_type: bytes | None = None
    response: list[bytes] = attrs.field(factory=list)
    captured: int = 0
    truncated: bool = False
    queue_wait: float | None = None
    tries: int = 1
    #: continuations of its stream on another engine (``--resume``), and the last one's
    #: backend; or why its stream, cut, could not be continued (a metric's label)
    resumes: int = 0
    resumed_backend: str | None = None
    resume_refused: str | None = None
    #: the captured response is in chunked framing (passed through as the backend sent it)
    chunked: bool = False
    #: who sent it: the ``--rate-key`` client key, for what learns from each request (the
    #: policy's outcome); never written to the result log
    client: str | None = None
    #: the tenant of its API key (``--auth keys``): a name of the keys file, never the key
    tenant: str | None = None
    #: what the request was routed by, for the policy that predicted something of it (a
    #: cache-aware policy's outcome); never written to the result log
    routing: RoutingRequest | None = attrs.field(default=None, repr=False)
    #: headers txlb adds to the backend's answer (a token budget's x-ratelimit-*-tokens)
    added_headers: tuple[tuple[bytes, bytes], ...] = ()
    #: the response's last bytes past :data:`CAPTURE_LIMIT` (at most about
    #: :data:`TAIL_LIMIT`), oldest first
    tail: deque[bytes] = attrs.field(factory=deque, repr=False)
    tail_size: int = 0
    #: SSE ``data:`` lines relayed (captured or not): what a stream without ``usage``
    #: is known to have generated at least -- counted only when ``count_events`` (a token
    #: budget reserved for the request and will charge it), the one reader
    events: int = 0
    count_events: bool = False
    #: what the readers of its summary need of the answer (:class:`~txlb._records.needs.
    #: Needs`, the proxy's observer's): the capture keeps and parses no more than that
    needs: Needs = Needs.TEXTS
    #: an SSE answer summarised as it passes (``None``: the answer is kept raw in
    #: ``response``, or not at all, and read at the end)
    stream: StreamCapture | None = attrs.field(default=None, repr=False)
    #: where captured bytes go: chosen at the first (``None`` until then)
    _keep: Callable[[bytes], object] | None = attrs.field(default=None, init=False,
                                                          repr=False)

    def answered_by_proxy(self, status: int, body: bytes) -> None:
        """
        txlb answered this request itself, with ``status`` and the JSON ``body`` (only ever
        before any of a backend's body reached the client: none was summarised).
        """
        self.status = status
        self.content_type = b"application/json"
        self.stream = self._keep = None  # the answer is txlb's now: chosen again
        self.capture(body)

    def _choose_keeping(self) -> Callable[[bytes], object]:
        """
        What the first captured bytes decide: a 200 SSE answer of an LLM API is summarised
        as it passes (:class:`StreamCapture`); another answer a reader will parse (a JSON
        answer, an error's body for the result log) is kept raw for the end; nothing is
        kept that no reader reads (:class:`~txlb._records.needs.Needs`).
        """
        needs = self.needs
        api = API_PATHS.get(self.path)
        if needs == Needs.NOTHING or (self.status == 200 and api is None):
            return _ignore
        if self.status != 200:
            return self.response.append if needs >= Needs.TEXTS else _ignore
        if api in STREAM_FOLDS and (self.content_type or b"").startswith(
                b"text/event-stream"):
            self.stream = StreamCapture(api, self.chunked, texts=needs >= Needs.TEXTS)
            return self.stream.feed
        return self.response.append

    def capture(self, data: bytes) -> None:
        """
        Keep ``data`` for the summary while under the limit -- raw, or folded into a
        stream's running summary -- and the last :data:`TAIL_LIMIT` bytes past it; count
        its events if asked to (called per chunk: cheap, and bounded per byte).
        """
        if self.count_events:
            self.events += data.count(b"data:")
        keep = self._keep
        if keep is None:
            keep = self._keep = self._choose_keeping()
        room = CAPTURE_LIMIT - self.captured
        if len(data) > room:
            self.truncated = True
            if room > 0:
                keep(data[:room])
                self.captured += room
                data = data[room:]
            if keep is _ignore:
                return
            if len(data) > TAIL_LIMIT:
                data = data[-TAIL_LIMIT:]
            tail = self.tail
            tail.append(data)
            self.tail_size += len(data)
            while len(tail) > 1 and self.tail_size - len(tail[0]) >= TAIL_LIMIT:
                self.tail_size -= len(tail.popleft())
            return
        keep(data)
        self.captured += len(data)


def _ignore(data: bytes) -> None:
    """Where the bytes of an answer no reader parses go."""
