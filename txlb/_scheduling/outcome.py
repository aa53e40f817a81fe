"""
What one finished request teaches the parts that learn from traffic.

A :class:`RequestOutcome` is the one value a policy's ``observe``, the outlier detector and
(in a fleet of replicas) a budget receive for each request that ended: who served it, how it
went and what it cost, in the units a scheduler reasons in.  It is built from the
request's :class:`~txlb._records.summary.Summary` once, where the request is counted (the
bookkeeper), so every consumer reads the same numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import attrs

if TYPE_CHECKING:
    from txlb._scheduling.request import RoutingRequest


class Summary(Protocol):
    """
    What an outcome is made of: the fields of a request's
    :class:`~txlb._records.summary.Summary` it reads -- declared here, beside the
    outcome, so that what the schedulers learn from needs nothing of the records'.
    """

    @property
    def backend(self) -> str: ...
    @property
    def status(self) -> int: ...
    @property
    def ttft(self) -> float | None: ...
    @property
    def dur(self) -> float: ...
    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def cached_prompt_tokens(self) -> int | None: ...
    @property
    def completion_tokens(self) -> int | None: ...
    @property
    def outcome(self) -> str: ...
    @property
    def stream(self) -> bool: ...


@attrs.frozen
class RequestOutcome:
    """One finished request, as the consumers that learn from it see it."""

    #: the backend that served (or last failed) it: a pool key, ``""`` for none
    backend: str
    #: the status the client got
    status: int
    #: a backend's answer reached txlb, so the timings say something about that backend
    answered: bool
    #: seconds from the request's start to the backend's first response byte
    ttfb: float | None
    #: seconds from the request's start to its end
    duration: float
    #: the prompt's tokens, as the backend counted them (``usage``), when it said
    prompt_tokens: int | None = None
    #: of those, how many the engine served from its prefix (KV) cache, when it said
    cached_prompt_tokens: int | None = None
    #: seconds per generated token after the first (decode speed), when it can be told
    time_per_output_token: float | None = None
    #: the client key of ``--rate-key`` (an address, or a header's value), when known
    client: str | None = None
    #: what the request was routed by (the same object the policy's ``choose`` saw), so a
    #: policy can match the outcome to what it predicted; ``None`` when not known (a
    #: summary from another process)
    routing: RoutingRequest | None = attrs.field(default=None, eq=False, repr=False)
    #: the completion's tokens, as the backend counted them (``usage``), when it said
    completion_tokens: int | None = None
    #: how it ended, as the result log's ``outcome``: ``ok``, ``client_abort``,
    #: ``timeout``, ``upstream_error`` or ``proxy_error``
    end: str = "ok"
    #: a stream's events relayed to the client (SSE ``data:`` lines): the completion
    #: tokens it is known to have generated at least when its ``usage`` did not say;
    #: ``None`` when not known (not a stream, a summary from another process)
    relayed_events: int | None = None

    @classmethod
    def of(cls, summary: Summary, answered: bool, client: str | None = None,
           routing: RoutingRequest | None = None,
           relayed_events: int | None = None) -> RequestOutcome:
        """The outcome of the request ``summary`` describes."""
        return cls(
            backend=summary.backend,
            status=summary.status,
            answered=answered,
            ttfb=summary.ttft,
            duration=summary.dur,
            prompt_tokens=summary.prompt_tokens,
            cached_prompt_tokens=summary.cached_prompt_tokens,
            time_per_output_token=time_per_output_token(summary, answered),
            client=client,
            routing=routing,
            completion_tokens=summary.completion_tokens,
            end=summary.outcome,
            relayed_events=relayed_events if summary.stream else None,
        )


def time_per_output_token(summary: Summary, answered: bool) -> float | None:
    """
    Seconds per generated token after the first (decode speed): the time from the first
    byte to the end over the tokens after the first, for an answered, streamed request that
    generated two tokens or more (a plain JSON answer arrives whole, so its first byte
    says nothing of the first token).  The policies' outcome and the metrics' histogram
    read this one definition.
    """
    tokens = summary.completion_tokens
    if (not answered or not summary.stream or summary.ttft is None or tokens is None
            or tokens < 2):
        return None
    return max(0.0, summary.dur - summary.ttft) / (tokens - 1)
