"""
Which scheduling policy should txlb use in front of heterogeneous LLM engines?

A deterministic discrete-event simulation that drives txlb's *real* scheduling code --
:class:`txlb._backend.Pool`, :class:`txlb._routing.Router` and the policies made by
:func:`txlb._policies.make_policy` -- on a :class:`twisted.internet.task.Clock`.  There is
no real time, no socket and no HTTP: only the engines behind the balancer are modelled.

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
* No KV-cache limit, no preemption, no chunked prefill, no prefix caching, no network
  time; the balancer's own overhead is zero.

TTFT is measured as the real balancer measures it: from the request's arrival at the
balancer to its first token, i.e. balancer queue wait + engine queue wait + prefill.
Completion time is arrival to last token.

The balancer side
-----------------
One :class:`~txlb._backend.Pool` + :class:`~txlb._routing.Router` + policy per balancer
replica, exactly as :mod:`txlb._balancer` wires them.  ``router.acquire()`` gives a lease;
the request goes to the lease's engine, and ``lease.release()`` is called once when its
last token is out.  As in ``Balancer._request_ended``, the ``latency`` policy is told the
request's TTFT (``policy.observe``) when the request *ends*.  For ``queue-depth`` each
replica scrapes every engine's running/waiting counts every ``scrape_interval`` seconds
(like the health prober) into ``pool.set_engine_depth``; the replicas' scrape phases are
staggered evenly over the interval.  Health is perfect: no backend ever goes down.

The workload
------------
Poisson arrivals; output lengths lognormal (median 200 tokens, p99 about 3000, capped at
8000, at least 1), prompt lengths lognormal (median 600 tokens, capped at 16000).  The
arrival rate is ``load`` times the fleet's capacity, where an engine's capacity is
``max_num_seqs / (mean prefill time + mean decode time at a full batch)`` requests/s,
computed from the generated workload itself -- the throughput the fleet reaches only if
every engine is kept exactly full, so ``load`` is an optimistic utilisation figure.
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

Run from the repository root::

    python -m bench.policies              # about a minute and a half on 2 cores
    python -m bench.policies --help

Tables go to standard output and ``bench/results/policies.md``, the plot to
``bench/results/policies.png``.
"""

from __future__ import annotations

import argparse
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

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from txlb._backend import Lease, Pool
from txlb._config import BackendSpec
from txlb._policies import POLICY_NAMES, PeakEwmaLatency, make_policy
from txlb._routing import Router, RoutingError

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
    """One request of the workload, and what happened to it."""

    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    replica: int
    engine: str | None = None
    lease: Lease | None = None
    first_token: float | None = None
    done: float | None = None
    refused: bool = False


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


class Engine:
    """
    One simulated vLLM engine: a batch of at most ``max_num_seqs`` sequences plus a FIFO
    waiting queue, prefill per sequence, and decode at a shared per-sequence speed.

    Decode uses a virtual token clock ``_vtokens``: the number of tokens any sequence that
    was decoding all along would have produced.  It advances at the current per-sequence
    speed; a sequence that starts decoding at virtual time ``v`` with ``n`` tokens to go
    finishes at virtual time ``v + n``, so one heap and one timer serve the whole batch.
    """

    def __init__(self, clock: Clock, key: str, cls: EngineClass, params: Params,
                 on_first_token: Callable[[Request], None],
                 on_done: Callable[[Request], None]) -> None:
        self.clock = clock
        self.key = key
        self.cls = cls
        self.max_num_seqs = params.max_num_seqs
        self.degradation = params.degradation
        self.on_first_token = on_first_token
        self.on_done = on_done
        self.running = 0  # prefilling + decoding
        self.waiting: deque[Request] = deque()
        self.peak_waiting = 0
        self.served = 0
        self._vtokens = 0.0
        self._vtokens_at = 0.0
        self._finishing: list[tuple[float, int, Request]] = []
        self._timer: IDelayedCall | None = None

    def speed(self) -> float:
        """Tokens/s of each decoding sequence with the batch as it is now."""
        return self.cls.decode_rate * (1 - self.degradation * self.running / self.max_num_seqs)

    def _advance(self) -> None:
        now = self.clock.seconds()
        self._vtokens += self.speed() * (now - self._vtokens_at)
        self._vtokens_at = now

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
            self.clock.callLater(request.prompt_tokens / self.cls.prefill_rate,
                                 self._prefilled, request)

    def _prefilled(self, request: Request) -> None:
        self._advance()
        request.first_token = self.clock.seconds()
        heapq.heappush(self._finishing,
                       (self._vtokens + request.output_tokens - 1, request.index, request))
        self.on_first_token(request)
        self._schedule()

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
        for request in finished:
            request.done = now
            self.running -= 1
        self._admit()
        self._schedule()
        for request in finished:  # may re-enter submit() through the routers' queues
            self.on_done(request)


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
    sim_seconds: float
    wall_seconds: float

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


