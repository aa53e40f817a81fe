"""
The real ``twistd -n llmlb`` in front of two real llama.cpp ``llama-server`` processes
(the build in ``../shared/realengine``, see its README): the aliases they list, the
engine txlb recognises in each, ``--unknown-model forward``, the result-log lines of
the Responses and Messages APIs as llama-server answers them, and its prompt cache's hits
as the result log and the metrics report them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from twisted.internet import defer
from twisted.trial.unittest import TestCase

from ..parts import missing, real_engine_dir
from ..processes import Client, TwistdProcess, header, wait_until

REALENGINE = real_engine_dir()
SERVER = REALENGINE / "llama-server"
JSON = {b"content-type": [b"application/json"]}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LlamaServers(TestCase):
    timeout = 120

    def setUp(self) -> None:
        if not os.access(SERVER, os.X_OK):
            missing("llama-server", f"no llama-server at {SERVER}")
        model = Path(self.mktemp() + ".gguf").resolve()
        made = subprocess.run(
            [sys.executable, str(REALENGINE / "make_model.py"), str(model), "--n-embd", "128",
             "--n-layer", "2", "--n-head", "4", "--n-head-kv", "2", "--n-ff", "352"],
            capture_output=True, timeout=60)
        if made.returncode != 0:
            missing("gguf", "make_model.py failed (pip install gguf numpy): "
                    + made.stderr.decode(errors="replace")[-300:])
        self.model = model
        self.keys: list[str] = []

    def start_server(self, *args: str) -> str:
        port = free_port()
        log = open(self.mktemp(), "wb")  # noqa: SIM115 -- closed by the cleanup
        process = subprocess.Popen(
            [str(SERVER), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
             "--parallel", "2", "-c", "4096", "-t", "1", "-tb", "1", "--no-webui", *args],
            stdout=log, stderr=subprocess.STDOUT)

        def stop() -> None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
            log.close()

        self.addCleanup(stop)
        return f"127.0.0.1:{port}"

    async def healthy(self, client: Client, key: str) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                response, _ = await client.fetch(f"http://{key}/health")
                if response.code == 200:
                    return
            except Exception:  # not listening yet
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"llama-server {key} never became healthy")
            await defer.ensureDeferred(_sleepless_pause())

    def test_aliases_engines_unknown_models_and_new_apis(self) -> Any:
        return defer.ensureDeferred(self.scenario())

    async def scenario(self) -> None:
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)
        with_metrics = self.start_server("--alias", "tiny,tiny-alt", "--metrics")
        without = self.start_server("--alias", "other")
        for key in (with_metrics, without):
            await self.healthy(client, key)
        log_path = Path(self.mktemp()).resolve()
        lb = TwistdProcess("--backends", f"{with_metrics},{without}", "--policy", "queue-depth",
                           "--health-interval", "0.5", "--unknown-model", "forward",
                           "--admin", "tcp:0:interface=127.0.0.1", "--log-file", str(log_path))
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        await lb.started()

        engines: dict[str, Any] = {}

        async def recognised() -> bool:
            _, body = await client.fetch(lb.admin_url + "/status")
            engines.update({b["backend"]: b for b in json.loads(body.body)["backends"]})
            return all(engines.get(k, {}).get("engine") for k in (with_metrics, without))

        deadline = time.monotonic() + 20
        while not await recognised():
            self.assertLess(time.monotonic(), deadline, f"engines never recognised: {engines}")
            await defer.ensureDeferred(_sleepless_pause())
        self.assertEqual(engines[with_metrics]["engine"], "llamacpp")
        self.assertEqual(engines[without]["engine"], "unknown")  # no --metrics: 501
        self.assertEqual(engines[with_metrics]["models"], ["tiny", "tiny-alt"])
        _, status = await client.fetch(lb.url + "/__lb_status")
        self.assertEqual({b["engine"] for b in json.loads(status.body)["backends"]},
                         {"llamacpp", "unknown"})

        # an alias routes to the backend listing it; a name nobody lists is forwarded
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        response, _ = await client.fetch(lb.url + "/v1/chat/completions", b"POST",
                                         json.dumps({"model": "tiny-alt", **chat}).encode(), JSON)
        self.assertEqual((response.code, header(response, b"x-backend")), (200, with_metrics))
        response, _ = await client.fetch(lb.url + "/v1/chat/completions", b"POST",
                                         json.dumps({"model": "anything", **chat}).encode(), JSON)
        self.assertEqual(response.code, 200)

        # the Responses and Messages APIs, streamed and not, get their own fields (ignore_eos:
        # the random model may end an answer early, and these lines count every token;
        # temperature 0: sampled text can hit a stop word, and the model is fixed by its seed,
        # so greedy decoding gives the same answers every run)
        for path, body in [
                ("/v1/responses", {"input": "Hi", "max_output_tokens": 6, "stream": True}),
                ("/v1/responses", {"input": "Hi", "max_output_tokens": 6}),
                ("/v1/messages", {**chat, "max_tokens": 5, "stream": True}),
                ("/chat/completions", {**chat, "max_tokens": 3})]:
            asked = {"model": "tiny", **body, "ignore_eos": True, "temperature": 0}
            response, _ = await client.fetch(lb.url + path, b"POST",
                                             json.dumps(asked).encode(), JSON)
            self.assertEqual(response.code, 200, path)
        def forwarded() -> list[str]:
            # the lines of what the engines answered, not of txlb's own /__lb_status
            return [line for line in log_path.read_text().splitlines()
                    if " GET /__lb_status " not in line]

        await wait_until(lambda: log_path.exists() and len(forwarded()) >= 6, timeout=10,
                         what="six result-log lines")
        lines = forwarded()
        self.assertIn("finish=completed ctok=6/6", lines[2])
        self.assertIn("path=/v1/responses", lines[2])
        self.assertIn("finish=completed ctok=6/6", lines[3])
        self.assertIn("finish=max_tokens ctok=5/5", lines[4])
        self.assertIn("finish=length ctok=3/3", lines[5])
        self.assertIn("path=/chat/completions", lines[5])

        # --policy queue-depth says once that the backend without metrics has no queue
        warnings = [line for line in lb.output().splitlines()
                    if "exports no engine queue" in line]
        self.assertEqual(len(warnings), 1, lb.output()[-2000:])
        self.assertIn(without, warnings[0])
        self.assertIn("HTTP 501", warnings[0])


    def test_queue_depth_reads_the_llamacpp_queue(self) -> Any:
        return defer.ensureDeferred(self.queue_depth_scenario())

    async def queue_depth_scenario(self) -> None:
        """
        ``--policy queue-depth`` reads the engine's own ``llamacpp:requests_processing`` and
        ``llamacpp:requests_deferred``: requests sent to the engine directly (so that txlb
        counts none of them itself) show in the backend's ``engine_depth``, and with one
        slot a depth of 2 or more can only come from the deferred queue.
        """
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)
        key = self.start_server("--metrics", "--parallel", "1")
        await self.healthy(client, key)
        lb = TwistdProcess("--backends", key, "--policy", "queue-depth",
                           "--health-interval", "0.2", "--admin", "tcp:0:interface=127.0.0.1")
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        await lb.started()

        async def status() -> dict[str, Any]:
            _, body = await client.fetch(lb.admin_url + "/status")
            backends: list[dict[str, Any]] = json.loads(body.body)["backends"]
            return backends[0]

        deadline = time.monotonic() + 20
        while (await status()).get("engine") != "llamacpp":
            self.assertLess(time.monotonic(), deadline, "the engine was never recognised")
            await defer.ensureDeferred(_sleepless_pause())
        idle = await status()
        self.assertEqual(idle["engine_depth"], 0.0)

        # four long generations straight to the engine: one runs, three wait in its queue
        # (ignore_eos: the random model may end one at once)
        body = json.dumps({"model": "x", "prompt": "Hi", "max_tokens": 1500,
                           "ignore_eos": True}).encode()
        direct = [defer.ensureDeferred(client.fetch(f"http://{key}/v1/completions", b"POST",
                                                    body, JSON)) for _ in range(4)]
        depths = []
        deadline = time.monotonic() + 30
        try:
            while not any(depth >= 2 for depth in depths):
                self.assertLess(time.monotonic(), deadline,
                                f"the engine's queue never showed: depths {depths}")
                backend = await status()
                self.assertEqual(backend["active"], 0)  # none of them is txlb's
                if backend["engine_depth"] is not None:
                    depths.append(backend["engine_depth"])
                await defer.ensureDeferred(_sleepless_pause())
        finally:
            await defer.DeferredList(direct, consumeErrors=True)
        self.assertLessEqual(max(depths), 4, depths)

    def test_a_repeated_prompt_is_reported_cached(self) -> None:
        return defer.ensureDeferred(self.prompt_cache_scenario())

    def test_a_repeated_prompt_is_reported_cached_through_workers(self) -> None:
        """The same, where workers summarise and the supervisor writes and counts."""
        return defer.ensureDeferred(self.prompt_cache_scenario("--workers", "2"))

    async def prompt_cache_scenario(self, *options: str) -> None:
        """
        llama-server's prompt cache, as txlb reports it: the second of two identical
        prompts (one slot, so the same cache) is mostly served from the cache, in the
        result log (JSON), plain and streamed -- a stream without ``include_usage`` says
        it only in its ``timings`` -- and in the metrics.
        """
        client = Client()
        self.addCleanup(client.pool.closeCachedConnections)
        key = self.start_server("--parallel", "1", "--alias", "tiny")
        await self.healthy(client, key)
        log_path = Path(self.mktemp()).resolve()
        lb = TwistdProcess("--backends", key, "--admin", "tcp:0:interface=127.0.0.1",
                           "--log-file", str(log_path), "--log-format", "json", *options)
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        await lb.started()
        system = "You answer every question about the sea with care and in detail. " * 6
        chat = {"model": "tiny", "max_tokens": 3, "ignore_eos": True,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": "Why is the sea blue?"}]}
        for body in (chat, chat, {**chat, "stream": True}):
            response, _ = await client.fetch(lb.url + "/v1/chat/completions", b"POST",
                                             json.dumps(body).encode(), JSON)
            self.assertEqual(response.code, 200)
        await wait_until(lambda: log_path.exists() and len(log_path.read_text().splitlines())
                         >= 3, timeout=10, what="three result-log lines")
        lines = [json.loads(line) for line in log_path.read_text().splitlines()]
        self.assertEqual([line["stream"] for line in lines], [False, False, True])
        counts = [(line["ptok"], line["cached"]) for line in lines]
        prompt = counts[0][0]
        self.assertGreater(prompt, 100, counts)
        self.assertEqual([ptok for ptok, _ in counts], [prompt] * 3, counts)
        self.assertLess(counts[0][1], prompt // 2, counts)  # a cold cache
        for _, cached in counts[1:]:
            self.assertGreater(cached, prompt // 2, counts)
        _, metrics = await client.fetch(lb.admin_url + "/metrics")
        text = metrics.body.decode()
        self.assertIn(f'txlb_prompt_tokens_total{{backend="{key}"}} {float(3 * prompt)}', text)
        cached_total = float(sum(cached for _, cached in counts))
        self.assertIn(f'txlb_cached_prompt_tokens_total{{backend="{key}"}} {cached_total}',
                      text)



async def _sleepless_pause() -> None:
    """Give the reactor 50 ms (a timer, not a sleep: other events run meanwhile)."""
    from twisted.internet import reactor, task

    await task.deferLater(reactor, 0.05, lambda: None)
