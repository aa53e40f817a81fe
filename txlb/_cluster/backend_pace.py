"""
How fast a backend answers: :class:`Pace`, its latency averages and last signs of life.

The status pages show the averages; the hung-backend detector (:mod:`txlb._cluster.hung`)
and the prober read when the last byte and the last successful head came, and how long
such heads take, to tell a backend that went silent from one that is merely slow.
"""

from __future__ import annotations

import attrs

#: Weight of the newest sample in the latency averages shown in status.
EWMA_ALPHA = 0.2


@attrs.define(eq=False)
class Pace:
    """One backend's timings, in this process; read-only from outside."""

    _ewma_duration: float | None = None
    _ewma_ttft: float | None = None
    #: when the last byte (head or body) of a proxied response came from it, in this
    #: process: what the hung-backend detector (txlb._cluster.hung) and the prober read
    _last_byte: float | None = None
    #: when the last successful (2xx) response head came from it in this process, and how
    #: long such heads take here (an average of send-to-head times): the hung-backend
    #: detector judges a client that left unanswered against these, its own and the
    #: other backends'.  An error head is a byte (``_last_byte``) but no pace: a 400 in
    #: 2 ms says nothing of how fast the engine answers a request it generates for.
    _last_head: float | None = None
    _head_wait: float | None = None

    def heard(self, at: float) -> None:
        """A byte of a proxied response (head or body) arrived from it at ``at``."""
        self._last_byte = at

    def head_came(self, at: float, waited: float, status: int) -> None:
        """
        A proxied response's head of ``status`` arrived at ``at``, ``waited`` seconds after
        its try was sent: a byte whatever the status; a successful one also sets the pace
        (:attr:`last_head`, :attr:`head_wait`).
        """
        self._last_byte = at
        if 200 <= status < 300:
            self._last_head = at
            self._head_wait = _ewma(self._head_wait, waited)

    def timed(self, duration: float, ttft: float | None) -> None:
        """Fold a finished request's timings into the averages."""
        self._ewma_duration = _ewma(self._ewma_duration, duration)
        if ttft is not None:
            self._ewma_ttft = _ewma(self._ewma_ttft, ttft)

    @property
    def ewma_duration(self) -> float | None:
        return self._ewma_duration

    @property
    def ewma_ttft(self) -> float | None:
        return self._ewma_ttft

    @property
    def last_byte(self) -> float | None:
        return self._last_byte

    @property
    def last_head(self) -> float | None:
        """When its last successful (2xx) response head came, in this process."""
        return self._last_head

    @property
    def head_wait(self) -> float | None:
        """How long its successful (2xx) response heads take, on average, from sending."""
        return self._head_wait


def _ewma(previous: float | None, sample: float) -> float:
    return sample if previous is None else previous + EWMA_ALPHA * (sample - previous)
