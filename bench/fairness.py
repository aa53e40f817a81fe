"""
What ``--fairness vtc`` buys a light tenant when a heavy one floods the fleet.

A deterministic discrete-event simulation on a :class:`twisted.internet.task.Clock`, with
txlb's *real* :class:`~txlb._cluster.pool.Pool`, :class:`~txlb._scheduling.router.Router`
and :class:`~txlb._scheduling.fairness.FairShares` (the Virtual Token Counter of Sheng et
al., "Fairness in Serving Large Language Models", OSDI 2024), in front of
:mod:`bench.sim_engines`' virtual-clock engines: bench.policies' eight heterogeneous
vLLM-like engines with ``max_conns = max_num_seqs`` (experiment C there), so the excess
waits in the balancer's queue -- where the fair order acts.

Each tenant sends Poisson arrivals (bench.policies' lognormal prompt and output lengths)
for ``--duration`` simulated seconds, then the queue drains; one tenant, ``heavy``, sends
``--heavy-ratio`` (10) times the rate of each other (light) tenant, and all together
``--load`` (1.5) times the fleet's full-batch capacity.  Each tenant's arrivals and
lengths come from its own seeded stream, so every run of a scenario replays the *same*
request sequence: once with ``vtc``, once with ``fifo`` (arrival order; the counters are
kept all the same, as txlb keeps them), and once with the light tenants alone, for
reference.  Each request goes through the proxy's calls: ``fairness.price`` (its body is
``4 * prompt`` bytes and says ``max_tokens`` = its real output, so the grant's estimate
is exact unless ``--estimate default``), ``router.acquire``, ``fairness.granted`` with
the lease, and at its end the lease released, then ``fairness.settle`` with its
``usage`` -- in the order txlb's exchange does them.

TTFT is arrival at the balancer to first token (balancer queue + prefill).  The queue
timeout is longer than any wait (10^9 s), so every request completes and both orders serve
the same work.  Besides the 2- and 10-tenant scenarios the page has a weighted pair (weight
2 against 1, both backlogged), variants (no ``max_tokens``; txlb's default 30 s queue
timeout, with and without the default class's starvation guard) and a burst after a quiet
period, run both with txlb's lift and with the paper's (every arrival lifted).  Virtual
time: the figures depend on the seed, not on the machine, so one run per configuration is
the measurement.

``python -m bench.fairness_report`` writes bench/results/fairness.md.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from bench.classes import CAPPED
from bench.policies_run import specs_for
from bench.sim_engines import (
    Z99,
    Engine,
    Params,
    Request,
    lognormal_tokens,
    make_workload,
    percentile,
    run_to_the_end,
)
from txlb._cluster.pool import Pool
from txlb._cluster.slots import Lease
from txlb._config import Config
from txlb._config.classes import built_in
from txlb._scheduling.budgets import CHARS_PER_TOKEN
from txlb._scheduling.classes import PriorityClasses
from txlb._scheduling.fairness import (
    INPUT_PRICE,
    OUTPUT_PRICE,
    FairShares,
    StreamMeter,
    cost_of,
)
from txlb._scheduling.outcome import RequestOutcome
from txlb._scheduling.policies.registry import make_policy
from txlb._scheduling.request import RoutingRequest
from txlb._scheduling.router import Router, RoutingError

HEAVY = "heavy"
PATH, METHOD = b"/v1/completions", b"POST"
#: lengths drawn to work out the fleet's full-batch capacity (bench.sim_engines' way)
CALIBRATION = 20_000


@dataclass(frozen=True)
class Tenant:
    name: str
    #: its request rate, relative to the other tenants'
    share: float
    weight: float = 1.0


def tenants_of(count: int, heavy_ratio: float) -> tuple[Tenant, ...]:
    """``heavy`` at ``heavy_ratio`` times each of ``count - 1`` light tenants' rate."""
    lights = tuple(Tenant(f"light{i}", 1.0) for i in range(1, count))
    return (Tenant(HEAVY, heavy_ratio), *lights)


@dataclass(frozen=True)
class Arrival:
    when: float
    tenant: str
    prompt: int
    output: int


def workload(params: Params, tenants: Sequence[Tenant], duration: float,
             capacity: float) -> tuple[Arrival, ...]:
    """Every tenant's Poisson arrivals over ``duration``, from the tenant's own streams."""
    rate = params.load * capacity / sum(t.share for t in tenants)
    return merged(stream(params, t.name, ((0.0, duration, rate * t.share),))
                  for t in tenants)


