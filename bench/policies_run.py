"""
One policy experiment of :mod:`bench.policies`: a workload replayed through one or more
balancers (txlb's real Pool, Router and policy) over the simulated engines.

Apart from the command line and the report, so that :mod:`bench.classes`, which reruns
experiment C with priority classes, takes the experiments without the rest.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from bench.sim_engines import (
    ENGINE_CLASSES,
    Engine,
    EngineClass,
    Params,
    Request,
    make_workload,
    percentile,
    run_to_the_end,
)
from txlb._cluster.pool import Pool
from txlb._cluster.slots import Lease
from txlb._config import BackendSpec
from txlb._scheduling.outcome import RequestOutcome
from txlb._scheduling.policies import IPolicy
from txlb._scheduling.policies.registry import BUILT_IN, make_policy
from txlb._scheduling.router import Router, RoutingError

POLICY_NAMES = tuple(factory.name for factory in BUILT_IN)


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

    run_to_the_end(clock, outstanding)

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
