"""
What one finished request amounts to: the fields of its result-log line.

Pure functions over bytes, kept apart from the writer so they can be tested (and fuzzed) on
their own, and so nothing here runs per chunk: the proxy only collects the first
:data:`CAPTURE_LIMIT` bytes of the response, and :func:`summarize` reads them once, when
the request has ended.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from typing import TYPE_CHECKING, Any, Literal

import attrs

from ._escape import clip

if TYPE_CHECKING:
    from ._config import Config

#: How much of a response is kept for the summary; the client always gets all of it.
CAPTURE_LIMIT = 512 * 1024
#: Characters of content shown after ``|`` by default (``--log-content``), and the most
#: that can be asked for: 1,000 characters take at most 12,000 bytes escaped, which keeps a
#: completion line under :data:`MAX_LINE`.
PREVIEW_CHARS = 200
MAX_PREVIEW_CHARS = 1000
#: Request keys listed on an error line.
MAX_REQ_KEYS = 64
#: Bytes each value chosen by a client or a backend may take once escaped, in either
#: format (:func:`~txlb._escape.clip`): with these no line is longer than
#: :data:`MAX_LINE` bytes, plus the backend's name (which comes from the configuration).
MAX_ORID = 256
MAX_METHOD = 32
MAX_PATH = 2048
MAX_FINISH = 64
MAX_KEY = 64
MAX_ERR_BODY = 8192
MAX_LINE = 16 * 1024
#: Paths whose responses are LLM completions and get the full summary.
COMPLETION_PATHS = frozenset({b"/v1/chat/completions", b"/v1/completions"})

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

    def answered_by_proxy(self, status: int, body: bytes) -> None:
        """txlb answered this request itself, with ``status`` and the JSON ``body``."""
        self.status = status
        self.content_type = b"application/json"
        self.capture(body)

    def capture(self, data: bytes) -> None:
        """Keep ``data`` for the summary while under the limit (called per chunk: cheap)."""
        room = CAPTURE_LIMIT - self.captured
        if room <= 0:
            self.truncated = True
            return
        if len(data) > room:
            data = data[:room]
            self.truncated = True
        self.response.append(data)
        self.captured += len(data)


@attrs.frozen
class Summary:
    """The fields of one result-log line, in the order the text format writes them."""

    time: float
    orid: str
    backend: str
    method: str
    path: str
    status: int
    kind: str  # "completion", "error" or "other"
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


def parse_json_object(body: bytes) -> dict[str, Any] | None:
    """``body`` as a JSON object, or ``None`` if it is not one."""
    if not body or body.lstrip()[:1] != b"{":
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _int_or_none(value: object) -> int | None:
    """
    ``value`` if it is an integer in the 64-bit range any engine's counts fit in: JSON
    allows 4,300 digits, which would bloat the line and overflow the metrics' floats.
    """
    if isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63:
        return value
    return None


def _sse_payloads(data: bytes) -> list[dict[str, Any]]:
    """
    The JSON objects of every ``data:`` line; ``[DONE]`` and broken events are skipped.

    All events are parsed in one ``json.loads`` of a JSON array made of them -- about 2.5
    times faster than one call per event for a typical 200-token stream, which matters
    because this runs once for every streamed request.  A stream with any broken event
    (or cut by the capture limit) falls back to parsing the events one by one.
    """
    payloads = [line[5:] for line in data.split(b"\n") if line[:5] == b"data:"]
    payloads = [p for p in payloads if b"[DONE]" not in p or p.strip() != b"[DONE]"]
    try:
        parsed = json.loads(b"[" + b",".join(payloads) + b"]")
    except ValueError:
        return [event for event in map(parse_json_object, payloads) if event is not None]
    return [event for event in parsed if isinstance(event, dict)]


@attrs.define
class _Completion:
    content: list[str] = attrs.field(factory=list)
    reasoning: list[str] = attrs.field(factory=list)
    finish: str | None = None
    completion_tokens: int | None = None

    def add_events(self, events: list[dict[str, Any]], part: str) -> None:
        """
        Fold the events of a stream (``part="delta"``) or a whole answer (``"message"``)
        in.  Only the first choice counts.  Written as one loop with no calls per event:
        it runs over every token of every streamed request.
        """
        content, reasoning = self.content, self.reasoning
        for event in events:
            choices = event.get("choices")
            if choices.__class__ is list:
                for choice in choices:
                    if choice.__class__ is not dict or choice.get("index", 0) != 0:
                        continue
                    holder = choice.get(part)
                    if holder.__class__ is dict:
                        text = holder.get("content")
                        if text.__class__ is str:
                            content.append(text)
                        text = holder.get("reasoning_content") or holder.get("reasoning")
                        if text.__class__ is str:
                            reasoning.append(text)
                    text = choice.get("text")  # /v1/completions
                    if text.__class__ is str:
                        content.append(text)
                    finish = choice.get("finish_reason")
                    if finish.__class__ is str:
                        self.finish = finish
            usage = event.get("usage")
            if usage.__class__ is dict:
                tokens = _int_or_none(usage.get("completion_tokens"))
                if tokens is not None:
                    self.completion_tokens = tokens


def parse_completion(body: bytes, content_type: bytes | None) -> _Completion:
    """Content, reasoning, finish reason and usage from a plain JSON or an SSE response."""
    completion = _Completion()
    stripped = body.lstrip()
    if (content_type or b"").startswith(b"text/event-stream") or stripped.startswith(b"data:"):
        completion.add_events(_sse_payloads(body), "delta")
    else:
        answer = parse_json_object(body)
        if answer is not None:
            completion.add_events([answer], "message")
    return completion


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


def summarize(record: RequestRecord, privacy: Privacy = KEEP_ALL) -> Summary:
    """Turn what the proxy saw into the fields of the log line, keeping what ``privacy`` allows."""
    request = parse_json_object(record.request_body)
    body = b"".join(record.response)
    if record.chunked:
        body = dechunk(body)
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
    }
    if status != 200:
        keys = request_keys(request) if request is not None else None
        # decoding stops early: the clip keeps at most MAX_ERR_BODY characters anyway
        err_body = body[:4 * MAX_ERR_BODY].decode("utf-8", "replace")
        if privacy.err_body is not None:
            err_body = err_body[:privacy.err_body]
        err_body = clip(err_body, MAX_ERR_BODY, "text")
        return Summary(kind="error", req_keys=keys, err_body=err_body, **common)
    if record.path not in COMPLETION_PATHS:
        return Summary(kind="other", **common)

    completion = parse_completion(body, record.content_type)
    content = "".join(completion.content)
    reasoning = "".join(completion.reasoning)
    visible = _THINK_BLOCK.sub("", content).strip()
    max_tokens = None
    thinking = False
    if request is not None:
        max_tokens = _int_or_none(request.get("max_tokens"))
        if max_tokens is None:
            max_tokens = _int_or_none(request.get("max_completion_tokens"))
        kwargs = request.get("chat_template_kwargs")
        thinking = isinstance(kwargs, dict) and kwargs.get("enable_thinking") is True
    return Summary(
        kind="completion",
        finish=None if completion.finish is None else clip(completion.finish, MAX_FINISH),
        completion_tokens=completion.completion_tokens,
        max_tokens=max_tokens,
        thinking=thinking,
        think=bool(reasoning) or "<think>" in content,
        empty=not visible,
        clen=len(content),
        preview=visible[:min(privacy.content, MAX_PREVIEW_CHARS)],
        **common,
    )
