"""
What one finished request amounts to: the fields of its result-log line.

Kept apart from the writer so it can be tested (and fuzzed) on its own.  The proxy hands
each relayed chunk to :meth:`RequestRecord.capture`, which keeps of the first
:data:`CAPTURE_LIMIT` bytes what the summary's readers need (:class:`~txlb._records.needs.
Needs`) and the last :data:`TAIL_LIMIT` beyond them (where a long stream's final ``usage``
is), and counts the stream's events when a token budget will charge them (one
``bytes.count`` per chunk).  A streamed answer is summarised as it passes
(:class:`StreamCapture`: its events split and folded in chunk by chunk), so that
:func:`summarize`, when the request has ended, has only a bounded remainder to read; a
JSON answer or an error's body is kept and read there, once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import attrs
import orjson

from txlb._config.bounds import MAX_PREVIEW_CHARS
from txlb._records.escape import clip
from txlb._records.needs import Needs
from txlb._records.sse import EventSplitter, data_payload

if TYPE_CHECKING:
    from txlb._config import Config
    from txlb._scheduling.request import RoutingRequest

#: How much of a response is kept for the summary; the client always gets all of it.
CAPTURE_LIMIT = 512 * 1024
#: How much of a response's end is kept beyond :data:`CAPTURE_LIMIT`: a stream's last
#: events, which carry its ``usage`` and finish reason.
TAIL_LIMIT = 64 * 1024
#: Characters of content shown after ``|`` by default (``--log-content``), and the most
#: that can be asked for: 1,000 characters take at most 12,000 bytes escaped, which keeps a
#: completion line under :data:`MAX_LINE`.
PREVIEW_CHARS = 200
#: Request keys listed on an error line.
MAX_REQ_KEYS = 64
#: Bytes each value chosen by a client or a backend may take once escaped, in either
#: format (:func:`~txlb._records.escape.clip`): with these no line is longer than
#: :data:`MAX_LINE` bytes, plus the backend's name (which comes from the configuration).
MAX_ORID = 256
MAX_METHOD = 32
MAX_PATH = 2048
MAX_FINISH = 64
MAX_KEY = 64
MAX_ERR_BODY = 8192
MAX_LINE = 16 * 1024
#: The LLM APIs txlb summarises, by path: OpenAI's chat and completions (also without
#: ``/v1``, as an ``openai`` client whose base URL lacks it sends them), the Responses API,
#: the Anthropic-style Messages API (vLLM and llama.cpp serve it) and embeddings.
API_PATHS = {
    b"/v1/chat/completions": "chat",
    b"/chat/completions": "chat",
    b"/v1/completions": "chat",
    b"/completions": "chat",
    b"/v1/responses": "responses",
    b"/responses": "responses",
    b"/v1/messages": "messages",
    b"/v1/embeddings": "embeddings",
    b"/embeddings": "embeddings",
}
#: The two paths whose text line does not name its path (it is what the line always was).
CLASSIC_PATHS = frozenset({b"/v1/chat/completions", b"/v1/completions"})

#: What happens to an orid taken from the request body's ``user`` (often an e-mail address).
UserMode = Literal["keep", "hash", "drop"]
#: Hex digits of the keyed digest written in place of a hashed ``user``: 64 bits, enough to
#: tell a fleet's users apart, and a prefix no e-mail address or X-Orid is likely to share.
USER_DIGEST_HEX = 16
USER_DIGEST_PREFIX = "h:"


@attrs.frozen
class Privacy:
    """
    How much of what users wrote or were answered a summary keeps, applied once in
    :func:`summarize` -- so both formats and the ``--workers`` pipe carry only what is kept.

    ``content``: characters of the answer kept after ``|`` (0: none).  ``user``: an orid
    taken from the body's ``user`` is kept, replaced by a keyed digest (``user_key``; the
    same user always gets the same digest under one key, and no one without the key can
    recover or test a guess of the address), or dropped (``-``); an ``X-Orid`` header is the
    operator's own id and always kept.  ``err_body``: characters of an error body kept
    (``None``: all, up to :data:`MAX_ERR_BODY` bytes; 0: none) -- a backend's 400 often
    quotes the prompt back.
    """

    content: int = PREVIEW_CHARS
    user: UserMode = "keep"
    user_key: bytes = attrs.field(default=b"", repr=False)
    err_body: int | None = None


KEEP_ALL = Privacy()


def privacy_of(config: Config) -> Privacy:
    """The :class:`Privacy` of a :class:`~txlb._config.Config`'s ``--log-*`` options."""
    key = config.log_user_key
    user: UserMode = "hash" if config.log_user == "hash" else (
        "drop" if config.log_user == "drop" else "keep")
    return Privacy(content=config.log_content, user=user,
                   user_key=b"" if key is None else key.encode("utf-8", "surrogatepass"),
                   err_body=config.log_error_body)

