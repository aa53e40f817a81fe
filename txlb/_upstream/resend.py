"""
When a request whose connection was lost may be sent again: the one rule for every path
that could send a request a second time.

For an LLM a request sent twice is two generations (twice the GPU time, and a second side
effect for an agent calling tools), so a lost connection is proof of nothing by itself: the
backend may have read the request and started on it before it crashed.  A request may be
sent again only when the backend provably never had it, or as good as provably:

* **the write failed**: part of the request was still unsent when the connection was lost,
  so the backend never had it whole and cannot have started on it (on any connection);
* **the idle-close race**: on a *reused* keep-alive connection, the backend closed (or
  reset) it within :data:`RESEND_WINDOW` of the request's last byte being written, before
  sending a byte of response.  That is a backend closing an idle connection as txlb reused
  it (its keep-alive timeout racing ours), not a backend that read the request.  A backend
  that held the request longer may have started on it -- an engine crashing 0.8 s into a
  prefill -- and that request is never sent again, not even to the same backend.

The upstream client (:mod:`txlb._upstream.client`) applies it to its one resend on a new
connection; the failure table (:mod:`txlb._proxy.failures`) retries on another backend only
what this rule allows (``unsent``), never ``closed_unanswered``.  docs/reliability.md states
the same rule and the same number (``tests/unit/test_failures.py`` compares them).
"""

from __future__ import annotations

#: Seconds, from the moment the request's last byte was written to the transport (the
#: injected clock), within which a reused connection's close before any byte of response
#: is the idle-close race.  A close travels in well under a millisecond on a LAN, so the
#: race is over in a few; 50 ms leaves room for a busy reactor noticing late, yet is far
#: shorter than any engine takes to start on a request it read (tokenising, scheduling,
#: prefill), so a request an engine died on is not sent again.
RESEND_WINDOW = 0.050


def may_send_again(*, write_failed: bool, reused: bool, answered: bool,
                   held: float) -> bool:
    """
    Whether a request whose connection was lost before its response head may be sent
    again.

    ``write_failed``: part of the request was still unsent; ``reused``: the connection had
    carried an earlier request (it came from the keep-alive pool); ``answered``: a byte of
    response arrived; ``held``: seconds from the request's last byte written to the loss.
    """
    if write_failed:
        return True
    return reused and not answered and held <= RESEND_WINDOW
