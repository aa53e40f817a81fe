"""
The fleet-scale model: txlb's real Router, Pool and policies over virtual-clock engines
with prefix caches (:mod:`bench.prefix.engine_model`), on a ``task.Clock``.

As in :mod:`bench.policies`: one ``Pool`` + ``Router`` per balancer replica, each arrival
sent to a seeded random replica, ``router.acquire`` gives the lease, the request goes to
that engine, the lease is released at its last token, and the policy's ``observe`` is
told what the bookkeeper would tell it -- including the prompt tokens and the cached prompt
tokens the engine reported (the closed loop).  Every 2 s each replica's pool hears each
engine's KV-cache usage (``pool.set_engine``, what the prober's scrape gives), and its
queue (``set_engine_depth``) when the policy asks for engine metrics.

Arrivals are Poisson at ``load`` x the fleet's prefill capacity *without any cache hit*
(``engines x prefill_rate / mean prompt tokens``): at load 0.8 a router that never hit
would keep the prefill units 80 % busy, and every hit makes room.  ``hot-burst`` arrives
in bursts of ``8 x engines`` requests at one instant, the bursts Poisson at the same mean
rate.

Policies: txlb's ``least-conn`` and ``cache-aware`` (from the registry), and two that exist
only here: ``oracle`` -- knows every engine's cache exactly and sends each request to the
engine with the longest cached prefix among those under the same load bound as
``cache-aware`` (``ceil(1.25 x fair share)`` of in-flight), ties and the rest by least-conn:
the ceiling a router that cannot see inside the engines aims at; and ``prefix-hash`` --
consistent hashing of the prompt's first 256 characters with no load bound (what
vllm-router's ``consistent_hash`` amounts to for requests without a session key).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from bench.prefix.engine_model import (
    CachedEngine,
    EngineConfig,
    Job,
    block_chain,
    render,
)
from bench.prefix.synced_index import SharedIndex, StaleView
from bench.prefix.workloads import CHARS_PER_TOKEN, Options, PrefixRequest, generate
from bench.sim_engines import run_to_the_end
from txlb._cluster.backend import Backend
from txlb._cluster.pool import Pool
from txlb._cluster.slots import Lease
from txlb._config import BackendSpec
from txlb._scheduling.outcome import RequestOutcome
from txlb._scheduling.policies import IPolicy, Policy
from txlb._scheduling.policies._ties import WeightedTies
from txlb._scheduling.policies.cache_aware import CacheAware
from txlb._scheduling.policies.least_conn import load as least_conn_load
from txlb._scheduling.policies.registry import make_policy
from txlb._scheduling.request import ANY_REQUEST, RoutingRequest
from txlb._scheduling.router import Router, RoutingError
from txlb.testing import count_tokens

LOAD_FACTOR = 1.25
SCRAPE_INTERVAL = 2.0


def load_bound(backend: Backend, candidates: Sequence[Backend], factor: float) -> int:
    """``ceil(factor x backend's weight share of the in-flight, counting the new one)``."""
    total_weight = sum(b.effective_weight for b in candidates)
    in_flight = sum(b.counts.active for b in candidates) + 1
    return math.ceil(factor * in_flight * backend.effective_weight / total_weight)


class Oracle(Policy):
    """The engine holding the longest cached prefix, under the load bound (see above)."""

    name = "oracle"

    def __init__(self, engines: dict[str, CachedEngine],
                 prompts: dict[int, tuple[tuple[int, ...], int]],
                 factor: float = LOAD_FACTOR) -> None:
        self.engines = engines
        self.prompts = prompts  # id(body) -> (block chain, prompt tokens), while in flight
        self.factor = factor
        self._ties = WeightedTies()

    def _prompt(self, request: RoutingRequest) -> tuple[tuple[int, ...], int]:
        body = request.json or {}
        known = self.prompts.get(id(body))
        if known is not None:
            return known
        text = render(body)
        return block_chain(text), count_tokens(text)

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        chain, tokens = self._prompt(request)
        room = [b for b in candidates if b.counts.active < load_bound(b, candidates, self.factor)]
        pool = room or list(candidates)
        matches = {b.key: self.engines[b.key].cache.match(chain, tokens) for b in pool}
        best = max(matches.values())
        if best == 0:
            return self._ties.best(candidates, least_conn_load)
        return self._ties.best([b for b in pool if matches[b.key] == best], least_conn_load)


class PrefixHash(Policy):
    """Consistent hashing of the prompt's first 256 characters, no load bound."""

    name = "prefix-hash"
    VIRTUAL_NODES = 160

    def __init__(self) -> None:
        self._ring: tuple[tuple[str, ...], list[int], list[str]] | None = None

    @staticmethod
    def _hash(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        keys = tuple(sorted(b.key for b in candidates))
        if self._ring is None or self._ring[0] != keys:
            ring = sorted((self._hash(f"{k}#{i}"), k) for k in keys
                          for i in range(self.VIRTUAL_NODES))
            self._ring = (keys, [p for p, _ in ring], [k for _, k in ring])
        _, points, owners = self._ring
        key = render(request.json or {})[:256]
        owner = owners[bisect.bisect(points, self._hash(key)) % len(points)]
        return next(b for b in candidates if b.key == owner)


POLICIES = ("least-conn", "cache-aware", "oracle", "prefix-hash")


@dataclass(frozen=True)
class Scenario:
    workload: str
    engines: int = 8
    requests: int = 20_000
    replicas: int = 1
    shared_index: bool = False  # one policy object for every replica's router
    shared_counts: bool = False  # one pool (exact fleet-wide in-flight, as --workers has)
    #: > 0: one index, each replica looking it up in a copy refreshed every this many
    #: seconds (bench.prefix.synced_index); 0: as shared_index says
    index_refresh: float = 0.0
    load: float = 0.8
    seed: int = 1
    config: EngineConfig = EngineConfig()
    options: Options | None = None

    def workload_options(self) -> Options:
        if self.options is not None:
            return self.options
        return Options(seed=self.seed, requests=self.requests, burst=8 * self.engines)


@dataclass(frozen=True)
class VirtualResult:
    workload: str
    policy: str
    engines: int
    replicas: int
    shared_index: bool
    shared_counts: bool
    requests: int
    refused: int
    hit_rate: float  # cached prompt tokens / prompt tokens, as the engines counted them
    ttft_p50: float
    ttft_p99: float
    ttft_mean: float
    rps: float  # completed requests / time from first arrival to last completion
    output_tps: float
    max_in_flight: int  # the most requests one engine held (running + waiting)
    sim_seconds: float
    wall_seconds: float
    index_refresh: float = 0.0


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def arrivals(requests: Sequence[PrefixRequest], scenario: Scenario) -> list[float]:
    """Arrival times (see the module docstring), from their own seeded stream."""
    rng = random.Random(f"arrivals-{scenario.workload}-{scenario.seed}")
    mean_prompt = sum(r.prompt_chars() for r in requests) / len(requests) / CHARS_PER_TOKEN
    rate = scenario.load * scenario.engines * scenario.config.prefill_rate / mean_prompt
    sizes = Counter(r.burst for r in requests if r.burst >= 0)
    times: list[float] = []
    now, burst = 0.0, None
    for request in requests:
        if request.burst < 0:
            now += rng.expovariate(rate)
        elif request.burst != burst:
            now += rng.expovariate(rate / sizes[request.burst])
            burst = request.burst
        times.append(now)
    return times


def _make_policy(name: str, clock: Clock, engines: dict[str, CachedEngine],
                 prompts: dict[int, tuple[tuple[int, ...], int]], seed: str) -> IPolicy:
    if name == "oracle":
        return Oracle(engines, prompts)
    if name == "prefix-hash":
        return PrefixHash()
    return make_policy(name, clock, random.Random(seed))


def _stale_views(scenario: Scenario, clock: Clock,
                 policies: Sequence[IPolicy]) -> list[StaleView]:
    """
    With ``index_refresh``: one shared index, each replica's cache-aware policy looking
    it up through a copy refreshed every ``index_refresh`` (bench.prefix.synced_index).
    """
    if not scenario.index_refresh or scenario.replicas < 2:
        return []
    if scenario.shared_index:
        raise ValueError("index_refresh shares the index its own way: not with shared_index")
    views = []
    shared: SharedIndex | None = None
    for replica, policy in enumerate(policies):
        if not isinstance(policy, CacheAware):
            raise ValueError("index_refresh needs the cache-aware policy")
        if shared is None:
            shared = SharedIndex(clock, policy.index.max_entries,
                                 policy.index.default_capacity)
            hasher = policy.hasher
        # one index needs one key: each process draws its own hashing secret, so replicas
        # sharing an index must share the secret too, or no block of one matches another's
        policy.hasher = hasher
        view = StaleView(shared, replica)
        policy.index = view  # type: ignore[assignment]
        views.append(view)
    return views


def run(scenario: Scenario, policy_name: str,
        requests: Sequence[PrefixRequest] | None = None) -> VirtualResult:
    """Replay the scenario's workload through ``policy_name`` (see the module docstring)."""
    started_wall = time.perf_counter()
    if requests is None:
        requests = list(generate(scenario.workload, scenario.workload_options()))
    times = arrivals(requests, scenario)
    clock = Clock()
    specs = tuple(BackendSpec("10.0.0.1", 8000 + i) for i in range(scenario.engines))
    jobs: list[Job] = []
    outstanding = [len(requests)]
    refused = [0]
    replica_rng = random.Random(f"replicas-{scenario.seed}")
    replica_of = [replica_rng.randrange(scenario.replicas) for _ in requests]

    engines: dict[str, CachedEngine] = {}
    prompts: dict[int, tuple[tuple[int, ...], int]] = {}
    pools: list[Pool] = []
    routers: list[Router] = []
    policies: list[IPolicy] = []
    shared: IPolicy | None = None
    common = Pool(specs, clock=clock) if scenario.shared_counts else None
    for replica in range(scenario.replicas):
        pool = common or Pool(specs, clock=clock)
        if scenario.shared_index and shared is not None:
            policy = shared
        else:
            policy = _make_policy(policy_name, clock, engines, prompts,
                                  f"policy-{scenario.seed}-{policy_name}-{replica}")
            shared = policy
        pools.append(pool)
        policies.append(policy)
        routers.append(Router(pool, policy, clock, queue_timeout=60.0, retry_after=1,
                              rng=random.Random(f"router-{scenario.seed}")))

    views = _stale_views(scenario, clock, policies)

    def refresh(view: StaleView) -> None:
        view.refresh()
        if outstanding[0] > 0:
            clock.callLater(scenario.index_refresh, refresh, view)

    for replica, view in enumerate(views):
        clock.callLater(scenario.index_refresh * replica / len(views), refresh, view)

    def done(job: Job) -> None:
        lease: Lease = job.context[0]
        replica: int = job.context[1]
        routed: RoutingRequest = job.context[2]
        assert job.first_token is not None and job.done is not None
        prompts.pop(id(job.body), None)
        lease.release()
        policies[replica].observe(lease.backend, RequestOutcome(
            backend=lease.backend.key, status=200, answered=True,
            ttfb=job.first_token - job.arrival, duration=job.done - job.arrival,
            prompt_tokens=job.prompt_tokens, cached_prompt_tokens=job.cached_tokens,
            routing=routed))
        outstanding[0] -= 1

    def first_token(job: Job) -> None:
        pass

    for spec in specs:
        engines[spec.key] = CachedEngine(clock, spec.key, scenario.config, first_token, done)

    def leased(lease: Lease, job: Job, replica: int, routed: RoutingRequest) -> None:
        job.context = (lease, replica, routed)
        engines[lease.backend.key].submit(job)

    def refuse(failure: Failure, job: Job) -> None:
        failure.trap(RoutingError)
        prompts.pop(id(job.body), None)
        refused[0] += 1
        outstanding[0] -= 1

    def arrive(index: int) -> None:
        request = requests[index]
        body: dict[str, Any] = request.body
        text = render(body)
        chain, prompt = block_chain(text), count_tokens(text)
        prompts[id(body)] = (chain, prompt)
        job = Job(index, clock.seconds(), body, prompt, int(body["max_tokens"]), chain)
        jobs.append(job)
        if index + 1 < len(requests):
            clock.callLater(times[index + 1] - clock.seconds(), arrive, index + 1)
        replica = replica_of[index]
        routed = RoutingRequest(model=body.get("model"), json=body)
        d: Deferred[Lease] = routers[replica].acquire(routed)
        d.addCallbacks(leased, refuse, callbackArgs=(job, replica, routed),
                       errbackArgs=(job,))

    needs_depth = any(getattr(p, "needs_engine_metrics", False) for p in policies)

    def scrape() -> None:
        for pool in dict.fromkeys(pools):
            for backend in pool:
                engine = engines[backend.key]
                pool.set_engine(backend, "vllm", engine.kv_usage())
                if needs_depth:
                    pool.set_engine_depth(backend, engine.running, len(engine.waiting),
                                          engine.kv_usage())
        if outstanding[0] > 0:
            clock.callLater(SCRAPE_INTERVAL, scrape)

    clock.callLater(0, scrape)
    clock.callLater(times[0], arrive, 0)
    run_to_the_end(clock, outstanding)
    busy = [e.key for e in engines.values() if e.busy()]
    if busy:
        raise RuntimeError(f"requests left over on {busy}")
    return summarise(scenario, policy_name, jobs, engines, refused[0],
                     time.perf_counter() - started_wall)


def summarise(scenario: Scenario, policy_name: str, jobs: Sequence[Job],
              engines: dict[str, CachedEngine], refused: int,
              wall: float) -> VirtualResult:
    ok = [j for j in jobs if j.done is not None and j.first_token is not None]
    ttft = [(j.first_token or 0.0) - j.arrival for j in ok]
    span = max(j.done or 0.0 for j in ok) - min(j.arrival for j in jobs)
    queries = sum(e.query_tokens for e in engines.values())
    hits = sum(e.hit_tokens for e in engines.values())
    return VirtualResult(
        workload=scenario.workload, policy=policy_name, engines=scenario.engines,
        replicas=scenario.replicas, shared_index=scenario.shared_index,
        shared_counts=scenario.shared_counts, index_refresh=scenario.index_refresh,
        requests=len(jobs), refused=refused, hit_rate=hits / queries if queries else 0.0,
        ttft_p50=quantile(ttft, 0.5), ttft_p99=quantile(ttft, 0.99),
        ttft_mean=sum(ttft) / len(ttft), rps=len(ok) / span if span else 0.0,
        output_tps=sum(j.output_tokens for j in ok) / span if span else 0.0,
        max_in_flight=max(e.peak_in_flight for e in engines.values()),
        sim_seconds=span, wall_seconds=wall,
    )


Job_ = tuple[Scenario, str]


def run_job(job: Job_) -> VirtualResult:
    """One (scenario, policy) run; a top-level function so a process pool can call it."""
    return run(*job)


def run_all(jobs: Sequence[Job_], processes: int,
            progress: Callable[[VirtualResult], None] | None = None) -> list[VirtualResult]:
    """Every job, on ``processes`` worker processes (results do not depend on it)."""
    if processes <= 1:
        results = []
        for job in jobs:
            results.append(run_job(job))
            if progress:
                progress(results[-1])
        return results
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(processes) as executor:
        results = []
        for result in executor.map(run_job, jobs, chunksize=1):
            results.append(result)
            if progress:
                progress(result)
        return results
