"""
What ``--policy cache-aware``'s prefix index costs in memory and time:
``python -m bench.prefix_memory [CONVERSATIONS] [CHARS]``.

Routes CONVERSATIONS distinct chat conversations (default 10,000), each a system prompt of
CHARS characters (default 4,000, ~1,000 tokens) and a short question, over eight backends
with no cap on the index, and reports the index's entries and the memory they hold
(``tracemalloc``: every allocation made while routing and still alive after, once the
requests themselves are gone), then the policy's CPU per request.
"""

from __future__ import annotations

import gc
import sys
import time
import tracemalloc

from txlb._cluster.pool import Pool
from txlb._config import BackendSpec
from txlb._scheduling.policies.cache_aware import CacheAware
from txlb._scheduling.request import RoutingRequest


def conversation(n: int, chars: int) -> RoutingRequest:
    system = (f"conversation {n}: you are a helpful assistant. " * (chars // 30 + 1))[:chars]
    return RoutingRequest(model="m", json={"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "hello"}]})


def main(argv: list[str]) -> None:
    conversations = int(argv[0]) if argv else 10_000
    chars = int(argv[1]) if len(argv) > 1 else 4_000
    backends = list(Pool(tuple(BackendSpec("127.0.0.1", 9000 + i) for i in range(8))))
    policy = CacheAware(max_entries=10**8, capacity_blocks=10**8)
    requests = [conversation(n, chars) for n in range(conversations)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    started = time.process_time()
    for request in requests:
        policy.choose(backends, request)
    cpu = time.process_time() - started
    del request
    requests.clear()  # the predictions of requests that are gone are forgotten with them
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    size = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    entries = policy.index.entries
    print(f"{conversations} conversations of {chars} characters over 8 backends: "
          f"{entries} index entries, {size / 1e6:.1f} MB ({size / max(1, entries):.0f} B "
          f"per entry, {size / conversations * 1e4 / 1e6:.1f} MB per 10,000 conversations)")
    # the time without tracemalloc's overhead
    policy = CacheAware()
    requests = [conversation(n % 64, chars) for n in range(5000)]
    started = time.process_time()
    for request in requests:
        policy.choose(backends, request)
    cpu = time.process_time() - started
    print(f"CPU per request (64 recurring prompts, {chars} characters): "
          f"{cpu / len(requests) * 1e6:.0f} us")


if __name__ == "__main__":
    main(sys.argv[1:])
