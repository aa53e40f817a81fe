"""
What a backend was sent and what came back: :class:`Counts`.

The in-flight count is what every policy weighs and every ``max_conns`` caps, so it rises
the moment a slot is taken and falls exactly once per request (the lease sees to that);
next to it the totals the status pages show (requests, responses by status class, prompt
tokens) and the requests started and finished since the engine's queue was last scraped,
which the queue-depth policy adds to that scrape's figure.
"""

from __future__ import annotations

import attrs


@attrs.define(eq=False)
class Counts:
    """One backend's counters; read-only from outside, changed by the pool and leases."""

    #: in-flight requests: this process's own count, or with shared counts the
    #: all-process total as last read (:meth:`txlb._cluster.pool.Pool.refresh`)
    _active: int = 0
    _requests: int = 0
    _responses: dict[str, int] = attrs.field(factory=dict)
    #: prompt tokens of the answers that said them, and of those the ones the engine
    #: served from its prefix cache (the admin's hit rate)
    _prompt_tokens: int = 0
    _cached_prompt_tokens: int = 0
    _started_since_scrape: int = 0
    _finished_since_scrape: int = 0

    # -- in-flight slots (the pool and leases) ---------------------------------------

    def took_slot(self) -> None:
        """A request was sent here: one more in flight, started, and since the scrape."""
        self._active += 1
        self._requests += 1
        self._started_since_scrape += 1

    def gave_slot(self) -> None:
        """A request sent here ended (its lease released)."""
        self._active -= 1
        self._finished_since_scrape += 1

    def untook_slot(self) -> None:
        """
        A slot taken for a choice the shared store refused (``--shared-state``'s
        ``max_conns``): as if never taken -- nothing was sent, nothing finished.
        """
        self._active -= 1
        self._requests = max(0, self._requests - 1)
        # a scrape since the take restarted the count: the take is not in it any more
        self._started_since_scrape = max(0, self._started_since_scrape - 1)

    def counted(self, active: int, requests: int | None = None) -> None:
        """The all-process counts, as the shared counts last read them (``--workers``)."""
        self._active = active
        if requests is not None:
            self._requests = requests

    def scrape_restarts(self) -> None:
        """The engine's queue was read again: what was sent before is in that figure."""
        self._started_since_scrape = 0
        self._finished_since_scrape = 0

    # -- what the proxy's answers teach ----------------------------------------------

    def finished(self, status: int) -> None:
        """Count a finished request's status class."""
        status_class = f"{status // 100}xx"
        self._responses[status_class] = self._responses.get(status_class, 0) + 1

    def prompt_counted(self, prompt_tokens: int, cached_prompt_tokens: int | None) -> None:
        """An answer said how many prompt tokens it had, and perhaps how many were cached."""
        self._prompt_tokens += prompt_tokens
        if cached_prompt_tokens:
            self._cached_prompt_tokens += cached_prompt_tokens

    # -- views -----------------------------------------------------------------------

    @property
    def active(self) -> int:
        return self._active

    @property
    def requests(self) -> int:
        return self._requests

    @property
    def responses(self) -> dict[str, int]:
        return self._responses

    @property
    def prompt_tokens(self) -> int:
        return self._prompt_tokens

    @property
    def cached_prompt_tokens(self) -> int:
        return self._cached_prompt_tokens

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Cached over all prompt tokens reported; ``None`` before any was."""
        if not self._prompt_tokens:
            return None
        return self._cached_prompt_tokens / self._prompt_tokens

    @property
    def started_since_scrape(self) -> int:
        return self._started_since_scrape

    @property
    def finished_since_scrape(self) -> int:
        return self._finished_since_scrape
