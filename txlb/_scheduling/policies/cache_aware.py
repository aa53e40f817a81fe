"""
``--policy cache-aware``: send a prompt where its prefix is cached, without piling up.

Each request's prompt becomes a chain of keyed block hashes (:mod:`txlb._scheduling.prefix`);
each backend has an index of the blocks txlb sent it, no larger than its engine's learned
capacity (:mod:`txlb._scheduling.prefix_index`).  The choice, among the eligible backends:

1. No backend holds any of the prompt's blocks: **least-conn, exactly** (the same smooth
   weighted tie-breaking), so traffic without shared prefixes is balanced as by
   ``--policy least-conn``.
2. Otherwise, only backends under the bounded-load cap ``ceil(1.25 x fair share)`` of the
   fleet's in-flight requests (as ``--affinity``) compete, and each scores its *gain*: the
   blocks it holds (scaled by its trust score; nothing while its engine reports a KV cache
   above :data:`KV_SATURATED` full, where vLLM starts preempting) less the blocks placing
   the rest of the prompt there would evict (what does not fit in its room).  The best gain
   wins, ties by least-conn.  When no gain is positive -- a new prefix, or one whose home is
   full -- the least-loaded backend with room for it takes it, so tenants spread over the
   fleet's caches instead of clustering on the engine that happens to share a header.
   While a backend is idle and another has more than one request in flight, only the idle
   ones compete: a hot prefix would otherwise keep the one backend that lacks it idle.

What the engine reports afterwards closes the loop (:meth:`CacheAware.observe`): each
outcome is matched to the prediction made for its request, and corrects the backend's
capacity estimate and trust.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
from zope.interface import implementer

from txlb._config.errors import ConfigError
from txlb._config.option import OptionSpec
from txlb._config.values import parse_nonnegative_int, parse_number
from txlb._scheduling.policies import IPreparesRequests, Policy, PolicyFactory
from txlb._scheduling.policies._ties import WeightedTies
from txlb._scheduling.policies.least_conn import load
from txlb._scheduling.prefix import DEFAULT_BLOCK_CHARS, DEFAULT_MAX_BLOCKS, PrefixHasher
from txlb._scheduling.prefix_index import (
    DEFAULT_CAPACITY_BLOCKS,
    DEFAULT_MAX_ENTRIES,
    BackendIndex,
    FleetIndex,
)
from txlb._scheduling.request import ANY_REQUEST, RoutingRequest

if TYPE_CHECKING:
    import random

    from twisted.internet.interfaces import IReactorTime

    from txlb._cluster.backend import Backend
    from txlb._scheduling.outcome import RequestOutcome

#: The engine's KV cache usage (``vllm:kv_cache_usage_perc``) above which its matches stop
#: attracting requests: near full, vLLM preempts running requests to make room.
KV_SATURATED = 0.9
#: Predictions kept for requests in flight (an outcome that never comes -- a request
#: refused after routing -- is forgotten when its request is, or past this many).
MAX_PENDING = 65_536
#: ``--cache-load``'s default: the bounded-load factor of ``--affinity``'s ring.
DEFAULT_LOAD_FACTOR = 1.25


def load_bound(backend: Backend, candidates: Sequence[Backend], factor: float) -> int:
    """
    The most in-flight requests ``backend`` may hold and still be preferred for its cache:
    ``ceil(factor x its weight's share of the fleet's in-flight, counting this request)``
    -- the bound of ``--affinity``'s ring (:class:`txlb._scheduling.affinity.BoundedLoadRing`).
    """
    total_weight = sum(b.effective_weight for b in candidates)
    in_flight = sum(b.counts.active for b in candidates) + 1
    return math.ceil(factor * in_flight * backend.effective_weight / total_weight)


@attrs.define(slots=True)
class _Prediction:
    request: weakref.ref[RoutingRequest]
    backend: str
    matched: int
    chars: int
    #: the backend's index (weakly: a removed backend's goes with it), the blocks this
    #: request added to it and the cached tokens it was predicted to find there -- what
    #: a retry elsewhere takes back (see CacheAware._predict)
    index: weakref.ref[BackendIndex]
    added: list[int]
    expected: float


@implementer(IPreparesRequests)
class CacheAware(Policy):
    """The longest trusted, room-respecting prefix match under a bounded load; else least-conn."""

    name = "cache-aware"
    #: KV cache usage and queue come from the engines' /metrics (scraped with the probes)
    needs_engine_metrics = True

    def __init__(self, block_chars: int = DEFAULT_BLOCK_CHARS,
                 max_blocks: int = DEFAULT_MAX_BLOCKS,
                 max_entries: int = DEFAULT_MAX_ENTRIES,
                 capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
                 load_factor: float = DEFAULT_LOAD_FACTOR,
                 secret: bytes | None = None) -> None:
        if load_factor < 1.0:
            raise ValueError("the load factor must be at least 1")
        self.hasher = PrefixHasher(block_chars, max_blocks, secret)
        self.index = FleetIndex(max_entries, capacity_blocks)
        self.load_factor = load_factor
        self._ties = WeightedTies()
        self._pending: OrderedDict[int, _Prediction] = OrderedDict()
        #: told of every chain sent and where (``--shared-state`` publishes it to the other
        #: replicas, :mod:`txlb._shared.prefixes`): called on the request's path, so cheap
        self.on_sent: Callable[[Backend, Sequence[int]], object] | None = None

    # -- sharing the index ----------------------------------------------------------------

    def tell_sends(self, told: Callable[[Backend, Sequence[int]], object] | None) -> None:
        """Tell ``told`` of every chain sent and where (``None``: no one)."""
        self.on_sent = told

    def use_secret(self, secret: bytes) -> None:
        """
        Hash with ``secret`` from now on (the fleet's, so every replica names a prompt's
        blocks alike).  What the index lists was named with the old key and can never
        match again, nor be renamed (the index keeps hashes, not prompts): it goes.  The
        capacities and trust learned stay -- they are the engines'.
        """
        self.hasher = PrefixHasher(self.hasher.block_chars, self.hasher.max_blocks, secret)
        self.index.forget_blocks()

    def heard(self, backend: Backend, chain: Sequence[int]) -> None:
        """Another replica sent ``chain`` to ``backend``: listed as if sent from here."""
        self.index.sent(backend, chain)

    # -- choosing -------------------------------------------------------------------------

    def prepare(self, request: RoutingRequest) -> None:
        """Hash the prompt before the router takes the (with ``--workers``, shared) lock."""
        self._key(request)

    def _key(self, request: RoutingRequest) -> tuple[list[int], int]:
        """The request's chain and rendered length, worked out once per request."""
        if request.json is None:  # nothing to hash (and ANY_REQUEST is shared by all)
            return [], 0
        key = request.memo.get(self.hasher)
        if key is None:
            key = request.memo[self.hasher] = self.hasher.key(request.json, request.model,
                                                              request.budget)
        return key  # type: ignore[return-value]

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        chain, chars = self._key(request)
        if not chain:
            return self._ties.best(candidates, load)
        if chars >= self.hasher.block_chars * self.hasher.max_blocks:
            chars = 0  # rendering stopped short: no measure of characters per token
        matches = [self.index.match(b, chain) for b in candidates]
        if not any(matches):
            chosen, matched = self._ties.best(candidates, load), 0
        else:
            chosen, matched = self._by_gain(candidates, matches, len(chain))
        index = self.index.of(chosen)
        index.counted(chosen.engine.prefix_cache_counts, self.hasher.block_chars)
        expected = index.predicted(matched, self.hasher.block_chars)
        self.index.sent(chosen, chain)
        if self.on_sent is not None:
            self.on_sent(chosen, chain)
        self._predict(request, chosen, _Prediction(
            weakref.ref(request), chosen.key, matched, chars, weakref.ref(index),
            chain[matched:], expected))
        return chosen

    def _by_gain(self, candidates: Sequence[Backend], matches: Sequence[int],
                 blocks: int) -> tuple[Backend, int]:
        under = [(b, m) for b, m in zip(candidates, matches, strict=True)
                 if b.counts.active < load_bound(b, candidates, self.load_factor)]
        if not under:  # cannot happen (someone is under ceil(c x share)); be safe
            under = list(zip(candidates, matches, strict=True))
        idle = [(b, m) for b, m in under if b.counts.active == 0]
        if idle and any(b.counts.active > 1 for b in candidates):
            # An idle backend beside busy ones takes the request, with or without the prefix:
            # otherwise a hot prefix held everywhere but there keeps it idle for good (each
            # holder stays under the bound as the fleet's in-flight grows), and the others
            # queue what it could be doing.
            under = idle
        gains: list[tuple[Backend, int, float, int]] = []
        for backend, matched in under:
            index = self.index.get(backend)
            room = index.room if index is not None else self.index.default_capacity
            trust = index.trust if index is not None else 1.0
            usage = backend.engine.kv_cache_usage
            worth = 0.0 if usage is not None and usage >= KV_SATURATED else matched * trust
            overflow = max(0, blocks - matched - room)
            gains.append((backend, matched, worth - overflow, overflow))
        best = max(gain for _, _, gain, _ in gains)
        if best > 0:
            pool = [(b, m) for b, m, gain, _ in gains if gain >= best - 1e-9]
        else:
            pool = [(b, m) for b, m, _, overflow in gains if overflow == 0] or [
                (b, m) for b, m, _, _ in gains]
        chosen = self._ties.best([b for b, _ in pool], load)
        return chosen, dict((b.key, m) for b, m in pool)[chosen.key]

    def _predict(self, request: RoutingRequest, backend: Backend,
                 prediction: _Prediction) -> None:
        """
        Keep ``prediction`` for ``request`` until its outcome.  A request chosen for again
        is a retry (the backend it left refused it, or answered 502/503): that backend
        never prefilled it, so the blocks it added there and the hits predicted there are
        taken back -- left, they would be matched by the next request of its prefix, and
        that engine's honest "nothing cached" read as an eviction.
        """
        key = id(request)
        pending = self._pending
        earlier = pending.get(key)
        if (earlier is not None and earlier.request() is request
                and earlier.backend != backend.key):
            left = earlier.index()
            if left is not None:
                self.index.withdraw(left, earlier.added, earlier.expected)

        def forget(ref: weakref.ref[RoutingRequest]) -> None:
            entry = pending.get(key)
            if entry is not None and entry.request is ref:
                del pending[key]

        prediction.request = weakref.ref(request, forget)
        pending[key] = prediction
        pending.move_to_end(key)
        while len(pending) > MAX_PENDING:
            pending.popitem(last=False)

    # -- learning -------------------------------------------------------------------------

    def observe(self, backend: Backend, outcome: RequestOutcome) -> None:
        """
        Match the outcome to the prediction made for its request on this backend, and let
        that backend's index learn from what the engine reported (nothing when it did not).
        """
        request = getattr(outcome, "routing", None)
        if request is None:
            return
        prediction = self._pending.get(id(request))
        if prediction is None or prediction.request() is not request:
            return
        del self._pending[id(request)]
        if prediction.backend != backend.key:
            return  # retried elsewhere after the prediction: not this backend's answer
        self.index.of(backend).learned(
            self.hasher.block_chars, prediction.chars, prediction.matched,
            outcome.prompt_tokens, outcome.cached_prompt_tokens, self.index.max_entries)

    def describe(self, backend: Backend) -> Mapping[str, object]:
        index = self.index.get(backend)
        if index is None:  # nothing sent there yet: what a fresh index would say
            index = BackendIndex(self.index.default_capacity)
        return {"prefix_cache": index.describe()}


