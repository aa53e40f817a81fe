"""Token budgets ([[budgets]]): the table, buckets, estimate, admission and reconciliation."""

from __future__ import annotations

import hashlib
import json
import math
import random
from typing import Any

from treq.testing import StubTreq
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest
from zope.interface.verify import verifyObject

from txlb import LoadBalancer, build_config
from txlb._cluster.local_store import TokenLevels
from txlb._cluster.store import DEBT_WINDOWS, ITokenLevels
from txlb._config import MAX_BUDGET_TOKENS, ConfigError, parse_budgets, token_digest
from txlb._records.summary import CAPTURE_LIMIT
from txlb._scheduling.budgets import (
    MAX_CHOICES,
    MAX_COUNT,
    Estimate,
    charge,
    estimate_tokens,
    go_duration,
)
from txlb._scheduling.outcome import RequestOutcome
from txlb._scheduling.ratelimit import client_key
from txlb._scheduling.request import RoutingRequest

from ..helpers import ClientConnection, FakeResponse, FakeUpstream, keep_records

ONE = ["127.0.0.1:8002"]


def budget(**fields: Any) -> dict[str, Any]:
    table: dict[str, Any] = {"name": "b", "key": "ip", "tokens_per_minute": 100}
    table.update(fields)
    return {name: value for name, value in table.items() if value is not None}


def body_of(size: int, max_tokens: int | None = 10, **more: Any) -> bytes:
    """A completion request body of exactly ``size`` bytes (its prompt padded)."""
    fields: dict[str, Any] = {"prompt": ""}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    fields.update(more)
    bare = len(json.dumps(fields).encode())
    assert size >= bare, size
    fields["prompt"] = "x" * (size - bare)
    body = json.dumps(fields).encode()
    assert len(body) == size
    return body


class TableTests(SynchronousTestCase):
    """The [[budgets]] table: everything a config file can get wrong is one clear line."""

    def refused(self, value: object) -> str:
        with self.assertRaises(ConfigError) as caught:
            parse_budgets("budgets", value)
        message = str(caught.exception)
        self.assertNotIn("\n", message)
        return message

    def test_a_budget_per_key_per_tenant_and_per_class(self) -> None:
        every, tenant, batch = parse_budgets("budgets", [
            budget(name="every-ip", tokens_per_day=5000),
            budget(name="acme", key="token", value="sk-acme", tokens_per_minute=None,
                   tokens_per_day=10**6),
            budget(name="batch", key="header:X-Team", **{"class": "batch"}),
        ])
        self.assertEqual((every.kind, every.key, every.priority), ("ip", None, None))
        self.assertEqual(every.windows, ((60.0, 100), (86400.0, 5000)))
        self.assertEqual(tenant.key, "token:" + token_digest("sk-acme"))
        self.assertEqual(tenant.windows, ((86400.0, 10**6),))
        self.assertEqual((batch.kind, batch.priority), ("header:X-Team", "batch"))

    def test_a_token_is_kept_only_as_its_digest(self) -> None:
        config = build_config({"backends": ONE, "budgets": [
            budget(key="token", value="sk-very-secret")]}, environ={})
        self.assertNotIn("sk-very-secret", repr(config))
        # the digest is the one --rate-key token keys a bearer token by
        digest = parse_budgets("budgets", [budget(key="token", digest=token_digest("sk-1"))])
        self.assertEqual(digest[0].key, "token:" + token_digest("sk-1"))

    def test_a_budget_for_one_address_is_normalised(self) -> None:
        (spec,) = parse_budgets("budgets", [budget(value=" 2001:DB8:0::1")])
        self.assertEqual(spec.key, "ip:2001:db8::1")
        self.assertIn("not an IP address", self.refused([budget(value="10.0.0.300")]))

    def test_unknown_keys_are_refused_with_a_suggestion(self) -> None:
        message = self.refused([budget(tokens_per_minut=5)])
        self.assertIn("'tokens_per_minut'", message)
        self.assertIn("did you mean 'tokens_per_minute'?", message)

    def test_bad_numbers_are_refused(self) -> None:
        for bad in (0, -5, "100", 1.5, True, MAX_BUDGET_TOKENS + 1, None):
            table = budget(tokens_per_minute=None)
            table["tokens_per_minute"] = bad
            message = self.refused([table])
            self.assertIn("budgets.tokens_per_minute", message, bad)

    def test_an_empty_budget_is_refused(self) -> None:
        self.assertIn("limits nothing", self.refused([budget(tokens_per_minute=None)]))

    def test_duplicates_are_refused(self) -> None:
        self.assertIn("used twice", self.refused([budget(), budget(tokens_per_day=9)]))
        message = self.refused([budget(name="one"), budget(name="two")])
        self.assertIn("limits the same clients as 'one'", message)
        # the same key kind for one client, or for one class, is another budget
        parse_budgets("budgets", [budget(name="one"), budget(name="two", value="10.0.0.1"),
                                  budget(name="three", **{"class": "batch"})])

    def test_every_other_mistake_names_the_key(self) -> None:
        cases = {
            "budgets.name": [budget(name="")],
            "budgets.key": [budget(key="user")],
            "no key": [{"name": "b", "tokens_per_minute": 1}],
            "both 'value' and 'digest'": [budget(key="token", value="a", digest="0" * 32)],
            "budgets.digest": [budget(key="token", digest="not-hex")],
            "budgets.class": [budget(**{"class": ""})],
            "budgets.value": [budget(key="header:X", value="")],
            "not a list": {"name": "b"},
            "not a table": ["b"],
        }
        for expected, value in cases.items():
            self.assertIn(expected, self.refused(value))
        self.assertEqual(parse_budgets("budgets", ()), ())

    def test_a_digest_belongs_to_a_token_budget(self) -> None:
        self.assertIn("budgets.digest", self.refused([budget(digest="0" * 32)]))

    def test_a_secret_value_is_not_echoed(self) -> None:
        message = self.refused([budget(key="token", value="x" * 2000)])
        self.assertNotIn("x" * 50, message)

    def test_the_config_file_table(self) -> None:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write('backends = ["h:1"]\n[[budgets]]\nname = "per-ip"\nkey = "ip"\n'
                         'tokens_per_minute = 1000\n')
        config = build_config({"config": path}, environ={})
        self.assertEqual([spec.name for spec in config.budgets], ["per-ip"])
        with open(path, "w") as handle:
            handle.write('backends = ["h:1"]\n[[budgets]]\nname = "per-ip"\nkey = "ip"\n'
                         'tokens_per_minut = 1\n')
        with self.assertRaises(ConfigError):
            build_config({"config": path}, environ={})


