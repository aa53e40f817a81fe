"""
The failure table: for each kind of failure an exchange can meet, what the client gets, the
result log's outcome, whether the request is tried on another backend, and what it costs the
backend -- one data structure, like Envoy's retry state, instead of branches spread over the
exchange.

:data:`FAILURES` is the table, :func:`classify` names the kind of a failed upstream request,
and the ``## The failure table`` section of ``docs/reliability.md`` is the same table for
users (``tests/unit/test_failures.py`` reads it and compares, so the two cannot drift).

Whether a lost connection's request is tried again follows the one rule of
:func:`txlb._upstream.resend.may_send_again`: ``unsent`` (the write failed) may be, and
``closed_unanswered`` (the backend had the whole request) never is -- by the time the
exchange sees one, the upstream client has already resent what the idle-close race allows.

A rule's ``status`` is the answer while nothing of the response has reached the client;
once some has, every failure ends the same way -- the connection is closed without its last
chunk (a truncated response, never a fake success) -- with the same outcome.
"""

from __future__ import annotations

import enum
import json
import math
from typing import Any

import attrs
from twisted.internet import error as neterror
from twisted.python.failure import Failure
from twisted.web.client import RequestNotSent, RequestTransmissionFailed, ResponseNeverReceived

from txlb._http.words import describe_failure


class Kind(enum.Enum):
    """The kinds of failure, named as the docs' table names them."""

    REFUSED = "refused"
    UNSENT = "unsent"
    CONNECT_TIMEOUT = "connect_timeout"
    CLOSED_UNANSWERED = "closed_unanswered"
    BAD_RESPONSE = "bad_response"
    ANSWERED_RETRIABLE = "answered_502_503"
    ANSWERED = "answered"
    READ_TIMEOUT = "read_timeout"
    BODY_FAILED = "body_failed"
    CLIENT_STALLED = "client_stalled"
    CLIENT_GONE = "client_gone"
    SHUTDOWN = "shutdown"
    PROXY_ERROR = "proxy_error"


class Answer(enum.Enum):
    """What the client gets when it is not an error of txlb's own (the docs' words)."""

    RELAYED = "the backend's answer"
    TRUNCATED = "a truncated response"
    NOTHING = "nothing"


class Blame(enum.Enum):
    """What a failure does to the backend (the docs' words)."""

    NONE = "—"
    DOWN = "marked down"
    DOWN_PROBED = "marked down, probed at once"
    PROBED = "probed at once"
    #: the pool's outlier detector counts the answer (its 5xx only, and not those a
    #: request provoked itself: see :func:`provoked_by_request`)
    ANSWER_COUNTED = "a 5xx counts toward outlier ejection"

    @property
    def marks_down(self) -> bool:
        return self in (Blame.DOWN, Blame.DOWN_PROBED)

    @property
    def probes(self) -> bool:
        """Whether the backend is probed at once (a reset may be a restart, not a death)."""
        return self in (Blame.DOWN_PROBED, Blame.PROBED)


@attrs.frozen
class Rule:
    """One row of the failure table."""

    kind: Kind
    #: txlb's own error status, or what the client gets instead
    status: int | Answer
    #: the result log's ``end=`` (``ok`` is not shown)
    outcome: str
    #: tried on another backend (when one can take it, within ``--retries`` and
    #: ``--retry-window``, and nothing reached the client yet)
    retried: bool
    backend: Blame
    #: txlb's error message, formatted with the exchange's fields (``backend``, ...)
    message: str = ""


#: The failure table (``docs/reliability.md``, "The failure table", says the same).
FAILURES: dict[Kind, Rule] = {rule.kind: rule for rule in (
    Rule(Kind.REFUSED, 502, "upstream_error", retried=True, backend=Blame.DOWN,
         message="{backend} could not be reached"),
    Rule(Kind.UNSENT, 502, "upstream_error", retried=True, backend=Blame.DOWN_PROBED,
         message="{backend} could not be reached"),
    # ambiguous (the backend may be taking it), so the prober decides, as nginx: 504
    Rule(Kind.CONNECT_TIMEOUT, 504, "timeout", retried=False, backend=Blame.NONE,
         message="timed out connecting to {backend}"),
    # an engine killed mid-prefill may have done the work: a second try is a second generation
    Rule(Kind.CLOSED_UNANSWERED, 502, "upstream_error", retried=False, backend=Blame.PROBED,
         message="{backend} closed the connection without answering"),
    Rule(Kind.BAD_RESPONSE, 502, "upstream_error", retried=False, backend=Blame.NONE,
         message="bad response from {backend}"),
    Rule(Kind.ANSWERED_RETRIABLE, Answer.RELAYED, "ok", retried=True,
         backend=Blame.ANSWER_COUNTED),
    Rule(Kind.ANSWERED, Answer.RELAYED, "ok", retried=False, backend=Blame.ANSWER_COUNTED),
    # the generation may still be running on that GPU: never doubled
    Rule(Kind.READ_TIMEOUT, 504, "timeout", retried=False, backend=Blame.NONE,
         message="{backend} sent nothing for {timeout:g}s"),
    Rule(Kind.BODY_FAILED, 502, "upstream_error", retried=False, backend=Blame.NONE,
         message="{backend} failed before its body"),
    Rule(Kind.CLIENT_STALLED, Answer.TRUNCATED, "client_timeout", retried=False,
         backend=Blame.NONE),
    Rule(Kind.CLIENT_GONE, Answer.NOTHING, "client_abort", retried=False, backend=Blame.NONE),
    Rule(Kind.SHUTDOWN, 503, "shutdown", retried=False, backend=Blame.NONE,
         message="{reason}"),
    Rule(Kind.PROXY_ERROR, 502, "proxy_error", retried=False, backend=Blame.NONE,
         message="internal proxy error"),
)}

