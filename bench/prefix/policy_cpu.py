"""
What a txlb policy itself costs per request: ``choose()`` + ``observe()`` on a workload.

No network and no reactor: a :class:`~txlb._cluster.pool.Pool` of ``backends`` backends,
the policy :func:`~txlb._scheduling.policies.registry.make_policy` builds, and for each
workload request one ``RoutingRequest`` (body bytes and the parsed JSON, as the proxy
builds it), ``prepare`` (for a policy that prepares requests, as the router calls it) and ``choose``
(timed together as the choice), a slot taken with ``pool.slots.acquire`` (so the policy sees
load: at most ``in_flight`` requests are held, the oldest released first) and, when the slot is
released, ``observe`` with the outcome the bookkeeper would give (prompt tokens at 4
characters a token, a quarter of them cached).  Only the ``choose`` and ``observe`` calls
are timed (``time.process_time_ns``, so other processes on the machine do not count);
building the requests is not.
"""

from __future__ import annotations

import json
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from twisted.internet.task import Clock

from bench.prefix.workloads import CHARS_PER_TOKEN, PrefixRequest
from txlb._cluster.backend import Backend
from txlb._cluster.pool import Pool
from txlb._cluster.slots import Lease
from txlb._config import BackendSpec
from txlb._scheduling.outcome import RequestOutcome
from txlb._scheduling.policies import IPreparesRequests
from txlb._scheduling.policies.registry import make_policy
from txlb._scheduling.request import RoutingRequest


@dataclass(frozen=True)
class PolicyCost:
    policy: str
    requests: int
    choose_us: float  # mean microseconds of CPU per choose()
    observe_us: float  # mean microseconds of CPU per observe()

    @property
    def total_us(self) -> float:
        return self.choose_us + self.observe_us


def measure(policy_name: str, requests: Sequence[PrefixRequest], backends: int = 4,
            in_flight: int = 32) -> PolicyCost:
    """The policy's CPU per request on ``requests`` (see the module docstring)."""
    clock = Clock()
    pool = Pool(tuple(BackendSpec("127.0.0.1", 9000 + i) for i in range(backends)),
                clock=clock)
    policy = make_policy(policy_name, clock, random.Random(f"policy-cpu-{policy_name}"))
    candidates = list(pool)
    prepares = IPreparesRequests.providedBy(policy)
    routing = [RoutingRequest(model=r.body.get("model"), body=json.dumps(r.body).encode(),
                              json=r.body) for r in requests]
    held: deque[tuple[Lease, Backend, RequestOutcome]] = deque()
    choose_ns = observe_ns = 0
    for request, routed in zip(requests, routing, strict=True):
        if len(held) >= in_flight:
            lease, backend, outcome = held.popleft()
            lease.release()
            started = time.process_time_ns()
            policy.observe(backend, outcome)
            observe_ns += time.process_time_ns() - started
        started = time.process_time_ns()
        if prepares:
            IPreparesRequests(policy).prepare(routed)
        backend = policy.choose(candidates, routed)
        choose_ns += time.process_time_ns() - started
        prompt = request.prompt_chars() // CHARS_PER_TOKEN
        held.append((pool.slots.acquire(backend), backend, RequestOutcome(
            backend=backend.key, status=200, answered=True, ttfb=0.1, duration=1.0,
            prompt_tokens=prompt, cached_prompt_tokens=prompt // 4, routing=routed)))
    while held:
        lease, backend, outcome = held.popleft()
        lease.release()
        started = time.process_time_ns()
        policy.observe(backend, outcome)
        observe_ns += time.process_time_ns() - started
    n = max(1, len(requests))
    return PolicyCost(policy_name, len(requests), choose_ns / n / 1000, observe_ns / n / 1000)
