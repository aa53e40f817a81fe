"""
What a backend's engine says of itself: :class:`EngineReading`, from its ``/metrics``.

The prober recognises the engine (vLLM, SGLang...) and scrapes its queue, KV-cache usage
and prefix-cache counters; the queue-depth and cache-aware policies act on the last
figures, and forget the queue rather than act on a stale one when a scrape fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs


@attrs.define(eq=False)
class EngineReading:
    """One backend's engine figures as last scraped; read-only from outside."""

    #: the engine recognised from its ``/metrics`` ("vllm", "sglang", "llamacpp", "tgi",
    #: "unknown"); ``None`` until looked at
    _name: str | None = None
    #: its running plus waiting requests, ``None`` when not (or no longer) known
    _depth: float | None = None
    #: its KV-cache usage, a fraction (1 = full), when it exports one
    _kv_cache_usage: float | None = None
    #: its prefix-cache counters at the last scrape: (hits, queries) in tokens
    _prefix_cache_counts: tuple[float, float] | None = None
    #: scrapes of the queue so far (a worker process restarts its local count "since the
    #: scrape" when this changes)
    _scrapes: int = 0

    def seen(self, name: str, kv_cache: float | None) -> None:
        self._name = name
        self._kv_cache_usage = kv_cache

    def scraped(self, depth: float, kv_cache: float | None,
                prefix_cache: tuple[float, float] | None) -> None:
        self._kv_cache_usage = kv_cache
        self._prefix_cache_counts = prefix_cache
        self._depth = depth
        self._scrapes += 1

    def depth_lost(self) -> bool:
        """The queue could not be scraped; ``True`` if a figure was known (now forgotten)."""
        if self._depth is None:
            return False
        self._depth = None
        return True

    def shared(self) -> dict[str, Any]:
        """Its part of :data:`txlb._cluster.backend.SHARED_FIELDS`, JSON-ready."""
        counts = self._prefix_cache_counts
        return {"engine_depth": self._depth, "engine_scrapes": self._scrapes,
                "engine": self._name, "kv_cache_usage": self._kv_cache_usage,
                "prefix_cache_counts": None if counts is None else list(counts)}

    def mirror(self, state: Mapping[str, Any]) -> None:
        """Take the supervisor's :meth:`shared` part."""
        counts = state["prefix_cache_counts"]
        self._depth = state["engine_depth"]
        self._scrapes = state["engine_scrapes"]
        self._name = state["engine"]
        self._kv_cache_usage = state["kv_cache_usage"]
        self._prefix_cache_counts = None if counts is None else tuple(counts)

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def depth(self) -> float | None:
        return self._depth

    @property
    def kv_cache_usage(self) -> float | None:
        return self._kv_cache_usage

    @property
    def prefix_cache_counts(self) -> tuple[float, float] | None:
        """The engine's prefix-cache (hits, queries) in tokens, as last scraped."""
        return self._prefix_cache_counts

    @property
    def scrapes(self) -> int:
        return self._scrapes