def run(experiment: Experiment, policy_name: str, params: Params) -> RunResult:
    """Replay the workload through ``experiment.replicas`` balancers using ``policy_name``."""
    started_wall = time.perf_counter()
    clock = Clock()
    workload = make_workload(params, experiment.replicas)
    specs = specs_for(experiment, params)
    requests: list[Request] = []
    outstanding = [len(workload.arrivals)]

    pools: list[Pool] = []
    routers: list[Router] = []
    latency_policies: list[PeakEwmaLatency | None] = []
    for replica in range(experiment.replicas):
        pool = Pool(tuple(spec for spec, _ in specs))
        policy = make_policy(policy_name, clock.seconds,
                             random.Random(f"policy-{params.seed}-{policy_name}-{replica}"))
        pools.append(pool)
        routers.append(Router(pool, policy, clock, queue_timeout=params.queue_timeout,
                              retry_after=1, rng=random.Random(f"router-{params.seed}")))
        latency_policies.append(policy if isinstance(policy, PeakEwmaLatency) else None)

    def first_token(request: Request) -> None:
        pass  # the balancer learns the TTFT only when the request ends (as txlb does)

    def done(request: Request) -> None:
        lease = request.lease
        assert lease is not None and request.first_token is not None
        latency = latency_policies[request.replica]
        if latency is not None:
            latency.observe(lease.backend, request.first_token - request.arrival)
        outstanding[0] -= 1
        lease.release()

    engines = {spec.key: Engine(clock, spec.key, cls, params, first_token, done)
               for spec, cls in specs}

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
        if index + 1 < len(workload.arrivals):
            clock.callLater(workload.arrivals[index + 1][0] - clock.seconds(),
                            arrive, index + 1)
        d: Deferred[Lease] = routers[replica].acquire(model=None, session=None)
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
        leaked = [b.key for b in pool if b.active]
        if leaked:
            raise RuntimeError(f"in-flight counts left over on {leaked}")
    return summarise(experiment, policy_name, requests, engines, specs, clock.seconds(),
                     time.perf_counter() - started_wall)


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


def by_policy(results: Sequence[RunResult], key: str) -> dict[str, RunResult]:
    return {r.policy: r for r in results if r.experiment == key}


def ranking(results: dict[str, RunResult]) -> list[RunResult]:
    return sorted(results.values(), key=lambda r: (r.mean_completion, r.p99_completion))