#: Answers that mean "this backend cannot take it now": retried elsewhere when possible.
RETRIED_STATUSES = frozenset({502, 503})

#: Connection failures that mean "nothing is listening there": the backend is down.
_UNREACHABLE = (
    neterror.ConnectionRefusedError,
    neterror.NoRouteError,
    neterror.DNSLookupError,
    neterror.UnknownHostError,
)
#: The connection failed before the whole request left (txlb's client, or Agent's): the
#: backend never had it, so it cannot have started generating.
_NEVER_SENT = (RequestTransmissionFailed, RequestNotSent)
#: Connect attempts that ran out of time.
_CONNECT_TIMEOUT = (neterror.TimeoutError, neterror.TCPTimedOutError)
#: Methods whose requests carry a body: one missing (or not JSON) provokes a 5xx from some
#: engines, which is then the request's fault, not the backend's.
_BODY_METHODS = frozenset({b"POST", b"PUT", b"PATCH"})


def classify(failure: Failure) -> Kind:
    """The kind of failure of an upstream request that got no response head."""
    if failure.check(*_UNREACHABLE):
        return Kind.REFUSED  # provably never started: nothing listens there
    if failure.check(*_NEVER_SENT):
        return Kind.UNSENT  # provably never started: part of the request never left
    if _is_reset(failure):
        return Kind.CLOSED_UNANSWERED
    if failure.check(*_CONNECT_TIMEOUT):
        return Kind.CONNECT_TIMEOUT
    return Kind.BAD_RESPONSE


def answered(status: int) -> Kind:
    """The kind of a response head the backend sent."""
    return Kind.ANSWERED_RETRIABLE if status in RETRIED_STATUSES else Kind.ANSWERED


def failure_words(failure: Failure) -> str:
    """What a connection failure was, in words (a wrapper's own message is a repr list)."""
    reasons: list[Any] = getattr(failure.value, "reasons", [])
    if reasons and isinstance(reasons[0], Failure):
        return f"connection lost while sending the request ({describe_failure(reasons[0])})"
    return describe_failure(failure)


def _is_reset(failure: Failure) -> bool:
    """A connection the backend closed or reset before sending a response head."""
    if not failure.check(ResponseNeverReceived):
        return False
    reasons: list[Any] = getattr(failure.value, "reasons", [])
    return any(reason.check(neterror.ConnectionLost, neterror.ConnectionDone) for reason in reasons)


def provoked_by_request(method: bytes, body: bytes) -> bool:
    """
    Whether a 5xx answer is the request's own doing rather than the backend's: a body that
    is not a JSON object (an engine such as llama.cpp answers 500 to one), so garbage POSTs
    cannot eject a healthy backend.
    """
    return bool(body or method in _BODY_METHODS) and not standard_json_object(body)


def standard_json_object(body: bytes) -> bool:
    """
    Whether ``body`` is a JSON object as RFC 8259 and strict parsers read it.  Python's
    parser also takes ``NaN``, ``Infinity``, numbers past a double and lone surrogates,
    which llama.cpp's rejects with a 500: a client sending them must not count as the
    backend failing.  Only a 5xx asks, so the re-encoding (for surrogates) is rare.
    """
    if not body or body.lstrip()[:1] != b"{":
        return False

    def refused(text: str) -> float:
        raise ValueError(text)

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(text)
        return value

    try:
        value = json.loads(body, parse_constant=refused, parse_float=finite,
                           parse_int=finite)
        if b"\\u" in body:
            json.dumps(value, ensure_ascii=False).encode("utf-8")  # lone surrogates raise
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict)
