"""
``--policy cache-aware`` in front of real llama.cpp engines: a tenant's repeated system
prompt goes where the engine already holds it, and the engine says so (``timings.cache_n``).

Real sockets, three ``llama-server`` processes with the generated 1.8 MB model, the real
``twistd -n llmlb``.  NOT RUN (see ``tests.parts.missing``) without the engine or the
model generator's packages.
"""

from __future__ import annotations

import json
import random
from typing import Any

from .test_realengine import MODEL, RealEngineTestCase


def tenant_prompt(tenant: int) -> str:
    """A system prompt of ~800 characters (about as many tokens on the test model)."""
    rng = random.Random(f"cache-aware-real-{tenant}")
    return " ".join(f"{rng.randrange(16 ** 3):03x}" for _ in range(200))


def body(tenant: int, turn: int) -> bytes:
    return json.dumps({
        "model": MODEL, "stream": False, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": tenant_prompt(tenant)},
                     {"role": "user", "content": f"question {turn} from tenant {tenant}"}],
    }).encode()


class CacheAwareRealEngineTests(RealEngineTestCase):
    timeout = 60

    async def test_each_tenant_stays_on_one_engine_and_hits_its_cache(self) -> None:
        await self.start("--policy", "cache-aware", engines=3)
        backends: dict[int, set[str]] = {0: set(), 1: set()}
        cached: dict[int, list[int]] = {0: [], 1: []}
        for turn in range(4):
            for tenant in (0, 1):
                response, chunks = await self.post(self.lb.url, body(tenant, turn))
                self.assertEqual(response.code, 200, chunks.body[:300])
                backend = response.headers.getRawHeaders(b"x-backend")
                assert backend is not None
                backends[tenant].add(backend[0].decode())
                answer: dict[str, Any] = json.loads(chunks.body)
                cached[tenant].append(int(answer["timings"]["cache_n"]))
        for tenant in (0, 1):
            self.assertEqual(len(backends[tenant]), 1,
                             f"tenant {tenant} was spread over {sorted(backends[tenant])}")
            self.assertEqual(cached[tenant][0], 0, "the first request found a cold cache")
            for repeat in cached[tenant][1:]:
                # the whole system prompt (~800 tokens) came from the engine's cache
                self.assertGreater(repeat, 700, cached[tenant])
