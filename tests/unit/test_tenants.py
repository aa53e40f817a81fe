"""
``--auth keys``: a request's API key names its tenant, or the request gets a 401.

Tried as an attacker would: no key, a wrong key, a key of another tenant's length, a
malformed header, two keys, a huge key, a tenant named through a header; and as a tenant
would: its models only, its key never forwarded, the engine's own key sent instead, its
class bounded, its budget and rate limit its own, its name in the result log.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from txlb._config import ConfigError, build_config
from txlb._config.keys import read_keys
from txlb._records.resultlog import format_text
from txlb._records.summary import summarize
from txlb._scheduling.tenants import MAX_KEY_LENGTH, key_digest

from .test_failover import FailoverTestCase

ALPHA = b"sk-test-alpha-0000000000000000000000000000"
BETA = b"sk-test-beta-00000000000000000000000000000"


def keys_file(test: SynchronousTestCase, text: str | None = None) -> str:
    """A keys file of tenants alpha (any model, weight 2) and beta (model m1 only)."""
    if text is None:
        text = (
            '[tenants.alpha]\nweight = 2.0\n\n[tenants.beta]\nmodels = ["m1"]\n'
            'class = "batch"\n\n'
            f'[[keys]]\nsha256 = "{key_digest(ALPHA)}"\ntenant = "alpha"\nlabel = "ci"\n\n'
            f'[[keys]]\nsha256 = "{key_digest(BETA)}"\ntenant = "beta"\n')
    path = test.mktemp()
    with open(path, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o600)
    return path


class AuthTestCase(FailoverTestCase):
    def build_auth(self, text: str | None = None, **options: Any) -> None:
        options.setdefault("backends", ["10.0.0.1:8000"])
        self.keys_path = keys_file(self, text)
        self.build(auth="keys", keys_file=self.keys_path, **options)

    def call(self, headers: list[tuple[bytes, bytes]], body: dict[str, Any] | None = None,
             path: bytes = b"/v1/completions", method: bytes = b"POST") -> Any:
        client = self.client()
        raw = json.dumps(body if body is not None else {"model": "m1", "prompt": "x"})
        client.request(method, path, headers=headers,
                       body=raw.encode() if method == b"POST" else b"")
        return client

    def bearer(self, key: bytes) -> list[tuple[bytes, bytes]]:
        return [(b"Authorization", b"Bearer " + key)]


class RefusedKeyTests(AuthTestCase):
    def setUp(self) -> None:
        self.build_auth()

    def assertUnauthorized(self, client: Any) -> dict[str, Any]:
        response = client.response()
        self.assertEqual(response.status, 401)
        self.assertEqual(response.header(b"www-authenticate"), [b'Bearer realm="txlb"'])
        error = json.loads(response.body)["error"]
        self.assertEqual((error["type"], error["code"]),
                         ("invalid_request_error", "invalid_api_key"))
        self.assertEqual(self.upstream.calls, [])  # nothing reached an engine
        self.assertEqual(self.records[-1].status, 401)
        self.assertIsNone(self.records[-1].tenant)
        return error

    def test_no_key(self) -> None:
        self.assertIn("API key", self.assertUnauthorized(self.call([]))["message"])

    def test_a_wrong_key_and_one_of_another_tenants_length_get_the_same_words(self) -> None:
        wrong = self.assertUnauthorized(self.call(self.bearer(b"sk-nope")))
        same_length = self.assertUnauthorized(
            self.call(self.bearer(ALPHA[:-1] + b"1")))  # one character off alpha's
        self.assertEqual(wrong, same_length)

    def test_another_scheme_or_an_empty_bearer(self) -> None:
        for value in (b"Basic " + ALPHA, b"Bearer", b"Bearer    ", ALPHA):
            self.assertUnauthorized(self.call([(b"Authorization", value)]))

    def test_two_keys_are_refused_even_when_both_are_right(self) -> None:
        self.assertUnauthorized(self.call(self.bearer(ALPHA) + [(b"x-api-key", ALPHA)]))
        self.assertUnauthorized(self.call(self.bearer(ALPHA) + self.bearer(ALPHA)))

    def test_a_huge_key_is_not_digested(self) -> None:
        self.assertUnauthorized(self.call(self.bearer(b"k" * (MAX_KEY_LENGTH + 1))))

    def test_the_model_list_needs_a_key_too(self) -> None:
        self.assertUnauthorized(self.call([], path=b"/v1/models", method=b"GET"))

    def test_refusals_are_counted_by_reason(self) -> None:
        self.call([])
        self.call(self.bearer(b"sk-nope"))
        self.call([(b"Authorization", b"Basic x")])
        self.assertEqual(self.lb.tenants.refused, {"missing": 1, "malformed": 1, "unknown": 1})
        sample = self.lb.metrics.registry.get_sample_value
        self.assertEqual(sample("txlb_auth_refused_total"), 3)

    def test_the_balancers_own_status_needs_no_key(self) -> None:
        client = self.call([], path=b"/__lb_status", method=b"GET")
        self.assertEqual(client.response().status, 200)


class AdmittedKeyTests(AuthTestCase):
    def setUp(self) -> None:
        self.build_auth()

    def test_a_good_key_is_served_and_never_forwarded(self) -> None:
        client = self.call(self.bearer(ALPHA) + [(b"x-tenant", b"beta")])
        call = self.upstream.calls[0]
        self.assertEqual(call.headers.getRawHeaders(b"authorization"), None)
        self.assertEqual(call.headers.getRawHeaders(b"x-api-key"), None)
        self.answer(0, 200, b'{"ok": 1}')
        self.assertEqual(client.response().status, 200)
        self.assertEqual(self.records[-1].tenant, "alpha")
        self.assertEqual(self.records[-1].routing.client, "tenant:alpha")

    def test_the_anthropic_header_works_alike(self) -> None:
        self.call([(b"x-api-key", ALPHA)], path=b"/v1/messages")
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertEqual(self.upstream.calls[0].headers.getRawHeaders(b"x-api-key"), None)

    def test_a_tenant_uses_its_models_only(self) -> None:
        refused = self.call(self.bearer(BETA), {"model": "m2", "prompt": "x"}).response()
        self.assertEqual(refused.status, 404)
        self.assertEqual(json.loads(refused.body)["error"]["code"], "model_not_found")
        unnamed = self.call(self.bearer(BETA), {"prompt": "x"}).response()
        self.assertEqual(unnamed.status, 404)
        self.call(self.bearer(BETA), {"model": "m1", "prompt": "x"})
        self.assertEqual(len(self.upstream.calls), 1)

    def test_a_tenants_class_bounds_its_header(self) -> None:
        self.call(self.bearer(BETA) + [(b"x-priority", b"interactive")])
        self.assertEqual(self.records, [])  # in flight
        self.answer(0, 200)
        self.assertEqual(self.records[-1].routing.priority, "batch")

    def test_the_tenant_is_in_the_result_log_line(self) -> None:
        self.call(self.bearer(ALPHA))
        self.answer(0, 200)
        line = format_text(summarize(self.records[-1]))
        self.assertIn(" tenant=alpha", line)
        self.assertNotIn(ALPHA.decode(), line)


class EngineKeyTests(FailoverTestCase):
    def engine_config(self, extra: str = "", environ: dict[str, str] | None = None) -> Any:
        """A config of one backend table; ``environ`` is the process's environment."""
        self.patch(os, "environ", dict(environ or {}))
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write('[[backends]]\nurl = "10.0.0.1:8000"\n' + extra)
        return build_config({"config": path, "log-file": "none"}, {})

    def test_the_backends_own_key_replaces_the_clients(self) -> None:
        self.build(config=self.engine_config('api_key = "engine-secret"\n'), backends=None)
        client = self.client()
        client.request(b"POST", b"/v1/completions", body=b'{"prompt": "x"}',
                       headers=[(b"Authorization", b"Bearer client-key")])
        self.assertEqual(self.upstream.calls[0].headers.getRawHeaders(b"authorization"),
                         [b"Bearer engine-secret"])

    def test_the_probe_carries_it(self) -> None:
        self.build(config=self.engine_config('api_key = "engine-secret"\n'), backends=None)
        self.lb.health.probe_all()
        probes = self.probes.calls
        self.assertTrue(probes)
        self.assertEqual(probes[0].headers.getRawHeaders(b"authorization"),
                         [b"Bearer engine-secret"])

    def test_from_the_environment(self) -> None:
        config = self.engine_config('api_key_env = "ENGINE_KEY"\n', {"ENGINE_KEY": "from-env"})
        self.assertEqual(config.backends[0].api_key, "from-env")
        self.assertNotIn("from-env", repr(config))

    def test_mistakes_never_echo_the_key(self) -> None:
        for extra, words in [
            ('api_key = "has space"\n', "printable"),
            ('api_key = "a"\napi_key_env = "B"\n', "not both"),
            ('api_key_env = "NOT_SET_ANYWHERE"\n', "has no NOT_SET_ANYWHERE"),
        ]:
            with self.assertRaises(ConfigError) as raised:
                self.engine_config(extra)
            self.assertIn(words, str(raised.exception))
            self.assertNotIn("has space", str(raised.exception))


