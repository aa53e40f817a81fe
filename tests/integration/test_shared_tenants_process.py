"""
Tenants over ``--shared-state`` for real: a real ``redis-server`` and two ``twistd -n llmlb
--auth keys`` replicas with the same keys file.  A key revoked through one replica's admin
API is refused by the other within a second, before the other reloads; what one replica
serves a tenant shows in the other's fair-share counters.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor, task

from ..processes import TwistdProcess, chat_body
from .test_integration import JSON, Fleet
from .test_shared_state_process import SharedStateCase
from .test_tenants_process import make_key


class SharedTenantsProcessTests(SharedStateCase):
    async def keyed_replicas(self) -> tuple[list[TwistdProcess], dict[str, str]]:
        self.fleet = Fleet(self, 1)
        directory = Path(tempfile.mkdtemp(prefix="txlb-shared-tenants-"))
        self.addCleanup(shutil.rmtree, directory, True)
        keys = directory / "keys.toml"
        keys.write_text("")
        keys.chmod(0o600)
        made = {name: make_key(keys, name) for name in ("alpha", "beta")}
        replicas = await self.replicas(2, "--auth", "keys", "--keys-file", str(keys))
        return replicas, made

    async def code(self, replica: TwistdProcess, key: str) -> int:
        response, _ = await self.client.fetch(
            replica.url + "/v1/chat/completions", b"POST", chat_body(stream=False),
            {**JSON, b"authorization": [f"Bearer {key}".encode()]})
        return int(response.code)

    @defer.inlineCallbacks
    def test_a_key_revoked_on_one_replica_is_refused_by_the_other_within_a_second(self) -> Any:
        (one, other), made = yield defer.ensureDeferred(self.keyed_replicas())
        code = yield defer.ensureDeferred(self.code(other, made["alpha"]))
        self.assertEqual(code, 200)
        digest = hashlib.sha256(made["alpha"].encode()).hexdigest()
        response, body = yield defer.ensureDeferred(self.client.fetch(
            one.admin_url + f"/tenants/keys/{digest[:8]}", b"DELETE"))
        self.assertEqual(response.code, 200, body.body)
        revoked_at = time.monotonic()
        while True:  # bounded: 40 tries, 2 s
            code = yield defer.ensureDeferred(self.code(other, made["alpha"]))
            if code == 401:
                break
            self.assertLess(time.monotonic() - revoked_at, 2.0, "never refused")
            yield task.deferLater(reactor, 0.05)
        self.assertLess(time.monotonic() - revoked_at, 1.5)
        self.assertNotIn("reload", other.output().split("shared state: connected")[-1])
        code = yield defer.ensureDeferred(self.code(other, made["beta"]))
        self.assertEqual(code, 200)

    @defer.inlineCallbacks
    def test_what_one_replica_serves_shows_in_the_others_counters(self) -> Any:
        (one, other), made = yield defer.ensureDeferred(self.keyed_replicas())
        for _ in range(3):
            code = yield defer.ensureDeferred(self.code(one, made["alpha"]))
            self.assertEqual(code, 200)

        async def counters() -> dict[str, float]:
            _, body = await self.client.fetch(other.admin_url + "/tenants")
            listing: dict[str, Any] = json.loads(body.body)
            return listing["fairness"]["counters"]

        deadline = time.monotonic() + 5
        while True:
            seen = yield defer.ensureDeferred(counters())
            if seen.get("alpha", 0) > 0:
                break
            self.assertLess(time.monotonic(), deadline, f"never shared: {seen}")
            yield task.deferLater(reactor, 0.1)

