"""
The virtual-clock engine of the fleet-scale model: a vLLM engine with a prefix cache.

* **Prefix cache.**  The prompt is rendered (each message's role and content, in order) and
  cut into blocks of 16 tokens (64 characters at 4 characters a token, vLLM's block size);
  each block is named by a hash chained over every block before it, so a block is shared
  only by prompts that agree up to its end.  The cache holds ``kv_cache_blocks`` blocks,
  least recently used evicted first.  A request looks its chain up when its prefill
  *starts* (the longest run of leading blocks present is its cached prefix, at most the
  prompt less one token) and its blocks enter the cache when its prefill *ends*: two
  requests prefilling the same new prefix at once both pay for it, as in vLLM.
* **Prefill.**  One prefill at a time per engine, FIFO, at ``prefill_rate`` uncached
  prompt tokens per second (compute-bound, as prefill is on a GPU), plus
  ``prefill_overhead`` seconds each: piling requests on one engine queues their prefills.
* **Batch and decode.**  At most ``max_num_seqs`` requests hold a batch slot (prefilling or
  decoding; the rest wait FIFO); decoding runs at ``decode_rate x (1 - degradation x
  running / max_num_seqs)`` tokens/s per sequence (processor sharing, on a virtual token
  clock, as :mod:`bench.policies`' engine).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.interfaces import IDelayedCall
from twisted.internet.task import Clock

from bench.prefix.workloads import CHARS_PER_TOKEN

BLOCK_TOKENS = 16
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN


def render(body: Mapping[str, Any]) -> str:
    """What the engine's chat template turns a chat body into (role and content, in order)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(f"<|{m.get('role')}|>{m.get('content')}\n" for m in messages
                       if isinstance(m, dict))
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def block_chain(text: str) -> list[int]:
    """The chained hashes of ``text``'s full blocks."""
    chain: list[int] = []
    previous = 0
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        previous = hash((previous, text[start:start + BLOCK_CHARS]))
        chain.append(previous)
    return chain


class BlockCache:
    """An LRU set of block hashes, ``capacity`` blocks at most."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, chain: Sequence[int]) -> int:
        """How many leading blocks of ``chain`` are cached (the cache is not touched)."""
        n = 0
        for block in chain:
            if block not in self._blocks:
                break
            n += 1
        return n

    def touch(self, chain: Sequence[int]) -> None:
        """``chain``'s blocks are used now: insert or refresh them, evict the oldest."""
        blocks = self._blocks
        for block in chain:
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


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
    chain: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    first_token: float | None = None
    done: float | None = None
    engine: str = ""
    context: Any = None  # the caller's (the lease)


class CachedEngine:
    """One simulated engine (see the module docstring)."""

    def __init__(self, clock: Clock, key: str, config: EngineConfig,
                 on_first_token: Callable[[Job], None], on_done: Callable[[Job], None]
                 ) -> None:
        self.clock = clock
        self.key = key
        self.config = config
        self.cache = BlockCache(config.kv_cache_blocks)
        self.on_first_token = on_first_token
        self.on_done = on_done
        self.running = 0
        self.waiting: deque[Job] = deque()
        self.prefills: deque[Job] = deque()
        self.prefilling: Job | None = None
        self.peak_in_flight = 0
        self.served = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.held_blocks = 0  # blocks of the requests in the batch
        self._vtokens = 0.0
        self._vtokens_at = 0.0
        self._finishing: list[tuple[float, int, Job]] = []
        self._timer: IDelayedCall | None = None

    @property
    def in_flight(self) -> int:
        return self.running + len(self.waiting)

    def speed(self) -> float:
        c = self.config
        return c.decode_rate * (1 - c.degradation * self.running / c.max_num_seqs)

    def _advance(self) -> None:
        now = self.clock.seconds()
        self._vtokens += self.speed() * (now - self._vtokens_at)
        self._vtokens_at = now

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
            job = self.waiting.popleft()
            self.held_blocks += -(-(job.prompt_tokens + job.output_tokens) // BLOCK_TOKENS)
            self.prefills.append(job)
        self._next_prefill()

    def _next_prefill(self) -> None:
        if self.prefilling is not None or not self.prefills:
            return
        job = self.prefilling = self.prefills.popleft()
        job.chain = block_chain(render(job.body))
        cached = min(self.cache.match(job.chain) * BLOCK_TOKENS, job.prompt_tokens - 1)
        job.cached_tokens = max(0, cached)
        self.query_tokens += job.prompt_tokens
        self.hit_tokens += job.cached_tokens
        uncached = job.prompt_tokens - job.cached_tokens
        self.clock.callLater(self.config.prefill_overhead + uncached / self.config.prefill_rate,
                             self._prefilled, job)

    def _prefilled(self, job: Job) -> None:
        self._advance()
        self.prefilling = None
        self.cache.touch(job.chain)
        job.chain = []
        job.first_token = self.clock.seconds()
        heapq.heappush(self._finishing, (self._vtokens + job.output_tokens - 1, job.index, job))
        self.on_first_token(job)
        self._next_prefill()
        self._schedule()

    def _schedule(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._finishing:
            delay = max(0.0, (self._finishing[0][0] - self._vtokens) / self.speed())
            self._timer = self.clock.callLater(delay, self._decoded)

    def _decoded(self) -> None:
        self._timer = None
        self._advance()
        finished = []
        while self._finishing and self._finishing[0][0] <= self._vtokens + 1e-6:
            finished.append(heapq.heappop(self._finishing)[2])
        now = self.clock.seconds()
        for job in finished:
            job.done = now
            self.running -= 1
            self.held_blocks -= -(-(job.prompt_tokens + job.output_tokens) // BLOCK_TOKENS)
        self._admit()
        self._schedule()
        for job in finished:
            self.on_done(job)

    def kv_usage(self) -> float:
        """
        What ``vllm:kv_cache_usage_perc`` says: the blocks the requests in the batch hold,
        as a fraction of the cache (blocks kept only for reuse do not count), at most 1.
        """
        return min(1.0, self.held_blocks / self.config.kv_cache_blocks)

    def busy(self) -> bool:
        return bool(self.running or self.waiting or self._finishing or self.prefilling)
