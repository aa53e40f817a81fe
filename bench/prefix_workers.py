"""
Cache-aware routing under ``--workers``: one index per worker against one shared index, in a
small seeded model -- ``python -m bench.prefix_workers [--seed N]``.

The workload is the one the cache-aware design was measured against: 8 tenants with
800-token system prompts on 4 engines that each cache ~1,900 tokens (two tenants' prompts,
not three), each request the tenant's prompt plus a new question, 16 in flight.  Each engine
is an LRU of the prompt blocks it prefilled (prefix semantics: a request finds the longest
run of its leading blocks cached, then caches all of them); it reports cached tokens, which
closes the policy's loop.  Requests reach the workers at random, as the kernel hands
connections out; the in-flight counts are shared, as under ``--workers``.

Prints the prefix hit rate (cached prompt tokens / prompt tokens) for ``least-conn``, for
``cache-aware`` with one index, and with one index per worker for 2 and 4 workers.
"""

from __future__ import annotations

import argparse
import random
from collections import OrderedDict
from collections.abc import Sequence

from txlb._cluster.backend import Backend
from txlb._cluster.pool import Pool
from txlb._cluster.slots import Lease
from txlb._config import BackendSpec
from txlb._scheduling.outcome import RequestOutcome
from txlb._scheduling.policies import IPolicy
from txlb._scheduling.policies.cache_aware import CacheAware
from txlb._scheduling.policies.least_conn import LeastConnections
from txlb._scheduling.request import RoutingRequest

TENANTS, ENGINES, IN_FLIGHT, REQUESTS = 8, 4, 16, 4000
PROMPT_CHARS, CACHE_CHARS, CHARS_PER_TOKEN = 3200, 7600, 4


class Engine:
    """An engine's prefix cache, in txlb's blocks: an LRU of chain hashes."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def serve(self, chain: Sequence[int]) -> int:
        hit = 0
        for block in chain:
            if block not in self.blocks:
                break
            hit += 1
        for block in reversed(chain):
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hit


def run(policies: Sequence[IPolicy], seed: int) -> tuple[float, int]:
    """The prefix hit rate, and the most requests one engine held in flight."""
    rng = random.Random(seed)
    pool = Pool(tuple(BackendSpec("127.0.0.1", 9000 + i) for i in range(ENGINES)))
    backends = list(pool)
    ruler = CacheAware(secret=b"bench" * 4)  # the engines' own view of blocks
    block = ruler.hasher.block_chars
    engines = {b.key: Engine(CACHE_CHARS // block) for b in backends}
    systems = [(f"Tenant {t} house rules, to be followed in every answer. " * 80)
               [:PROMPT_CHARS] for t in range(TENANTS)]
    flying: list[tuple[Lease, IPolicy, Backend, RoutingRequest, int, int]] = []
    prompt_tokens = cached_tokens = most = 0
    for n in range(REQUESTS):
        body = {"model": "m", "messages": [
            {"role": "system", "content": systems[rng.randrange(TENANTS)]},
            {"role": "user", "content": f"question {n}: " + "w" * rng.randrange(50, 400)}]}
        request = RoutingRequest(model="m", json=body)
        policy = policies[rng.randrange(len(policies))]
        backend = policy.choose(backends, request)
        lease = pool.slots.acquire(backend)
        most = max(most, backend.counts.active)
        chain, chars = ruler.hasher.key(body, "m")
        hit = engines[backend.key].serve(chain)
        tokens = chars // CHARS_PER_TOKEN
        flying.append((lease, policy, backend, request, tokens, hit * block // CHARS_PER_TOKEN))
        prompt_tokens += tokens
        cached_tokens += hit * block // CHARS_PER_TOKEN
        while len(flying) >= IN_FLIGHT:
            lease, done_by, served, done, tokens, cached = flying.pop(rng.randrange(len(flying)))
            lease.release()
            done_by.observe(served, RequestOutcome(
                backend=served.key, status=200, answered=True, ttfb=0.1, duration=1.0,
                prompt_tokens=tokens, cached_prompt_tokens=cached, routing=done))
    return cached_tokens / prompt_tokens, most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    seed = parser.parse_args().seed
    print(f"{TENANTS} tenants x {PROMPT_CHARS // CHARS_PER_TOKEN}-token prompts, {ENGINES} "
          f"engines caching {CACHE_CHARS // CHARS_PER_TOKEN} tokens each, {IN_FLIGHT} in "
          f"flight, {REQUESTS} requests, seed {seed}")
    print("| routing | prefix hit rate | most in flight on one engine |")
    print("|---|---|---|")

    def row(name: str, policies: Sequence[IPolicy]) -> None:
        rate, most = run(policies, seed)
        print(f"| {name} | {rate:.3f} | {most} |")

    row("least-conn", [LeastConnections()])
    for factor in (1.25, 1.5, 2.0):
        row(f"cache-aware, --cache-load {factor}, one process",
            [CacheAware(load_factor=factor)])
    for workers in (2, 4):
        row(f"cache-aware, {workers} workers, an index each",
            [CacheAware() for _ in range(workers)])
        row(f"cache-aware, {workers} workers, one index shared", [CacheAware()] * workers)


if __name__ == "__main__":
    main()