class KeysFileTests(SynchronousTestCase):
    def test_auth_keys_needs_a_keys_file(self) -> None:
        with self.assertRaises(ConfigError) as raised:
            build_config({"auth": "keys", "backends": "10.0.0.1:8000"}, {})
        self.assertIn("needs --keys-file", str(raised.exception))

    def test_a_pasted_key_is_never_echoed(self) -> None:
        path = keys_file(self, '[[keys]]\nsha256 = "sk-live-this-is-a-real-key"\n'
                               'tenant = "a"\n')
        with self.assertRaises(ConfigError) as raised:
            read_keys(path)
        self.assertNotIn("sk-live", str(raised.exception))
        self.assertIn("entry 1", str(raised.exception))

    def test_the_same_key_twice_is_refused(self) -> None:
        digest = hashlib.sha256(b"k").hexdigest()
        path = keys_file(self, f'[[keys]]\nsha256 = "{digest}"\ntenant = "a"\n'
                               f'[[keys]]\nsha256 = "{digest}"\ntenant = "b"\n')
        with self.assertRaises(ConfigError) as raised:
            read_keys(path)
        self.assertIn("the same key as entry 1", str(raised.exception))
        self.assertNotIn(digest, str(raised.exception))

    def test_tenants_cannot_be_named_to_forge_log_lines(self) -> None:
        for name in ('"a b"', '"a\\nb"', '"-x"', '"' + "a" * 65 + '"'):
            path = keys_file(self, f"[tenants.{name}]\nweight = 1\n")
            with self.assertRaises(ConfigError):
                read_keys(path)

    def test_unknown_fields_and_bad_weights(self) -> None:
        for text, words in [
            ("[tenants.a]\nwieght = 2\n", "did you mean 'weight'"),
            ("[tenants.a]\nweight = 0\n", "not a number from"),
            ("[tenants.a]\nweight = true\n", "not a number from"),
            ("[tenants.a]\nmodels = [1]\n", "not a list of model names"),
            ("[tenants.a]\ntokens_per_minute = -1\n", "whole number of tokens"),
            ("[[keys]]\nsha256 = 3\ntenant = \"a\"\n", "is not the SHA-256"),
            ("[[keys]]\ntenant = \"a\"\n", "is not the SHA-256"),
            ("surprise = 1\n", "unknown key 'surprise'"),
        ]:
            path = keys_file(self, text)
            with self.assertRaises(ConfigError) as raised:
                read_keys(path)
            self.assertIn(words, str(raised.exception), text)

    def test_a_world_readable_file_is_noticed(self) -> None:
        path = keys_file(self, "")
        self.assertFalse(read_keys(path).world_readable)
        os.chmod(path, 0o644)
        self.assertTrue(read_keys(path).world_readable)

    def test_a_tenants_class_must_exist(self) -> None:
        path = keys_file(self, '[tenants.a]\nclass = "gold"\n')
        with self.assertRaises(ConfigError) as raised:
            build_config({"auth": "keys", "keys-file": path, "backends": "10.0.0.1:8000"}, {})
        self.assertIn("is not one of the classes", str(raised.exception))

    def test_a_budget_of_one_client_is_refused_with_keys(self) -> None:
        keys = keys_file(self, "")
        config = self.mktemp()
        with open(config, "w") as handle:
            handle.write('backends = ["10.0.0.1:8000"]\nauth = "keys"\n'
                         f'keys-file = "{keys}"\n[[budgets]]\nname = "one"\nkey = "ip"\n'
                         'value = "10.0.0.7"\ntokens_per_minute = 100\n')
        with self.assertRaises(ConfigError) as raised:
            build_config({"config": config}, {})
        self.assertIn("is for one client", str(raised.exception))

    def test_a_tenants_own_budget_joins_the_budgets(self) -> None:
        keys = keys_file(self, "[tenants.a]\ntokens_per_minute = 1000\n")
        config = build_config({"auth": "keys", "keys-file": keys,
                               "backends": "10.0.0.1:8000"}, {})
        [budget] = config.budgets
        self.assertEqual((budget.name, budget.key, budget.windows),
                         ("tenant.a", "tenant:a", ((60.0, 1000),)))