_THINK_BLOCK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)


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
    #: the captured response is in chunked framing (passed through as the backend sent it)
    chunked: bool = False
    #: who sent it: the ``--rate-key`` client key, for what learns from each request (the
    #: policy's outcome); never written to the result log
    client: str | None = None
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
        if api in _STREAM_FOLDS and (self.content_type or b"").startswith(
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


@attrs.frozen
class Summary:
    """
    The fields of one result-log line.  How each is named, written in both formats and
    checked on the workers' wire is its row in :data:`txlb._records.fields.FIELDS`.
    """

    time: float
    orid: str
    backend: str
    method: str
    path: str
    status: int
    kind: str  # "completion", "embedding", "error" or "other"
    outcome: str
    dur: float
    ttft: float | None = None
    finish: str | None = None
    completion_tokens: int | None = None
    max_tokens: int | None = None
    thinking: bool = False
    think: bool = False
    empty: bool = True
    clen: int = 0
    preview: str = ""
    req_keys: list[str] | None = None
    err_body: str = ""
    truncated: bool = False
    tries: int = 1
    #: the prompt's tokens as the engine counted them (completions and embeddings), and of
    #: those how many it served from its prefix cache (completions): ``None`` when the
    #: answer did not say; ``cached_prompt_tokens`` is never above ``prompt_tokens`` and is
    #: ``None`` whenever ``prompt_tokens`` is
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    #: embeddings: how many vectors came back
    count: int | None = None
    #: a completion came as a stream (SSE): only then does the time from its first byte to
    #: its end measure the generation (a plain JSON answer arrives whole, at the end)
    stream: bool = False
    #: the priority class it was queued in; ``None`` for a request refused before its
    #: class was known (a rate limit, a bad target)
    priority: str | None = None


def parse_json_object(body: bytes) -> dict[str, Any] | None:
    """
    ``body`` as a JSON object, or ``None`` if it is not one -- nor one nested too deep for
    Python's recursive parser (RecursionError, not ValueError: a client or a backend
    choosing the depth must not get past this).

    Parsed by orjson (C, several times faster than the standard library on the bodies
    txlb reads); what orjson refuses is read by Python's ``json`` as it always was
    (:func:`_stdlib_loads`), so every body gets the outcome it had.
    """
    if not body or body.lstrip()[:1] != b"{":
        return None
    if _LONG_DIGITS in body.translate(_DIGITS):
        # orjson reads an integer past 64 bits as a float: json keeps it whole (the
        # alias rewriting writes the body again, an orid is the user's number)
        return _stdlib_object(body)
    try:
        value = orjson.loads(body)
    except ValueError:  # orjson.JSONDecodeError
        return _stdlib_object(body)
    return value if value.__class__ is dict else None


#: every digit as ``0``, anything else as ``x``: a run of 19 zeros is an integer that may
#: not fit in 64 bits (found at C speed, about a nanosecond a byte)
_DIGITS = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x78 for byte in range(256))
_LONG_DIGITS = b"0" * 19


def _stdlib_object(body: bytes) -> dict[str, Any] | None:
    value = _stdlib_loads(body)
    return value if value.__class__ is dict else None


def _stdlib_loads(body: bytes) -> object:
    """
    ``body`` read by Python's ``json``, or ``None``: for what orjson refuses and ``json``
    reads -- ``NaN`` and ``Infinity``, lone surrogates escaped in a string, nesting past
    orjson's 1,024 levels -- and integers past 64 bits, which orjson reads as floats; so
    that orjson changes no outcome.  (A stream's events are parsed by orjson alone: the
    numbers a summary reads of them are counts, and a count past 64 bits is none either
    way.)
    """
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _int_or_none(value: object) -> int | None:
    """
    ``value`` if it is an integer in the 64-bit range any engine's counts fit in: JSON
    allows 4,300 digits, which would bloat the line and overflow the metrics' floats.
    """
    if isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63:
        return value
    return None


