"""
Several txlb replicas in front of the same engines: how evenly do they load them, with and
without shared in-flight counts?  (``python -m bench.policies --replicas 2,4,8``.)

The same virtual-clock engines as :mod:`bench.policies` (:class:`bench.sim_engines.Engine`),
here a fleet of identical ones, so that "even" has one meaning: the same number of requests
in flight on each.  In front of them, ``N`` balancer replicas, each with txlb's own
:class:`~txlb._cluster.pool.Pool`, :class:`~txlb._scheduling.router.Router` and policy (as
:mod:`txlb._balancer` wires them), all on one :class:`~twisted.internet.task.Clock`.  What a
replica knows of the others is modelled at the store seam: each pool is given a
:class:`ReplicaCounts` (an :class:`~txlb._cluster.store.IInFlightCounts`) whose totals are
the replica's own in-flight requests, exact, plus the other replicas' as it last read them:

* **independent**: it never reads them (separate txlb processes, no ``--shared-state``);
* **shared, delay d**: every replica publishes each change at once and reads the others'
  counts every ``d`` seconds (the replicas' read phases staggered evenly over ``d``), so a
  choice sees the others' requests as they were at most ``d`` ago; ``d = 0`` reads them
  live at every choice (the exact count ``--workers`` has on one machine);
* **single**: one balancer takes all the traffic (the ideal the replicas are measured
  against).

The traffic is skewed across the replicas, the way an L4 balancer or DNS round robin with
long-lived client connections skews it:

* **skewed**: Poisson arrivals; each goes to replica 0 with probability ``skew`` (0.7), else
  to one of the others at random;
* **bursts**: requests come in bursts of ``burst`` (half the engine count), all of a
  burst to one replica (chosen at random per burst) within ``burst_window`` seconds; the
  bursts are Poisson.

The same request sequence (times, lengths, replicas) is replayed for every variant.

What a run reports (:class:`FleetResult`): the per-engine **imbalance** -- max over the
engines of the requests in flight (running + waiting) divided by their mean, sampled at
every arrival while the fleet holds any; **p99 TTFT**; **over batch**, how many requests
found their engine's batch full (``max_num_seqs`` running) when they reached it, and so
waited inside it; and the **overshoot**: at each choice, how many more requests the chosen
engine held than the choosing replica believed (the others' picks it had not read yet), the
quantity the bound in ``bench/results/scale-out.md`` is about.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from zope.interface import implementer

from bench.sim_engines import (
    Z99,
    Engine,
    EngineClass,
    Params,
    Request,
    engine_capacity,
    lognormal_tokens,
    percentile,
    run_to_the_end,
)
from txlb._cluster.pool import Pool
from txlb._cluster.slots import Lease
from txlb._cluster.store import IInFlightCounts
from txlb._config import BackendSpec
from txlb._scheduling.policies.registry import make_policy
from txlb._scheduling.router import Router, RoutingError

#: every engine of the fleet: the "fast" class of bench.policies
GPU = EngineClass("gpu", 16, 60.0, 8000.0, 1)

TRAFFIC = ("skewed", "bursts")


@dataclass(frozen=True)
class FleetParams:
    """Everything a fleet run depends on, besides the replicas and how they share."""

    seed: int = 1
    requests: int = 20_000
    engines: int = 16
    load: float = 0.8
    traffic: str = "skewed"
    skew: float = 0.7  # the share of the traffic replica 0 gets ("skewed")
    burst: int = 0  # requests per burst ("bursts"); 0: half the engine count
    burst_window: float = 0.05  # seconds over which a burst's requests arrive
    policy: str = "least-conn"
    engine: Params = Params()  # max_num_seqs, degradation, length distributions

    @property
    def burst_size(self) -> int:
        return self.burst or max(1, self.engines // 2)


@dataclass(frozen=True)
class Variant:
    """How many replicas, and what each knows of the others' in-flight requests."""

    replicas: int
    shared: bool
    delay: float = 0.0  # seconds between two reads of the others' counts (shared only)

    @property
    def label(self) -> str:
        if self.replicas == 1:
            return "single balancer"
        if not self.shared:
            return "independent"
        return f"shared, delay {self.delay * 1000:g} ms"