def stream(params: Params, tenant: str,
           phases: Sequence[tuple[float, float, float]]) -> list[Arrival]:
    """``tenant``'s Poisson arrivals: in each phase ``(start, end, rate)`` at ``rate``/s."""
    clock_rng = random.Random(f"arrivals-{params.seed}-{tenant}")
    length_rng = random.Random(f"lengths-{params.seed}-{tenant}")
    sigma = _output_sigma(params)
    arrivals = []
    for start, end, rate in phases:
        now = start + clock_rng.expovariate(rate)
        while now < end:
            prompt = lognormal_tokens(length_rng, params.prompt_median, params.prompt_sigma,
                                      params.prompt_cap)
            output = lognormal_tokens(length_rng, params.output_median, sigma,
                                      params.output_cap)
            arrivals.append(Arrival(now, tenant, prompt, output))
            now += clock_rng.expovariate(rate)
    return arrivals


def merged(streams: Iterable[Sequence[Arrival]]) -> tuple[Arrival, ...]:
    return tuple(sorted((a for s in streams for a in s), key=lambda a: (a.when, a.tenant)))


#: the burst scenario: (start, end, rate over the fleet's capacity) of each tenant's phases
BURST = {"steady": ((0.0, 240.0, 0.5),),
         "bursty": ((0.0, 180.0, 0.05), (180.0, 210.0, 3.0))}


def burst_arrivals(params: Params, capacity: float) -> tuple[Arrival, ...]:
    """``steady`` at half the capacity; ``bursty`` light for 180 s, then at 3 x for 30 s."""
    return merged(stream(params, name, [(a, b, rate * capacity) for a, b, rate in phases])
                  for name, phases in BURST.items())


def _output_sigma(params: Params) -> float:
    return math.log(params.output_p99 / params.output_median) / Z99


def capacity_of(params: Params) -> float:
    """The fleet's full-batch capacity, requests/s, for this length distribution."""
    return make_workload(replace(params, requests=CALIBRATION), 1).capacity


@dataclass
class Gaps:
    """The service gap between backlogged tenants, as the run goes."""

    #: the largest difference of FairShares' counters between two tenants that both had
    #: requests waiting, sampled at every grant
    counters: float = 0.0
    #: the largest difference of the weighted service two tenants were granted over an
    #: interval both stayed backlogged throughout (the paper's W_f(t1,t2) - W_g(t1,t2)),
    #: from the requests' real tokens, independent of the counters
    interval: float = 0.0
    samples: int = 0


@dataclass(frozen=True)
class TenantFigures:
    sent: int
    completed: int
    p50_ttft: float
    p99_ttft: float
    #: unweighted price-weighted tokens (1 prompt + 2 completion) granted while the fleet
    #: was saturated (between a quarter of the duration and its end)
    saturated_service: float


@dataclass(frozen=True)
class Run:
    order: str
    tenants: dict[str, TenantFigures]
    gaps: Gaps
    #: completions per simulated second, and prompt + completion tokens processed per
    #: second, between a quarter of the duration and its end (the fleet full)
    requests_per_s: float
    tokens_per_s: float
    #: the most prompt + completion tokens the fleet held in flight at once
    peak_in_flight_tokens: int
    longest_prompt: int
    longest_output: int
    fleet_max_conns: int
    refused: int
    wall_seconds: float


