"""
Tenants through the real ``twistd -n llmlb --auth keys`` over ``twistd vllm-sim``: keys made
by ``python -m txlb.keys``, the official ``openai`` client with a good key and a wrong one,
a tenant's models, the tenant in the result log (never a key), the same under
``--workers 2``, and the fair queue's order behind a busy backend.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor, task, threads

from ..parts import missing
from ..processes import ROOT, Client, TwistdProcess, chat_body, clean_environment, wait_until
from .test_classes_process import QueueProcessCase
from .test_integration import JSON


def make_key(keys: Path, tenant: str) -> str:
    """A key for ``tenant`` added to ``keys`` by the command an operator runs."""
    done = subprocess.run([sys.executable, "-m", "txlb.keys", tenant, "--add", str(keys)],
                          capture_output=True, text=True, timeout=60,
                          env=clean_environment(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines()[1]


def ask_openai(base: str, key: str, model: str = "sim-model") -> tuple[str, Any]:
    """One streamed chat and the model list through the official client, or its error."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    try:
        models = [m.id for m in client.models.list()]
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], stream=True,
            max_tokens=5)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream
                       if chunk.choices)
    except openai.APIStatusError as error:
        return type(error).__name__, (error.status_code, error.body)
    return "ok", (models, text)


def list_models(base: str, key: str) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    return [m.id for m in client.models.list()]


