"""
A policy's per-request work runs before the router takes its lock (``IPreparesRequests``):
with ``--workers`` that lock is every worker's, so hashing a prompt inside it would delay
all of them.  The cache-aware policy hashes each request once, whatever its retries.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.server import Site
from zope.interface import implementer

from txlb import BackendSpec, IPreparesRequests, LoadBalancer, Policy, RoutingRequest
from txlb._cluster.backend import Backend
from txlb._cluster.pool import Pool
from txlb._config import build_config
from txlb._scheduling.policies.cache_aware import CacheAware
from txlb._scheduling.request import ANY_REQUEST

from ..helpers import ClientConnection, FakeResponse, FakeUpstream


@implementer(IPreparesRequests)
class Preparing(Policy):
    """Records, for each call, whether the pool's lock was held."""

    name = "preparing"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.locked = False
        self.calls: list[tuple[str, bool]] = []

    def prepare(self, request: RoutingRequest) -> None:
        self.calls.append(("prepare", self.locked))
        if self.fail:
            raise RuntimeError("prepare broke")
        request.memo[self] = "worked out"

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        self.calls.append((f"choose:{request.memo.get(self)}", self.locked))
        return candidates[0]


class PrepareTests(SynchronousTestCase):
    def build(self, policy: Policy, backends: int = 1) -> None:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write("".join(f'[[backends]]\nurl = "127.0.0.1:{8002 + n}"\n'
                                 for n in range(backends)))
        self.lb = LoadBalancer(config=build_config({"config": path, "log_file": "none"}, {}),
                               reactor=self.clock, agent=self.upstream,
                               probe_agent=FakeUpstream(), rng=random.Random(5),
                               policy=policy)
        self.site = Site(self.lb.resource(), reactor=self.clock)
        pool = self.lb.pool
        exclusive = pool.slots.exclusive

        def locked(fn: Callable[..., Any], *args: Any) -> Any:
            # what --workers' pool does: the choice runs under the workers' shared lock
            assert isinstance(policy, (Preparing, Counting))
            policy.locked = True
            try:
                return exclusive(fn, *args)
            finally:
                policy.locked = False

        pool.slots.exclusive = locked  # type: ignore[method-assign]

    def post(self, body: dict[str, object]) -> ClientConnection:
        client = ClientConnection(self.site)
        client.request(b"POST", b"/v1/chat/completions", body=json.dumps(body).encode())
        return client

    def test_prepare_runs_before_the_lock_and_choose_sees_its_work(self) -> None:
        policy = Preparing()
        self.build(policy)
        self.post({"model": "m", "messages": []})
        self.assertEqual(policy.calls, [("prepare", False), ("choose:worked out", True)])

    def test_a_failing_prepare_is_logged_and_the_request_still_routed(self) -> None:
        policy = Preparing(fail=True)
        self.build(policy)
        self.post({"model": "m", "messages": []})
        self.assertEqual(policy.calls, [("prepare", False), ("choose:None", True)])
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_cache_aware_hashes_a_request_once_across_its_retry(self) -> None:
        policy = Counting()
        self.build(policy, backends=2)
        self.post({"model": "m", "messages": [{"role": "system", "content": "s" * 2000}]})
        self.assertEqual(len(self.upstream.calls), 1)
        self.upstream.calls[0].respond(FakeResponse(502))
        self.assertEqual(len(self.upstream.calls), 2)  # retried on the other backend
        self.assertEqual(policy.hashed, [False])  # once, and outside the lock

    def test_the_shared_any_request_keeps_no_memo(self) -> None:
        policy = CacheAware()
        (backend,) = Pool((BackendSpec("127.0.0.1", 8002),))
        policy.prepare(ANY_REQUEST)
        policy.choose([backend], ANY_REQUEST)
        self.assertEqual(ANY_REQUEST.memo, {})


class Counting(CacheAware):
    """Cache-aware, counting the prompts it hashes and whether the lock was held then."""

    def __init__(self) -> None:
        super().__init__()
        self.locked = False
        self.hashed: list[bool] = []
        key = self.hasher.key

        def counted(body: Any, model: Any, budget: Any = None) -> tuple[list[int], int]:
            self.hashed.append(self.locked)
            return key(body, model, budget)

        self.hasher.key = counted  # type: ignore[method-assign]
