"""
Which scheduling policy should txlb use in front of heterogeneous LLM engines?

A deterministic discrete-event simulation that drives txlb's *real* scheduling code --
:class:`txlb._cluster.pool.Pool`, :class:`txlb._scheduling.router.Router` and the policies
made by :func:`txlb._scheduling.policies.registry.make_policy` -- on a
:class:`twisted.internet.task.Clock`.  There is no real time, no socket and no HTTP: only the
engines behind the balancer are modelled.

The engine model (one per backend)
----------------------------------
Each simulated engine behaves like a vLLM server, simplified:

* **A batch of at most ``max_num_seqs`` sequences** ("running"); a request that arrives
  when the batch is full waits in the engine's own FIFO queue ("waiting") and joins the
  batch as soon as a sequence finishes -- the ``vllm:num_requests_running`` /
  ``vllm:num_requests_waiting`` pair that the ``queue-depth`` policy scrapes.
* **Prefill.**  A sequence that joins the batch first spends ``prompt_tokens /
  prefill_rate`` seconds in prefill, then emits its first token.  Prefill of different
  sequences does not contend (each has its own timer) and does not slow decoding; a
  prefilling sequence does occupy a batch slot.
* **Decode.**  Every decoding sequence on an engine advances at the same per-sequence
  speed ``decode_rate * (1 - degradation * running / max_num_seqs)`` tokens/s, where
  ``running`` counts the whole batch (prefilling sequences included): with the default
  degradation of 0.3, a full batch decodes each sequence 30 % slower than a lone one, so
  an engine's total throughput still rises with batch size.  The speed is recomputed
  whenever the batch changes (processor sharing on a "virtual token clock").  A request
  finishes when it has produced ``output_tokens`` tokens (the first comes from prefill).
* **Prefix cache (off unless ``Params.kv_cache_blocks`` is set).**  The same model as the
  simulated vLLM's, :class:`txlb.testing.PrefixCache`: a request that carries its prompt's
  block chain (``Request.blocks``) looks it up when it joins the batch, pins its blocks
  while it runs, and prefills only the tokens not found (``Request.cached_tokens``); the
  blocks stay cached, least recently used first out, after it ends.  The experiments below
  carry no prompts, so the cache changes nothing in them.
* No KV-cache limit on admission, no preemption, no chunked prefill, no network time; the
  balancer's own overhead is zero.

TTFT is measured as the real balancer measures it: from the request's arrival at the
balancer to its first token, i.e. balancer queue wait + engine queue wait + prefill.
Completion time is arrival to last token.

The balancer side
-----------------
One :class:`~txlb._cluster.pool.Pool` + :class:`~txlb._scheduling.router.Router` + policy per
balancer replica, exactly as :mod:`txlb._balancer` wires them.  ``router.acquire()`` gives a lease;
the request goes to the lease's engine, and ``lease.release()`` is called once when its
last token is out.  As in the bookkeeper (``txlb._records.bookkeeper.policy_learns``), the
``latency`` policy is told the request's TTFT (``policy.observe``) when the request *ends*.
For ``queue-depth`` each replica scrapes every engine's running/waiting counts every
``scrape_interval`` seconds (like the health prober) into ``pool.set_engine_depth``; the
replicas' scrape phases are staggered evenly over the interval.  Health is perfect: no
backend ever goes down.

The workload
------------
Poisson arrivals; output lengths lognormal (median 200 tokens, p99 about 3000, capped at
8000, at least 1), prompt lengths lognormal (median 600 tokens, capped at 16000).  The
arrival rate is ``load`` times the fleet's capacity, where an engine's capacity is
``max_num_seqs / (mean prefill time + mean decode time at a full batch)`` requests/s,
computed from the generated workload itself -- the throughput the fleet reaches only if
every engine is kept exactly full; a real scheduler cannot quite do that, so the
effective utilisation is somewhat above ``load``.
The same request sequence (arrival times, lengths, replica choice) is replayed for every
policy; every random draw comes from ``random.Random`` seeded from ``--seed``.  All
requests are measured, including the cold start (no warm-up is discarded).

Experiments
-----------
A. one balancer, all weights 1 (what most users configure), ``max_conns`` 0 (no cap);
B. the same with weights proportional to decode speed (3 / 2 / 1);
C. one balancer, weights 1, ``max_conns = max_num_seqs``: the excess waits in the
   balancer's FIFO queue (``queue_timeout`` 30 s, the only source of 503s) rather than
   inside the engines;
D. three balancer replicas over the same engines, each arrival to a random replica,
   weights 1, no cap: each replica's pool sees only its own in-flight requests.

Each experiment runs every policy.  Besides the main tables (``--seed``, ``--load``) the
report repeats all four experiments over ``--seeds`` seeds (median and range, and each
policy's rank per seed), runs A, C and D at the ``--loads``, and has a diagnostics table
of where each policy puts the requests (time-averaged requests per engine, and how
unevenly it loads the four identical fast engines), including two what-if runs of the
``latency`` policy fed its sample at the first token rather than at the end.  A
"Recommendation" section is generated from those numbers.

Run from the repository root::

    python -m bench.policies              # 152 runs of 20000 requests: ~75 s on 2 cores
    python -m bench.policies --seeds 1 --loads ''   # main tables only: ~15 s
    python -m bench.policies --replicas 2,4,8 --publish-delay 0,0.01,0.1,1
        # instead: N replicas over one fleet, independent or sharing their in-flight
        # counts (bench.fleet_balance), to bench/results/scale-out.md: ~3 min on 2 cores
    python -m bench.policies --help

Tables go to standard output and ``bench/results/policies.md``, the plot to
``bench/results/policies.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import heapq
import math
import os
import platform
import random
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from txlb._cluster.pool import Pool
from txlb._cluster.slots import Lease
from txlb._config import BackendSpec
from txlb._records.outcome import RequestOutcome
from txlb._scheduling.policies import IPolicy
from txlb._scheduling.policies.registry import BUILT_IN, make_policy
from txlb._scheduling.router import Router, RoutingError
from txlb.testing import BLOCK_TOKENS, CacheLease, PrefixCache

POLICY_NAMES = tuple(factory.name for factory in BUILT_IN)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


# -- parameters -------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Experiment:
    key: str
    title: str
    replicas: int
    weighted: bool
    capped: bool
    policies: tuple[str, ...] = POLICY_NAMES


EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment("A", "One balancer, all weights 1, no max_conns", 1, False, False),
    Experiment("B", "One balancer, weights 3/2/1 (proportional to decode speed), "
               "no max_conns", 1, True, False),
    Experiment("C", "One balancer, all weights 1, max_conns = max_num_seqs (queue in the "
               "balancer, queue_timeout 30 s)", 1, False, True),
    Experiment("D", "Three balancer replicas (random spraying), all weights 1, "
               "no max_conns", 3, False, False),
)

Z99 = 2.3263478740408408  # standard normal quantile at 0.99


# -- the workload -----------------------------------------------------------------------------


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


# -- the engines ------------------------------------------------------------------------------


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


# -- one run ----------------------------------------------------------------------------------


@dataclass
class RunResult:
    experiment: str
    policy: str
    completed: int
    refused: int
    mean_completion: float
    p99_completion: float
    mean_ttft: float
    p99_ttft: float
    mean_balancer_wait: float
    peak_waiting: dict[str, int]  # engine class -> max over its engines
    share: dict[str, float]  # engine class -> fraction of requests served
    in_flight: dict[str, float]  # engine class -> time-averaged requests per engine
    fast_spread: float  # mean (max - min) requests among the fast engines, at arrivals
    sim_seconds: float
    wall_seconds: float
    seed: int = 0
    load: float = 0.0
    observe_at: str = "end"

    @property
    def peak_waiting_max(self) -> int:
        return max(self.peak_waiting.values())


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def specs_for(experiment: Experiment,
              params: Params) -> tuple[tuple[BackendSpec, EngineClass], ...]:
    specs = []
    port = 8000
    for cls in ENGINE_CLASSES:
        for _ in range(cls.count):
            port += 1
            specs.append((BackendSpec(
                "10.0.0.1", port,
                weight=cls.weight if experiment.weighted else 1,
                max_conns=params.max_num_seqs if experiment.capped else 0,
            ), cls))
    return tuple(specs)


def run(experiment: Experiment, policy_name: str, params: Params,
        observe_at: str = "end") -> RunResult:
    """
    Replay the workload through ``experiment.replicas`` balancers using ``policy_name``.

    ``observe_at`` is when the ``latency`` policy is given a request's TTFT: ``"end"``
    (when the request ends, what txlb does) or ``"first-token"`` (a what-if, for the
    diagnostics only).
    """
    started_wall = time.perf_counter()
    clock = Clock()
    workload = make_workload(params, experiment.replicas)
    specs = specs_for(experiment, params)
    requests: list[Request] = []
    outstanding = [len(workload.arrivals)]

    pools: list[Pool] = []
    routers: list[Router] = []
    policies: list[IPolicy] = []
    for replica in range(experiment.replicas):
        pool = Pool(tuple(spec for spec, _ in specs), clock=clock)
        policy = make_policy(policy_name, clock,
                             random.Random(f"policy-{params.seed}-{policy_name}-{replica}"))
        pools.append(pool)
        routers.append(Router(pool, policy, clock, queue_timeout=params.queue_timeout,
                              retry_after=1, rng=random.Random(f"router-{params.seed}")))
        policies.append(policy)

    def observe(request: Request) -> None:
        # what txlb tells every policy of an answered request (only latency learns from it)
        assert request.lease is not None and request.first_token is not None
        backend = request.lease.backend
        ttfb = request.first_token - request.arrival
        policies[request.replica].observe(backend, RequestOutcome(
            backend=backend.key, status=200, answered=True, ttfb=ttfb,
            duration=clock.seconds() - request.arrival))

    def first_token(request: Request) -> None:
        if observe_at == "first-token":
            observe(request)

    def done(request: Request) -> None:
        lease = request.lease
        assert lease is not None
        if observe_at == "end":
            observe(request)
        outstanding[0] -= 1
        lease.release()

    engines = {spec.key: Engine(clock, spec.key, cls, params, first_token, done)
               for spec, cls in specs}
    fast_engines = [e for e in engines.values() if e.cls == ENGINE_CLASSES[0]]
    spreads: list[int] = []

    def leased(lease: Lease, request: Request) -> None:
        request.lease = lease
        engines[lease.backend.key].submit(request)

    def refused(failure: Failure, request: Request) -> None:
        failure.trap(RoutingError)
        request.refused = True
        outstanding[0] -= 1

    def arrive(index: int) -> None:
        when, prompt, output, replica = workload.arrivals[index]
        request = Request(index, when, prompt, output, replica)
        requests.append(request)
        depths = [e.running + len(e.waiting) for e in fast_engines]
        spreads.append(max(depths) - min(depths))
        if index + 1 < len(workload.arrivals):
            clock.callLater(workload.arrivals[index + 1][0] - clock.seconds(),
                            arrive, index + 1)
        d: Deferred[Lease] = routers[replica].acquire()
        d.addCallbacks(leased, refused, callbackArgs=(request,), errbackArgs=(request,))

    def scrape(pool: Pool) -> None:
        for backend in pool:
            engine = engines[backend.key]
            pool.set_engine_depth(backend, engine.running, len(engine.waiting))
        if outstanding[0] > 0:
            clock.callLater(params.scrape_interval, scrape, pool)

    if policy_name == "queue-depth":
        for replica, pool in enumerate(pools):
            offset = params.scrape_interval * replica / experiment.replicas
            clock.callLater(offset, scrape, pool)
    clock.callLater(workload.arrivals[0][0], arrive, 0)

    # Jump straight to each next event: exact, whatever the float rounding of a delta.
    while outstanding[0] > 0 or clock.calls:
        if not clock.calls:
            raise RuntimeError("simulation stalled with requests outstanding")
        clock.rightNow = max(clock.rightNow, clock.calls[0].getTime())
        clock.advance(0)

    for pool in pools:
        leaked = [b.key for b in pool if b.counts.active]
        if leaked:
            raise RuntimeError(f"in-flight counts left over on {leaked}")
    busy = [e.key for e in engines.values() if e.running or e.waiting or e._finishing]
    if busy or len(requests) != len(workload.arrivals):
        raise RuntimeError(f"requests left over on {busy} or never arrived")
    result = summarise(experiment, policy_name, requests, engines, specs, clock.seconds(),
                       time.perf_counter() - started_wall)
    return dataclasses.replace(result, seed=params.seed, load=params.load,
                               observe_at=observe_at, fast_spread=sum(spreads) / len(spreads))


def summarise(experiment: Experiment, policy_name: str, requests: Sequence[Request],
              engines: dict[str, Engine],
              specs: Sequence[tuple[BackendSpec, EngineClass]], sim_seconds: float,
              wall_seconds: float) -> RunResult:
    ok = [r for r in requests if not r.refused]
    assert all(r.done is not None and r.first_token is not None for r in ok)
    completion = [r.done - r.arrival for r in ok]  # type: ignore[operator]
    ttft = [r.first_token - r.arrival for r in ok]  # type: ignore[operator]
    waits = [r.lease.waited for r in ok if r.lease is not None]
    peak: dict[str, int] = {}
    served: dict[str, int] = {}
    for spec, cls in specs:
        engine = engines[spec.key]
        peak[cls.name] = max(peak.get(cls.name, 0), engine.peak_waiting)
        served[cls.name] = served.get(cls.name, 0) + engine.served
    # Time-averaged requests on an engine while arrivals last (the drain left out): the
    # time requests spent on a class's engines before the last arrival / (that x engines).
    window = max(r.arrival for r in requests)
    residence = {cls.name: 0.0 for cls in ENGINE_CLASSES}
    for r in ok:
        assert r.engine is not None and r.done is not None and r.lease is not None
        on_engine = r.arrival + r.lease.waited
        residence[engines[r.engine].cls.name] += max(0.0, min(r.done, window) - on_engine)
    total = max(1, sum(served.values()))
    return RunResult(
        experiment=experiment.key,
        policy=policy_name,
        completed=len(ok),
        refused=len(requests) - len(ok),
        mean_completion=sum(completion) / len(completion),
        p99_completion=percentile(completion, 99),
        mean_ttft=sum(ttft) / len(ttft),
        p99_ttft=percentile(ttft, 99),
        mean_balancer_wait=sum(waits) / len(waits) if waits else 0.0,
        peak_waiting=peak,
        share={name: count / total for name, count in served.items()},
        in_flight={cls.name: residence[cls.name] / (window * cls.count)
                   for cls in ENGINE_CLASSES},
        fast_spread=0.0,
        sim_seconds=sim_seconds,
        wall_seconds=wall_seconds,
    )


# -- reporting --------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    try:
        uname = subprocess.run(["uname", "-a"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        uname = platform.platform()
    return {
        "uname -a": uname,
        "nproc": str(os.cpu_count()),
        "python": f"{platform.python_version()} ({sys.executable})",
    }


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "txlb"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + (" + uncommitted changes to txlb/" if dirty else "")


Selection = dict[str, RunResult]  # policy -> result


def pick(results: Sequence[RunResult], experiment: str, seed: int, load: float,
         observe_at: str = "end") -> Selection:
    """The results of one experiment at one seed and load, by policy (in policy order)."""
    return {r.policy: r for r in results
            if r.experiment == experiment and r.seed == seed and r.load == load
            and r.observe_at == observe_at}


def table(results: Sequence[RunResult], show_wait: bool) -> str:
    names = [cls.name for cls in ENGINE_CLASSES]
    head = ["policy", "mean completion s", "p99 completion s", "mean TTFT s", "p99 TTFT s"]
    if show_wait:
        head.append("mean balancer wait s")
    head += ["peak engine waiting (max)", "peak waiting " + " / ".join(names),
             "share of requests " + " / ".join(names), "503s"]
    lines = ["| " + " | ".join(head) + " |",
             "|---|" + "---:|" * (len(head) - 1)]
    for r in results:
        row = [f"`{r.policy}`", f"{r.mean_completion:.1f}", f"{r.p99_completion:.1f}",
               f"{r.mean_ttft:.2f}", f"{r.p99_ttft:.2f}"]
        if show_wait:
            row.append(f"{r.mean_balancer_wait:.2f}")
        row += [str(r.peak_waiting_max),
                " / ".join(str(r.peak_waiting[n]) for n in names),
                " / ".join(f"{100 * r.share[n]:.0f} %" for n in names),
                str(r.refused)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def spread(values: Sequence[float], digits: int) -> str:
    """``median (min-max)``."""
    return f"{median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def per_seed(results: Sequence[RunResult], experiment: str, seeds: Sequence[int],
             load: float) -> list[Selection]:
    return [pick(results, experiment, seed, load) for seed in seeds]


def seed_table(selections: Sequence[Selection]) -> str:
    """Each policy over the seeds: median (min-max), and its rank by mean completion."""
    lines = ["| policy | mean completion s | p99 completion s | p99 TTFT s | peak engine "
             "waiting | rank by mean completion, per seed |",
             "|---|---:|---:|---:|---:|---|"]
    ranks: dict[str, list[int]] = {}
    for selection in selections:
        ordered = sorted(selection.values(), key=lambda r: r.mean_completion)
        for rank, r in enumerate(ordered, 1):
            ranks.setdefault(r.policy, []).append(rank)
    for policy in selections[0]:
        runs = [s[policy] for s in selections]
        lines.append(
            f"| `{policy}` | {spread([r.mean_completion for r in runs], 1)} | "
            f"{spread([r.p99_completion for r in runs], 0)} | "
            f"{spread([r.p99_ttft for r in runs], 2)} | "
            f"{spread([r.peak_waiting_max for r in runs], 0)} | "
            + ", ".join(str(k) for k in ranks[policy]) + " |")
    return "\n".join(lines)


def load_table(results: Sequence[RunResult], experiment: str, seed: int,
               loads: Sequence[float]) -> str:
    """Each policy at each load: mean completion / p99 TTFT / peak engine waiting / 503s."""
    columns = [pick(results, experiment, seed, load) for load in loads]
    lines = ["| policy | " + " | ".join(f"load {load:g}" for load in loads) + " |",
             "|---|" + "---:|" * len(loads)]
    for policy in columns[0]:
        cells = []
        for column in columns:
            r = column[policy]
            cell = f"{r.mean_completion:.1f} / {r.p99_ttft:.2f} / {r.peak_waiting_max}"
            if r.refused:
                cell += f" / **{r.refused} x 503**"
            elif r.mean_balancer_wait >= 0.005:
                cell += f" (wait {r.mean_balancer_wait:.2f})"
            cells.append(cell)
        lines.append(f"| `{policy}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def diagnostic_table(results: Sequence[RunResult], seed: int, load: float) -> str:
    """Where each policy puts the requests, and the ``latency`` what-if rows."""
    names = " / ".join(c.name for c in ENGINE_CLASSES)
    lines = [f"| experiment | policy | mean in flight per engine {names} | spread among the "
             "fast engines | peak engine waiting | p99 TTFT s | mean completion s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    rows: list[tuple[str, str, RunResult]] = []
    for policy, r in pick(results, "A", seed, load).items():
        rows.append(("A", f"`{policy}`", r))
    for experiment in ("A", "D"):
        for observe_at in ("end", "first-token"):
            found = pick(results, experiment, seed, load, observe_at).get("latency")
            if found is not None and (experiment, observe_at) != ("A", "end"):
                what = "TTFT at request end (txlb)" if observe_at == "end" else \
                    "TTFT at first token (what-if)"
                rows.append((experiment, f"`latency`, {what}", found))
    for experiment, label, r in rows:
        lines.append(
            f"| {experiment} | {label} | "
            + " / ".join(f"{r.in_flight[c.name]:.1f}" for c in ENGINE_CLASSES)
            + f" | {r.fast_spread:.1f} | {r.peak_waiting_max} | {r.p99_ttft:.2f} | "
            f"{r.mean_completion:.1f} |")
    return "\n".join(lines)


def recommendation(results: Sequence[RunResult], params: Params, seeds: Sequence[int],
                   loads: Sequence[float], workload: Workload) -> str:
    """Turn the measured numbers into advice, quoting the numbers it rests on."""
    seed, load = params.seed, params.load
    a, b, c, d = (pick(results, k, seed, load) for k in "ABCD")
    over = {k: per_seed(results, k, seeds, load) for k in "ABCD"}
    n = len(seeds)
    many = f"*median of {n} seeds*" if n > 1 else f"*seed {seed}*"

    def med(experiment: str, policy: str, attr: str = "mean_completion") -> float:
        return median([getattr(s[policy], attr) for s in over[experiment]])

    def order(experiment: str) -> list[str]:
        return sorted(over[experiment][0], key=lambda p: med(experiment, p))

    def wins(experiment: str, policy: str) -> int:
        return sum(1 for s in over[experiment]
                   if min(s.values(), key=lambda r: r.mean_completion).policy == policy)

    def ranks(experiment: str, policy: str) -> list[int]:
        return [sorted(s, key=lambda p: s[p].mean_completion).index(policy) + 1
                for s in over[experiment]]

    def stable(experiment: str) -> bool:
        orders = {tuple(sorted(s, key=lambda p: s[p].mean_completion)) for s in over[experiment]}
        return len(orders) == 1

    out = ["## Recommendation", "",
           f"Numbers are seed {seed} at load {load:g} unless marked {many}.", ""]

    # A: one balancer, weights 1.
    order_a = order("A")
    best = order_a[0]
    close = [p for p in order_a if med("A", p) <= 1.05 * med("A", best)]
    lc, lat = a["least-conn"], a["latency"]
    slots = workload.rate * lc.mean_completion
    total_slots = params.max_num_seqs * sum(cls.count for cls in ENGINE_CLASSES)
    out.append(
        f"* **One balancer over heterogeneous GPUs: a load-aware policy "
        f"({', '.join(f'`{p}`' for p in close)})**, within 5 % of each other by mean "
        f"completion ({many}: "
        + ", ".join(f"`{p}` {med('A', p):.1f} s" for p in order_a)
        + f"; `{best}` lowest in {wins('A', best)} of {n} seeds).  They need no weights to "
        f"find the fast GPUs: with equal in-flight counts the fast ones finish sooner and "
        f"get {100 * lc.share['fast']:.0f} % of the requests (their share of capacity: "
        f"{100 * _capacity_share(params, workload)['fast']:.0f} %).  "
        + ("`least-conn`, the default and the simplest, is the best of them here"
           if best == "least-conn" else
           f"`least-conn`, the default, is "
           f"{100 * (med('A', 'least-conn') / med('A', best) - 1):.0f} % behind `{best}`")
        + f"; `p2c` and `queue-depth` spread identical engines less evenly (mean in-flight "
        f"spread among the 4 fast engines {a['p2c'].fast_spread:.1f} and "
        f"{a['queue-depth'].fast_spread:.1f} requests vs {lc.fast_spread:.1f} for "
        "`least-conn`, see *Diagnostics*): `p2c` by its random draw, `queue-depth` by "
        "counting completions only at each scrape."
    )
    best_b = order("B")[0]
    out.append(
        f"* **Better still: the same policy with weights proportional to speed (B).**  "
        f"`{best_b}` with weights 3/2/1: {med('B', best_b):.1f} s mean completion vs "
        f"{med('A', 'least-conn'):.1f} s for `least-conn` unweighted ({many}), p99 "
        f"completion {b[best_b].p99_completion:.0f} s vs {lc.p99_completion:.0f} s.  Equal "
        "in-flight counts keep as many requests on a slow GPU as on a fast one, each taking "
        f"up to 3x as long there; weights cut the slow GPUs' share from "
        f"{100 * lc.share['slow']:.0f} % to {100 * b[best_b].share['slow']:.0f} %.  So if "
        "you know the GPUs' relative decode throughput, put it in `weight`"
        + (" and keep `least-conn`." if med("B", "least-conn") <= 1.02 * med("B", best_b)
           else f" and use `{best_b}`.")
    )
    gap = lat.mean_completion / lc.mean_completion - 1
    out.append(
        f"* **`latency` is not recommended on its own**: mean completion "
        f"{100 * gap:+.0f} % vs `least-conn` but p99 TTFT {lat.p99_ttft:.1f} s vs "
        f"{lc.p99_ttft:.2f} s, with up to {lat.peak_waiting_max} requests queued inside "
        f"one engine while `least-conn` "
        + ("never queued any" if lc.peak_waiting_max == 0
           else f"peaked at {lc.peak_waiting_max}")
        + f"; ranked {', '.join(map(str, ranks('A', 'latency')))} of "
        f"{len(over['A'][0])} across the seeds.  The *Diagnostics* show why: the four "
        f"identical fast engines differ by {lat.fast_spread:.1f} requests in flight on "
        f"average (`least-conn`: {lc.fast_spread:.1f}), so some queue while their twins "
        "have room.  With `max_conns` = `max_num_seqs` (C) it "
        f"cannot overfill an engine and its preference for fast engines pays: "
        f"{med('C', 'latency'):.1f} s mean ({many}), best in C, p99 TTFT "
        f"{c['latency'].p99_ttft:.2f} s -- still behind weighted `{best_b}` "
        f"({med('B', best_b):.1f} s)."
    )
    out.append(
        f"* **`round-robin` / `random` with equal weights are not usable on a mixed "
        f"fleet**: {med('A', 'round-robin') / med('A', best):.0f}x / "
        f"{med('A', 'random') / med('A', best):.0f}x the best mean completion ({many}), "
        f"because they give the two slow GPUs {100 * a['round-robin'].share['slow']:.0f} % "
        f"of the requests when they have "
        f"{100 * _capacity_share(params, workload)['slow']:.0f} % of the capacity; their "
        f"queues grow for the whole run (peak "
        f"{max(a['round-robin'].peak_waiting_max, a['random'].peak_waiting_max)} waiting).  "
        f"A slow GPU offered 1/{sum(c.count for c in ENGINE_CLASSES)} of the traffic "
        f"overloads at any load above {_static_limit(params, workload):.2f} x capacity"
        + (", so this holds at every load in the load table."
           if min(loads) > _static_limit(params, workload) else ".")
    )
    static_b = max(med("B", "round-robin"), med("B", "random")) / med("B", best_b)
    static_c = max(med("C", "round-robin"), med("C", "random")) / med("C", order("C")[0])
    rr_b, rnd_b, lc_b = b["round-robin"], b["random"], b["least-conn"]
    out.append(
        f"* **When round-robin / random are fine**: with weights proportional to speed (B) "
        f"they come within {100 * (static_b - 1):.0f} % of the best mean ({many}), with "
        f"worse tails (p99 TTFT {rr_b.p99_ttft:.2f} / {rnd_b.p99_ttft:.2f} s vs "
        f"`least-conn` {lc_b.p99_ttft:.2f} s; peak engine queue {rr_b.peak_waiting_max} / "
        f"{rnd_b.peak_waiting_max} vs {lc_b.peak_waiting_max}), since they cannot see that "
        f"a backend drew several long answers; with `max_conns` (C) within "
        f"{100 * (static_c - 1):.0f} %.  Identical GPUs (not simulated) are the "
        "equal-weight case of B.  "
        + ("They beat `least-conn` in no run here." if not _static_wins(results) else
           "They beat `least-conn` in: " + ", ".join(_static_wins(results)) + ".")
    )
    out.append(
        f"* **`max_conns` = the engine's `max_num_seqs` (C) is a cheap safety net**: it "
        f"rescues `round-robin` ({a['round-robin'].mean_completion:.1f} s -> "
        f"{c['round-robin'].mean_completion:.1f} s mean) and `latency` (above), and "
        "changes nothing for the policies that never reach it.  The balancer queue it "
        "creates stayed short: mean wait at most "
        f"{max(r.mean_balancer_wait for r in results if r.experiment == 'C'):.2f} s, and "
        "no request was refused with 503 at any load simulated ("
        + _refusals(results, "C", seed, loads) + ")."
    )
    lc_d, qd_d, p2c_d = d["least-conn"], d["queue-depth"], d["p2c"]
    replicas = next(e.replicas for e in EXPERIMENTS if e.key == "D")
    ratio = med("D", "queue-depth") / med("D", "least-conn")
    high = max(loads)
    hi = pick(results, "D", seed, high)
    out.append(
        "* **Several replicas (D): "
        + ("local `least-conn` is enough here, `queue-depth` matches it.**  "
           if abs(ratio - 1) <= 0.03 else
           "`queue-depth` beats local `least-conn`.**  " if ratio < 1 else
           "local `least-conn` beats `queue-depth`.**  ")
        + f"{replicas} replicas sprayed at random: `least-conn` "
        f"{lc_d.mean_completion:.1f} s mean / {lc_d.p99_ttft:.2f} s p99 TTFT (one "
        f"balancer: {lc.mean_completion:.1f} s / {lc.p99_ttft:.2f} s); `queue-depth` "
        f"{qd_d.mean_completion:.1f} s / {qd_d.p99_ttft:.2f} s; mean-completion ratio "
        f"queue-depth / least-conn {ratio:.3f} ({many})"
        + (f"; at load {high:g}: {hi['least-conn'].p99_ttft:.2f} s vs "
           f"{hi['queue-depth'].p99_ttft:.2f} s p99 TTFT, `p2c` {hi['p2c'].p99_ttft:.2f} s"
           if hi else "")
        + f".  Random spraying makes each replica's in-flight counts a fair sample of "
        "the fleet's, so equalising them locally very nearly equalises them globally; "
        f"and with about {workload.rate / replicas * params.scrape_interval:.0f} requests per "
        "replica per scrape interval spread over 8 engines, replicas do not visibly herd "
        "onto the same engine.  `p2c` "
        f"({p2c_d.mean_completion:.1f} s, p99 TTFT {p2c_d.p99_ttft:.2f} s) "
        + ("gains nothing from its anti-herding randomness"
           if med("D", "p2c") >= med("D", "least-conn") else "does slightly better")
        + ".  "
        + (f"Near saturation `queue-depth` has the longer TTFT tail, with one balancer as "
           f"with three (load {high:g}, p99 TTFT: one balancer "
           f"{pick(results, 'A', seed, high)['queue-depth'].p99_ttft:.2f} s vs "
           f"{pick(results, 'A', seed, high)['least-conn'].p99_ttft:.2f} s for `least-conn`; "
           f"three replicas {hi['queue-depth'].p99_ttft:.2f} s vs "
           f"{hi['least-conn'].p99_ttft:.2f} s), presumably because between scrapes it "
           "counts the requests it sent but not the ones that finished.  "
           if hi and pick(results, "A", seed, high)
           and hi["queue-depth"].p99_ttft > 1.1 * hi["least-conn"].p99_ttft
           and pick(results, "A", seed, high)["queue-depth"].p99_ttft
           > 1.1 * pick(results, "A", seed, high)["least-conn"].p99_ttft else "")
        + "`queue-depth` should matter when the engines "
        "carry load a replica cannot count -- skewed or sticky client-to-replica "
        "traffic, direct clients, other balancers -- none of which is modelled."
    )
    consistent = [k for k in "ABCD" if stable(k)]
    out.append(
        "* **Caveats.**  One fleet shape, one request-length distribution, a simplified "
        "engine (module docstring: no KV-cache limit, no preemption, prefill does not "
        "contend with decode), perfect health, streaming requests only (txlb takes TTFT "
        "at the first body byte, which for a non-streaming request is about its whole "
        "duration).  Every policy replays the same requests, which makes small "
        "differences between policies more repeatable than their size suggests: "
        + (f"the ranking by mean completion was the same in all {n} seeds in "
           f"{len(consistent)} of the 4 experiments ({', '.join(consistent) or '-'})"
           if n > 1 else "only one seed was run")
        + "; still, a different fleet or workload could reorder policies that are within "
        f"a few per cent of each other.  Load {load:g} means {workload.rate:.2f} req/s against "
        f"{workload.capacity:.2f} req/s at full batches; by Little's law `least-conn` keeps "
        f"{slots:.0f} of the {total_slots} batch slots busy on average."
    )
    return "\n".join(out)


def _static_limit(params: Params, workload: Workload) -> float:
    """The load above which an equal share of the traffic overloads the slowest engine."""
    engines = sum(cls.count for cls in ENGINE_CLASSES)
    slowest = min(engine_capacity(cls, params, workload.mean_prompt, workload.mean_output)
                  for cls in ENGINE_CLASSES)
    return engines * slowest / workload.capacity


def _static_wins(results: Sequence[RunResult]) -> list[str]:
    """Runs in which round-robin or random had a lower mean completion than least-conn."""
    least = {(r.experiment, r.seed, r.load, r.observe_at): r.mean_completion
             for r in results if r.policy == "least-conn"}
    return [f"{r.experiment} seed {r.seed} load {r.load:g} (`{r.policy}`)" for r in results
            if r.policy in ("round-robin", "random")
            and r.mean_completion < least.get((r.experiment, r.seed, r.load, r.observe_at),
                                              math.inf)]


def _capacity_share(params: Params, workload: Workload) -> dict[str, float]:
    caps = {cls.name: cls.count * engine_capacity(cls, params, workload.mean_prompt,
                                                  workload.mean_output)
            for cls in ENGINE_CLASSES}
    total = sum(caps.values())
    return {name: cap / total for name, cap in caps.items()}


def _refusals(results: Sequence[RunResult], experiment: str, seed: int,
              loads: Sequence[float]) -> str:
    parts = []
    for load in loads:
        selection = pick(results, experiment, seed, load)
        refused = {p: r.refused for p, r in selection.items() if r.refused}
        parts.append(f"load {load:g}: " + (", ".join(f"`{p}` {k}" for p, k in refused.items())
                                           if refused else "none"))
    return "; ".join(parts)


def markdown(results: Sequence[RunResult], params: Params, seeds: Sequence[int],
             loads: Sequence[float], workload: Workload, wall: float,
             command: str) -> str:
    seed, load = params.seed, params.load
    info = machine()
    shares = _capacity_share(params, workload)
    lines = [
        "# Scheduling policies over heterogeneous engines (simulation)",
        "",
        f"- date: `{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}`",
        *(f"- {k}: `{v}`" for k, v in info.items()),
        f"- txlb: `{git_revision()}`",
        f"- command: `{command}` ({len(results)} runs, {wall:.0f} s wall)",
        f"- seed: {seed} (seed table: seeds {', '.join(map(str, seeds))}); "
        f"{params.requests} requests per run; Poisson arrivals at {workload.rate:.2f} "
        f"req/s = load {load:g} x full-batch capacity {workload.capacity:.2f} req/s "
        "(load table: other loads, same seed)",
        "- engines: " + "; ".join(
            f"{c.count} {c.name} (decode {c.decode_rate:g} tok/s per sequence, prefill "
            f"{c.prefill_rate:g} tok/s, {100 * shares[c.name]:.0f} % of capacity, weight "
            f"{c.weight} in B)" for c in ENGINE_CLASSES)
        + f"; max_num_seqs {params.max_num_seqs}; per-sequence decode speed x "
        f"(1 - {params.degradation:g} x running / max_num_seqs)",
        f"- requests: output tokens lognormal, median {params.output_median:g}, p99 "
        f"{params.output_p99:g}, cap {params.output_cap} (mean {workload.mean_output:.0f}); "
        f"prompt tokens lognormal, median {params.prompt_median:g}, sigma "
        f"{params.prompt_sigma:g}, cap {params.prompt_cap} (mean {workload.mean_prompt:.0f})",
        f"- balancer: txlb's own Pool + Router + make_policy on a twisted Clock; "
        f"queue_timeout {params.queue_timeout:g} s; `queue-depth` scrapes every engine's "
        f"running + waiting every {params.scrape_interval:g} s; `latency` is told each "
        "request's TTFT (arrival to first token) when the request ends, as txlb does",
        "- columns: completion = arrival at the balancer to last token; TTFT = arrival to "
        "first token (balancer queue + engine queue + prefill); peak engine waiting = the "
        "most requests ever waiting inside one engine (vLLM's num_requests_waiting), max "
        "over all 8 and per class; share = fraction of the requests each class served; "
        "503s = requests refused by the router",
        "",
    ]
    for experiment in EXPERIMENTS:
        lines += [f"## {experiment.key}. {experiment.title}", "",
                  table(list(pick(results, experiment.key, seed, load).values()),
                        show_wait=experiment.capped), ""]
    if len(seeds) > 1:
        lines += [f"## Across seeds {', '.join(map(str, seeds))} (load {load:g})", "",
                  "Median (min-max) over the seeds; the last column is the policy's rank "
                  "by mean completion in each seed (1 = lowest).", ""]
        for experiment in EXPERIMENTS:
            lines += [f"### {experiment.key}. {experiment.title}", "",
                      seed_table(per_seed(results, experiment.key, seeds, load)), ""]
    if len(loads) > 1:
        lines += [f"## Across loads (seed {seed})", "",
                  "Each cell: mean completion s / p99 TTFT s / peak engine waiting (and the "
                  "mean balancer queue wait, or the 503 count, where there is any).", ""]
        for experiment in EXPERIMENTS:
            if all(pick(results, experiment.key, seed, x) for x in loads):
                lines += [f"### {experiment.key}. {experiment.title}", "",
                          load_table(results, experiment.key, seed, loads), ""]
    lines += [
        f"## Diagnostics: where the requests sit (A, seed {seed}, load {load:g})", "",
        "Mean in flight = requests on one engine (running + waiting), time-averaged while "
        "arrivals last; spread = max - min of that count over the 4 identical fast "
        "engines, averaged over arrivals.  txlb tells `PeakEwmaLatency` a request's TTFT "
        "when the request *ends* (the bookkeeper's `policy_learns`); the what-if rows feed the "
        "same sample the moment the first token arrives instead (not what txlb does).", "",
        diagnostic_table(results, seed, load), "",
        "How `latency` gets there: below an engine's batch cap its TTFT is just prefill "
        "time, which does not depend on the load, so the peak-EWMA of two identical "
        "engines differs only by noise (prompt lengths, the last queueing spike); the cost "
        "`peak_ewma x (active + 1)` turns that noise into a proportional difference in "
        "requests, pushing the engine with the lowest average towards and past "
        "`max_num_seqs`.  Load shows up in TTFT only once requests queue inside that "
        "engine, and txlb learns it only when those requests end; then the peak-sensitive "
        "average jumps and the traffic swings to the others.  Feeding the sample at the "
        "first token shortens the lag (see the what-if rows) but does not remove the "
        "cause.", "",
        recommendation(results, params, seeds, loads, workload), "",
        "![policies](policies.png)", "",
    ]
    return "\n".join(lines)


def plot(results: Sequence[RunResult], params: Params, loads: Sequence[float],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows_n = len(EXPERIMENTS) + (1 if len(loads) > 1 else 0)
    fig, axes = plt.subplots(rows_n, 3, figsize=(16, 3.8 * rows_n), squeeze=False)
    for row, experiment in enumerate(EXPERIMENTS):
        runs = list(pick(results, experiment.key, params.seed, params.load).values())
        names = [r.policy for r in runs]
        x = list(range(len(runs)))
        width = 0.38
        panels = (
            ("completion s", [r.mean_completion for r in runs],
             [r.p99_completion for r in runs]),
            ("TTFT s", [r.mean_ttft for r in runs], [r.p99_ttft for r in runs]),
        )
        for col, (label, means, p99s) in enumerate(panels):
            ax = axes[row][col]
            ax.bar([i - width / 2 for i in x], means, width, label="mean")
            ax.bar([i + width / 2 for i in x], p99s, width, label="p99")
            ax.set_yscale("log")
            ax.set_xticks(x, names, rotation=15, fontsize=8)
            ax.set_ylabel(label + " (log)")
            ax.set_title(f"{experiment.key}: {label}", fontsize=10)
            ax.legend(fontsize=8)
            ax.grid(axis="y", alpha=0.3)
        ax = axes[row][2]
        classes = [cls.name for cls in ENGINE_CLASSES]
        w = 0.8 / len(classes)
        if all(r.peak_waiting_max == 0 for r in runs):
            ax.text(0.5, 0.5, "no request ever waited inside an engine", ha="center",
                    va="center", transform=ax.transAxes, fontsize=9)
        else:
            for k, name in enumerate(classes):
                ax.bar([i - 0.4 + w * (k + 0.5) for i in x],
                       [max(r.peak_waiting[name], 0.5) for r in runs], w, label=name)
            ax.set_yscale("log")
            ax.legend(fontsize=8)
        ax.set_xticks(x, names, rotation=15, fontsize=8)
        ax.set_ylabel("peak waiting in one engine (log)")
        ax.set_title(f"{experiment.key}: peak engine queue by class (0 drawn as 0.5)",
                     fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    if len(loads) > 1:
        for col, key in enumerate(("A", "C", "D")):
            ax = axes[-1][col]
            by_load = [pick(results, key, params.seed, load) for load in loads]
            if not all(by_load):
                ax.set_visible(False)
                continue
            values = [s[policy].mean_completion for s in by_load for policy in s]
            for policy in by_load[0]:
                ax.plot(loads, [s[policy].mean_completion for s in by_load], marker="o",
                        label=policy)
            log = max(values) > 3 * min(values)
            if log:
                ax.set_yscale("log")
            ax.set_xlabel("load (x full-batch capacity)")
            ax.set_ylabel("mean completion s" + (" (log)" if log else ""))
            ax.set_title(f"{key}: mean completion vs load", fontsize=10)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
    fig.suptitle(
        "txlb policies, simulated 4 fast + 2 medium + 2 slow engines, seed "
        f"{params.seed}, load {params.load:g}\n"
        + "; ".join(f"{e.key} = {e.title}" for e in EXPERIMENTS[:2]) + "\n"
        + "; ".join(f"{e.key} = {e.title}" for e in EXPERIMENTS[2:]), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=80)
    plt.close(fig)


# -- main -------------------------------------------------------------------------------------

Job = tuple[Experiment, str, Params, str]


def _run_job(job: Job) -> RunResult:
    return run(*job)


def jobs_for(params: Params, seeds: Sequence[int], loads: Sequence[float]) -> list[Job]:
    """Every run the report needs, each once."""
    wanted: dict[tuple[str, str, int, float, str], Job] = {}

    def add(experiment: Experiment, policy: str, seed: int, load: float,
            observe_at: str = "end") -> None:
        run_params = dataclasses.replace(params, seed=seed, load=load)
        wanted[(experiment.key, policy, seed, load, observe_at)] = (
            experiment, policy, run_params, observe_at)

    for experiment in EXPERIMENTS:
        for policy in experiment.policies:
            for seed in seeds:
                add(experiment, policy, seed, params.load)
            if experiment.key != "B":
                for load in loads:
                    add(experiment, policy, params.seed, load)
    for experiment in (EXPERIMENTS[0], EXPERIMENTS[3]):
        add(experiment, "latency", params.seed, params.load, "first-token")
    # the longest runs (overloaded round-robin/random, high loads) first, for the pool
    return sorted(wanted.values(), key=lambda job: -job[2].load)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.policies", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=Params.seed,
                        help="seed of the main tables (default %(default)s)")
    parser.add_argument("--seeds", type=int, default=4,
                        help="seeds in the seed table: --seed and the next ones "
                             "(default %(default)s; 1 leaves the table out)")
    parser.add_argument("--requests", type=int, default=Params.requests,
                        help="requests per run (default %(default)s)")
    parser.add_argument("--load", type=float, default=Params.load,
                        help="arrival rate as a fraction of full-batch capacity "
                             "(default %(default)s)")
    parser.add_argument("--loads", default=None,
                        help="comma-separated loads of the load table, '' to leave it out "
                             "(default 0.7,0.8,0.9,0.95; with --replicas: the loads of the "
                             "fleet tables, default 0.8,0.9)")
    parser.add_argument("--replicas", default="",
                        help="instead of the policy experiments, the fleet-balance runs "
                             "(bench.fleet_balance) at these comma-separated replica counts, "
                             "e.g. 2,4,8; to bench/results/scale-out.md")
    parser.add_argument("--publish-delay", default="0,0.01,0.1,1",
                        help="with --replicas: comma-separated seconds between two reads of "
                             "the other replicas' counts (default %(default)s)")
    parser.add_argument("--traffic", default="skewed,bursts",
                        help="with --replicas: traffic patterns (default %(default)s)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="worker processes; results do not depend on it")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="directory for policies.md and policies.png")
    args = parser.parse_args(argv)
    command = "python -m bench.policies" + "".join(
        f" {arg}" for arg in (argv if argv is not None else sys.argv[1:]))
    if args.replicas.strip():
        return fleet_main(args, parser, command)
    if args.loads is None:
        args.loads = "0.7,0.8,0.9,0.95"
    params = Params(seed=args.seed, requests=args.requests, load=args.load)
    seeds = [args.seed + k for k in range(max(1, args.seeds))]
    loads = sorted({float(x) for x in args.loads.split(",") if x.strip()} | {args.load}) \
        if args.loads.strip() else [args.load]

    started = time.perf_counter()
    jobs = jobs_for(params, seeds, loads)
    print(f"{len(jobs)} runs on {args.jobs} processes ...", file=sys.stderr, flush=True)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as executor:
            results = list(executor.map(_run_job, jobs, chunksize=1))
    else:
        results = [_run_job(job) for job in jobs]
    wall = time.perf_counter() - started

    workload = make_workload(params, 1)
    report = markdown(results, params, seeds, loads, workload, wall, command)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "policies.md").write_text(report)
    plot(results, params, loads, args.out / "policies.png")
    print(report)
    print(f"\nwrote {args.out / 'policies.md'} and {args.out / 'policies.png'} "
          f"({wall:.0f} s; slowest run {max(r.wall_seconds for r in results):.1f} s)")
    return 0


def _numbers(parser: argparse.ArgumentParser, option: str, text: str,
             kind: type[float] | type[int]) -> list:  # type: ignore[type-arg]
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{option}: {text!r} is not a comma-separated list of numbers")
    if not values or any(v < 0 or not math.isfinite(v) for v in values):
        parser.error(f"{option}: {text!r}: give one or more numbers, none negative")
    return values


def fleet_main(args: argparse.Namespace, parser: argparse.ArgumentParser,
               command: str) -> int:
    """``--replicas``: the fleet-balance runs of :mod:`bench.fleet_balance`."""
    from bench import fleet_balance

    replicas = _numbers(parser, "--replicas", args.replicas, int)
    if any(n < 2 or n > 64 for n in replicas):
        parser.error(f"--replicas: {args.replicas!r}: each count from 2 to 64")
    delays = _numbers(parser, "--publish-delay", args.publish_delay, float)
    loads = _numbers(parser, "--loads", args.loads if args.loads is not None else "0.8,0.9",
                     float)
    if any(not 0 < x <= 2 for x in loads):
        parser.error(f"--loads: {args.loads!r}: each load above 0 and at most 2")
    traffics = [t.strip() for t in args.traffic.split(",") if t.strip()]
    unknown = [t for t in traffics if t not in fleet_balance.TRAFFIC]
    if unknown or not traffics:
        parser.error(f"--traffic: {args.traffic!r}: choose from "
                     f"{', '.join(fleet_balance.TRAFFIC)}")
    params = fleet_balance.FleetParams(seed=args.seed, requests=args.requests)
    text = fleet_balance.report(params, replicas, delays, loads, traffics, args.jobs,
                                args.out, command)
    print(text)
    print(f"\nwrote {args.out / 'scale-out.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
