"""The admin port of a real ``twistd -n llmlb``, driven with curl."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from twisted.internet import defer, utils
from twisted.trial.unittest import TestCase

from ..parts import missing
from ..processes import TwistdProcess
from .test_integration import Fleet

CURL = shutil.which("curl")


class AdminProcessTests(TestCase):
    """
    The admin port of a real ``twistd -n llmlb``, driven with curl the way docs/operations.md
    tells operators to: what they type works, what a browser page would send does not.
    """

    timeout = 90

    async def curl(self, *args: str) -> tuple[int, Any]:
        """Run curl against the admin port; the status and the (JSON) body."""
        out, err, code = await utils.getProcessOutputAndValue(
            CURL or "", ["-s", "-w", "\n%{http_code}", *args], env={})
        self.assertEqual(code, 0, err)
        body, _, status = out.decode().rpartition("\n")
        return int(status), json.loads(body) if body else None

    @defer.inlineCallbacks
    def test_curl_as_documented(self) -> Any:
        if CURL is None:
            missing("curl", "curl is not installed (apt-get install curl)")
        fleet = Fleet(self, 2)
        lb = TwistdProcess("--backends", ",".join(fleet.keys), "--admin",
                           "tcp:0:interface=127.0.0.1", "--admin-hosts", "lb-admin.internal")
        self.addCleanup(lambda: defer.ensureDeferred(lb.stop()))
        yield defer.ensureDeferred(lb.started())
        admin, key = lb.admin_url, fleet.keys[0]

        def curl(*args: str) -> defer.Deferred[tuple[int, Any]]:
            return defer.ensureDeferred(self.curl(*args))

        # what operators type
        code, state = yield curl("-X", "POST", f"{admin}/backends/{key}/drain")
        self.assertEqual((code, state["draining"]), (200, True))
        code, state = yield curl("-X", "POST", f"{admin}/backends/{key}/undrain")
        self.assertEqual((code, state["draining"]), (200, False))
        code, state = yield curl("-X", "POST", "-H", "Content-Type: application/json",
                                 f"{admin}/backends", "-d", '{"backend": "127.0.0.1:9"}')
        self.assertEqual((code, state["backend"]), (201, "127.0.0.1:9"))
        code, _ = yield curl("-X", "DELETE", f"{admin}/backends/127.0.0.1:9")
        self.assertEqual(code, 200)
        code, _ = yield curl("-H", "Host: lb-admin.internal:8001", f"{admin}/status")
        self.assertEqual(code, 200)
        # what a page could make a browser send, and forgetting the JSON content type
        code, error = yield curl(f"{admin}/backends", "-d", '{"backend": "127.0.0.1:10"}')
        self.assertEqual((code, error["error"]["code"]), (415, 415))
        code, error = yield curl("-H", "Host: evil.example:8001", f"{admin}/status")
        self.assertEqual((code, error["error"]["code"]), (403, 403))
        code, error = yield curl("-X", "POST", "-H", "Origin: http://evil.example",
                                 f"{admin}/backends/{key}/drain")
        self.assertEqual((code, error["error"]["code"]), (403, 403))
        big = Path(self.mktemp())
        big.write_bytes(json.dumps({"backend": "127.0.0.1:11", "models": ["m" * 100_000]})
                        .encode())
        code, error = yield curl("-X", "POST", "-H", "Content-Type: application/json",
                                 f"{admin}/backends", "--data-binary", f"@{big}")
        self.assertEqual((code, error["error"]["code"]), (413, 413))
        code, status = yield curl(f"{admin}/status")
        self.assertEqual((code, status["total"], status["draining"]), (200, 2, 0))