def recommendation(results: Sequence[RunResult], workload: Workload) -> str:
    """Turn the measured numbers into advice, saying how large each difference is."""
    a, b, c, d = (by_policy(results, k) for k in "ABCD")

    def cite(r: RunResult) -> str:
        return (f"`{r.policy}` {r.mean_completion:.1f} s mean / {r.p99_completion:.0f} s "
                f"p99 completion")

    def ratio(x: RunResult, y: RunResult) -> str:
        return f"{x.mean_completion / y.mean_completion:.1f}x"

    out = ["## Recommendation", ""]
    order_a = ranking(a)
    best_a = order_a[0]
    out.append(
        f"* **One balancer over heterogeneous GPUs, weights left at 1 (A).**  Best: "
        f"{cite(best_a)}; order by mean completion: "
        + ", ".join(f"`{r.policy}` {r.mean_completion:.1f} s" for r in order_a) + ".  "
        "Load-aware policies adapt to the slow GPUs on their own; "
        + ("round-robin and random do not" if min(a["round-robin"].mean_completion,
                                                  a["random"].mean_completion)
           > 2 * best_a.mean_completion
           else "round-robin and random stay within 2x of it here")
        + f" (`round-robin` {ratio(a['round-robin'], best_a)}, `random` "
        f"{ratio(a['random'], best_a)} the best mean; their peak engine queue "
        f"{a['round-robin'].peak_waiting_max} / {a['random'].peak_waiting_max} requests, "
        f"vs {best_a.peak_waiting_max}).  With equal weights they send the slow GPUs "
        f"{100 * a['round-robin'].share['slow']:.0f} % of the traffic, more than those "
        "can serve at this load."
    )
    best_b = ranking(b)[0]
    rr_b, rnd_b = b["round-robin"], b["random"]
    out.append(
        f"* **Weights proportional to speed (B)** are what make `round-robin` / `random` "
        f"usable: `round-robin` {rr_b.mean_completion:.1f} s mean / "
        f"{rr_b.p99_completion:.0f} s p99 (was {a['round-robin'].mean_completion:.1f} s / "
        f"{a['round-robin'].p99_completion:.0f} s), `random` {rnd_b.mean_completion:.1f} s / "
        f"{rnd_b.p99_completion:.0f} s.  The best in B is {cite(best_b)}; weights change "
        f"`least-conn` from {a['least-conn'].mean_completion:.1f} s to "
        f"{b['least-conn'].mean_completion:.1f} s mean.  Round-robin/random are fine only "
        "when the backends are identical (or weighted correctly) and request lengths do "
        "not vary much -- a long-tailed output length still piles up on whichever "
        "backend drew the long requests, which their peak queues show."
    )
    best_c = ranking(c)[0]
    out.append(
        f"* **max_conns = max_num_seqs (C)** moves the excess from the engines' queues "
        f"into txlb's FIFO, which hands each waiting request to whichever backend frees a "
        f"slot first.  Best: {cite(best_c)}; `round-robin` here "
        f"{c['round-robin'].mean_completion:.1f} s mean (vs "
        f"{a['round-robin'].mean_completion:.1f} s without the cap); 503s (queue wait "
        f"over {30} s): " + ", ".join(f"`{r.policy}` {r.refused}" for r in c.values())
        + "."
    )
    lc_d, qd_d = d["least-conn"], d["queue-depth"]
    best_d = ranking(d)[0]
    out.append(
        f"* **Three replicas (D).**  Local `least-conn` {lc_d.mean_completion:.1f} s mean "
        f"/ {lc_d.p99_completion:.0f} s p99 (single balancer: "
        f"{a['least-conn'].mean_completion:.1f} s / {a['least-conn'].p99_completion:.0f} s); "
        f"`queue-depth` {qd_d.mean_completion:.1f} s / {qd_d.p99_completion:.0f} s (single: "
        f"{a['queue-depth'].mean_completion:.1f} s / "
        f"{a['queue-depth'].p99_completion:.0f} s).  Best with replicas: {cite(best_d)}.  "
        "With arrivals sprayed at random over the replicas, each replica's own counts are "
        "a proportional sample of the fleet's load, so local least-connections loses "
        + ("little" if lc_d.mean_completion < 1.25 * a["least-conn"].mean_completion
           else "a lot")
        + " by not seeing the other replicas; queue-depth's shared view "
        + ("helps" if qd_d.mean_completion < 0.95 * lc_d.mean_completion else
           "does not beat it here" if qd_d.mean_completion < 1.05 * lc_d.mean_completion
           else "is worse here, its 2 s old scrape being shared by all replicas")
        + "."
    )
    out.append(
        "* **Caveats.**  One seed, one load level "
        f"({workload.rate:.2f} req/s, nominally {100 * workload.rate / workload.capacity:.0f} "
        "% of full-batch capacity), one fleet shape, and a simplified engine (see the "
        "model above); the ranking between close policies (a few per cent) is within what "
        "another seed can change, large factors are not.  Check with `--seed` and `--load`."
    )
    return "\n".join(out)


