"""
txlb's own answers on the main port (txlb._proxy.local), without the resource around them.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from txlb._proxy.local import MODELS_PATH, STATUS_PATH, LocalAnswers


class _Pool:
    def status(self) -> dict[str, object]:
        return {"healthy": 1, "backends": []}


class _Router:
    pool = _Pool()

    def queue_status(self) -> dict[str, object]:
        return {"waiting": 2}

    def model_list(self) -> dict[str, object]:
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
        self.assertTrue(self.answers().answer(req, STATUS_PATH))
        self.assertEqual(req.responseCode, 200)
        self.assertEqual(self.body(req), {"healthy": 1, "backends": [], "queue": {"waiting": 2}})

    def test_models_merged_by_the_router(self) -> None:
        req = request(b"GET")
        self.assertTrue(self.answers("off").answer(req, MODELS_PATH))
        self.assertEqual(self.body(req), {"object": "list", "data": [{"id": "m"}]})

    def test_status_only_to_whom_lb_status_shows_it(self) -> None:
        remote, local = request(b"GET"), request(b"GET", "127.0.0.1")
        self.assertFalse(self.answers("loopback").answer(remote, STATUS_PATH))
        self.assertEqual(remote.written, [])
        self.assertTrue(self.answers("loopback").answer(local, STATUS_PATH))
        self.assertFalse(self.answers("off").answer(request(b"GET", "127.0.0.1"), STATUS_PATH))

    def test_anything_else_left_to_forward(self) -> None:
        for method, path in [(b"POST", STATUS_PATH), (b"POST", MODELS_PATH),
                             (b"GET", b"/v1/models/m"), (b"GET", b"/v1/chat/completions")]:
            req = request(method)
            self.assertFalse(self.answers().answer(req, path), (method, path))
            self.assertEqual((req.written, req.finished), ([], 0))