def _count(value: int | None) -> int | None:
    """A count of tokens a backend reported: a negative one is none (the metrics' counters
    refuse a negative increment)."""
    return None if value is None or value < 0 else value


def _sum_counts(*counts: int | None) -> int | None:
    """The sum of counts that are all known, if it is still in the 64-bit range."""
    if any(value is None for value in counts):
        return None
    total = sum(value for value in counts if value is not None)
    return total if total < 2**63 else None


def _prompt_counts(prompt: int | None, cached: int | None) -> tuple[int | None, int | None]:
    """
    A prompt and cached-prompt count as a summary keeps them: each a count (a negative one
    is none), a cached count only beside a prompt count, and never above it -- a backend
    claiming more cache hits than prompt tokens gets the whole prompt, not a hit rate
    above 1.
    """
    prompt, cached = _count(prompt), _count(cached)
    if prompt is None:
        return None, None
    return prompt, None if cached is None else min(cached, prompt)


def _openai_prompt(usage: object, timings: object) -> tuple[int | None, int | None]:
    """
    The prompt and cached-prompt tokens of an OpenAI-style answer: ``usage.prompt_tokens``
    and ``usage.prompt_tokens_details.cached_tokens`` (vLLM with
    ``--enable-prompt-tokens-details``, SGLang, llama.cpp), else llama.cpp's ``timings``:
    ``cache_n`` tokens reused from its prompt cache plus ``prompt_n`` evaluated.
    """
    prompt = cached = None
    if isinstance(usage, dict):
        prompt = _count(_int_or_none(usage.get("prompt_tokens")))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached = _int_or_none(details.get("cached_tokens"))
    if isinstance(timings, dict) and (prompt is None or cached is None):
        reused = _count(_int_or_none(timings.get("cache_n")))
        if prompt is None:
            prompt = _sum_counts(reused, _count(_int_or_none(timings.get("prompt_n"))))
        if cached is None:
            cached = reused
    return _prompt_counts(prompt, cached)


#: how many events at a stream's end are searched for llama.cpp's ``timings``: it sends
#: them with the final chunk, and with ``include_usage`` once more on the usage chunk after
_TIMINGS_TAIL = 3


def _sse_payloads(data: bytes) -> list[dict[str, Any]]:
    """
    The JSON objects of every ``data:`` line of a whole body; ``[DONE]`` and broken events
    are skipped.  Each is parsed on its own (:func:`parse_json_object`), as a stream
    summarised while it passes parses it (:class:`StreamCapture`).
    """
    events = []
    for line in data.split(b"\n"):
        payload = data_payload(line)
        if payload is not None:
            event = parse_json_object(payload)
            if event is not None:
                events.append(event)
    return events


@attrs.define
class _Completion:
    content: list[str] = attrs.field(factory=list)
    reasoning: list[str] = attrs.field(factory=list)
    finish: str | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    #: the answer was a stream (SSE), as the parser found it
    stream: bool = False


class _ChatFold:
    """
    An OpenAI chat or completions answer, one event (or the whole JSON answer, with
    ``part="message"``) at a time.  Only the first choice counts.  The prompt's counts are
    read once, at the end, from the last ``usage`` seen and the ``timings`` of the last
    :data:`_TIMINGS_TAIL` events (where llama.cpp puts them), not looked up per event.
    """

    __slots__ = ("completion", "_part", "_last_usage", "_timings", "_timings_at", "_seen")

    def __init__(self, part: str = "delta", stream: bool = True) -> None:
        self.completion = _Completion(stream=stream)
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
            tokens = _int_or_none(usage.get("completion_tokens"))
            if tokens is not None:
                completion.completion_tokens = tokens
        found = event.get("timings")
        if found.__class__ is dict:
            self._timings, self._timings_at = found, self._seen

    def skip(self) -> None:
        """An event passed over unparsed (it holds no counts): it still moves the window
        in which ``timings`` are read."""
        self._seen += 1

    def end(self) -> _Completion:
        completion = self.completion
        timings = self._timings if self._seen - self._timings_at < _TIMINGS_TAIL else None
        if self._last_usage is not None or timings is not None:
            completion.prompt_tokens, completion.cached_prompt_tokens = _openai_prompt(
                self._last_usage, timings)
        return completion