class LevelTests(SynchronousTestCase):
    """The buckets: a rolling window as a continuously refilled bucket, bounded in memory."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.levels = TokenLevels(self.clock)
        self.minute = ("k", 600.0, 10.0)  # 600 tokens a minute: 10 a second

    def test_provides_the_store_interface(self) -> None:
        self.assertTrue(verifyObject(ITokenLevels, self.levels))

    def test_reserve_until_empty_then_wait_for_the_refill(self) -> None:
        self.assertEqual(self.levels.reserve([self.minute], 400), 0)
        self.assertEqual(self.levels.reserve([self.minute], 200), 0)
        self.assertEqual(self.levels.level(self.minute), 0)
        self.assertEqual(self.levels.reserve([self.minute], 50), 5.0)  # 50 at 10/s
        self.clock.advance(4.9)
        self.assertGreater(self.levels.reserve([self.minute], 50), 0)
        self.clock.advance(0.1)
        self.assertEqual(self.levels.reserve([self.minute], 50), 0)

    def test_refill_is_continuous_and_stops_at_the_capacity(self) -> None:
        self.levels.reserve([self.minute], 600)
        self.clock.advance(30)
        self.assertEqual(self.levels.level(self.minute), 300)
        self.clock.advance(3600)
        self.assertEqual(self.levels.level(self.minute), 600)

    def test_a_request_must_fit_every_bucket_and_takes_from_none_otherwise(self) -> None:
        day = ("d", 1000.0, 1000 / 86400)
        self.levels.reserve([day], 950)
        self.assertGreater(self.levels.reserve([self.minute, day], 100), 0)
        self.assertEqual(self.levels.level(self.minute), 600)  # nothing taken
        self.assertEqual(self.levels.reserve([self.minute, day], 50), 0)
        self.assertEqual(self.levels.level(self.minute), 550)

    def test_adjust_gives_back_up_to_the_capacity_or_takes_a_debt(self) -> None:
        self.levels.reserve([self.minute], 500)
        self.levels.adjust([self.minute], 10_000)
        self.assertEqual(self.levels.level(self.minute), 600)
        self.levels.adjust([self.minute], -700)
        self.assertEqual(self.levels.level(self.minute), -100)
        self.assertEqual(self.levels.reserve([self.minute], 1), 10.1)
        self.levels.adjust([self.minute], -10**18)  # a debt of at most 60 windows
        self.assertEqual(self.levels.level(self.minute), -600 * DEBT_WINDOWS)

    def test_a_lowered_capacity_caps_the_level(self) -> None:
        self.levels.reserve([self.minute], 100)
        self.assertEqual(self.levels.level(("k", 50.0, 1.0)), 50)

    def test_memory_stays_bounded_under_many_keys(self) -> None:
        levels = TokenLevels(self.clock, max_keys=5_000)
        for n in range(20_000):
            levels.reserve([(f"client-{n}", 100.0, 10.0)], 1)
        self.assertLessEqual(len(levels), 5_000)
        self.clock.advance(1)  # every bucket is full again: the next call sweeps them
        levels.reserve([("one-more", 100.0, 10.0)], 1)
        self.assertEqual(len(levels), 1)

    def test_forget(self) -> None:
        for key in ("a", "b"):
            self.levels.reserve([(key, 10.0, 1.0)], 5)
        self.levels.forget(lambda key: key == "b")
        self.assertEqual(len(self.levels), 1)
        self.assertEqual(self.levels.level(("a", 10.0, 1.0)), 10)


class EstimateTests(SynchronousTestCase):
    """What admission reserves, from the body alone: hostile bodies cannot shrink it."""

    def estimate(self, body: object, path: bytes = b"/v1/completions") -> Estimate:
        raw = json.dumps(body).encode() if not isinstance(body, bytes) else body
        parsed = body if isinstance(body, dict) else None
        return estimate_tokens(raw, parsed, path, 256)

    def test_body_over_four_plus_max_tokens(self) -> None:
        self.assertEqual(estimate_tokens(body_of(400, 30), {"max_tokens": 30},
                                         b"/v1/completions", 256), Estimate(100, 30))
        self.assertEqual(estimate_tokens(body_of(401, 30), {"max_tokens": 30},
                                         b"/v1/completions", 256).prompt, 101)

    def test_every_api_names_its_maximum(self) -> None:
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            self.assertEqual(self.estimate({field: 7}).completion, 7)
        self.assertEqual(self.estimate({"max_tokens": 5, "n": 3}).completion, 15)
        self.assertEqual(self.estimate({"input": "x"}, b"/v1/embeddings").completion, 0)
        for api in (b"/v1/chat/completions", b"/v1/responses", b"/v1/messages"):
            self.assertEqual(self.estimate({"max_tokens": 9}, api).completion, 9)

    def test_a_path_that_generates_nothing_costs_its_body(self) -> None:
        def get(body: bytes, path: bytes) -> Estimate:
            return estimate_tokens(body, None, path, 256, b"GET")

        self.assertEqual(get(b"", b"/metrics"), Estimate(0, 0))
        self.assertEqual(get(b"xxxx", b"/v1/completions/x"), Estimate(1, 0))
        self.assertEqual(self.estimate({"prompt": "x"}, b"/tokenize").completion, 0)

    def test_an_unknown_post_is_estimated_like_a_completion(self) -> None:
        # an engine's own generate endpoints (/generate, /completion) generate too
        for path in (b"/generate", b"/completion", b"/v1/completions/x"):
            self.assertEqual(self.estimate({"max_tokens": 9}, path).completion, 9, path)
            self.assertEqual(self.estimate({"text": "x"}, path).completion, 256, path)

    def test_no_maximum_is_the_default(self) -> None:
        self.assertEqual(self.estimate({"prompt": "x"}).completion, 256)
        self.assertEqual(self.estimate(b""), Estimate(0, 256))
        self.assertEqual(self.estimate(b"not json at all").completion, 256)

    def test_hostile_numbers(self) -> None:
        for bad in (-1, "-5", "1e", 1.5, "1.5", float("nan"), True, None, [5], {"a": 1}):
            self.assertEqual(self.estimate({"max_tokens": bad}).completion, 256, bad)
            self.assertEqual(self.estimate({"max_tokens": 2, "n": bad}).completion, 2, bad)
        self.assertEqual(self.estimate({"max_tokens": 10**30}).completion, MAX_COUNT)
        self.assertEqual(self.estimate({"max_tokens": 1, "n": 10**9}).completion,
                         MAX_CHOICES)
        self.assertEqual(self.estimate({"max_tokens": 1, "n": 0}).completion, 1)

    def test_the_estimate_covers_what_the_engine_may_generate(self) -> None:
        """
        A maximum the engines accept (vLLM's pydantic takes 5000.0 and "5000" for an
        int; chat prefers max_completion_tokens over max_tokens) counts at its value, and
        of several the largest counts: with a stream without usage that is what is charged.
        """
        for fields in ({"max_tokens": 100000.0}, {"max_tokens": "100000"},
                       {"max_tokens": " 100000 "}, {"max_tokens": "100000.0"},
                       {"max_tokens": 1, "max_completion_tokens": 100000},
                       {"max_completion_tokens": 5, "max_output_tokens": 100000}):
            body = {"messages": [], **fields}
            estimate = estimate_tokens(json.dumps(body).encode(), body,
                                       b"/v1/chat/completions", 256)
            self.assertEqual(estimate.completion, 100000, fields)
        self.assertEqual(self.estimate({"max_tokens": "9" * 40}).completion, MAX_COUNT)
        self.assertEqual(self.estimate({"max_tokens": float("inf")}).completion, MAX_COUNT)
        self.assertEqual(self.estimate({"max_tokens": 1e300}).completion, MAX_COUNT)
        self.assertEqual(self.estimate({"max_tokens": 2, "n": "3"}).completion, 6)


def outcome(status: int = 200, answered: bool = True, prompt: int | None = None,
            completion: int | None = None, backend: str = "127.0.0.1:8002",
            end: str = "ok") -> RequestOutcome:
    return RequestOutcome(backend=backend, status=status, answered=answered, ttfb=None,
                          duration=1.0, prompt_tokens=prompt, completion_tokens=completion,
                          end=end)


class ChargeTests(SynchronousTestCase):
    """What a finished request costs, in every way it can end."""

    estimate = Estimate(prompt=40, completion=100)

    def test_usage_wins(self) -> None:
        self.assertEqual(charge(outcome(prompt=37, completion=12), self.estimate), 49)
        self.assertEqual(charge(outcome(prompt=37, completion=500), self.estimate), 537)

    def test_a_missing_part_is_its_estimate(self) -> None:
        self.assertEqual(charge(outcome(), self.estimate), 140)  # a stream without usage
        self.assertEqual(charge(outcome(prompt=37), self.estimate), 137)
        self.assertEqual(charge(outcome(completion=3), self.estimate), 43)
        # a client that left mid-answer: what it did not see counted is the estimate
        self.assertEqual(charge(outcome(end="client_abort"), self.estimate), 140)

    def test_an_error_answer_costs_nothing(self) -> None:
        self.assertEqual(charge(outcome(status=400), self.estimate), 0)
        self.assertEqual(charge(outcome(status=500, prompt=40), self.estimate), 0)

    def test_never_answered(self) -> None:
        # sent, then the client left (or the backend fell silent): the prompt was read
        for end in ("client_abort", "timeout"):
            self.assertEqual(charge(outcome(status=499, answered=False, end=end),
                                    self.estimate), 40)
        # never sent, or no backend took it
        for backend, end in (("-", "client_abort"), ("-", "proxy_error"),
                             ("127.0.0.1:8002", "upstream_error")):
            self.assertEqual(charge(outcome(status=503, answered=False, backend=backend,
                                            end=end), self.estimate), 0)


class GoDurationTests(SynchronousTestCase):
    def test_as_openai_writes_the_reset(self) -> None:
        self.assertEqual([go_duration(s) for s in (0, 0.0061, 0.5, 1, 1.2, 59.5, 360, 3601)],
                         ["0s", "7ms", "500ms", "1s", "2s", "1m0s", "6m0s", "1h0m1s"])


class ProxyTestCase(SynchronousTestCase):
    def build(self, budgets: list[dict[str, Any]], backends: list[Any] | None = None,
              **options: Any) -> LoadBalancer:
        self.clock = Clock()
        self.upstream = FakeUpstream()
        self.lb = LoadBalancer(backends or ONE, reactor=self.clock, agent=self.upstream,
                               probe_agent=FakeUpstream(), rng=random.Random(3),
                               log_file="none", budgets=budgets, **options)
        self.records: list[Any] = keep_records(self.lb)
        self.site = self.lb.site()
        return self.lb

    def post(self, body: bytes, peer: str = "10.1.2.3",
             headers: list[tuple[bytes, bytes]] | None = None,
             path: bytes = b"/v1/completions") -> ClientConnection:
        client = ClientConnection(self.site, peer=peer)
        client.request(b"POST", path, headers=headers, body=body)
        return client

    def answer(self, usage: dict[str, int] | None = None, status: int = 200,
               n: int = -1) -> None:
        payload: dict[str, Any] = {"choices": [{"text": "hi", "finish_reason": "stop"}]}
        if usage is not None:
            payload["usage"] = usage
        body = json.dumps(payload).encode()
        response = self.upstream.calls[n].respond(FakeResponse(
            status, [(b"Content-Type", b"application/json")], length=len(body)))
        response.send(body)
        response.end()

    def remaining(self, client: ClientConnection) -> int:
        (value,) = client.response().header(b"x-ratelimit-remaining-tokens")
        return int(value)


class AdmissionTests(ProxyTestCase):
    """The proxy: reserve, refuse with 429 (never forwarded), refill, reconcile."""

    def test_forwarded_answers_say_the_budget_as_openai_does(self) -> None:
        self.build([budget(tokens_per_minute=600)])
        client = self.post(body_of(400, 50))  # 100 + 50
        self.answer()
        response = client.response()
        self.assertEqual(response.status, 200)
        self.assertEqual(response.header(b"x-ratelimit-limit-tokens"), [b"600"])
        self.assertEqual(response.header(b"x-ratelimit-remaining-tokens"), [b"450"])
        self.assertEqual(response.header(b"x-ratelimit-reset-tokens"), [b"15s"])

    def test_no_budget_no_headers(self) -> None:
        self.build([])
        client = self.post(body_of(400, 50))
        self.answer()
        self.assertEqual(client.response().header(b"x-ratelimit-remaining-tokens"), [])

    def test_exhausted_gives_429_never_forwarded_then_refills(self) -> None:
        self.build([budget(tokens_per_minute=600)])
        for _ in range(4):
            self.post(body_of(400, 50))  # 150 each, all in flight
        self.assertEqual(len(self.upstream.calls), 4)
        refused = self.post(body_of(40, 0)).response()  # needs 10
        self.assertEqual(refused.status, 429)
        self.assertEqual(refused.header(b"retry-after"), [b"1"])
        error = json.loads(refused.body)["error"]
        self.assertEqual(error["type"], "rate_limit_exceeded")
        self.assertIn("token budget 'b' exceeded", error["message"])
        self.assertEqual(refused.header(b"x-ratelimit-remaining-tokens"), [b"0"])
        self.assertEqual(len(self.upstream.calls), 4)  # never forwarded
        self.assertEqual(self.records[-1].status, 429)
        self.assertIn(b"token budget 'b' exceeded", b"".join(self.records[-1].response))
        # another client has its own bucket
        self.post(body_of(40, 0), peer="10.9.9.9")
        self.assertEqual(len(self.upstream.calls), 5)
        self.clock.advance(1)  # 10 tokens back
        self.post(body_of(40, 0))
        self.assertEqual(len(self.upstream.calls), 6)

    def test_retry_after_says_when_it_fits(self) -> None:
        self.build([budget(tokens_per_minute=600)])
        self.post(body_of(400, 500))  # 600: all of it
        refused = self.post(body_of(400, 200)).response()  # 300 at 10/s
        self.assertEqual(refused.header(b"retry-after"), [b"30"])
        self.clock.advance(29)
        self.assertEqual(self.post(body_of(400, 200)).response().status, 429)
        self.clock.advance(1)
        self.post(body_of(400, 200))
        self.assertEqual(len(self.upstream.calls), 2)

    def test_an_over_estimate_is_given_back_from_usage(self) -> None:
        self.build([budget(tokens_per_minute=600)])
        self.post(body_of(400, 500))  # reserves all 600
        self.answer({"prompt_tokens": 80, "completion_tokens": 20})
        self.assertEqual(self.lb.budgets.charged, {"b": 100})
        client = self.post(body_of(400, 100))  # 200 fits in the 500 left
        self.answer()
        self.assertEqual(self.remaining(client), 300)

    def test_an_under_estimate_becomes_a_debt(self) -> None:
        self.build([budget(tokens_per_minute=600)])
        self.post(body_of(40, 10))  # reserves 20
        self.answer({"prompt_tokens": 300, "completion_tokens": 500})  # cost 800
        refused = self.post(body_of(40, 0)).response()  # -200 left: 210 to go at 10/s
        self.assertEqual(refused.status, 429)
        self.assertEqual(refused.header(b"retry-after"), [b"21"])

    def test_hostile_usage_cannot_lock_a_client_out_for_long(self) -> None:
        self.build([budget(tokens_per_minute=600)])
        self.post(body_of(40, 10))
        self.answer({"prompt_tokens": 2**62, "completion_tokens": 2**62})
        refused = self.post(body_of(40, 0)).response()
        # -36,000 (60 windows) to 10, at 10/s: an hour, not years
        self.assertEqual(refused.header(b"retry-after"), [b"3601"])
        # a usage Summary does not believe (negative, beyond 64 bits) is no usage at all:
        # the estimate stands
        self.clock.advance(3602)  # 20 again
        self.post(body_of(40, 10))
        self.answer({"prompt_tokens": -5, "completion_tokens": 2**70})
        self.assertEqual(self.lb.budgets.charged["b"], 2**63 + 20)

    def test_what_a_request_really_cost_is_paid_in_full(self) -> None:
        """
        A request that really cost ten windows (no max_tokens: admitted on the 256
        estimate) is paid in full: the client is back after ten minutes, not two.
        """
        self.build([budget(tokens_per_minute=600)])
        self.post(json.dumps({"prompt": "x"}).encode())  # no max_tokens: 256 + 4
        self.answer({"prompt_tokens": 10, "completion_tokens": 5990})  # 6000: ten minutes
        self.clock.advance(121)
        forwarded = len(self.upstream.calls)
        self.post(json.dumps({"prompt": "x"}).encode())
        self.assertEqual(len(self.upstream.calls), forwarded,
                         "admitted after 2 minutes though it used 10 minutes' tokens")
        self.clock.advance(567 - 121)  # -5400 after the answer, +10/s, to the 260 it needs
        self.post(json.dumps({"prompt": "x"}).encode())
        self.assertEqual(len(self.upstream.calls), forwarded + 1)

    def test_a_stream_without_usage_is_charged_its_estimate(self) -> None:
        self.build([budget(tokens_per_minute=600)])
        self.post(body_of(400, 100, stream=True))  # 200
        response = self.upstream.last.respond(FakeResponse(
            200, [(b"Content-Type", b"text/event-stream")]))
        response.send(b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')
        response.end()
        self.assertEqual(self.lb.budgets.charged, {"b": 200})

    def test_a_request_that_never_reached_a_backend_is_refunded(self) -> None:
        self.build([budget(tokens_per_minute=600)], queue_timeout=5,
                   backends=[{"url": "http://127.0.0.1:8002", "max_conns": 1}])
        self.post(body_of(400, 100))
        queued = self.post(body_of(400, 100), peer="10.0.0.9")
        self.clock.advance(5)
        self.assertEqual(queued.response().status, 503)
        self.assertEqual(self.lb.budgets.charged, {})
        self.answer(n=0)
        client = self.post(body_of(400, 500), peer="10.0.0.9")  # all 600 again
        self.assertEqual(len(self.upstream.calls), 2)
        self.answer()
        self.assertEqual(self.remaining(client), 0)

    def test_a_request_that_can_never_fit(self) -> None:
        self.build([budget(tokens_per_minute=600)])
        for body in (body_of(400, 10**30), body_of(4000, 0)):
            refused = self.post(body).response()
            self.assertEqual(refused.status, 429)
            self.assertEqual(refused.header(b"retry-after"), [])
            self.assertIn("can never fit", json.loads(refused.body)["error"]["message"])
        self.assertEqual(self.upstream.calls, [])
        self.assertEqual(self.lb.budgets.levels.level(("b\x1f60\x1fip:10.1.2.3", 600, 10)),
                         600)

    def test_several_budgets_all_must_fit_and_the_tightest_is_shown(self) -> None:
        self.build([budget(name="every", tokens_per_minute=600, tokens_per_day=700),
                    budget(name="vip", value="10.0.0.7", tokens_per_minute=100)])
        client = self.post(body_of(400, 100))  # 200 of each
        self.answer()
        self.assertEqual(client.response().header(b"x-ratelimit-limit-tokens"), [b"600"])
        self.assertEqual(self.remaining(client), 400)
        client = self.post(body_of(400, 100))  # the minute has 200 left, the day 300
        self.answer()
        self.assertEqual(self.remaining(client), 200)
        self.clock.advance(60)  # the minute is full again, the day nearly as it was
        client = self.post(body_of(40, 0))  # 10
        self.answer()
        self.assertEqual(client.response().header(b"x-ratelimit-limit-tokens"), [b"700"])
        self.assertEqual(self.remaining(client), 290)
        refused = self.post(body_of(400, 300)).response()  # 400 fits the minute only
        self.assertEqual(refused.status, 429)
        day = self.lb.budgets.levels.level(("every\x1f86400\x1fip:10.1.2.3", 700, 700 / 86400))
        self.assertEqual(refused.header(b"retry-after"),
                         [b"%d" % math.ceil((400 - day) / (700 / 86400))])
        self.assertGreater(math.ceil((400 - day) / (700 / 86400)), 12_000)
        self.assertEqual(refused.header(b"x-ratelimit-limit-tokens"), [b"700"])
        # the tenant's own budget applies to it alone
        self.assertIn("'vip'", json.loads(
            self.post(body_of(400, 100), peer="10.0.0.7").response().body)["error"]["message"])
        self.assertEqual(self.lb.budgets.refused, {"every": 1, "vip": 1})

    def test_token_budgets_key_by_digest(self) -> None:
        self.build([budget(key="token", tokens_per_minute=300),
                    budget(name="acme", key="token", value="sk-acme", tokens_per_minute=150)])

        def post(token: bytes) -> ClientConnection:
            return self.post(body_of(400, 50),
                             headers=[(b"Authorization", b"Bearer " + token)])

        post(b"sk-other"), post(b"sk-other")
        self.assertEqual(post(b"sk-other").response().status, 429)
        post(b"sk-acme")
        self.assertEqual(post(b"sk-acme").response().status, 429)  # its own 150
        self.assertEqual(len(self.upstream.calls), 3)
        held = repr(self.lb.budgets.levels._levels)  # type: ignore[attr-defined]
        self.assertNotIn("sk-other", held)
        self.assertNotIn("sk-acme", held)
        self.assertIn(token_digest("sk-acme"), held)

    def test_a_class_budget_counts_only_its_class(self) -> None:
        lb = self.build([budget(name="batch", tokens_per_minute=100, **{"class": "batch"})])
        self.post(body_of(400, 200))  # no class: the batch budget does not apply
        self.assertEqual(len(self.upstream.calls), 1)
        budgets = lb.budgets
        request = DummyRequest([b""])
        request.client = IPv4Address("TCP", "10.1.2.3", 40000)
        small = RoutingRequest(body=body_of(40, 50), json={"max_tokens": 50})
        self.assertFalse(budgets.admit(request, small, b"/v1/completions", "batch").refused)
        self.assertTrue(budgets.admit(request, small, b"/v1/completions", "batch").refused)
        self.assertFalse(budgets.admit(request, small, b"/v1/completions",
                                       "interactive").refused)


class DuplicateAuthorizationTests(ProxyTestCase):
    """
    Two Authorization headers: txlb would key the request by one value (Request.getHeader
    gives the last) and vLLM (Starlette's Headers.get) authenticate by the first, so a
    second header would dodge a key's budget.  RFC 9110 allows one: 400, never forwarded.
    """

    def test_a_token_budget_cannot_be_dodged_with_a_second_authorization(self) -> None:
        self.build([budget(key="token", value="sk-acme", tokens_per_minute=600)])
        for n in range(3):
            client = self.post(body_of(400, 500), headers=[
                (b"Authorization", b"Bearer sk-acme"),
                (b"Authorization", b"Bearer junk-%d" % n)])
            response = client.response()
            self.assertEqual(response.status, 400)
            error = json.loads(response.body)["error"]
            self.assertEqual(error["type"], "invalid_request_error")
            self.assertIn("more than one Authorization", error["message"])
        self.assertEqual(self.upstream.calls, [])
        self.assertEqual([record.status for record in self.records], [400, 400, 400])
        # one header is admitted as before
        self.post(body_of(400, 500), headers=[(b"Authorization", b"Bearer sk-acme")])
        self.assertEqual(len(self.upstream.calls), 1)


class EncodedPathTests(ProxyTestCase):
    """
    ``/v1/%63ompletions`` is ``/v1/completions`` to an ASGI engine (uvicorn decodes the
    path before FastAPI routes it): txlb classifies it by the decoded path too -- its
    estimate has a completion and its answer's usage is read -- and forwards it as sent.
    """

    def test_an_encoded_api_path_is_charged_its_usage(self) -> None:
        self.build([budget(tokens_per_minute=600)])
        self.post(body_of(400, 500), path=b"/v1/%63ompletions?x=%41")
        self.assertEqual(self.upstream.last.uri, b"http://127.0.0.1:8002/v1/%63ompletions?x=%41")
        self.answer({"prompt_tokens": 100, "completion_tokens": 500})
        self.assertEqual(self.lb.budgets.charged, {"b": 600})
        (record,) = self.records
        self.assertEqual(record.path, b"/v1/completions")

    def test_an_unknown_post_reserves_a_completion(self) -> None:
        self.build([budget(tokens_per_minute=600)])
        client = self.post(body_of(40, None), path=b"/generate")
        self.answer()
        self.assertEqual(self.remaining(client), 600 - 10 - 256)
        self.assertEqual(self.lb.budgets.charged, {"b": 10 + 256})  # usage is not read there


class LongStreamTests(ProxyTestCase):
    """
    The summary reads the first CAPTURE_LIMIT (512 KiB) of an answer and its last
    TAIL_LIMIT: a stream longer than the capture (~2,500 vLLM tokens) is still charged the
    usage of its final event, not its estimate.
    """

    def test_a_long_stream_is_charged_its_usage(self) -> None:
        self.build([budget(tokens_per_minute=100000)])
        self.post(json.dumps({"prompt": "x", "stream": True,
                              "stream_options": {"include_usage": True}}).encode())
        response = self.upstream.last.respond(FakeResponse(
            200, [(b"Content-Type", b"text/event-stream")]))
        chunk = b'data: {"choices": [{"text": "tok", "index": 0}]}\n\n'
        tokens = CAPTURE_LIMIT // len(chunk) + 10
        for _ in range(tokens):
            response.send(chunk)
        response.send(b'data: {"choices": [], "usage": {"prompt_tokens": 5, '
                      b'"completion_tokens": %d}}\n\ndata: [DONE]\n\n' % tokens)
        response.end()
        self.assertEqual(self.lb.budgets.charged, {"b": 5 + tokens})


class AbortedStreamTests(ProxyTestCase):
    """
    A stream's usage comes in its last event: a client that sets no max_tokens and leaves
    just before the end (or a stream without include_usage) is charged at least a token
    for each event it was relayed, not only its estimate (prompt + 256).
    """

    def test_what_was_relayed_is_charged_at_least(self) -> None:
        self.build([budget(tokens_per_minute=100000)])
        client = self.post(json.dumps({"prompt": "x", "stream": True,
                                       "stream_options": {"include_usage": True}}).encode())
        response = self.upstream.last.respond(FakeResponse(
            200, [(b"Content-Type", b"text/event-stream")]))
        for _ in range(2000):
            response.send(b'data: {"choices": [{"text": "tok", "index": 0}]}\n\n')
        client.disconnect()
        self.assertGreaterEqual(self.lb.budgets.charged.get("b", 0), 2000)

    def test_a_stream_without_usage_is_charged_its_events(self) -> None:
        self.build([budget(tokens_per_minute=100000)])
        body = json.dumps({"prompt": "x", "stream": True}).encode()
        self.post(body)
        response = self.upstream.last.respond(FakeResponse(
            200, [(b"Content-Type", b"text/event-stream")]))
        for _ in range(999):
            response.send(b'data: {"choices": [{"text": "tok", "index": 0}]}\n\n')
        response.send(b"data: [DONE]\n\n")
        response.end()
        self.assertEqual(self.lb.budgets.charged, {"b": math.ceil(len(body) / 4) + 1000})


class KeyChurnTests(ProxyTestCase):
    """
    A client that spent its day with its real key sends MAX_KEYS requests with made-up
    keys (each answered 401 by the backend, so each costs nothing and leaves a bucket
    behind): past MAX_KEYS buckets the one full again soonest goes, never its spent one.
    (Shown with max_keys lowered to 10 instead of 100,000.)
    """

    def test_made_up_keys_do_not_refill_a_spent_budget(self) -> None:
        self.build([budget(key="token", tokens_per_minute=None, tokens_per_day=600)])
        self.lb.budgets.levels.max_keys = 10  # type: ignore[attr-defined]
        real = [(b"Authorization", b"Bearer sk-real")]
        self.post(body_of(400, 500), headers=real)
        self.answer({"prompt_tokens": 100, "completion_tokens": 500})
        self.assertEqual(self.post(body_of(40, 5), headers=real).response().status, 429)
        for n in range(10):
            self.post(body_of(40, 5), headers=[(b"Authorization", b"Bearer junk-%d" % n)])
            self.answer(status=401)
        forwarded = len(self.upstream.calls)
        self.post(body_of(40, 5), headers=real)
        self.assertEqual(len(self.upstream.calls), forwarded,
                         "forwarded: the spent day's bucket was forgotten")

    def test_past_the_limit_the_bucket_full_soonest_goes(self) -> None:
        levels = TokenLevels(Clock(), max_keys=3)
        levels.reserve([("spent", 600.0, 1.0)], 600)  # full in 600 s
        levels.reserve([("half", 600.0, 1.0)], 300)  # 300 s
        levels.reserve([("little", 600.0, 1.0)], 10)  # 10 s
        levels.reserve([("new", 600.0, 1.0)], 100)  # 100 s: "little" goes
        self.assertEqual(levels.level(("little", 600.0, 1.0)), 600)
        self.assertEqual(levels.level(("spent", 600.0, 1.0)), 0)
        self.assertEqual(len(levels), 3)
        for n in range(1000):  # churn: the heap of stale entries stays bounded too
            levels.reserve([(f"junk-{n}", 600.0, 1.0)], 1)
            levels.adjust([(f"junk-{n}", 600.0, 1.0)], 1)
        self.assertEqual(levels.level(("spent", 600.0, 1.0)), 0)
        self.assertLess(len(levels._full_at), 200)


class HugeHeaderKeyTests(ProxyTestCase):
    """
    key = "header:NAME" keys a bucket by a digest of the header's value, not the value:
    MAX_KEYS (100,000) buckets of ~16 KB values would be ~1.6 GB (and every --workers
    spent message would carry the value).
    """

    def test_a_bucket_key_is_bounded(self) -> None:
        self.build([budget(key="header:X-Team")])
        self.post(body_of(40, 1), headers=[(b"X-Team", b"t" * 10000)])
        keys = list(self.lb.budgets.levels._levels)  # type: ignore[attr-defined]
        self.assertEqual(len(keys), 1)
        self.assertLess(len(keys[0]), 200)

    def test_a_header_value_budget_meets_its_header(self) -> None:
        self.build([budget(key="header:X-Team", value="acme", tokens_per_minute=600)])
        acme = [(b"X-Team", b"acme")]
        self.post(body_of(400, 500), headers=acme)
        self.assertEqual(self.post(body_of(400, 500), headers=acme).response().status, 429)
        self.post(body_of(400, 500), headers=[(b"X-Team", b"other")])
        self.assertEqual(len(self.upstream.calls), 2)

    def test_the_rate_limit_keys_by_the_digest_too(self) -> None:
        request = DummyRequest([b""])
        request.requestHeaders.setRawHeaders(b"X-Team", [b"t" * 10000])
        key = client_key(request, "header:X-Team")
        self.assertEqual(key, "header:" + hashlib.sha256(b"t" * 10000).hexdigest()[:32])


class DualStackTests(ProxyTestCase):
    """An IPv4 client of a dual-stack listener (::ffff:10.0.0.7) is its IPv4 address."""

    def test_a_one_client_budget_meets_a_mapped_address(self) -> None:
        for configured in ("10.0.0.7", "::ffff:10.0.0.7"):
            self.build([budget(value=configured, tokens_per_minute=600)])
            self.post(body_of(400, 500), peer="::ffff:10.0.0.7")
            refused = self.post(body_of(400, 500), peer="10.0.0.7").response()
            self.assertEqual(refused.status, 429, configured)
            self.assertEqual(len(self.upstream.calls), 1, configured)

    def test_the_client_key(self) -> None:
        request = DummyRequest([b""])
        for host, key in (("::ffff:10.0.0.7", "ip:10.0.0.7"), ("::1", "ip:::1"),
                          ("2001:db8::1", "ip:2001:db8::1"), ("10.0.0.7", "ip:10.0.0.7")):
            request.client = IPv4Address("TCP", host, 5000)
            self.assertEqual(client_key(request), key)


class ReconfigureTests(ProxyTestCase):
    """A reload's budgets: levels kept by name, lowered limits capped, removed ones gone."""

    def reload(self, budgets: list[dict[str, Any]]) -> None:
        self.lb.budgets.reconfigure(build_config(
            {"backends": ONE, "budgets": budgets}, environ={}))

    def test_levels_survive_a_raised_limit(self) -> None:
        self.build([budget(tokens_per_minute=600)])
        self.post(body_of(400, 300))  # 400: 200 left
        self.reload([budget(tokens_per_minute=1200)])
        client = self.post(body_of(400, 100))  # the 200 left, not a fresh 1200
        self.answer()
        self.assertEqual(client.response().header(b"x-ratelimit-limit-tokens"), [b"1200"])
        self.assertEqual(self.remaining(client), 0)

    def test_a_lowered_limit_caps_the_level(self) -> None:
        self.build([budget(tokens_per_minute=600)])
        client = self.post(body_of(40, 10))
        self.answer()
        self.reload([budget(tokens_per_minute=100)])
        client = self.post(body_of(40, 10))
        self.answer()
        self.assertEqual(self.remaining(client), 80)

    def test_a_removed_budget_stops_applying_and_in_flight_requests_settle(self) -> None:
        self.build([budget(name="gone", key="header:X-Team", tokens_per_minute=600),
                    budget(name="kept", tokens_per_minute=None, tokens_per_day=10_000)])
        self.post(body_of(400, 500))  # 600 reserved in both
        self.reload([budget(name="kept", tokens_per_minute=None, tokens_per_day=10_000)])
        self.assertEqual(len(self.lb.budgets.levels), 1)
        self.answer({"prompt_tokens": 10, "completion_tokens": 10})
        self.assertEqual(self.lb.budgets.charged, {"kept": 20})
        client = self.post(body_of(400, 1000))  # 1100: the minute budget is gone
        self.answer()
        self.assertEqual(self.remaining(client), 10_000 - 20 - 1100)
        # a client key holding the separator does not confuse which budget a bucket is of
        self.lb.budgets.levels.reserve([("kept\x1f86400\x1fheader:a\x1fgone\x1f60", 9.0, 1.0)],
                                       1)
        self.reload([budget(name="kept", tokens_per_minute=None, tokens_per_day=10_000)])
        self.assertEqual(len(self.lb.budgets.levels), 2)
        self.reload([])
        self.assertEqual(len(self.lb.budgets.levels), 0)
        client = self.post(body_of(400, 10**6))
        self.answer()
        self.assertEqual(client.response().header(b"x-ratelimit-limit-tokens"), [])


class ObservabilityTests(ProxyTestCase):
    def test_metrics_by_budget(self) -> None:
        self.build([budget(name="team", tokens_per_minute=100)])
        self.post(body_of(40, 50))
        self.answer({"prompt_tokens": 5, "completion_tokens": 7})
        self.post(body_of(400, 50)).response()  # 150: never fits
        sample = self.lb.metrics.registry.get_sample_value
        self.assertEqual(sample("txlb_budget_tokens_total", {"budget": "team"}), 12)
        self.assertEqual(sample("txlb_budget_refused_total", {"budget": "team"}), 1)
        self.assertIn(b"txlb_budget_refused_total", self.lb.metrics.exposition())

    def test_status_shows_the_budgets_never_a_key(self) -> None:
        self.build([budget(name="acme", key="token", value="sk-acme",
                           tokens_per_day=5000)])
        self.post(body_of(40, 1), headers=[(b"Authorization", b"Bearer sk-acme")])
        status = self.lb.budgets.status()
        self.assertEqual(status, {
            "budgets": [{"name": "acme", "key": "token", "one_client": True, "class": None,
                         "tokens_per_minute": 100, "tokens_per_day": 5000}],
            "budget_keys_tracked": 2})
        self.assertNotIn(token_digest("sk-acme"), json.dumps(status))

    def test_the_admin_status_lists_them(self) -> None:
        self.build([budget(name="acme", key="token", value="sk-acme", tokens_per_day=5000)])
        self.post(body_of(40, 1), headers=[(b"Authorization", b"Bearer sk-acme")])
        admin = StubTreq(self.lb.admin_resource())
        response = self.successResultOf(admin.get("http://127.0.0.1/status"))
        text = self.successResultOf(response.content()).decode()
        status = json.loads(text)
        self.assertEqual([entry["name"] for entry in status["budgets"]], ["acme"])
        self.assertEqual(status["budget_keys_tracked"], 2)
        self.assertNotIn("sk-acme", text)
        self.assertNotIn(token_digest("sk-acme"), text)

    def test_tracked_keys_stay_bounded_through_the_proxy(self) -> None:
        self.build([budget(tokens_per_minute=10**6)])
        self.lb.budgets.levels.max_keys = 50  # type: ignore[attr-defined]
        for n in range(200):
            self.post(b"{}", peer=f"10.0.{n // 250}.{n % 250}")
        self.assertLessEqual(len(self.lb.budgets.levels), 50)
        self.assertEqual(len(self.upstream.calls), 200)


class ClassesAndBudgetsTests(ProxyTestCase):
    """A budget for a priority class meets the class the proxy gave the request."""

    def test_a_class_budget_applies_to_the_requests_of_that_class(self) -> None:
        self.build([budget(name="batch", tokens_per_minute=100, **{"class": "batch"})])
        batch = [(b"X-Priority", b"batch")]
        first = self.post(body_of(40, 50), headers=batch)
        self.answer({"prompt_tokens": 10, "completion_tokens": 50, "total_tokens": 60})
        self.assertEqual(first.response().status, 200)
        # the next batch request no longer fits; an interactive one is not counted
        self.assertEqual(self.post(body_of(40, 50), headers=batch).response().status, 429)
        interactive = self.post(body_of(40, 50), headers=[(b"X-Priority", b"interactive")])
        self.answer({"prompt_tokens": 10, "completion_tokens": 50, "total_tokens": 60})
        self.assertEqual(interactive.response().status, 200)
        self.assertEqual(len(self.upstream.calls), 2)

    def test_a_budget_for_a_class_that_does_not_exist_is_refused(self) -> None:
        error = self.assertRaises(ConfigError, build_config, {"backends": ONE, "budgets": [
            budget(name="bulk", **{"class": "Batch"})]}, environ={})
        self.assertIn("budgets.class", str(error))
        self.assertIn("did you mean 'batch'", str(error))

    def test_a_digest_as_sha256sum_prints_it_limits_that_key(self) -> None:
        full = hashlib.sha256(b"sk-acme").hexdigest()  # printf %s sk-acme | sha256sum
        # as [[classes]] keys take it: uppercase and surrounding spaces are the same key
        for digest in (full, "sha256:" + full, full[:32], full.upper(), f"  {full}\n",
                       "SHA256:" + full.upper()):
            (spec,) = parse_budgets("budgets", [budget(key="token", digest=digest)])
            self.assertEqual(spec.key, "token:" + token_digest("sk-acme"), digest)
        self.assertIn("budgets.digest", self.refused_digest(full[:40]))
        self.assertIn("budgets.digest", self.refused_digest(full[:63] + "g"))

    def refused_digest(self, digest: str) -> str:
        return str(self.assertRaises(ConfigError, parse_budgets, "budgets",
                                     [budget(key="token", digest=digest)]))
