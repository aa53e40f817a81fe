"""
The virtual-clock engine of the fleet-scale model: a vLLM engine with a prefix cache.

* **Prefix cache.**  The simulators' own model, :class:`txlb.testing.PrefixCache` (the one
  ``twistd vllm-sim --kv-cache-blocks`` and :mod:`bench.policies` use): the prompt rendered
  as a chat template would (:func:`txlb.testing.render_prompt`), cut into blocks of 16
  tokens at 4 characters a token, each block's key chained over the blocks before it;
  ``kv_cache_blocks`` blocks, the running requests' blocks pinned, the others evicted
  least recently used first.  A request acquires its chain when its prefill *starts* (the
  longest run of leading blocks present is its cached prefix) and releases it at its end.
* **Prefill.**  One prefill at a time per engine, FIFO, at ``prefill_rate`` uncached
  prompt tokens per second (prefill is compute-bound on a GPU), plus ``prefill_overhead``
  seconds each.  This is where this model departs from :mod:`bench.policies`' engine,
  whose prefills run side by side without slowing each other: routing many requests to
  one engine must cost their time to first token, or piling up would look free.
* **Batch and decode.**  At most ``max_num_seqs`` requests hold a batch slot (prefilling or
  decoding; the rest wait FIFO); decoding runs at ``decode_rate x (1 - degradation x
  running / max_num_seqs)`` tokens/s per sequence (processor sharing, on a virtual token
  clock: :class:`bench.sim_engines.DecodeBatch`, shared with that module's engine).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from twisted.internet.task import Clock

from bench.sim_engines import DecodeBatch
from txlb.testing import BLOCK_TOKENS, CacheLease, PrefixCache, render_prompt
from txlb.testing import block_chain as _block_chain


def render(body: Mapping[str, Any]) -> str:
    """What the engine prefills for a chat (or completions) body."""
    return render_prompt(body, chat="messages" in body)


def block_chain(text: str) -> tuple[int, ...]:
    """The chained keys of ``text``'s whole blocks (vLLM's block size)."""
    return _block_chain(text, BLOCK_TOKENS)


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32
    decode_rate: float = 30.0
    degradation: float = 0.3
    prefill_rate: float = 20000.0
    prefill_overhead: float = 0.005
    kv_cache_blocks: int = 2048


@dataclass
class Job:
    """One request on an engine."""

    index: int
    arrival: float
    body: Mapping[str, Any]
    prompt_tokens: int
    output_tokens: int
    chain: tuple[int, ...] = ()
    cached_tokens: int = 0
    cache_lease: CacheLease | None = None
    first_token: float | None = None
    done: float | None = None
    engine: str = ""
    context: Any = None  # the caller's (the lease)


class CachedEngine(DecodeBatch[Job]):
    """One simulated engine (see the module docstring)."""

    cache: PrefixCache  # always one, unlike bench.policies' engine

    def __init__(self, clock: Clock, key: str, config: EngineConfig,
                 on_first_token: Callable[[Job], None], on_done: Callable[[Job], None]
                 ) -> None:
        super().__init__()
        self.clock = clock
        self.key = key
        self.config = config
        self.cache = PrefixCache(config.kv_cache_blocks, BLOCK_TOKENS)
        self.on_first_token = on_first_token
        self.on_done = on_done
        self.waiting: deque[Job] = deque()
        self.prefills: deque[Job] = deque()
        self.prefilling: Job | None = None
        self.peak_in_flight = 0
        self.served = 0

    @property
    def in_flight(self) -> int:
        return self.running + len(self.waiting)

    def speed(self) -> float:
        c = self.config
        return c.decode_rate * (1 - c.degradation * self.running / c.max_num_seqs)

    def submit(self, job: Job) -> None:
        self._advance()
        job.engine = self.key
        self.served += 1
        self.waiting.append(job)
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self._admit()
        self._schedule()

    def _admit(self) -> None:
        while self.waiting and self.running < self.config.max_num_seqs:
            self.running += 1
            self.prefills.append(self.waiting.popleft())
        self._next_prefill()

    def _next_prefill(self) -> None:
        if self.prefilling is not None or not self.prefills:
            return
        job = self.prefilling = self.prefills.popleft()
        if not job.chain:
            job.chain = block_chain(render(job.body))
        job.cache_lease = self.cache.acquire(job.chain, job.prompt_tokens)
        job.cached_tokens = job.cache_lease.cached_tokens
        uncached = job.prompt_tokens - job.cached_tokens
        self.clock.callLater(self.config.prefill_overhead + uncached / self.config.prefill_rate,
                             self._prefilled, job)

    def _prefilled(self, job: Job) -> None:
        self._advance()
        self.prefilling = None
        job.chain = ()
        job.first_token = self.clock.seconds()
        self._start_decoding(job)
        self.on_first_token(job)
        self._next_prefill()
        self._schedule()

    def kv_usage(self) -> float:
        """What ``vllm:kv_cache_usage_perc`` says: the share of blocks running requests pin."""
        return self.cache.usage

    @property
    def query_tokens(self) -> int:
        return self.cache.queries

    @property
    def hit_tokens(self) -> int:
        return self.cache.hits

    def busy(self) -> bool:
        return bool(self.running or self.waiting or self._finishing or self.prefilling)