def markdown(results: Sequence[RunResult], params: Params, workload: Workload,
             wall: float) -> str:
    info = machine()
    lines = [
        "# Scheduling policies over heterogeneous engines (simulation)",
        "",
        f"- date: `{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}`",
        *(f"- {k}: `{v}`" for k, v in info.items()),
        f"- txlb: `{git_revision()}`",
        f"- command: `python -m bench.policies --seed {params.seed} --requests "
        f"{params.requests} --load {params.load}`  ({wall:.0f} s wall)",
        f"- seed: {params.seed}; {params.requests} requests per run, Poisson arrivals at "
        f"{workload.rate:.2f} req/s = {params.load:.2f} x full-batch capacity "
        f"{workload.capacity:.2f} req/s",
        "- engines: " + "; ".join(
            f"{c.count} {c.name} (decode {c.decode_rate:g} tok/s/seq, prefill "
            f"{c.prefill_rate:g} tok/s, weight {c.weight} in B)" for c in ENGINE_CLASSES)
        + f"; max_num_seqs {params.max_num_seqs}; per-sequence speed x "
        f"(1 - {params.degradation:g} x running / max_num_seqs)",
        f"- requests: output lognormal median {params.output_median:g}, p99 "
        f"{params.output_p99:g}, cap {params.output_cap} (mean {workload.mean_output:.0f}); "
        f"prompt lognormal median {params.prompt_median:g}, sigma {params.prompt_sigma:g}, "
        f"cap {params.prompt_cap} (mean {workload.mean_prompt:.0f})",
        f"- balancer: txlb Pool + Router + make_policy on a twisted Clock; queue_timeout "
        f"{params.queue_timeout:g} s; queue-depth scrapes every {params.scrape_interval:g} s; "
        "latency policy observes TTFT (arrival to first token) at request end",
        "- times: completion = arrival at the balancer to last token; TTFT = arrival to "
        "first token (balancer queue + engine queue + prefill); peak engine waiting = the "
        "most requests ever waiting inside one engine (vLLM's num_requests_waiting), max "
        "over all engines and per class; share = fraction of requests each class served",
        "",
    ]
    for experiment in EXPERIMENTS:
        rows = [r for r in results if r.experiment == experiment.key]
        lines += [f"## {experiment.key}. {experiment.title}", "",
                  table(rows, show_wait=experiment.capped), ""]
    lines += [recommendation(results, workload), "",
              "![policies](policies.png)", ""]
    return "\n".join(lines)


def plot(results: Sequence[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(EXPERIMENTS), 3, figsize=(16, 4 * len(EXPERIMENTS)),
                             squeeze=False)
    for row, experiment in enumerate(EXPERIMENTS):
        rows = [r for r in results if r.experiment == experiment.key]
        names = [r.policy for r in rows]
        x = range(len(rows))
        width = 0.38
        panels = (
            ("completion (s, log)", [r.mean_completion for r in rows],
             [r.p99_completion for r in rows], True),
            ("TTFT (s, log)", [r.mean_ttft for r in rows], [r.p99_ttft for r in rows], True),
        )
        for col, (label, means, p99s, log) in enumerate(panels):
            ax = axes[row][col]
            ax.bar([i - width / 2 for i in x], means, width, label="mean")
            ax.bar([i + width / 2 for i in x], p99s, width, label="p99")
            if log:
                ax.set_yscale("log")
            ax.set_xticks(list(x), names, rotation=20)
            ax.set_ylabel(label)
            ax.set_title(f"{experiment.key}: {label.split(' ')[0]}", fontsize=10)
            ax.legend(fontsize=8)
            ax.grid(axis="y", alpha=0.3)
        ax = axes[row][2]
        classes = [cls.name for cls in ENGINE_CLASSES]
        w = 0.8 / len(classes)
        for k, name in enumerate(classes):
            ax.bar([i - 0.4 + w * (k + 0.5) for i in x],
                   [r.peak_waiting[name] for r in rows], w, label=name)
        ax.set_xticks(list(x), names, rotation=20)
        ax.set_ylabel("peak requests waiting in one engine")
        ax.set_title(f"{experiment.key}: peak engine queue", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("txlb policies, simulated heterogeneous fleet: "
                 + "; ".join(f"{e.key} = {e.title}" for e in EXPERIMENTS[:2]) + "\n"
                 + "; ".join(f"{e.key} = {e.title}" for e in EXPERIMENTS[2:]), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=90)
    plt.close(fig)


# -- main -------------------------------------------------------------------------------------


def _run_job(job: tuple[Experiment, str, Params]) -> RunResult:
    return run(*job)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.policies", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=Params.seed)
    parser.add_argument("--requests", type=int, default=Params.requests)
    parser.add_argument("--load", type=float, default=Params.load,
                        help="arrival rate as a fraction of full-batch capacity")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="worker processes (results do not depend on it)")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="directory for policies.md and policies.png")
    args = parser.parse_args(argv)
    params = Params(seed=args.seed, requests=args.requests, load=args.load)

    started = time.perf_counter()
    jobs = [(e, p, params) for e in EXPERIMENTS for p in e.policies]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as executor:
            results = list(executor.map(_run_job, jobs))
    else:
        results = [_run_job(job) for job in jobs]
    wall = time.perf_counter() - started

    workload = make_workload(params, 1)
    report = markdown(results, params, workload, wall)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "policies.md").write_text(report)
    plot(results, args.out / "policies.png")
    print(report)
    print(f"\nwrote {args.out / 'policies.md'} and {args.out / 'policies.png'} "
          f"({wall:.0f} s; slowest run {max(r.wall_seconds for r in results):.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