def run(params: Params, tenants: Sequence[Tenant], order: str, duration: float,
        capacity: float | None = None, estimate: str = "exact",
        only: frozenset[str] | None = None, guard: bool = True,
        arrivals: Sequence[Arrival] | None = None, streamed: bool = True) -> Run:
    """
    Replay the scenario's request sequence through one balancer with ``order`` (``vtc``
    or ``fifo``); ``only``: the requests of these tenants alone (the rest dropped);
    ``guard``: the built-in classes' starvation guard of the default class (at half the
    queue timeout), else none; ``arrivals``: this request sequence instead of the
    tenants' Poisson streams; ``streamed``: the bodies say ``"stream": true``, so a grant
    charges the prompt and each answer's output is charged as its engine decodes it (what
    txlb's :class:`~txlb._scheduling.fairness.StreamMeter` does with the relayed events),
    else the grant charges the completion's estimate too.
    """
    started = time.perf_counter()
    capacity = capacity_of(params) if capacity is None else capacity
    if arrivals is None:
        arrivals = workload(params, tenants, duration, capacity)
    if only is not None:
        arrivals = tuple(a for a in arrivals if a.tenant in only)
    weights = {t.name: t.weight for t in tenants}
    clock = Clock()
    specs = specs_for(CAPPED, params)
    pool = Pool(tuple(spec for spec, _ in specs), clock=clock)
    policy = make_policy("least-conn", clock, random.Random(f"policy-{params.seed}"))
    fairness = FairShares(enabled=order == "vtc")
    classes = built_in(params.queue_timeout)
    if not guard:
        classes = tuple(attrs.evolve(spec, starvation_age=None) for spec in classes)
    router = Router(pool, policy, clock, queue_timeout=params.queue_timeout, retry_after=1,
                    classes=PriorityClasses(Config(backends=(), classes=classes,
                                                   queue_timeout=params.queue_timeout)),
                    fairness=fairness)
    requests: list[Request] = []
    routed: list[RoutingRequest] = []
    outstanding = [len(arrivals)]
    waiting: dict[str, int] = {}  # tenant -> its requests in the balancer's queue
    service: dict[str, float] = {t.name: 0.0 for t in tenants}  # weighted, granted
    since: dict[str, tuple[int, dict[str, float]]] = {}  # backlogged from: (step, service)
    step = [0]
    gaps = Gaps()
    grants: dict[int, float] = {}  # request -> when it got its slot
    in_flight = [0, 0]  # tokens now, the most
    meters: dict[int, StreamMeter] = {}  # request -> its stream's meter, while it decodes
    metered: dict[int, int] = {}  # request -> tokens fed to its meter

    def stream_progress() -> None:
        """Every decoding answer's new tokens to its meter: what the relay would have seen."""
        for engine in engines.values():
            for job, produced in engine.decoding():
                meter = meters.get(job.index)
                if meter is not None and produced > metered[job.index]:
                    meter.tokens(produced - metered[job.index])
                    metered[job.index] = produced

    def sample() -> None:
        backlogged = [name for name, count in waiting.items() if count]
        if len(backlogged) < 2:
            return
        gaps.samples += 1
        values = [fairness.counters.get(name, 0.0) for name in backlogged]
        gaps.counters = max(gaps.counters, max(values) - min(values))
        for f in backlogged:  # f the later to be backlogged of each pair
            begun, then = since[f]
            gained_f = service[f] - then[f]
            for g in backlogged:
                if g != f and since[g][0] < begun:
                    gaps.interval = max(gaps.interval,
                                        abs(gained_f - (service[g] - then[g])))

    def queue(tenant: str) -> None:
        if not waiting.get(tenant):
            step[0] += 1
            since[tenant] = (step[0], dict(service))
        waiting[tenant] = waiting.get(tenant, 0) + 1

    def unqueue(tenant: str) -> None:
        waiting[tenant] -= 1

    def done(request: Request) -> None:
        assert request.lease is not None and request.first_token is not None
        outstanding[0] -= 1
        in_flight[0] -= request.prompt_tokens + request.output_tokens
        stream_progress()  # the counters as the freed slot's choice would read them
        meters.pop(request.index, None)
        metered.pop(request.index, None)
        lease, request.lease = request.lease, None
        lease.release()  # as the exchange ends: the slot first, then the bookkeeping
        assert request.done is not None
        fairness.settle(RequestOutcome(
            backend=lease.backend.key, status=200, answered=True,
            ttfb=request.first_token - request.arrival,
            duration=request.done - request.arrival, prompt_tokens=request.prompt_tokens,
            completion_tokens=request.output_tokens, routing=routed[request.index]))

    engines = {spec.key: Engine(clock, spec.key, cls, params, lambda r: None, done)
               for spec, cls in specs}

    def leased(lease: Lease, request: Request, queued: bool) -> None:
        routing = routed[request.index]
        assert routing.tenant is not None
        if queued:
            unqueue(routing.tenant)
        fairness.granted(routing)
        meter = fairness.meter(routing)
        if meter is not None:
            meters[request.index], metered[request.index] = meter, 0
        grants[request.index] = clock.seconds()
        service[routing.tenant] += cost_of(request.prompt_tokens, request.output_tokens,
                                           routing.weight)
        in_flight[0] += request.prompt_tokens + request.output_tokens
        in_flight[1] = max(in_flight[1], in_flight[0])
        sample()
        request.lease = lease
        engines[lease.backend.key].submit(request)

    def refused(failure: Failure, request: Request, queued: bool) -> None:
        failure.trap(RoutingError)
        request.refused = True
        outstanding[0] -= 1
        tenant = routed[request.index].tenant
        if queued and tenant is not None:
            unqueue(tenant)

    def arrive(index: int) -> None:
        arrival = arrivals[index]
        request = Request(index, arrival.when, arrival.prompt, arrival.output, 0)
        requests.append(request)
        if index + 1 < len(arrivals):
            clock.callLater(arrivals[index + 1].when - clock.seconds(), arrive, index + 1)
        asked: dict[str, object] = ({} if estimate == "default"
                                    else {"max_tokens": arrival.output})
        if streamed:
            asked["stream"] = True
        routing = RoutingRequest(tenant=arrival.tenant, weight=weights[arrival.tenant],
                                 body=bytes(arrival.prompt * CHARS_PER_TOKEN), json=asked)
        routed.append(routing)
        fairness.price(routing, PATH, METHOD)
        d: Deferred[Lease] = router.acquire(routing)  # the arrival (and its lift) is its
        queued = not d.called
        if queued:
            queue(arrival.tenant)
        d.addCallbacks(leased, refused, callbackArgs=(request, queued),
                       errbackArgs=(request, queued))

    if arrivals:
        clock.callLater(arrivals[0].when, arrive, 0)
    run_to_the_end(clock, outstanding)
    if any(b.counts.active for b in pool) or router.queue_length:
        raise RuntimeError("slots or waiters left over")
    return _summarise(order, requests, arrivals, grants, gaps, duration, in_flight[1],
                      sum(spec.max_conns for spec, _ in specs), time.perf_counter() - started)


