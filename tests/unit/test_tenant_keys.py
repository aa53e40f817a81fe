"""
Keys added and revoked: by ``python -m txlb.keys``, and through the admin API, which
edits the keys file (keeping its comments, atomically, mode 0600) and reloads; a revoked
key's stream finishes, its next request is refused; a reload takes a new keys file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
from pathlib import Path
from typing import Any
from unittest.mock import patch

from treq.testing import StubTreq
from twisted.trial.unittest import SynchronousTestCase

from txlb import keys as keys_command
from txlb._config import ConfigError
from txlb._config.keys import read_keys
from txlb._config.keys_edit import KEY_PREFIX, add_key, new_key, revoke_key
from txlb._scheduling.tenants import key_digest

from ..helpers import ClientConnection, FakeResponse
from .test_reload import ReloadTestCase
from .test_tenants import ALPHA, BETA, keys_file

JSON = {"Content-Type": "application/json"}


class EditTests(SynchronousTestCase):
    def test_new_keys_are_long_random_and_marked(self) -> None:
        made = {new_key() for _ in range(50)}
        self.assertEqual(len(made), 50)
        for key in made:
            self.assertTrue(key.startswith(KEY_PREFIX))
            self.assertEqual(len(key), 51)

    def test_an_added_key_keeps_the_files_comments_and_mode(self) -> None:
        path = keys_file(self)
        with open(path, "a") as handle:
            handle.write("# the operator's own note\n")
        os.chmod(path, 0o640)
        digest = hashlib.sha256(b"k").hexdigest()
        after = add_key(path, digest, "gamma", "new one")
        self.assertEqual(after.tenant(digest).name, "gamma")
        text = Path(path).read_text()
        self.assertIn("# the operator's own note\n", text)
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        self.assertEqual(read_keys(path).tenant(digest).name, "gamma")

    def test_a_revoked_key_is_cut_out_and_the_rest_kept(self) -> None:
        path = keys_file(self)
        entry, after = revoke_key(path, key_digest(ALPHA)[:8])
        self.assertEqual(entry.tenant, "alpha")
        self.assertIsNone(after.tenant(key_digest(ALPHA)))
        self.assertEqual(read_keys(path).tenant(key_digest(BETA)).name, "beta")
        self.assertIn("[tenants.alpha]", Path(path).read_text())  # its tenant stays

    def test_an_unknown_or_ambiguous_id(self) -> None:
        path = keys_file(self)
        with self.assertRaises(LookupError):
            revoke_key(path, "00000000")
        for bad in ("abc", "not-hex!", "g" * 8):
            with self.assertRaises(ConfigError):
                revoke_key(path, bad)

    def test_a_file_written_another_way_is_left_alone(self) -> None:
        digest = key_digest(ALPHA)
        text = f'keys = [{{sha256 = "{digest}", tenant = "alpha"}}]\n'
        path = keys_file(self, text)
        with self.assertRaises(ConfigError):
            add_key(path, hashlib.sha256(b"x").hexdigest(), "alpha")
        with self.assertRaises(ConfigError):
            revoke_key(path, digest[:8])
        self.assertEqual(Path(path).read_text(), text)

    def test_a_label_cannot_break_out_of_its_string(self) -> None:
        path = keys_file(self)
        with self.assertRaises(ConfigError):
            add_key(path, hashlib.sha256(b"y").hexdigest(), "alpha", 'x"\ntenant = "beta')
        digest = hashlib.sha256(b"z").hexdigest()
        add_key(path, digest, "alpha", 'say "hi" \\ bye')  # quotes and backslashes escaped
        entry = next(e for e in read_keys(path).keys if e.digest == digest)
        self.assertEqual((entry.tenant, entry.label), ("alpha", 'say "hi" \\ bye'))


class CommandTests(SynchronousTestCase):
    def run_command(self, *argv: str, stdin: str = "") -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with patch("sys.stdout", out), patch("sys.stderr", err), \
                patch("sys.stdin", io.StringIO(stdin)):
            code = keys_command.main(list(argv))
        return code, out.getvalue(), err.getvalue()

    def test_the_key_goes_to_stderr_and_the_entry_to_stdout(self) -> None:
        code, out, err = self.run_command("search", "--label", "ci")
        self.assertEqual(code, 0)
        key = err.splitlines()[1]
        self.assertTrue(key.startswith(KEY_PREFIX))
        self.assertNotIn(key, out)  # `>> keys.toml` never writes the key
        self.assertIn(f'sha256 = "{key_digest(key.encode())}"', out)
        self.assertIn('tenant = "search"', out)

    def test_add_appends_to_the_file(self) -> None:
        path = keys_file(self)
        code, out, err = self.run_command("alpha", "--add", path)
        self.assertEqual((code, out), (0, ""))
        key = err.splitlines()[1].encode()
        self.assertEqual(read_keys(path).tenant(key_digest(key)).name, "alpha")

    def test_digest_of_a_key_on_stdin(self) -> None:
        self.assertEqual(self.run_command("--digest", stdin="abc\n")[1].strip(),
                         hashlib.sha256(b"abc").hexdigest())

    def test_a_bad_tenant_name(self) -> None:
        code, _, err = self.run_command("no spaces")
        self.assertEqual(code, 2)
        self.assertIn("not a tenant name", err)


class AdminKeysTests(ReloadTestCase):
    """Through the admin API of a balancer started with --auth keys."""

    def setUp(self) -> None:
        self.keys = keys_file(self)
        self.first = (f'auth = "keys"\nkeys-file = "{self.keys}"\n'
                      + type(self).first)
        super().setUp()
        self.admin = StubTreq(self.lb.admin_resource())

    def call(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        response = self.successResultOf(self.admin.request(
            method, "http://127.0.0.1" + path, headers=JSON,
            data=None if body is None else json.dumps(body).encode()))
        return int(response.code), json.loads(self.successResultOf(response.content()))

    def request(self, key: bytes) -> ClientConnection:
        client = ClientConnection(self.site)
        client.request(b"POST", b"/v1/completions", body=b'{"model": "m1", "prompt": "x"}',
                       headers=[(b"Authorization", b"Bearer " + key)])
        return client

    def test_the_listing_never_shows_a_key(self) -> None:
        status, body = self.call("GET", "/tenants")
        self.assertEqual(status, 200)
        names = [t["name"] for t in body["tenants"]]
        self.assertEqual(names, ["alpha", "beta"])
        alpha = body["tenants"][0]
        self.assertEqual(alpha["keys"], [{"id": key_digest(ALPHA)[:8], "label": "ci"}])
        self.assertNotIn(key_digest(ALPHA), json.dumps(body))
        self.assertNotIn(ALPHA.decode(), json.dumps(body))

    def test_an_added_key_works_at_once(self) -> None:
        status, body = self.call("POST", "/tenants/keys", {"tenant": "alpha", "label": "x"})
        self.assertEqual((status, body["reloaded"]), (201, True))
        key = body["key"].encode()
        self.request(key)
        self.assertEqual(len(self.upstream.calls), 1)

    def test_a_revoked_keys_stream_finishes_and_its_next_request_is_refused(self) -> None:
        streaming = self.request(ALPHA)
        upstream = self.upstream.calls[0].respond(FakeResponse(
            200, [(b"Content-Type", b"text/event-stream")]))
        upstream.send(b"data: {}\n\n")
        status, body = self.call("DELETE", f"/tenants/keys/{key_digest(ALPHA)[:8]}")
        self.assertEqual((status, body["tenant"], body["reloaded"]), (200, "alpha", True))
        upstream.send(b"data: [DONE]\n\n")
        upstream.end()
        self.assertEqual(streaming.response().status, 200)
        self.assertIn(b"[DONE]", streaming.response().body)
        self.assertEqual(self.request(ALPHA).response().status, 401)
        self.assertEqual(len(self.upstream.calls), 1)
        self.request(BETA)  # the other tenant's key still works
        self.assertEqual(len(self.upstream.calls), 2)

    def test_mistakes_are_400_and_leave_the_file(self) -> None:
        before = Path(self.keys).read_text()
        for body in ({"tenant": "no spaces"}, {"tenant": 3}, {"tenant": "a", "key": "x"},
                     {"tenant": "a", "label": "x" * 65}):
            self.assertEqual(self.call("POST", "/tenants/keys", body)[0], 400, body)
        self.assertEqual(self.call("DELETE", "/tenants/keys/00000000")[0], 404)
        self.assertEqual(Path(self.keys).read_text(), before)

    def test_a_reload_takes_a_new_keys_file(self) -> None:
        Path(self.keys).write_text('[[keys]]\nsha256 = "' + key_digest(BETA) + '"\n'
                                   'tenant = "beta"\n')
        self.reload()
        self.assertEqual(self.request(ALPHA).response().status, 401)
        self.request(BETA)
        self.assertEqual(len(self.upstream.calls), 1)

    def test_a_broken_keys_file_is_refused_and_the_old_keys_stay(self) -> None:
        Path(self.keys).write_text("[[keys]]\nsha256 = 'nope'\n")
        self.refused()
        self.request(ALPHA)
        self.assertEqual(len(self.upstream.calls), 1)


class NoTenantsTests(ReloadTestCase):
    def test_without_keys_the_tenant_routes_say_so(self) -> None:
        admin = StubTreq(self.lb.admin_resource())
        response = self.successResultOf(admin.post(
            "http://127.0.0.1/tenants/keys", headers=JSON, data=b'{"tenant": "a"}'))
        self.assertEqual(response.code, 409)