class TenantProcessTests(QueueProcessCase):
    async def start_keys(self, *args: str, tenants: str = "",
                         max_conns: int = 0) -> tuple[TwistdProcess, Path, dict[str, str]]:
        try:
            import openai  # noqa: F401
        except ImportError:
            missing("openai", "the openai package is not installed")
        (sim,) = await self.sims(1, "--tokens-per-second", "20", "--ttft", "0.01")
        directory = Path(tempfile.mkdtemp(prefix="txlb-tenants-"))
        self.addCleanup(shutil.rmtree, directory, True)
        keys = directory / "keys.toml"
        keys.write_text("# the team keys\n" + tenants)
        keys.chmod(0o600)
        made = {name: make_key(keys, name) for name in ("alpha", "beta")}
        config = directory / "lb.toml"
        config.write_text(f'auth = "keys"\nkeys-file = "{keys}"\n'
                          f'[[backends]]\nurl = "{sim.key}"\nmax_conns = {max_conns}\n')
        log = directory / "results.log"
        lb = TwistdProcess("--config", str(config), "--log-file", str(log),
                           "--log-format", "json", "--health-interval", "5", *args)
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        await lb.started()
        self.client = Client()
        self.addCleanup(self.client.pool.closeCachedConnections)
        return lb, log, made

    async def models_learned(self, lb: TwistdProcess, key: str) -> None:
        """
        Until ``GET /v1/models`` lists the simulator's model: the balancer learns it from
        the backend's own list, on the first health check after it starts.
        """
        deadline = time.monotonic() + 10
        while True:
            _, body = await self.client.fetch(
                lb.url + "/v1/models", headers={b"authorization": [f"Bearer {key}".encode()]})
            if b"sim-model" in body.body:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the model was never listed: {body.body!r}")
            await task.deferLater(reactor, 0.02)

    def check_keys(self, lb: TwistdProcess, log: Path, made: dict[str, str]) -> Any:
        yield defer.ensureDeferred(self.models_learned(lb, made["alpha"]))
        good = yield threads.deferToThread(ask_openai, lb.url, made["alpha"])
        self.assertEqual(good[0], "ok")
        self.assertEqual(good[1][0], ["sim-model"])
        self.assertTrue(good[1][1])
        wrong = yield threads.deferToThread(ask_openai, lb.url, made["alpha"][:-1] + "x")
        self.assertEqual(wrong[0], "AuthenticationError")
        self.assertEqual(wrong[1][0], 401)
        self.assertEqual(wrong[1][1]["code"], "invalid_api_key")
        # beta may use m1 only, which the simulator does not serve
        limited = yield threads.deferToThread(ask_openai, lb.url, made["beta"])
        self.assertEqual(limited[0], "NotFoundError")
        self.assertEqual((limited[1][0], limited[1][1]["code"]), (404, "model_not_found"))
        listed = yield threads.deferToThread(list_models, lb.url, made["beta"])
        self.assertEqual(listed, [])

        def lines() -> list[dict[str, Any]]:
            return [json.loads(line) for line in log.read_text().splitlines()]

        yield defer.ensureDeferred(wait_until(lambda: log.exists() and any(
            line["path"] == "/v1/chat/completions" for line in lines()), timeout=20,
            what="the chat's result-log line"))
        chats = [line for line in lines() if line["path"] == "/v1/chat/completions"]
        self.assertEqual(chats[0]["tenant"], "alpha")
        refused = [line for line in lines() if line["status"] == 401]
        self.assertTrue(refused)
        self.assertTrue(all("tenant" not in line for line in refused))
        for key in made.values():
            self.assertNotIn(key, log.read_text())
            self.assertNotIn(key, lb.output())

    @defer.inlineCallbacks
    def test_keys_the_openai_client_and_the_result_log(self) -> Any:
        lb, log, made = yield defer.ensureDeferred(self.start_keys(
            tenants='[tenants.beta]\nmodels = ["m1"]\n'))
        yield from self.check_keys(lb, log, made)

    @defer.inlineCallbacks
    def test_the_same_under_workers(self) -> Any:
        lb, log, made = yield defer.ensureDeferred(self.start_keys(
            "--workers", "2", "--admin", "tcp:0:interface=127.0.0.1",
            tenants='[tenants.beta]\nmodels = ["m1"]\n'))
        yield from self.check_keys(lb, log, made)
        # the workers told the supervisor what they served: its counters are the fleet's
        response, body = yield defer.ensureDeferred(self.client.fetch(
            lb.admin_url + "/tenants", b"GET"))
        self.assertEqual(response.code, 200)
        listing = json.loads(body.body)
        self.assertEqual([t["name"] for t in listing["tenants"]], ["alpha", "beta"])
        self.assertEqual(listing["fairness"]["order"], "vtc")
        self.assertGreater(listing["fairness"]["counters"]["alpha"], 0)

    def send_as(self, lb: TwistdProcess, key: str, orid: str, tokens: int,
                stream: bool = False) -> defer.Deferred[Any]:
        return defer.ensureDeferred(self.client.fetch(
            lb.url + "/v1/chat/completions", b"POST", chat_body(stream=stream),
            {**JSON, b"x-orid": [orid.encode()], b"x-sim-tokens": [str(tokens).encode()],
             b"authorization": [f"Bearer {key}".encode()]}))

    @defer.inlineCallbacks
    def test_a_light_tenant_is_not_queued_behind_a_heavy_ones_backlog(self) -> Any:
        lb, log, made = yield defer.ensureDeferred(self.start_keys(max_conns=1))
        answers = [self.send_as(lb, made["alpha"], "busy", 40)]
        yield defer.ensureDeferred(self.holding(lb))
        for n in range(3):
            answers.append(self.send_as(lb, made["alpha"], f"a{n}", 1))
            yield defer.ensureDeferred(self.queued(lb, n + 1))
        answers.append(self.send_as(lb, made["beta"], "b0", 1))
        yield defer.ensureDeferred(self.queued(lb, 4))
        results = yield defer.gatherResults(answers, consumeErrors=True)
        self.assertEqual([response.code for response, _ in results], [200] * 5)
        order = yield defer.ensureDeferred(self.served(log, 5))
        # beta starts at alpha's counter (no credit for idling): a tie, which a0 wins by
        # arriving first; then beta, ahead of the rest of alpha's backlog (FIFO: last)
        self.assertEqual([orid for orid, _ in order], ["busy", "a0", "b0", "a1", "a2"])

    async def queued_in_workers(self, lb: TwistdProcess, length: int) -> None:
        """Until ``length`` requests wait in the workers' queues together (admin ``/status``)."""
        async def count() -> int:
            _, body = await self.client.fetch(lb.admin_url + "/status")
            return sum(row["queued"] for row in json.loads(body.body)["workers"])

        deadline = time.monotonic() + 10
        while (waiting := await count()) != length:
            if time.monotonic() > deadline:
                raise AssertionError(f"the workers' queues never held {length}: {waiting}")
            await task.deferLater(reactor, 0.02)

    @defer.inlineCallbacks
    def test_the_fair_order_holds_across_workers(self) -> Any:
        """
        Under ``--workers 2`` the requests land in whichever worker accepts them; however
        they land, a freed slot goes to the least served tenant waiting in either worker:
        beta is served within two turns of the slot freeing up, never behind all of
        alpha's backlog (what each worker's own order gives when beta waits alone in the
        other worker).  The answers stream, so each is charged what it is served as it
        is served: no estimate settles later and reorders the counters (the workers'
        timing decides when a settle lands).
        """
        lb, log, made = yield defer.ensureDeferred(self.start_keys(
            "--workers", "2", "--admin", "tcp:0:interface=127.0.0.1", max_conns=1))
        answers = [self.send_as(lb, made["alpha"], "busy", 40, stream=True)]
        yield defer.ensureDeferred(self.holding(lb))
        for n in range(4):
            answers.append(self.send_as(lb, made["alpha"], f"a{n}", 1, stream=True))
            yield defer.ensureDeferred(self.queued_in_workers(lb, n + 1))
        answers.append(self.send_as(lb, made["beta"], "b0", 1, stream=True))
        yield defer.ensureDeferred(self.queued_in_workers(lb, 5))
        results = yield defer.gatherResults(answers, consumeErrors=True)
        self.assertEqual([response.code for response, _ in results], [200] * 6)
        order = [orid for orid, _ in (yield defer.ensureDeferred(self.served(log, 6)))]
        self.assertEqual(order[0], "busy")
        self.assertIn("b0", order[1:3], order)
