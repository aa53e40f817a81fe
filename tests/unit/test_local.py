"""
txlb's own answers on the main port (txlb._proxy.local), without the resource around them.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from txlb._proxy.local import ASTERISK, MODELS_PATH, STATUS_PATH, LocalAnswers


class _Pool:
    def status(self) -> dict[str, object]:
        return {"healthy": 1, "backends": []}


class _Router:
    pool = _Pool()

    def queue_status(self) -> dict[str, object]:
        return {"waiting": 2}

    def model_list(self, only: object = None) -> dict[str, object]:
        return {"object": "list", "data": [{"id": "m"}]}


def request(method: bytes, host: str = "192.0.2.9") -> DummyRequest:
    req = DummyRequest([b""])
    req.method = method
    req.client = IPv4Address("TCP", host, 40000)
    return req


class LocalAnswersTests(SynchronousTestCase):
    def answers(self, lb_status: str = "on") -> LocalAnswers:
        return LocalAnswers(_Router(), lb_status)  # type: ignore[arg-type]

    def body(self, req: DummyRequest) -> Any:
        self.assertEqual(req.finished, 1)
        self.assertEqual(req.responseHeaders.getRawHeaders(b"content-type"),
                         [b"application/json"])
        return json.loads(b"".join(req.written))

    def test_status_is_the_pool_and_the_queue(self) -> None:
        req = request(b"GET")
        self.assertIsNotNone(self.answers().answer(req, STATUS_PATH))
        self.assertEqual(req.responseCode, 200)
        self.assertEqual(self.body(req), {"healthy": 1, "backends": [], "queue": {"waiting": 2}})

    def test_models_merged_by_the_router(self) -> None:
        req = request(b"GET")
        self.assertIsNotNone(self.answers("off").answer(req, MODELS_PATH))
        self.assertEqual(self.body(req), {"object": "list", "data": [{"id": "m"}]})

    def test_status_only_to_whom_lb_status_shows_it(self) -> None:
        remote, local = request(b"GET"), request(b"GET", "127.0.0.1")
        self.assertIsNone(self.answers("loopback").answer(remote, STATUS_PATH))
        self.assertEqual(remote.written, [])
        self.assertIsNotNone(self.answers("loopback").answer(local, STATUS_PATH))
        self.assertIsNone(self.answers("off").answer(request(b"GET", "127.0.0.1"),
                                                     STATUS_PATH))

    def test_anything_else_left_to_forward(self) -> None:
        for method, path in [(b"POST", STATUS_PATH), (b"POST", MODELS_PATH),
                             (b"GET", b"/v1/models/m"), (b"GET", b"/v1/chat/completions")]:
            req = request(method)
            self.assertIsNone(self.answers().answer(req, path), (method, path))
            self.assertEqual((req.written, req.finished), ([], 0))

    def test_the_asterisk_target_is_the_servers_own(self) -> None:
        """``OPTIONS *``: 200 with no body; ``*`` with another method: a JSON 405."""
        req = request(b"OPTIONS")
        self.assertEqual(self.answers().answer(req, ASTERISK), b"")
        self.assertEqual((req.responseCode, req.finished), (200, 1))
        self.assertEqual(req.responseHeaders.getRawHeaders(b"content-length"), [b"0"])
        req = request(b"GET")
        body = self.answers().answer(req, ASTERISK)
        self.assertEqual(req.responseCode, 405)
        self.assertEqual(req.responseHeaders.getRawHeaders(b"allow"), [b"OPTIONS"])
        self.assertEqual(self.body(req)["error"]["code"], 405)
        self.assertEqual(body, b"".join(req.written))
