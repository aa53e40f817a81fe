"""
``twistd -n llmlb --policy cache-aware`` as a real process in front of simulated vLLM
engines: requests that share a long prefix land on one backend, different tenants spread
over the fleet, and the result log names where each went.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from twisted.internet import defer
from twisted.trial.unittest import TestCase

from ..processes import Client, TwistdProcess, header
from .test_integration import JSON, Fleet


def tenant_body(tenant: int, question: str) -> bytes:
    system = (f"You are tenant {tenant}'s assistant; follow its house rules. " * 80)
    return json.dumps({"model": "sim-model", "stream": False, "max_tokens": 2,
                       "messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": question}]}).encode()


class CacheAwareProcessTests(TestCase):
    timeout = 60

    @defer.inlineCallbacks
    def test_a_shared_prefix_stays_home_and_tenants_spread(self) -> Any:
        fleet = Fleet(self, 4)
        log = Path(self.mktemp()).resolve()
        lb = TwistdProcess("--backends", ",".join(fleet.keys), "--policy", "cache-aware",
                           "--log-file", str(log))
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        yield defer.ensureDeferred(lb.started())
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)

        served: dict[int, list[str]] = {}
        for round_ in range(3):
            for tenant in range(6):  # not a multiple of 4: least-conn would move them
                response, _ = yield defer.ensureDeferred(client.fetch(
                    lb.url + "/v1/chat/completions", b"POST",
                    tenant_body(tenant, f"question {round_}"), JSON))
                self.assertEqual(response.code, 200)
                served.setdefault(tenant, []).append(header(response, b"x-backend") or "")
        for tenant, backends in served.items():
            self.assertEqual(len(set(backends)), 1, f"tenant {tenant} moved: {backends}")
        homes = Counter(backends[0] for backends in served.values())
        self.assertEqual(set(homes), set(fleet.keys))  # every engine holds some tenants
        self.assertEqual(sorted(homes.values()), [1, 1, 2, 2])  # spread, not clustered
        # the result log names the backend of every request, as the header did
        yield defer.ensureDeferred(lb.stop())
        logged = Counter(line.split()[3] for line in log.read_text().splitlines()
                         if " status=200 " in line)
        expected = Counter(b for backends in served.values() for b in backends)
        self.assertEqual(logged, expected)
