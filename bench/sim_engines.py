"""
The virtual-clock engines the scheduling simulations run txlb's real Router and Pool over.

Shared by the policy experiments (:mod:`bench.policies`), the priority-class bench
(:mod:`bench.classes`), the fleet-balance runs (:mod:`bench.fleet_balance`) and the
fleet-scale prefix model (:mod:`bench.prefix.engine_model`, which shares the decode batch):
each is a different experiment over the same engine, so the engine sits below them all.
The model itself is described in :mod:`bench.policies`' docstring ("The engine model").
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from twisted.internet.interfaces import IDelayedCall
from twisted.internet.task import Clock

from txlb._cluster.slots import Lease
from txlb.testing import BLOCK_TOKENS, CacheLease, PrefixCache


@dataclass(frozen=True)
class EngineClass:
    """A kind of GPU server: how many, how fast, and the weight of the weighted variant."""

    name: str
    count: int
    decode_rate: float  # tokens/s per sequence, alone in the batch
    prefill_rate: float  # prompt tokens/s
    weight: int  # BackendSpec weight in experiment B (proportional to decode_rate)


ENGINE_CLASSES: tuple[EngineClass, ...] = (
    EngineClass("fast", 4, 60.0, 8000.0, 3),
    EngineClass("medium", 2, 40.0, 5000.0, 2),
    EngineClass("slow", 2, 20.0, 2000.0, 1),
)


@dataclass(frozen=True)
class Params:
    """Everything a run depends on (besides the policy and the experiment)."""

    seed: int = 1
    requests: int = 20_000
    load: float = 0.8
    max_num_seqs: int = 32
    degradation: float = 0.3
    scrape_interval: float = 2.0
    queue_timeout: float = 30.0
    output_median: float = 200.0
    output_p99: float = 3000.0
    output_cap: int = 8000
    prompt_median: float = 600.0
    prompt_sigma: float = 0.8
    prompt_cap: int = 16000
    kv_cache_blocks: int = 0  # each engine's prefix cache, in blocks; 0: none
    block_tokens: int = BLOCK_TOKENS


Z99 = 2.3263478740408408  # standard normal quantile at 0.99


@dataclass
class Request:
    """
    One request of the workload, and what happened to it.

    ``blocks`` is the prompt as the engines' prefix cache sees it: the keys of its whole
    blocks, ``txlb.testing.block_chain(txlb.testing.render_prompt(body, chat))`` (with
    ``prompt_tokens`` its ``count_tokens``).  A chain rather than the text, so a workload
    hashes each distinct prompt once (a conversation's next turn extends the last one's
    chain with ``block_chain(text, known=...)``) and a fleet-scale run of tens of
    thousands of requests does no hashing in the engines; requests that share a prompt
    can share one tuple.  Empty: the request shares nothing with any other.
    """

    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    replica: int
    blocks: tuple[int, ...] = ()
    engine: str | None = None
    lease: Lease | None = None
    first_token: float | None = None
    done: float | None = None
    refused: bool = False
    cached_tokens: int = 0
    cache_lease: CacheLease | None = None


@dataclass(frozen=True)
class Workload:
    arrivals: tuple[tuple[float, int, int, int], ...]  # (time, prompt, output, replica)
    rate: float
    capacity: float
    mean_prompt: float
    mean_output: float


def lognormal_tokens(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


def engine_capacity(cls: EngineClass, params: Params, mean_prompt: float,
                    mean_output: float) -> float:
    """Requests/s the engine completes when its batch is kept exactly full."""
    prefill = mean_prompt / cls.prefill_rate
    decode = (mean_output - 1) / (cls.decode_rate * (1 - params.degradation))
    return params.max_num_seqs / (prefill + decode)


def make_workload(params: Params, replicas: int) -> Workload:
    """The request sequence: lengths first, then Poisson arrivals at ``load`` x capacity."""
    rng = random.Random(f"workload-{params.seed}")
    sigma = math.log(params.output_p99 / params.output_median) / Z99
    prompts = [lognormal_tokens(rng, params.prompt_median, params.prompt_sigma,
                                params.prompt_cap) for _ in range(params.requests)]
    outputs = [lognormal_tokens(rng, params.output_median, sigma, params.output_cap)
               for _ in range(params.requests)]
    mean_prompt = sum(prompts) / len(prompts)
    mean_output = sum(outputs) / len(outputs)
    capacity = sum(cls.count * engine_capacity(cls, params, mean_prompt, mean_output)
                   for cls in ENGINE_CLASSES)
    rate = params.load * capacity
    # The replica draw uses its own stream so the arrivals are the same for any replica count.
    replica_rng = random.Random(f"replicas-{params.seed}")
    now, arrivals = 0.0, []
    for prompt, output in zip(prompts, outputs, strict=True):
        now += rng.expovariate(rate)
        arrivals.append((now, prompt, output, replica_rng.randrange(replicas)))
    return Workload(tuple(arrivals), rate, capacity, mean_prompt, mean_output)


class Decoding(Protocol):
    """What a :class:`DecodeBatch` needs of a sequence it decodes."""

    index: int
    output_tokens: int
    done: float | None
    cache_lease: CacheLease | None


JobT = TypeVar("JobT", bound=Decoding)


class DecodeBatch(Generic[JobT]):
    """
    The decode half of a simulated engine, shared by this module's :class:`Engine` and the
    fleet model's (:mod:`bench.prefix.engine_model`), which differ only in how a sequence is
    admitted and prefilled.

    Decode uses a virtual token clock ``_vtokens``: the number of tokens any sequence that
    was decoding all along would have produced.  It advances at the current per-sequence
    speed (:meth:`speed`); a sequence that starts decoding at virtual time ``v`` with ``n``
    tokens to go finishes at virtual time ``v + n``, so one heap and one timer serve the
    whole batch.  A subclass sets ``clock``, ``cache`` and ``on_done``, counts ``running``
    up as it admits, calls :meth:`_start_decoding` after a prefill and defines
    :meth:`speed` and :meth:`_admit` (called whenever a batch slot frees).
    """

    clock: Clock
    cache: PrefixCache | None
    on_done: Callable[[JobT], None]

    def __init__(self) -> None:
        self.running = 0  # prefilling + decoding
        self._vtokens = 0.0
        self._vtokens_at = 0.0
        self._finishing: list[tuple[float, int, JobT]] = []
        self._timer: IDelayedCall | None = None

    def speed(self) -> float:
        """Tokens/s of each decoding sequence with the batch as it is now."""
        raise NotImplementedError

    def _admit(self) -> None:
        raise NotImplementedError

    def _advance(self) -> None:
        now = self.clock.seconds()
        self._vtokens += self.speed() * (now - self._vtokens_at)
        self._vtokens_at = now

    def _start_decoding(self, job: JobT) -> None:
        """``job``'s first token is out (the prefill made it): it decodes the rest."""
        heapq.heappush(self._finishing, (self._vtokens + job.output_tokens - 1, job.index, job))

    def _schedule(self) -> None:
        """(Re)arm the one decode timer for the next sequence to finish."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._finishing:
            delay = max(0.0, (self._finishing[0][0] - self._vtokens) / self.speed())
            self._timer = self.clock.callLater(delay, self._decoded)

    def decoding(self) -> Iterator[tuple[JobT, int]]:
        """Each sequence decoding now, with the tokens it has produced so far (its first)."""
        self._advance()
        for end, _, job in self._finishing:
            yield job, max(1, job.output_tokens - math.ceil(end - self._vtokens))

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
            if job.cache_lease is not None:
                assert self.cache is not None
                self.cache.release(job.cache_lease)
                job.cache_lease = None
        self._admit()
        self._schedule()
        for job in finished:  # may re-enter submit() through the routers' queues
            self.on_done(job)


class Engine(DecodeBatch[Request]):
    """
    One simulated vLLM engine: a batch of at most ``max_num_seqs`` sequences plus a FIFO
    waiting queue, prefill per sequence (of the prompt tokens its prefix cache, if any, does
    not hold), and decode at a shared per-sequence speed (:class:`DecodeBatch`).
    """

    def __init__(self, clock: Clock, key: str, cls: EngineClass, params: Params,
                 on_first_token: Callable[[Request], None],
                 on_done: Callable[[Request], None]) -> None:
        super().__init__()
        self.clock = clock
        self.key = key
        self.cls = cls
        self.max_num_seqs = params.max_num_seqs
        self.degradation = params.degradation
        self.on_first_token = on_first_token
        self.on_done = on_done
        self.waiting: deque[Request] = deque()
        self.peak_waiting = 0
        self.peak_running = 0
        self.cache = (PrefixCache(params.kv_cache_blocks, params.block_tokens)
                      if params.kv_cache_blocks else None)
        self.served = 0

    def kv_usage(self) -> float:
        """
        What the engine would report as ``vllm:kv_cache_usage_perc``, as the simulated vLLM
        does: the fraction of prefix-cache blocks pinned by running requests, or without a
        cache the fraction of batch slots taken.
        """
        if self.cache is not None:
            return self.cache.usage
        return min(1.0, self.running / self.max_num_seqs)

    def speed(self) -> float:
        return self.cls.decode_rate * (1 - self.degradation * self.running / self.max_num_seqs)

    def submit(self, request: Request) -> None:
        """A request arrives from the balancer."""
        self._advance()
        request.engine = self.key
        self.served += 1
        self.waiting.append(request)
        self._admit()
        self.peak_waiting = max(self.peak_waiting, len(self.waiting))
        self._schedule()

    def _admit(self) -> None:
        while self.waiting and self.running < self.max_num_seqs:
            request = self.waiting.popleft()
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
            if self.cache is not None and request.blocks:
                request.cache_lease = self.cache.acquire(request.blocks, request.prompt_tokens)
                request.cached_tokens = request.cache_lease.cached_tokens
            self.clock.callLater(
                (request.prompt_tokens - request.cached_tokens) / self.cls.prefill_rate,
                self._prefilled, request)

    def _prefilled(self, request: Request) -> None:
        self._advance()
        request.first_token = self.clock.seconds()
        self._start_decoding(request)
        self.on_first_token(request)
        self._schedule()


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def run_to_the_end(clock: Clock, outstanding: list[int]) -> None:
    """
    Run a simulation on ``clock`` until no request is ``outstanding[0]`` and nothing is
    scheduled, jumping straight to each next event: exact, whatever the float rounding of a
    delta would have made of ``clock.advance(delta)``.
    """
    while outstanding[0] > 0 or clock.calls:
        if not clock.calls:
            raise RuntimeError("simulation stalled with requests outstanding")
        clock.rightNow = max(clock.rightNow, clock.calls[0].getTime())
        clock.advance(0)
