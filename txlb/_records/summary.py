"""
What one finished request amounts to: the fields of its result-log line.

Kept apart from the writer so it can be tested (and fuzzed) on its own.
:func:`summarize` reads a :class:`~txlb._records.record.RequestRecord` once, when the
request has ended: a stream was summarised as it passed (:class:`~txlb._records.capture.
StreamCapture`), so only a bounded remainder is left to read; a JSON answer or an error's
body is read here, by its API's reader (:mod:`txlb._records.answers`).  What the line may
keep of what users wrote is :class:`~txlb._records.privacy.Privacy`, applied here; the
limits on each value's length, which keep every line under :data:`MAX_LINE`, are here too.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Any

import attrs

from txlb._config.bounds import MAX_PREVIEW_CHARS
from txlb._http.apis import API_PATHS
from txlb._json_body import parse_json_object
from txlb._log.escape import clip
from txlb._records.answers.chat import parse_completion
from txlb._records.answers.completion import int_or_none, is_stream, token_count
from txlb._records.answers.embeddings import parse_embeddings
from txlb._records.answers.messages import parse_messages
from txlb._records.answers.responses import parse_responses
from txlb._records.capture import dechunk, tail_lines
from txlb._records.needs import Needs
from txlb._records.privacy import KEEP_ALL, Privacy, privacy_of
from txlb._records.record import CAPTURE_LIMIT, TAIL_LIMIT, RequestRecord

#: What this module defines, and the names the tests and benchmarks import from here whose
#: homes are the modules beside it: the record, the capture, the privacy options, the chat
#: reader and the JSON reading.
__all__ = [
    "MAX_ERR_BODY", "MAX_FINISH", "MAX_KEY", "MAX_LINE", "MAX_METHOD", "MAX_ORID", "MAX_PATH",
    "MAX_PREVIEW_CHARS", "MAX_REQ_KEYS", "Summary", "orid_of", "request_keys", "summarize",
    # homed beside this module
    "CAPTURE_LIMIT", "TAIL_LIMIT", "Privacy", "RequestRecord", "dechunk", "parse_completion",
    "parse_json_object", "privacy_of",
]

#: Request keys listed on an error line.
MAX_REQ_KEYS = 64
#: Bytes each value chosen by a client or a backend may take once escaped, in either
#: format (:func:`~txlb._log.escape.clip`): with these no line is longer than
#: :data:`MAX_LINE` bytes, plus the backend's name (which comes from the configuration).
MAX_ORID = 256
MAX_METHOD = 32
MAX_PATH = 2048
MAX_FINISH = 64
MAX_KEY = 64
MAX_ERR_BODY = 8192
MAX_LINE = 16 * 1024
#: Hex digits of the keyed digest written in place of a hashed ``user``: 64 bits, enough to
#: tell a fleet's users apart, and a prefix no e-mail address or X-Orid is likely to share.
USER_DIGEST_HEX = 16
USER_DIGEST_PREFIX = "h:"

_THINK_BLOCK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)


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
    #: continuations of its stream on another engine, and the last one's backend
    resumes: int = 0
    resumed_backend: str | None = None
    #: why its stream, cut by its engine, was not continued (``--resume``)
    resume_refused: str | None = None
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
    #: the tenant whose API key it presented (``--auth keys``); ``None`` without keys, or
    #: for a request refused before its key was known
    tenant: str | None = None


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
    was summarised as it passed (:class:`~txlb._records.capture.StreamCapture`): what is
    left here is its last line, or the whole lines of the tail past the capture -- bounded,
    whatever its length.
    """
    request = _request_of(record)
    stream = record.stream
    texts = record.needs >= Needs.TEXTS
    body = b"" if stream is not None else b"".join(record.response)
    if stream is None:
        if record.chunked:
            body = dechunk(body)
        if record.tail and is_stream(body, record.content_type):
            # a stream longer than the capture: its last whole events too, where its usage
            # is (each part cut at a line's end, so every event parsed is whole)
            body = body[:body.rfind(b"\n") + 1] + b"\n" + (tail_lines(record.tail) or b"")
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
        "resumes": record.resumes,
        "resumed_backend": record.resumed_backend,
        "resume_refused": record.resume_refused,
        "priority": None if record.routing is None else record.routing.priority,
        "tenant": record.tenant,
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
        completion = stream.finish(tail_lines(record.tail))
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
        max_tokens = int_or_none(request.get("max_tokens"))
        if max_tokens is None:
            max_tokens = int_or_none(request.get("max_completion_tokens"))
        if max_tokens is None and api == "responses":
            max_tokens = int_or_none(request.get("max_output_tokens"))
        thinking = _asked_to_think(request)
    return Summary(
        kind="completion",
        # the finish reason, like the texts, is the result log's alone
        finish=None if completion.finish is None or not texts else clip(completion.finish,
                                                                          MAX_FINISH),
        completion_tokens=token_count(completion.completion_tokens),
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
    answer = parse_embeddings(body)
    return Summary(kind="embedding", prompt_tokens=answer.prompt_tokens, count=answer.count,
                   **common)
