"""
What txlb believes each engine's prefix cache holds: an approximate, bounded index.

txlb cannot see an engine's KV cache.  It knows what it sent where: every block hash of a
prompt routed to a backend (:mod:`txlb._scheduling.prefix`) is something that engine
prefilled and, until it ran out of room, kept.  :class:`BackendIndex` is that memory for one
backend -- an LRU of block hashes no larger than the engine's *capacity*, which is what makes
it honest: an engine that can hold two tenants' system prompts does not hold eight, and an
index that believed it would pull every tenant onto it (the failure of prefix routers that
match without counting room).

The capacity is an estimate in blocks, corrected by what the engine reports afterwards
(``usage.prompt_tokens_details.cached_tokens``, llama.cpp's ``timings.cache_n``):

* fewer tokens cached than predicted -- the engine evicted what the index still lists:
  the capacity shrinks to about what was still there (the index's size less the blocks that
  were missing) and the index is trimmed to it, oldest first, as the engine evicts;
* more cached than predicted -- the engine kept what the index had already let go: the
  capacity grows by the difference; a prediction that holds on a full index grows it by one.

A trust score (an average of the fraction of each predicted hit the engine confirmed)
scales the backend's matches, so an engine whose predicted hits keep missing -- prefix
caching switched off, a cache shared with other balancers' traffic -- stops attracting
requests by matches it never delivers.  Reports arrive in tokens; blocks are characters:
the ratio is learned per backend from ``prompt_tokens`` against the characters rendered.

:class:`FleetIndex` holds one index per backend (keyed weakly by the ``Backend`` object, so
a removed backend takes its index along) under one cap on the entries of all of them.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from txlb._cluster.backend import Backend

#: An engine's capacity before anything was learned, in blocks: 2,048 x 256 characters is
#: ~131k tokens' worth of prompt at 4 characters per token, below what one vLLM engine on a
#: 24 GB GPU keeps for a 7B model -- learned downwards from the first eviction it reports.
DEFAULT_CAPACITY_BLOCKS = 2048
#: The least a capacity estimate shrinks to: a few long prompts' worth.
MIN_CAPACITY_BLOCKS = 16
#: Entries of every backend's index together (one entry ~ 100 bytes: see docs/scheduling.md).
DEFAULT_MAX_ENTRIES = 200_000
#: Characters per token until a backend's answers have said otherwise.
DEFAULT_CHARS_PER_TOKEN = 4.0
#: How much one report moves the trust score and the characters-per-token ratio.
LEARNING_RATE = 0.2


class BackendIndex:
    """One backend's blocks (an LRU), its capacity estimate, trust and report counts."""

    __slots__ = ("entries", "capacity", "trust", "chars_per_token", "reports",
                 "unreported", "misses", "prompt_tokens", "predicted_tokens",
                 "cached_tokens", "counters_seen", "predicted_since", "counter_checks",
                 "up_since", "restarts", "__weakref__")

    def __init__(self, capacity: int = DEFAULT_CAPACITY_BLOCKS,
                 up_since: float | None = None) -> None:
        #: block hash -> None, least recently sent first
        self.entries: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity
        self.trust = 1.0
        self.chars_per_token = DEFAULT_CHARS_PER_TOKEN
        self.reports = 0
        self.unreported = 0
        self.misses = 0
        self.prompt_tokens = 0
        self.predicted_tokens = 0.0
        self.cached_tokens = 0
        #: the engine's prefix-cache (hits, queries) when last compared, and the cached
        #: tokens predicted here since: the loop's fallback when answers report nothing
        self.counters_seen: tuple[float, float] | None = None
        self.predicted_since = 0.0
        self.counter_checks = 0
        #: when the backend last came back into rotation, as this index last saw it
        self.up_since = up_since
        #: times the engine's cache was found started again (back up, counters reset)
        self.restarts = 0

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def room(self) -> int:
        """Blocks this engine could take before it must evict (by the estimate)."""
        return max(0, self.capacity - len(self.entries))

    def match(self, chain: Sequence[int]) -> int:
        """How many leading blocks of ``chain`` were sent here (and not evicted since)."""
        entries = self.entries
        matched = 0
        for block in chain:
            if block not in entries:
                break
            matched += 1
        return matched

    def sent(self, chain: Sequence[int]) -> int:
        """
        ``chain`` was sent here: its blocks become the most recent, the first block last
        (so eviction, oldest first, cuts a prefix from its end, as vLLM frees a request's
        deepest blocks first), and the oldest entries past the capacity go.  Returns how
        many entries the index grew by.
        """
        entries = self.entries
        before = len(entries)
        for block in reversed(chain):
            if block in entries:
                entries.move_to_end(block)
            else:
                entries[block] = None
        self.trim(self.capacity)
        return len(entries) - before

    def started_again(self) -> int:
        """
        The engine's cache is empty again (it came back up, or its counters started
        again): nothing listed is there any more, and its first answers -- honestly
        nothing cached -- are no evictions to learn from.  The capacity and trust are
        the engine's and stay.  How many entries went.
        """
        gone = len(self.entries)
        self.entries.clear()
        self.counters_seen = None
        self.predicted_since = 0.0
        self.restarts += 1
        return gone

    def trim(self, size: int) -> int:
        """Evict the oldest entries down to ``size``; how many went."""
        entries = self.entries
        gone = 0
        while len(entries) > size:
            entries.popitem(last=False)
            gone += 1
        return gone

    def learned(self, block_chars: int, chars: int, predicted: int,
                prompt_tokens: int | None, cached_tokens: int | None,
                max_capacity: int) -> None:
        """
        The engine answered a request predicted to find ``predicted`` blocks cached, whose
        rendered prompt was ``chars`` characters (0: not all of it was rendered): fold in
        what it reported.
        """
        if prompt_tokens is not None and prompt_tokens > 0 and chars > 0:
            ratio = min(32.0, max(0.5, chars / prompt_tokens))
            self.chars_per_token += LEARNING_RATE * (ratio - self.chars_per_token)
        if cached_tokens is None or prompt_tokens is None:
            self.unreported += 1
            return
        cached_tokens = max(0, min(cached_tokens, prompt_tokens))
        self.reports += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.predicted_tokens += min(prompt_tokens,
                                     predicted * block_chars / self.chars_per_token)
        cached = math.floor(cached_tokens * self.chars_per_token / block_chars + 1e-9)
        if predicted > 0:
            confirmed = min(cached, predicted) / predicted
            self.trust += LEARNING_RATE * (confirmed - self.trust)
        if predicted > 0 and cached < predicted - max(1, predicted // 4):
            # The engine evicted what the index still listed: it holds less than that.
            self.misses += 1
            still_there = min(self.capacity, len(self.entries)) - (predicted - cached)
            self.capacity = max(MIN_CAPACITY_BLOCKS, still_there)
            self.trim(self.capacity)
        elif cached > predicted:
            self.capacity = min(max_capacity, self.capacity + (cached - predicted))
        elif predicted > 0 and len(self.entries) >= self.capacity:
            self.capacity = min(max_capacity, self.capacity + 1)

    def predicted(self, blocks: int, block_chars: int) -> float:
        """A request was sent here predicted to find ``blocks`` cached: those tokens."""
        tokens = blocks * block_chars / self.chars_per_token
        self.predicted_since += tokens
        return tokens

    def withdraw(self, blocks: Iterable[int], tokens: float) -> int:
        """
        A request sent here went elsewhere before this engine saw it (a retry): forget the
        ``blocks`` it added and the ``tokens`` it was predicted to find.  How many went.
        """
        entries = self.entries
        before = len(entries)
        for block in blocks:
            entries.pop(block, None)
        self.predicted_since = max(0.0, self.predicted_since - tokens)
        return before - len(entries)

    def counted(self, counters: tuple[float, float] | None, block_chars: int) -> None:
        """
        The engine's prefix-cache counters (hits, queries in tokens, from its ``/metrics``)
        as now scraped.  While its answers report no cached tokens, the hits it counted
        since the last scrape are compared with the cached tokens predicted here since:
        far fewer -- the engine evicted what the index lists -- shrink the capacity and
        lower the trust, as a report would.  Answers that report are the finer signal:
        once one has, the counters are left alone.
        """
        if counters is None or self.reports or counters == self.counters_seen:
            return
        seen, self.counters_seen = self.counters_seen, counters
        predicted, self.predicted_since = self.predicted_since, 0.0
        if seen is None:
            return
        hits = counters[0] - seen[0]
        if hits < 0 or counters[1] < seen[1]:
            self.started_again()  # the counters started again: the engine restarted
            self.counters_seen = counters
            return
        if predicted <= 0:
            return
        self.counter_checks += 1
        confirmed = min(1.0, hits / predicted)
        self.trust += LEARNING_RATE * (confirmed - self.trust)
        if confirmed < 0.75:
            missing = math.ceil((predicted - hits) * self.chars_per_token / block_chars)
            self.misses += 1
            still_there = min(self.capacity, len(self.entries)) - missing
            self.capacity = max(MIN_CAPACITY_BLOCKS, still_there)
            self.trim(self.capacity)

    def describe(self) -> dict[str, object]:
        """JSON-ready: what ``/status`` shows of this backend's index (its ``prefix_cache``)."""
        def rate(tokens: float) -> float | None:
            return round(tokens / self.prompt_tokens, 4) if self.prompt_tokens else None

        return {
            "index_blocks": len(self.entries),
            "capacity_blocks": self.capacity,
            "trust": round(self.trust, 4),
            "chars_per_token": round(self.chars_per_token, 3),
            "predicted_hit_rate": rate(self.predicted_tokens),
            "reported_hit_rate": rate(self.cached_tokens),
            "reports": self.reports,
            "unreported": self.unreported,
            "misses": self.misses,
            "counter_checks": self.counter_checks,
            "restarts": self.restarts,
        }


class FleetIndex:
    """Every backend's :class:`BackendIndex`, under one cap on their entries together."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 capacity: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        if max_entries < 1 or capacity < 1:
            raise ValueError("max_entries and capacity must be positive")
        self.max_entries = max_entries
        self.default_capacity = min(capacity, max_entries)
        #: entries of every index, as last counted (exact while no backend is dropped)
        self._total = 0
        self._by_backend: weakref.WeakKeyDictionary[Backend, BackendIndex] = (
            weakref.WeakKeyDictionary())

    def get(self, backend: Backend) -> BackendIndex | None:
        return self._by_backend.get(backend)

    def of(self, backend: Backend) -> BackendIndex:
        index = self._by_backend.get(backend)
        if index is None:
            index = self._by_backend[backend] = BackendIndex(self.default_capacity,
                                                             backend.slow_start.up_since)
        return index

    def match(self, backend: Backend, chain: Sequence[int]) -> int:
        """
        How much of ``chain`` ``backend``'s index lists -- nothing of what was sent before
        the backend last came back into rotation (a restarted engine's cache is empty).
        """
        index = self._by_backend.get(backend)
        if index is None:
            return 0
        if index.up_since != backend.slow_start.up_since:
            index.up_since = backend.slow_start.up_since
            self._total -= index.started_again()
        return index.match(chain)

    @property
    def entries(self) -> int:
        return sum(len(index) for index in self._by_backend.values())

    def indexes(self) -> Iterable[BackendIndex]:
        return list(self._by_backend.values())

    def forget_blocks(self) -> None:
        """Every index empties (the blocks' names changed); capacities and trust stay."""
        for index in self._by_backend.values():
            index.entries.clear()
        self._total = 0

    def withdraw(self, index: BackendIndex, blocks: Iterable[int], tokens: float) -> None:
        """``index``'s backend never got the request that added ``blocks``: they go."""
        self._total -= index.withdraw(blocks, tokens)

    def sent(self, backend: Backend, chain: Sequence[int]) -> None:
        """``chain`` went to ``backend``; over the fleet's cap, the largest index gives way."""
        self._total += self.of(backend).sent(chain)
        if self._total <= self.max_entries:
            return
        self._total = self.entries  # recounted: a removed backend's index went with it
        excess = self._total - self.max_entries
        while excess > 0:
            largest = max(self._by_backend.values(), key=len)
            gone = largest.trim(max(0, len(largest) - excess))
            excess -= gone
            self._total -= gone