def parse_completion(body: bytes, content_type: bytes | None) -> _Completion:
    """Content, reasoning, finish reason and usage from a plain JSON or an SSE response."""
    stripped = body.lstrip()
    if (content_type or b"").startswith(b"text/event-stream") or stripped.startswith(b"data:"):
        fold = _ChatFold()
        for event in _sse_payloads(body):
            fold.add(event)
        return fold.end()
    fold = _ChatFold("message", stream=False)
    answer = parse_json_object(body)
    if answer is not None:
        fold.add(answer)
    return fold.end()


def _texts(blocks: object, kinds: tuple[str, ...], field: str = "text") -> list[str]:
    """The ``field`` strings of the blocks (dicts) in a list whose ``type`` is in ``kinds``."""
    if not isinstance(blocks, list):
        return []
    return [block[field] for block in blocks
            if isinstance(block, dict) and block.get("type") in kinds
            and isinstance(block.get(field), str)]


def _fold_response(completion: _Completion, response: dict[str, Any], texts: bool) -> None:
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
        tokens = _int_or_none(usage.get("output_tokens"))
        if tokens is not None:
            completion.completion_tokens = tokens
        details = usage.get("input_tokens_details")
        completion.prompt_tokens, completion.cached_prompt_tokens = _prompt_counts(
            _int_or_none(usage.get("input_tokens")),
            _int_or_none(details.get("cached_tokens")) if details.__class__ is dict else None)
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


class _ResponsesFold:
    """
    A Responses API stream, one event at a time.  Its stream is typed events, not chat's
    choices: the text comes in ``response.output_text.delta`` events (reasoning in
    ``response.reasoning_*``) and status and usage in the final ``response.completed`` (or
    ``.incomplete``, ``.failed``), whose full output is used only when no delta was kept
    (the capture may have cut them).
    """

    __slots__ = ("completion", "_final")

    def __init__(self) -> None:
        self.completion = _Completion(stream=True)
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

    def end(self) -> _Completion:
        completion = self.completion
        if self._final is not None:
            texts = not completion.content and not completion.reasoning
            _fold_response(completion, self._final, texts)
            self._final = None
        return completion


def parse_responses(body: bytes, content_type: bytes | None) -> _Completion:
    """A Responses API answer: a whole JSON object, or its stream (:class:`_ResponsesFold`)."""
    if not _is_stream(body, content_type):
        completion = _Completion()
        answer = parse_json_object(body)
        if answer is not None:
            _fold_response(completion, answer, texts=True)
        return completion
    fold = _ResponsesFold()
    for event in _sse_payloads(body):
        fold.add(event)
    return fold.end()


class _MessagesFold:
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
        self.completion = _Completion(stream=stream)
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
            tokens = _int_or_none(usage.get("output_tokens"))
            if tokens is not None:
                completion.completion_tokens = tokens
            for name in _MESSAGES_INPUTS:
                tokens = _count(_int_or_none(usage.get(name)))
                if tokens is not None:
                    self._inputs[name] = tokens

    def skip(self) -> None:
        """An event passed over unparsed: nothing to do."""

    def end(self) -> _Completion:
        completion, inputs = self.completion, self._inputs
        if "input_tokens" in inputs:
            read = inputs.get("cache_read_input_tokens")
            completion.prompt_tokens, completion.cached_prompt_tokens = _prompt_counts(
                _sum_counts(inputs["input_tokens"], read or 0,
                            inputs.get("cache_creation_input_tokens", 0)), read)
        return completion


def parse_messages(body: bytes, content_type: bytes | None) -> _Completion:
    """A Messages API answer: a whole JSON object, or its stream (:class:`_MessagesFold`)."""
    if _is_stream(body, content_type):
        fold = _MessagesFold()
        for event in _sse_payloads(body):
            fold.add(event)
        return fold.end()
    fold = _MessagesFold(stream=False)
    answer = parse_json_object(body)
    if answer is not None:
        fold.add_answer(answer)
    return fold.end()


#: the Messages API's three parts of a prompt: uncached, read from the cache, written to it
_MESSAGES_INPUTS = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")

