"""
``python -m bench.prefix.sharing_cost``: the CPU the shared cache-aware index adds per request.

Two replicas (real :class:`~txlb.LoadBalancer` objects with ``--policy cache-aware`` and
``--shared-state``) share an in-memory Redis on a :class:`~twisted.internet.task.Clock`, so
what is timed is txlb's own work, not a network: replica A picks for ``--requests``
prompts of ``--blocks`` blocks (a tenant's shared prefix and a question of its own), its
poll publishes them, replica B's poll applies them.  Printed per request, in microseconds
of process time:

* the pick on A without sharing (hook off) and with it (the chain remembered for the poll);
* A's poll: the entries built and handed to the client (the command's bytes are written
  by the client, pipelined with the poll, off the request's path);
* B's poll: the entries parsed and applied to its index -- paid by every other replica.

The Redis client's own encoding, the socket and Redis itself are not in these figures.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from txlb import LoadBalancer
from txlb._config import build_config
from txlb._config.shared import SharedStateSpec
from txlb._scheduling.policies.cache_aware import CacheAware
from txlb._scheduling.request import RoutingRequest
from txlb._shared.prefixes import FLEET_KEY
from txlb._shared.store import POLL, RedisStore


class MemoryRedis:
    """The few commands the store and the shared index send, answered from memory."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.key: str | None = None
        self.entries: list[tuple[int, list[Any]]] = []
        self.last = 0

    def execute_command(self, *args: Any, **kwargs: Any) -> Deferred[Any]:
        name = args[0]
        if name in ("EVALSHA", "EVAL") and args[1] in (FLEET_KEY.sha, FLEET_KEY.source):
            self.key = self.key or args[4]
            return succeed(self.key)
        if name in ("EVALSHA", "EVAL") and args[1] in (POLL.sha, POLL.source):
            return succeed(["2", "0"])
        if name == "XADD":
            self.last += 1
            self.entries.append((self.last, list(args[6:])))
            del self.entries[:-int(args[4])]
            return succeed(f"{self.last}-0")
        if name == "XREAD":
            after = int(str(args[5]).partition("-")[0])
            found = [[f"{n}-0", fields] for n, fields in self.entries if n > after]
            return succeed([[args[4], found[:int(args[2])]]] if found else None)
        return succeed([] if name == "HGETALL" else "OK")


def replica(redis: MemoryRedis, name: str, backends: str) -> LoadBalancer:
    config = build_config({"backends": backends, "policy": "cache-aware",
                           "shared-state": "redis://127.0.0.1:6379/0"}, environ={})
    store = RedisStore(SharedStateSpec("127.0.0.1", 6379), redis.clock, redis, replica=name)
    return LoadBalancer(config=config, reactor=redis.clock, store=store)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--blocks", type=int, default=32,
                        help="blocks (256 characters) per prompt")
    parser.add_argument("--tenants", type=int, default=50)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--per-poll", type=int, default=50,
                        help="requests between two polls (500/s at the 0.1 s poll)")
    args = parser.parse_args(argv)
    clock = Clock()
    redis = MemoryRedis(clock)
    backends = ",".join(f"127.0.0.1:{8001 + n}" for n in range(args.engines))
    a, b = replica(redis, "a", backends), replica(redis, "b", backends)
    for lb in (a, b):
        assert isinstance(lb.store, RedisStore) and lb.shared_index is not None
        lb.store.start()
        lb.store.link.connected = True
        lb.shared_index.poll()  # the key
    policy_a = a.policy
    assert isinstance(policy_a, CacheAware)
    rng = random.Random(1)
    size = args.blocks * 256
    bodies = []
    for n in range(args.requests):
        tenant = f"tenant {rng.randrange(args.tenants)} system prompt. " * (size // 30)
        bodies.append({"model": "m", "prompt": tenant[:size - 256] + f"question {n} " * 20})
    plain = LoadBalancer(config=build_config({"backends": backends, "policy": "cache-aware"},
                                             environ={}), reactor=clock)
    policy_plain = plain.policy
    assert isinstance(policy_plain, CacheAware)
    assert a.shared_index is not None and b.shared_index is not None
    alone = shared = written = read = 0.0
    for start in range(0, len(bodies), args.per_poll):
        for policy, lb in ((policy_plain, plain), (policy_a, a)):
            spent = 0.0
            for body in bodies[start:start + args.per_poll]:
                request = RoutingRequest(json=body, model="m")
                policy.prepare(request)  # the hashing: the same with or without sharing
                began = time.process_time()
                policy.choose(list(lb.pool), request)
                spent += time.process_time() - began
            if policy is policy_plain:
                alone += spent
            else:
                shared += spent
        began = time.process_time()
        a.shared_index.poll()
        written += time.process_time() - began
        began = time.process_time()
        while True:
            before = b.shared_index.applied
            b.shared_index.poll()
            if b.shared_index.applied == before:
                break
        read += time.process_time() - began
    n = len(bodies)
    print(f"{n} requests of {args.blocks} blocks, {args.tenants} tenants, "
          f"{args.engines} engines, a poll every {args.per_poll} requests")
    print(f"pick, not shared      {alone / n * 1e6:8.1f} us")
    print(f"pick, shared          {shared / n * 1e6:8.1f} us")
    print(f"A's poll (publish)    {written / n * 1e6:8.1f} us per request")
    print(f"B's poll (apply)      {read / n * 1e6:8.1f} us per request, on every other "
          f"replica")
    print(f"chains published by A: {a.shared_index.published} (the same chain to the same "
          f"engine within a poll goes once), applied on B: {b.shared_index.applied}")


if __name__ == "__main__":
    main()