def _summarise(order: str, requests: Sequence[Request], arrivals: Sequence[Arrival],
               grants: dict[int, float], gaps: Gaps, duration: float, peak: int,
               max_conns: int, wall: float) -> Run:
    start = duration / 4
    figures = {}
    for name in sorted({a.tenant for a in arrivals}, key=lambda n: (n != HEAVY, n)):
        mine = [r for r, a in zip(requests, arrivals, strict=True) if a.tenant == name]
        ok = [r for r in mine if not r.refused]
        ttft = [r.first_token - r.arrival for r in ok]  # type: ignore[operator]
        granted = [r for r in ok if start <= grants[r.index] <= duration]
        figures[name] = TenantFigures(
            sent=len(mine), completed=len(ok),
            p50_ttft=percentile(ttft, 50) if ttft else 0.0,
            p99_ttft=percentile(ttft, 99) if ttft else 0.0,
            saturated_service=sum(cost_of(r.prompt_tokens, r.output_tokens, 1.0)
                                  for r in granted))
    ok = [r for r in requests if not r.refused]
    ends = [r.done for r in ok if r.done is not None]
    seconds = duration - start
    return Run(
        order=order, tenants=figures, gaps=gaps,
        requests_per_s=sum(1 for end in ends if start <= end <= duration) / seconds,
        tokens_per_s=sum(_tokens_within(r, start, duration) for r in ok) / seconds,
        peak_in_flight_tokens=peak,
        longest_prompt=max((a.prompt for a in arrivals), default=0),
        longest_output=max((a.output for a in arrivals), default=0),
        fleet_max_conns=max_conns, refused=len(requests) - len(ok), wall_seconds=wall)


def _tokens_within(request: Request, start: float, end: float) -> float:
    """
    The tokens of ``request`` the fleet processed between ``start`` and ``end``: its prompt
    if its prefill ended then, and the share of its completion decoded then (decode taken
    as even from the first token to the last).
    """
    first, last = request.first_token, request.done
    assert first is not None and last is not None
    tokens = float(request.prompt_tokens) if start <= first <= end else 0.0
    if last > first:
        overlap = max(0.0, min(end, last) - max(start, first))
        tokens += (request.output_tokens - 1) * overlap / (last - first)
    return tokens


def fleet_tokens(r: Run) -> int:
    """M, the tokens the fleet holds in flight at most, over-estimated: every slot of
    the fleet holding the longest prompt and the longest completion of the workload."""
    return r.fleet_max_conns * (r.longest_prompt + r.longest_output)


def bound(longest_prompt: int, in_flight: int) -> float:
    """The paper's bound on the service gap of two backlogged tenants (weight 1)."""
    return 2 * max(INPUT_PRICE * longest_prompt, OUTPUT_PRICE * in_flight)


@dataclass(frozen=True)
class Comparison:
    """One scenario's request sequence under each order, and its light tenants alone."""

    name: str
    vtc: Run
    fifo: Run
    alone: Run | None = None


def compare(name: str, params: Params, tenants: Sequence[Tenant], duration: float,
            capacity: float, alone: bool = True, estimate: str = "exact",
            guard: bool = True, arrivals: Sequence[Arrival] | None = None,
            verbose: bool = False, streamed: bool = True) -> Comparison:
    """
    ``vtc`` and ``fifo`` on the same sequence (and, with ``alone``, the lights alone);
    ``verbose``: each run's wall time on stderr.
    """
    def one(order: str, only: frozenset[str] | None = None) -> Run:
        result = run(params, tenants, order, duration, capacity, estimate, only, guard,
                     arrivals, streamed)
        if verbose:
            print(f"{name}, {order}{' (lights alone)' if only else ''}: "
                  f"{result.wall_seconds:.1f}s", file=sys.stderr, flush=True)
        return result

    lights = frozenset(t.name for t in tenants if t.name != HEAVY)
    return Comparison(name, one("vtc"), one("fifo"), one("fifo", lights) if alone else None)