#: the APIs whose streams are summarised as they pass, and the fold of each
_STREAM_FOLDS: dict[str, Callable[[], _ChatFold | _ResponsesFold | _MessagesFold]] = {
    "chat": _ChatFold,
    "responses": _ResponsesFold,
    "messages": _MessagesFold,
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
    :meth:`finish` gives the completion :func:`summarize` reads of a whole capture (the
    tail's whole lines included).  ``parsed`` and ``parsed_at_end`` count the payload bytes
    parsed (all of them, and in :meth:`finish`): what the summary cost, observable.
    """

    __slots__ = ("_fold", "_splitter", "_result", "parsed", "parsed_at_end", "feed")

    def __init__(self, api: str, chunked: bool, texts: bool) -> None:
        self._fold = _STREAM_FOLDS[api]()
        self._splitter = EventSplitter(self._parse if texts else self._counts, chunked)
        self._result: _Completion | None = None
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
            event = _stdlib_loads(payload)
        if event.__class__ is dict:
            self._fold.add(event)

    def _counts(self, payload: bytes) -> None:
        """Only the counts are read: an event without them is passed over, unparsed."""
        if _COUNTS[0] in payload or _COUNTS[1] in payload:
            self._parse(payload)
        else:
            self._fold.skip()

    def finish(self, tail: bytes | None) -> _Completion:
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


def _is_stream(body: bytes, content_type: bytes | None) -> bool:
    stripped = body.lstrip()
    return ((content_type or b"").startswith(b"text/event-stream")
            or stripped.startswith((b"data:", b"event:")))


def orid_of(header: bytes | None, request: dict[str, Any] | None,
            privacy: Privacy = KEEP_ALL) -> str:
    """
    ``X-Orid``, else the body's ``user`` (a string or an integer; kept, hashed or dropped
    as ``privacy`` says), else ``-``; clipped.
    """
    if header:
        return clip(header.decode("utf-8", "replace"), MAX_ORID)
    user = None if request is None else request.get("user")
    if isinstance(user, int) and not isinstance(user, bool) and user:
        user = str(user)
    if not isinstance(user, str) or not user:
        return "-"
    if privacy.user == "drop":
        return "-"
    if privacy.user == "hash":
        # the whole value is digested (not the clipped one): two long addresses that share
        # their first 256 bytes are still two users; surrogates cannot be encoded strictly
        digest = hmac.new(privacy.user_key, user.encode("utf-8", "surrogatepass"),
                          hashlib.sha256).hexdigest()
        return USER_DIGEST_PREFIX + digest[:USER_DIGEST_HEX]
    return clip(user, MAX_ORID)


def request_keys(request: dict[str, Any]) -> list[str]:
    """
    The request's top-level keys for an error line, sorted -- at most
    :data:`MAX_REQ_KEYS` of them, each clipped to :data:`MAX_KEY` bytes, then ``…+N`` for
    the N left out, so a body of a million keys makes a long line, not a megabyte one.
    """
    keys = sorted(request)
    shown = [clip(key, MAX_KEY, "key") for key in keys[:MAX_REQ_KEYS]]
    if len(keys) > MAX_REQ_KEYS:
        shown.append(f"…+{len(keys) - MAX_REQ_KEYS}")
    return shown


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


def _tail_lines(record: RequestRecord) -> bytes | None:
    """
    The whole lines of the bytes past the capture (``None`` if it held the whole answer):
    the first and last may be cut, and are left out, so every event parsed is whole.
    """
    if not record.tail:
        return None
    tail = b"".join(record.tail)
    return tail[tail.find(b"\n") + 1:tail.rfind(b"\n") + 1]


def _request_of(record: RequestRecord) -> dict[str, Any] | None:
    """
    The request body as a JSON object: the routing's parse of it when there was one (the
    body forwarded is the one it parsed), else parsed here -- only for a reader of the
    texts, the one reader of what the request asked (its ``user``, ``max_tokens``, keys).
    """
    routing = record.routing
    if routing is not None and routing.body is record.request_body:
        found = routing.json
        return found if found.__class__ is dict else None
    if record.needs < Needs.TEXTS:
        return None
    return parse_json_object(record.request_body)


def summarize(record: RequestRecord, privacy: Privacy = KEEP_ALL) -> Summary:
    """
    Turn what the proxy saw into the fields of the log line, keeping what ``privacy``
    allows, and reading of the answer what its readers need (``record.needs``).  A stream
    was summarised as it passed (:class:`StreamCapture`): what is left here is its last
    line, or the whole lines of the tail past the capture -- bounded, whatever its length.
    """
    request = _request_of(record)
    stream = record.stream
    texts = record.needs >= Needs.TEXTS
    body = b"" if stream is not None else b"".join(record.response)
    if stream is None:
        if record.chunked:
            body = dechunk(body)
        if record.tail and _is_stream(body, record.content_type):
            # a stream longer than the capture: its last whole events too, where its usage
            # is (each part cut at a line's end, so every event parsed is whole)
            body = body[:body.rfind(b"\n") + 1] + b"\n" + (_tail_lines(record) or b"")
    status = record.status if record.status is not None else 499
    common: dict[str, Any] = {
        "time": record.ended,
        "orid": orid_of(record.orid_header, request, privacy),
        "backend": record.backend or "-",
        "method": clip(record.method.decode("ascii", "replace"), MAX_METHOD),
        "path": clip(record.path.decode("utf-8", "replace"), MAX_PATH),
        "status": status,
        "outcome": record.outcome,
        "dur": max(0.0, record.ended - record.started),
        "ttft": None if record.first_byte is None else record.first_byte - record.started,
        "truncated": record.truncated,
        "tries": record.tries,
        "priority": None if record.routing is None else record.routing.priority,
    }
    if status != 200:
        keys = request_keys(request) if request is not None else None
        # decoding stops early: the clip keeps at most MAX_ERR_BODY characters anyway
        err_body = body[:4 * MAX_ERR_BODY].decode("utf-8", "replace")
        if privacy.err_body is not None:
            err_body = err_body[:privacy.err_body]
        err_body = clip(err_body, MAX_ERR_BODY, "text")
        return Summary(kind="error", req_keys=keys, err_body=err_body, **common)
    api = API_PATHS.get(record.path)
    if api is None:
        return Summary(kind="other", **common)
    if api == "embeddings":
        return _embedding(body, common)

    if stream is not None:
        completion = stream.finish(_tail_lines(record))
    elif api == "responses":
        completion = parse_responses(body, record.content_type)
    elif api == "messages":
        completion = parse_messages(body, record.content_type)
    else:
        completion = parse_completion(body, record.content_type)
    content = reasoning = visible = ""
    if texts:
        content = "".join(completion.content)
        reasoning = "".join(completion.reasoning)
        visible = _THINK_BLOCK.sub("", content).strip()
    max_tokens = None
    thinking = False
    if request is not None:
        max_tokens = _int_or_none(request.get("max_tokens"))
        if max_tokens is None:
            max_tokens = _int_or_none(request.get("max_completion_tokens"))
        if max_tokens is None and api == "responses":
            max_tokens = _int_or_none(request.get("max_output_tokens"))
        thinking = _asked_to_think(request)
    return Summary(
        kind="completion",
        # the finish reason, like the texts, is the result log's alone
        finish=None if completion.finish is None or not texts else clip(completion.finish,
                                                                          MAX_FINISH),
        completion_tokens=_count(completion.completion_tokens),
        prompt_tokens=completion.prompt_tokens,
        cached_prompt_tokens=completion.cached_prompt_tokens,
        stream=completion.stream,
        max_tokens=max_tokens,
        thinking=thinking,
        think=bool(reasoning) or "<think>" in content,
        empty=not visible,
        clen=len(content),
        preview=visible[:min(privacy.content, MAX_PREVIEW_CHARS)],
        **common,
    )


def _asked_to_think(request: dict[str, Any]) -> bool:
    """
    The request turned reasoning on: ``chat_template_kwargs.enable_thinking`` (vLLM, SGLang),
    the Messages API's ``thinking: {"type": "enabled"}`` or the Responses API's
    ``reasoning: {"effort": ...}`` (any effort but ``none``).
    """
    kwargs = request.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("enable_thinking") is True:
        return True
    thinking = request.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        return True
    reasoning = request.get("reasoning")
    return (isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str)
            and reasoning["effort"] != "none")


def _embedding(body: bytes, common: dict[str, Any]) -> Summary:
    """An embeddings answer: how many vectors, and the prompt tokens they took."""
    answer = parse_json_object(body)
    count = prompt_tokens = None
    if answer is not None:
        data = answer.get("data")
        if isinstance(data, list):
            count = len(data)
        usage = answer.get("usage")
        if isinstance(usage, dict):
            prompt_tokens = _count(_int_or_none(usage.get("prompt_tokens")))
    return Summary(kind="embedding", prompt_tokens=prompt_tokens, count=count, **common)