@dataclass(frozen=True)
class FleetWorkload:
    arrivals: tuple[tuple[float, int, int, int], ...]  # (time, prompt, output, replica)
    rate: float  # requests/s over the fleet


def make_fleet_workload(params: FleetParams, replicas: int) -> FleetWorkload:
    """The request sequence, seeded; the replica draws are their own stream."""
    rng = random.Random(f"fleet-workload-{params.seed}")
    engine = params.engine
    sigma = math.log(engine.output_p99 / engine.output_median) / Z99
    prompts = [lognormal_tokens(rng, engine.prompt_median, engine.prompt_sigma,
                                engine.prompt_cap) for _ in range(params.requests)]
    outputs = [lognormal_tokens(rng, engine.output_median, sigma, engine.output_cap)
               for _ in range(params.requests)]
    mean_prompt = sum(prompts) / len(prompts)
    mean_output = sum(outputs) / len(outputs)
    rate = params.load * params.engines * engine_capacity(GPU, engine, mean_prompt,
                                                          mean_output)
    pick = random.Random(f"fleet-replicas-{params.seed}-{params.traffic}")
    times: list[float] = []
    chosen: list[int] = []
    now = 0.0
    if params.traffic == "skewed":
        for _ in range(params.requests):
            now += rng.expovariate(rate)
            times.append(now)
            if replicas == 1 or pick.random() < params.skew:
                chosen.append(0)
            else:
                chosen.append(1 + pick.randrange(replicas - 1))
    elif params.traffic == "bursts":
        size = params.burst_size
        while len(times) < params.requests:
            now += rng.expovariate(rate / size)
            replica = pick.randrange(replicas)
            offsets = sorted(rng.uniform(0, params.burst_window) for _ in range(size))
            for offset in offsets[:params.requests - len(times)]:
                times.append(now + offset)
                chosen.append(replica)
        order = sorted(range(len(times)), key=lambda k: times[k])
        times = [times[k] for k in order]
        chosen = [chosen[k] for k in order]
    else:
        raise ValueError(f"unknown traffic {params.traffic!r}; known: {', '.join(TRAFFIC)}")
    return FleetWorkload(tuple(zip(times, prompts, outputs, chosen, strict=True)), rate)


# -- what each replica knows of the others ------------------------------------------------------


class FleetCounts:
    """
    The truth: every replica's in-flight requests per backend slot, and the overshoot each
    choice made (how many requests the chosen engine held beyond what its replica saw).
    """

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.slots: dict[str, int] = {}
        self.by_replica: list[list[int]] = [[] for _ in range(replicas)]
        self.started: list[int] = []
        #: picks each replica ever made (for the bound: the picks a view has not read yet)
        self.picks = [0] * replicas
        self.overshoot: list[int] = []
        #: at each choice, the picks the other replicas made since the chooser last read
        self.unread: list[int] = []
        #: choices whose overshoot exceeded their unread picks (the hard bound; must be 0)
        self.beyond_bound = 0

    def register(self, key: str) -> int:
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = len(self.slots)
            for row in self.by_replica:
                row.append(0)
            self.started.append(0)
        return slot

    def others(self, replica: int) -> list[int]:
        """The other replicas' in-flight requests now, per slot."""
        totals = [0] * len(self.slots)
        for other, row in enumerate(self.by_replica):
            if other != replica:
                for slot, count in enumerate(row):
                    totals[slot] += count
        return totals