# -- its options: --cache-block, --cache-entries, --cache-load --------------------------


def parse_cache_block(option: str, value: object) -> int:
    """Characters per hashed block: a whole number from 16 to 65536."""
    number = parse_nonnegative_int(option, value)
    if not 16 <= number <= 65536:
        raise ConfigError(f"--{option}: {value!r} must be from 16 to 65536 characters")
    return number


def parse_cache_entries(option: str, value: object) -> int:
    """The index's cap in entries: a whole number, at least 1,000."""
    number = parse_nonnegative_int(option, value)
    if number < 1000:
        raise ConfigError(f"--{option}: {value!r} must be at least 1000")
    return number


def parse_cache_load(option: str, value: object) -> float:
    """The bounded-load factor: a number from 1 (strict balance) to 100."""
    factor = parse_number(option, value)
    if not 1.0 <= factor <= 100.0:
        raise ConfigError(f"--{option}: {value!r} must be a number from 1 to 100")
    return factor


#: What the option table lists for this policy (after ``--unknown-model``, in this order).
OPTIONS = (
    OptionSpec("cache-block", DEFAULT_BLOCK_CHARS, parse_cache_block,
               "--policy cache-aware: characters per hashed prompt block (16 to 65536; "
               "256 is ~64 tokens).", "LB_CACHE_BLOCK"),
    OptionSpec("cache-entries", DEFAULT_MAX_ENTRIES, parse_cache_entries,
               "--policy cache-aware: prompt blocks remembered over all backends "
               "(1,000 or more; ~116 bytes each).", "LB_CACHE_ENTRIES"),
    OptionSpec("cache-load", DEFAULT_LOAD_FACTOR, parse_cache_load,
               "--policy cache-aware: a backend above this many times its fair share of "
               "the in-flight requests is passed over for its cache (as --affinity's 1.25).",
               "LB_CACHE_LOAD"),
)


def build(clock: IReactorTime, rng: random.Random, values: Mapping[str, Any]) -> CacheAware:
    """The policy with ``--cache-block``, ``--cache-entries`` and ``--cache-load``."""
    return CacheAware(block_chars=values["cache_block"], max_entries=values["cache_entries"],
                      load_factor=values["cache_load"])


factory = PolicyFactory(
    CacheAware.name, build,
    "the backend already holding the longest prefix of the prompt, within 1.25x of a fair "
    "share of the load and its cache's room; least-conn when none does",
    nginx="least_conn;  # --policy cache-aware: nginx reads no request bodies, so it cannot "
          "route by the prompt's prefix; least_conn is what cache-aware does for prompts no "
          "backend holds",
    rank=70, options=OPTIONS)
