"""The routing key seam: what a policy's ``choose`` sees of the request it routes."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.server import Site

from txlb import BackendSpec, LoadBalancer, Policy, Pool, RoutingRequest
from txlb._cluster.backend import Backend
from txlb._scheduling.request import ANY_REQUEST
from txlb._scheduling.router import Router

from ..helpers import ClientConnection, FakeResponse, FakeUpstream


class Recording(Policy):
    """Chooses the first candidate and keeps every request it was asked about."""

    name = "recording"

    def __init__(self) -> None:
        self.seen: list[RoutingRequest] = []

    def choose(self, candidates: Sequence[Backend],
               request: RoutingRequest = ANY_REQUEST) -> Backend:
        self.seen.append(request)
        return candidates[0]


class PromptTests(SynchronousTestCase):
    def test_a_completion_prompt(self) -> None:
        self.assertEqual(RoutingRequest(json={"prompt": "Once upon"}).prompt(), "Once upon")
        self.assertEqual(RoutingRequest(json={"prompt": ["a", "b"]}).prompt(), "a\nb")

    def test_chat_messages_in_order_text_parts_too(self) -> None:
        request = RoutingRequest(json={"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "image_url", "image_url": {}}]},
            "not a message",
        ]})
        self.assertEqual(request.prompt(), "be brief\nhi")

    def test_no_prompt(self) -> None:
        self.assertIsNone(RoutingRequest().prompt())
        self.assertIsNone(RoutingRequest(json={"input": "x"}).prompt())
        self.assertIsNone(RoutingRequest(json={"messages": [{"content": 3}]}).prompt())
        self.assertIsNone(RoutingRequest(json={"prompt": [1, 2]}).prompt())

    def test_frozen(self) -> None:
        with self.assertRaises(AttributeError):
            RoutingRequest().model = "x"  # type: ignore[misc]


class RouterPassesTheRequestTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.pool = Pool((BackendSpec("127.0.0.1", 1, max_conns=1),
                          BackendSpec("127.0.0.1", 2, max_conns=1)))
        self.policy = Recording()
        self.router = Router(self.pool, self.policy, self.clock)

    def test_choose_sees_the_request(self) -> None:
        request = RoutingRequest(model=None, client="ip:10.0.0.1", body=b"{}")
        lease = self.successResultOf(self.router.acquire(request))
        self.assertEqual(self.policy.seen, [request])
        self.assertEqual(lease.backend.key, "127.0.0.1:1")

    def test_a_queued_request_is_chosen_for_with_its_request(self) -> None:
        first = self.successResultOf(self.router.acquire(RoutingRequest(client="a")))
        self.successResultOf(self.router.acquire(RoutingRequest(client="b")))
        waiting = self.router.acquire(RoutingRequest(client="c"))
        self.assertNoResult(waiting)
        first.release()
        self.successResultOf(waiting)
        self.assertEqual([r.client for r in self.policy.seen], ["a", "b", "c"])

    def test_a_retry_carries_the_same_request(self) -> None:
        request = RoutingRequest(client="a")
        self.successResultOf(self.router.acquire(request, exclude=frozenset({"127.0.0.1:1"})))
        self.assertIs(self.policy.seen[-1], request)

    def test_affinity_still_decides_for_a_session(self) -> None:
        from txlb._scheduling.affinity import BoundedLoadRing

        router = Router(self.pool, self.policy, self.clock, affinity=BoundedLoadRing())
        self.successResultOf(router.acquire(RoutingRequest(session="s")))
        self.assertEqual(self.policy.seen, [])


class ProxyFillsTheRequestTests(SynchronousTestCase):
    """From the client's request to the policy: model, session, client, body, one parse."""

    def build(self, **options: Any) -> None:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.policy = Recording()
        self.lb = LoadBalancer(["127.0.0.1:8002", "127.0.0.1:8003"], reactor=self.clock,
                               agent=self.upstream, probe_agent=FakeUpstream(),
                               rng=random.Random(5), policy=self.policy, log_file="none",
                               **options)
        self.site = Site(self.lb.resource(), reactor=self.clock)

    def post(self, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        ClientConnection(self.site, peer="10.9.8.7").request(
            b"POST", b"/v1/chat/completions", headers=headers, body=body)

    def test_model_client_body_and_prompt(self) -> None:
        self.build()
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        self.post(body.encode())
        (seen,) = self.policy.seen
        self.assertEqual(seen.model, "m")
        self.assertEqual(seen.client, "ip:10.9.8.7")
        self.assertIsNone(seen.session)
        self.assertEqual(seen.body, body.encode())
        self.assertEqual(seen.prompt(), "hi")
        self.upstream.calls[0].respond(FakeResponse(200, length=0)).end()

    def test_an_alias_is_seen_resolved_with_the_body_sent(self) -> None:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write('log-file = "none"\nbackends = ["127.0.0.1:8002"]\n'
                         '[[routes]]\nmodel = "alias"\nto = { "real" = 1 }\n')
        from txlb import build_config

        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.policy = Recording()
        lb = LoadBalancer(config=build_config({"config": path}, {}), reactor=self.clock,
                          agent=self.upstream, probe_agent=FakeUpstream(), policy=self.policy)
        self.site = Site(lb.resource(), reactor=self.clock)
        self.post(b'{"model": "alias", "prompt": "p"}')
        (seen,) = self.policy.seen
        self.assertEqual(seen.model, "real")
        self.assertEqual(seen.body, self.upstream.calls[0].body)
        self.assertEqual(json.loads(seen.body)["model"], "real")
        self.assertEqual(seen.prompt(), "p")

    def test_an_alias_rewrite_keeps_a_19_digit_negative_integer_whole(self) -> None:
        """
        -9223372036854775809 is one below the 64-bit minimum (19 digits): the body sent
        with the alias resolved holds it exactly, not rounded to a float.
        """
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write('log-file = "none"\nbackends = ["127.0.0.1:8002"]\n'
                         '[[routes]]\nmodel = "alias"\nto = { "real" = 1 }\n')
        from txlb import build_config

        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.policy = Recording()
        lb = LoadBalancer(config=build_config({"config": path}, {}), reactor=self.clock,
                          agent=self.upstream, probe_agent=FakeUpstream(), policy=self.policy)
        self.site = Site(lb.resource(), reactor=self.clock)
        self.post(b'{"model": "alias", "prompt": "p", "seed": -9223372036854775809}')
        sent = json.loads(self.upstream.calls[0].body)
        self.assertEqual(sent, {"model": "real", "prompt": "p", "seed": -9223372036854775809})
        self.assertIs(type(sent["seed"]), int)

    def test_session_key_of_affinity(self) -> None:
        self.build(affinity="header:x-session")
        self.post(b'{"n": 1}', headers=[(b"x-session", b"abc")])
        # affinity chooses for a session; the policy chose nothing
        self.assertEqual(self.policy.seen, [])
        self.post(b'{"n": 2}')
        (seen,) = self.policy.seen
        self.assertIsNone(seen.session)

    def test_a_body_that_is_not_json_routes_without_a_model(self) -> None:
        self.build()
        self.post(b"not json")
        (seen,) = self.policy.seen
        self.assertIsNone(seen.model)
        self.assertIsNone(seen.json)
        self.assertIsNone(seen.prompt())
        self.assertEqual(seen.body, b"not json")


def _long_conversation() -> dict[str, Any]:
    """An ordinary long request: over the parse budget, model and stream after messages."""
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "Looks something up. " * 4,
        "parameters": {"type": "object", "required": ["q"],
                       "properties": {"q": {"type": "string"}, "k": {"type": "integer"}}}}}
        for i in range(20)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are helpful. " * 50}]
    for turn in range(300):
        messages.append({"role": "user", "content": f"question {turn} é " + "words " * 150})
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": f"answer {turn} " + "more " * 100}]})
    return {"messages": messages, "model": "m", "tools": tools, "stream": True,
            "max_tokens": 300, "n": 2, "user": "u-1",
            "chat_template_kwargs": {"enable_thinking": True}}


