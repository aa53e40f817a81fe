"""
What txlb knows of each inference engine's ``/metrics``: which engine a backend runs, its
queue (running + waiting requests), its KV-cache usage and its prefix-cache counters.

Engines name the same facts differently (vLLM ``vllm:num_requests_running``, llama.cpp
``llamacpp:requests_processing``, ...).  The engine is recognised once, from the prefixes of
the metric names it exports, and its own names are read from then on; a backend that exports
none of them is ``unknown``, and policies that want its queue fall back to local counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

#: what :attr:`EngineReading.name <txlb._cluster.backend_engine.EngineReading.name>` says of
#: a backend whose ``/metrics`` holds no engine txlb knows (or that has none)
UNKNOWN = "unknown"


@attrs.frozen
class Engine:
    """One engine's metric names."""

    name: str
    #: every metric the engine exports starts so
    prefix: str
    running: str
    waiting: str
    #: KV-cache usage as a fraction (1 = full), newest name first
    kv_cache: tuple[str, ...] = ()
    #: the prefix cache's counters, in prompt tokens: looked up, and found cached
    prefix_queries: tuple[str, ...] = ()
    prefix_hits: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.running, self.waiting, *self.kv_cache, *self.prefix_queries,
                *self.prefix_hits)


ENGINES = (
    Engine("vllm", "vllm:", "vllm:num_requests_running", "vllm:num_requests_waiting",
           ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
           ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries",
            "vllm:gpu_prefix_cache_queries_total"),
           ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits",
            "vllm:gpu_prefix_cache_hits_total")),
    Engine("sglang", "sglang:", "sglang:num_running_reqs", "sglang:num_queue_reqs",
           ("sglang:token_usage",)),
    Engine("llamacpp", "llamacpp:", "llamacpp:requests_processing",
           "llamacpp:requests_deferred", ("llamacpp:kv_cache_usage_ratio",)),
    Engine("tgi", "tgi_", "tgi_batch_current_size", "tgi_queue_size"),
)
BY_NAME = {engine.name: engine for engine in ENGINES}


@attrs.frozen
class Reading:
    """
    What one scrape says: the queue (``None`` when not exported), KV-cache usage, and the
    prefix cache's (hits, queries) counters in tokens when the engine exports both.
    """

    running: float | None = None
    waiting: float | None = None
    kv_cache: float | None = None
    prefix_cache: tuple[float, float] | None = None


def _samples(text: str) -> Iterable[tuple[str, str]]:
    """(metric name, the rest of the line) of every sample line of Prometheus text."""
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        cut = len(line)
        for stop in ("{", " "):
            at = line.find(stop)
            if 0 <= at < cut:
                cut = at
        yield line[:cut], line[cut:]


def _value(rest: str) -> float | None:
    """A sample's value (after the labels), or ``None`` when it is no finite number."""
    if rest.startswith("{"):
        end = rest.rfind("}")
        if end < 0:
            return None
        rest = rest[end + 1:]
    parts = rest.split()
    if not parts:
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _collect(text: str, names: Iterable[str]) -> tuple[dict[str, float], dict[str, int]]:
    """
    In one pass: the sum over all samples (every label set: vLLM exports one per engine
    core, SGLang one per rank) of each metric in ``names`` that ``text`` has, and how many
    samples each had.
    """
    wanted = set(names)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for name, rest in _samples(text):
        if name in wanted:
            value = _value(rest)
            if value is not None:
                sums[name] = sums.get(name, 0.0) + value
                counts[name] = counts.get(name, 0) + 1
    return sums, counts


def prometheus_sum(text: str, name: str) -> float | None:
    """The sum of every sample of metric ``name`` in Prometheus text (``None`` if absent)."""
    return _collect(text, (name,))[0].get(name)


def recognise(text: str) -> Engine | None:
    """
    The engine whose metric prefix the ``/metrics`` text shows (the first in
    :data:`ENGINES` order when a sidecar mixes several), or ``None``.
    """
    seen = set()
    for name, _rest in _samples(text):
        for engine in ENGINES:
            if name.startswith(engine.prefix):
                seen.add(engine.name)
    return next((engine for engine in ENGINES if engine.name in seen), None)


def read(text: str, engine: Engine) -> Reading:
    """
    ``engine``'s queue and KV-cache usage from its ``/metrics``.  KV usage is averaged over
    its samples (one per engine core or rank) -- a fraction, whatever the count; the queue
    counts add up.
    """
    sums, counts = _collect(text, engine.names)
    kv_cache = None
    for name in engine.kv_cache:
        if name in sums:
            kv_cache = min(1.0, max(0.0, sums[name] / counts[name]))
            break
    running = sums.get(engine.running)
    waiting = sums.get(engine.waiting)
    if not math.isfinite((running or 0.0) + (waiting or 0.0)):
        # finite samples too big to add up (a hostile or broken exporter): no queue read,
        # rather than an infinite one (which is not even JSON in /status)
        running = waiting = None
    return Reading(
        running=None if running is None else max(0.0, running),
        waiting=None if waiting is None else max(0.0, waiting),
        kv_cache=kv_cache,
        prefix_cache=_counters(sums, engine),
    )


def _counters(sums: dict[str, float], engine: Engine) -> tuple[float, float] | None:
    """(hits, queries) under the first names the engine exports, when both are sane."""
    hits = next((sums[name] for name in engine.prefix_hits if name in sums), None)
    queries = next((sums[name] for name in engine.prefix_queries if name in sums), None)
    if hits is None or queries is None or not math.isfinite(hits + queries):
        return None
    if hits < 0 or queries < 0 or hits > queries:
        return None  # not what counters of a cache can say: ignored
    return hits, queries