@implementer(IInFlightCounts)
class ReplicaCounts:
    """
    One replica's view of the fleet's in-flight counts: its own, exact, plus the others' as
    it last read them.  ``delay`` None: it never reads them (independent replicas); 0: it
    reads them live at every choice; else every ``delay`` seconds from ``phase`` on, while
    ``running()`` says the run goes on.
    """

    def __init__(self, fleet: FleetCounts, replica: int, clock: Clock, delay: float | None,
                 phase: float = 0.0) -> None:
        self.fleet = fleet
        self.replica = replica
        self.clock = clock
        self.delay = delay
        self._seen: list[int] = []
        self._seen_picks = [0] * fleet.replicas
        self._timer: IDelayedCall | None = None
        if delay:
            self._timer = clock.callLater(phase, self._read)

    def _read(self) -> None:
        self._seen = self.fleet.others(self.replica)
        self._seen_picks = list(self.fleet.picks)
        assert self.delay
        self._timer = self.clock.callLater(self.delay, self._read)

    def stop(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _others(self, slot: int) -> int:
        if self.delay is None:
            return 0
        if self.delay == 0:
            return sum(row[slot] for other, row in enumerate(self.fleet.by_replica)
                       if other != self.replica)
        return self._seen[slot] if slot < len(self._seen) else 0

    # -- IInFlightCounts -------------------------------------------------------------------

    def register(self, key: str) -> int:
        return self.fleet.register(key)

    def assign(self, key: str, slot: int) -> None:
        raise NotImplementedError("replicas register their own slots")

    def slot(self, key: str) -> int:
        return self.fleet.slots[key]

    def take(self, key: str) -> None:
        slot = self.fleet.slots[key]
        true_total = sum(row[slot] for row in self.fleet.by_replica)
        believed = self.fleet.by_replica[self.replica][slot] + self._others(slot)
        overshoot = max(0, true_total - believed)
        fleet = self.fleet
        fleet.overshoot.append(overshoot)
        if self.delay == 0:
            unread = 0
        else:
            unread = sum(picks - seen for other, (picks, seen)
                         in enumerate(zip(fleet.picks, self._seen_picks, strict=True))
                         if other != self.replica)
        fleet.unread.append(unread)
        if overshoot > unread:
            fleet.beyond_bound += 1
        fleet.picks[self.replica] += 1
        fleet.by_replica[self.replica][slot] += 1
        self.fleet.started[slot] += 1

    def give_back(self, key: str) -> None:
        self.fleet.by_replica[self.replica][self.fleet.slots[key]] -= 1

    def total(self, key: str) -> int:
        return self.mine(key) + self._others(self.fleet.slots[key])

    def totals(self) -> Sequence[int]:
        own = self.fleet.by_replica[self.replica]
        return [count + self._others(slot) for slot, count in enumerate(own)]

    def started(self, key: str) -> int:
        return self.fleet.started[self.fleet.slots[key]]

    def mine(self, key: str) -> int:
        return self.fleet.by_replica[self.replica][self.fleet.slots[key]]

    def lock(self) -> None:
        pass  # one reactor thread: a choice is atomic already

    def unlock(self) -> None:
        pass


# -- one run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetResult:
    traffic: str
    load: float
    replicas: int
    shared: bool
    delay: float
    label: str
    completed: int
    refused: int
    rate: float
    imbalance: float  # mean over arrivals of max/mean in flight per engine
    imbalance_p99: float
    peak_in_flight: int  # the most requests one engine ever held
    p99_ttft: float
    mean_ttft: float
    over_batch: int  # requests that found their engine's batch full
    overshoot_mean: float
    overshoot_p99: int
    overshoot_max: int
    unread_mean: float  # picks by the other replicas since the chooser's last read
    unread_p99: int
    beyond_bound: int  # choices whose overshoot exceeded their unread picks: always 0
    wall_seconds: float


def run_fleet(params: FleetParams, variant: Variant) -> FleetResult:
    """Replay the workload through ``variant.replicas`` replicas (see the module docstring)."""
    started_wall = time.perf_counter()
    clock = Clock()
    workload = make_fleet_workload(params, variant.replicas)
    specs = tuple(BackendSpec("10.0.0.1", 8001 + n) for n in range(params.engines))
    fleet = FleetCounts(variant.replicas)
    views: list[ReplicaCounts] = []
    routers: list[Router] = []
    for replica in range(variant.replicas):
        delay = (variant.delay if variant.shared else None) if variant.replicas > 1 else None
        phase = variant.delay * replica / variant.replicas if delay else 0.0
        view = ReplicaCounts(fleet, replica, clock, delay, phase)
        views.append(view)
        pool = Pool(specs, clock=clock, shared=view)
        policy = make_policy(params.policy, clock,
                             random.Random(f"policy-{params.seed}-{replica}"))
        routers.append(Router(pool, policy, clock, queue_timeout=30.0, retry_after=1,
                              rng=random.Random(f"router-{params.seed}")))

    requests: list[Request] = []
    outstanding = [len(workload.arrivals)]
    over_batch = [0]
    ratios: list[float] = []
    peak = [0]

    def first_token(request: Request) -> None:
        pass

    def done(request: Request) -> None:
        assert request.lease is not None
        outstanding[0] -= 1
        request.lease.release()
        if outstanding[0] == 0:
            for view in views:
                view.stop()

    engines = {spec.key: Engine(clock, spec.key, GPU, params.engine, first_token, done)
               for spec in specs}
    engine_list = list(engines.values())

    def leased(lease: Lease, request: Request) -> None:
        request.lease = lease
        engine = engines[lease.backend.key]
        if engine.running >= engine.max_num_seqs:
            over_batch[0] += 1
        engine.submit(request)

    def refused(failure: Failure, request: Request) -> None:
        failure.trap(RoutingError)
        request.refused = True
        outstanding[0] -= 1

    def arrive(index: int) -> None:
        when, prompt, output, replica = workload.arrivals[index]
        request = Request(index, when, prompt, output, replica)
        requests.append(request)
        depths = [e.running + len(e.waiting) for e in engine_list]
        total = sum(depths)
        if total:
            ratios.append(max(depths) * len(depths) / total)
            peak[0] = max(peak[0], max(depths))
        if index + 1 < len(workload.arrivals):
            clock.callLater(workload.arrivals[index + 1][0] - clock.seconds(),
                            arrive, index + 1)
        d: Deferred[Lease] = routers[replica].acquire()
        d.addCallbacks(leased, refused, callbackArgs=(request,), errbackArgs=(request,))

    clock.callLater(workload.arrivals[0][0], arrive, 0)
    run_to_the_end(clock, outstanding)

    if any(any(row) for row in fleet.by_replica):
        raise RuntimeError("in-flight counts left over")
    ok = [r for r in requests if not r.refused]
    ttft = [r.first_token - r.arrival for r in ok]  # type: ignore[operator]
    overshoot = fleet.overshoot or [0]
    unread = fleet.unread or [0]
    return FleetResult(
        traffic=params.traffic, load=params.load, replicas=variant.replicas, shared=variant.shared,
        delay=variant.delay, label=variant.label, completed=len(ok),
        refused=len(requests) - len(ok), rate=workload.rate,
        imbalance=sum(ratios) / len(ratios), imbalance_p99=percentile(ratios, 99),
        peak_in_flight=peak[0], p99_ttft=percentile(ttft, 99),
        mean_ttft=sum(ttft) / len(ttft), over_batch=over_batch[0],
        overshoot_mean=sum(overshoot) / len(overshoot),
        overshoot_p99=int(percentile(overshoot, 99)), overshoot_max=max(overshoot),
        unread_mean=sum(unread) / len(unread), unread_p99=int(percentile(unread, 99)),
        beyond_bound=fleet.beyond_bound,
        wall_seconds=time.perf_counter() - started_wall)


def variants(replica_counts: Sequence[int], delays: Sequence[float]) -> list[Variant]:
    """The single balancer, then per replica count: independent, then each delay."""
    out = [Variant(1, False)]
    for n in replica_counts:
        if n < 2:
            continue
        out.append(Variant(n, False))
        out += [Variant(n, True, d) for d in delays]
    return out


def with_traffic(params: FleetParams, traffic: str) -> FleetParams:
    return dataclasses.replace(params, traffic=traffic)


def shares(params: FleetParams, replicas: int) -> list[float]:
    """Each replica's expected share of the traffic."""
    if replicas == 1:
        return [1.0]
    if params.traffic == "skewed":
        return [params.skew] + [(1 - params.skew) / (replicas - 1)] * (replicas - 1)
    return [1 / replicas] * replicas


def expected_unread(params: FleetParams, variant: Variant, rate: float) -> float:
    """
    E[U], the other replicas' picks a choice has not read, for Poisson arrivals at fleet
    rate ``rate``: a view is on average ``delay / 2`` old (reads every ``delay``), in which
    the others send ``(1 - s_i) x rate x delay / 2``; averaged over the choices (replica i
    makes a share s_i of them).
    """
    if not variant.shared or variant.replicas == 1:
        return math.nan
    return sum(s * (1 - s) * rate * variant.delay / 2 for s in shares(params, variant.replicas))