class LargeBodyTests(SynchronousTestCase):
    """A body over the parse budget: read as far as routing needs, routed as before."""

    def test_an_ordinary_long_request_has_the_key_and_estimate_of_a_whole_parse(self) -> None:
        from txlb._scheduling.budgets import estimate_tokens
        from txlb._scheduling.prefix import PrefixHasher
        from txlb._scheduling.work import WorkBudget, read_json

        body = json.dumps(_long_conversation()).encode()
        budget = WorkBudget()
        self.assertGreater(len(body), budget.json_bytes)
        reading = read_json(body, budget)
        self.assertTrue(reading.partial)
        whole = json.loads(body)
        hasher = PrefixHasher(secret=b"k" * 32)
        self.assertEqual(hasher.key(reading.json, "m", budget), hasher.key(whole, "m"))
        self.assertEqual(hasher.key(whole, "m")[1], 256 * 256)  # the whole key budget
        path = b"/v1/chat/completions"
        self.assertEqual(estimate_tokens(body, reading.json, path, 256),
                         estimate_tokens(body, whole, path, 256))
        assert reading.json is not None
        for name in ("model", "stream", "max_tokens", "n", "user", "chat_template_kwargs"):
            self.assertEqual(reading.json[name], whole[name], name)

    def test_a_long_prompt_is_read_as_its_beginning_and_keyed_as_a_whole_parse(self) -> None:
        """
        One 4 MB string (a pasted document): its first 256 KiB are read, cut where the
        prefix is still a string -- escapes, surrogate pairs and UTF-8 never split -- and
        the routing key, which renders the first 64 KiB, is the whole parse's.
        """
        import tracemalloc

        from txlb._scheduling.prefix import PrefixHasher
        from txlb._scheduling.work import WorkBudget, read_json

        hasher = PrefixHasher(secret=b"k" * 32)
        for piece in ("a", "é", "\n", "\U0001f600", 'q"', "\\"):
            content = ("x" * 7 + piece) * 500_000
            whole = {"model": "m", "messages": [{"role": "user", "content": content}]}
            body = json.dumps(whole, ensure_ascii=piece != "é").encode()
            budget = WorkBudget()
            tracemalloc.start()
            try:
                reading = read_json(body, budget)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            # bounded by the budget (a str of 4-byte characters at worst), never the body
            self.assertLess(peak, 8 * budget.json_bytes, piece)
            self.assertLess(peak, len(body) // 2, piece)
            assert reading.json is not None
            read = reading.json["messages"][0]["content"]
            self.assertTrue(content.startswith(read), piece)
            self.assertGreater(len(read), budget.json_bytes // 16, piece)
            self.assertLessEqual(len(read), budget.json_bytes, piece)
            self.assertEqual(hasher.key(reading.json, "m", WorkBudget()),
                             hasher.key(whole, "m"), piece)

    def test_a_small_body_is_parsed_whole(self) -> None:
        from txlb._scheduling.work import WorkBudget, read_json

        body = json.dumps(_long_conversation()["messages"][:3]).encode()
        body = b'{"model": "m", "messages": ' + body + b"}"
        reading = read_json(body, WorkBudget())
        self.assertFalse(reading.partial)
        self.assertEqual(reading.json, json.loads(body))


class HostileBodyTests(SynchronousTestCase):
    """What the proxy builds of a hostile body is bounded, and its model is still read."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.policy = Recording()
        lb = LoadBalancer(["127.0.0.1:8002"], reactor=self.clock, agent=self.upstream,
                          probe_agent=FakeUpstream(), policy=self.policy, log_file="none")
        self.site = Site(lb.resource(), reactor=self.clock)

    def post(self, body: bytes) -> RoutingRequest:
        ClientConnection(self.site).request(b"POST", b"/v1/chat/completions", body=body)
        (seen,) = self.policy.seen
        self.assertEqual(self.upstream.calls[0].body, body)  # forwarded byte for byte
        return seen

    def test_fifty_thousand_parts_are_not_all_built(self) -> None:
        parts = [{"type": "text", "text": f"part {i}"} for i in range(50_000)]
        seen = self.post(json.dumps({"messages": [{"role": "user", "content": parts}],
                                     "model": "m", "stream": True}).encode())
        self.assertEqual(seen.model, "m")
        assert seen.json is not None
        self.assertIs(seen.json["stream"], True)
        read = seen.json["messages"][0]["content"]
        self.assertLessEqual(len(read), 4096)
        self.assertEqual(read[:2], parts[:2])

    def test_a_hundred_thousand_messages_are_not_all_built(self) -> None:
        messages = [{"role": "user", "content": f"hi {i}"} for i in range(100_000)]
        seen = self.post(json.dumps({"messages": messages, "model": "m",
                                     "max_tokens": 7}).encode())
        self.assertEqual(seen.model, "m")
        assert seen.json is not None
        self.assertEqual(seen.json["max_tokens"], 7)
        self.assertLessEqual(len(seen.json["messages"]), 4096)
        self.assertEqual(seen.json["messages"][0], messages[0])

    def test_the_parse_spends_at_most_its_bytes(self) -> None:
        from txlb._scheduling.work import WorkBudget, read_json

        tools = [{"type": "function", "function": {"name": f"f{i}", "description": "d" * 200}}
                 for i in range(5_000)]
        budget = WorkBudget()
        reading = read_json(json.dumps({"model": "m", "tools": tools}).encode(), budget)
        assert reading.json is not None
        read = json.dumps(reading.json["tools"], separators=(",", ":")).encode()
        self.assertLessEqual(len(read), budget.json_bytes)
        self.assertGreater(len(read), budget.json_bytes // 2)

    def test_an_alias_rewrites_only_the_model_of_a_large_body(self) -> None:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write('log-file = "none"\nbackends = ["127.0.0.1:8002"]\n'
                         '[[routes]]\nmodel = "alias"\nto = { "real" = 1 }\n')
        from txlb import build_config

        lb = LoadBalancer(config=build_config({"config": path}, {}), reactor=self.clock,
                          agent=self.upstream, probe_agent=FakeUpstream(), policy=self.policy)
        messages = [{"role": "user", "content": f"hi {i}"} for i in range(30_000)]
        body = {"messages": messages, "model": "alias", "stream": False}
        ClientConnection(Site(lb.resource(), reactor=self.clock)).request(
            b"POST", b"/v1/chat/completions", body=json.dumps(body).encode())
        (seen,) = self.policy.seen
        self.assertEqual(seen.model, "real")
        sent = self.upstream.calls[0].body
        self.assertEqual(seen.body, sent)
        self.assertEqual(json.loads(sent), dict(body, model="real"))
