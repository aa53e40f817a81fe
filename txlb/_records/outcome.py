"""
What one finished request teaches the parts that learn from traffic.

A :class:`RequestOutcome` is the one value a policy's ``observe``, the outlier detector and
(in a fleet of replicas) a budget receive for each request that ended: who served it, how it
went and what it cost, in the units a scheduler reasons in.  It is built from the
request's :class:`~txlb._records.summary.Summary` once, where the request is counted (the
bookkeeper), so every consumer reads the same numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from txlb._records.summary import Summary

if TYPE_CHECKING:
    from txlb._scheduling.request import RoutingRequest


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

    @classmethod
    def of(cls, summary: Summary, answered: bool, client: str | None = None,
           routing: RoutingRequest | None = None) -> RequestOutcome:
        """The outcome of the request ``summary`` describes."""
        per_token = None
        tokens = summary.completion_tokens
        if answered and summary.ttft is not None and tokens is not None and tokens > 1:
            per_token = max(0.0, summary.dur - summary.ttft) / (tokens - 1)
        return cls(
            backend=summary.backend,
            status=summary.status,
            answered=answered,
            ttfb=summary.ttft,
            duration=summary.dur,
            prompt_tokens=summary.prompt_tokens,
            time_per_output_token=per_token,
            client=client,
            routing=routing,
        )
