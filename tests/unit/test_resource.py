"""
What the main port's resource (:mod:`txlb._proxy.resource`) does around admission, and what
it answers itself: the queue wait of a client that leaves while queued, user affinity over a
body that is not JSON, the path logged for a refused request whose target is not a path, the
shutdown timeout ending every request still in flight, classes matched by model, the status
and model list, a request while shutting down, and a body forwarded byte for byte.

Written for the behaviour the survivors of ``_proxy/resource``'s full mutation run showed no
test pinned down.
"""

from __future__ import annotations

import json

from txlb._config import build_config

from ..helpers import ClientConnection, FakeResponse
from .test_failover import FailoverTestCase
from .test_proxy import ProxyTestCase


class QueuedClientLeavesTests(FailoverTestCase):
    def test_its_queue_wait_is_the_time_it_waited(self) -> None:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write('[[backends]]\nurl = "127.0.0.1:8002"\nmax_conns = 1\n')
        self.build(config=build_config({"config": path, "log-file": "none"}, {}),
                   backends=None)
        self.clock.advance(1000)  # a clock far from 0: the wait is a difference
        self.post()
        queued = self.post()
        self.clock.advance(2.5)
        queued.disconnect()
        record = self.records[-1]
        self.assertEqual(record.outcome, "client_abort")
        self.assertAlmostEqual(record.queue_wait, 2.5)


class UserAffinityTests(FailoverTestCase):
    def test_a_body_that_is_not_json_is_forwarded_without_a_session(self) -> None:
        self.build(affinity="user")
        client = self.post(b"not json at all")
        self.assertEqual(len(self.upstream.calls), 1)
        self.assertEqual(self.upstream.calls[0].body, b"not json at all")
        self.answer(0, 200, b'{"ok": 1}')
        self.assertEqual(client.response().status, 200)

    def test_a_user_field_pins_and_a_missing_one_does_not(self) -> None:
        self.build(affinity="user")
        pinned = set()
        for n in range(4):
            self.post(json.dumps({"prompt": "x", "user": "alice"}).encode())
            pinned.add(self.backend_of(n))
            self.answer(n, 200)
        self.assertEqual(len(pinned), 1)


class RefusedTargetTests(FailoverTestCase):
    def test_a_target_that_is_not_a_path_is_logged_as_dash(self) -> None:
        """``*`` (or an authority form) names no path: the log says ``-``, not the target."""
        self.build(max_body="1KiB")
        client = ClientConnection(self.lb.site())
        client.send(b"POST * HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        client.send(b"401\r\n" + b"a" * 0x401 + b"\r\n")
        self.assertTrue(client.transport.value().startswith(b"HTTP/1.1 413 "))
        self.assertEqual(self.records[-1].status, 413)
        self.assertEqual(self.records[-1].path, b"-")


class ShutdownTimeoutTests(FailoverTestCase):
    def test_abort_all_ends_every_request_in_flight(self) -> None:
        self.build()
        waiting = self.post()  # forwarded, no answer yet
        streaming = self.post()
        started = self.upstream.calls[1].respond(FakeResponse(200, [
            (b"Content-Type", b"text/event-stream")]))
        started.send(b"data: 1\n\n")
        self.lb.proxy.abort_all("the balancer is shutting down")
        self.assertEqual(waiting.response().status, 503)
        self.assertIn(b"shutting down", waiting.response().body)
        self.assertFalse(streaming.response().complete)  # cut short: it had begun
        self.assertEqual(sorted(r.outcome for r in self.records[-2:]), ["shutdown", "shutdown"])
        self.assertEqual(self.lb.pool.slots.in_flight, 0)



class ClassByModelTests(FailoverTestCase):
    def test_a_class_matches_the_model_sent_and_an_aliases_target(self) -> None:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write('[[backends]]\nurl = "127.0.0.1:8002"\nmodels = ["big"]\n'
                         '[[routes]]\nmodel = "alias"\nto = {big = 1}\n'
                         '[[classes]]\nname = "named"\nmodels = ["alias"]\n'
                         '[[classes]]\nname = "bulk"\nmodels = ["big"]\n'
                         '[[classes]]\nname = "default"\n')
        self.build(config=build_config({"config": path, "log-file": "none"}, {}),
                   backends=None)
        for n, (model, klass) in enumerate([("big", "bulk"), ("alias", "named"),
                                            (None, None)]):
            body = {"prompt": "x"} if model is None else {"model": model, "prompt": "x"}
            self.post(json.dumps(body).encode())
            self.answer(n, 200)
            self.assertEqual(self.records[-1].routing.priority,
                             klass or "default", model)


class MainPortAnswerTests(ProxyTestCase):
    """What the main port answers itself, and what it forwards untouched."""

    def test_status_and_models_answer_200(self) -> None:
        for path in (b"/__lb_status", b"/v1/models"):
            client = self.client()
            client.request(b"GET", path)
            self.assertEqual(client.response().status, 200, path)

    def test_a_request_while_shutting_down_is_refused_and_its_connection_closed(self) -> None:
        """
        503 with Retry-After (the health interval, rounded up, never under 1 s), then the
        kept-alive connection is closed so the client goes elsewhere.
        """
        self.build(["127.0.0.1:8002"], health_interval=1)
        self.lb.proxy.shutting_down = True
        client = self.client()
        client.request(b"GET", b"/v1/models/x")
        answer = client.response()
        self.assertEqual((answer.status, answer.header(b"retry-after")), (503, [b"1"]))
        self.assertTrue(client.transport.disconnecting)
        self.assertEqual(self.upstream.calls, [])

    def test_body_forwarded_byte_for_byte_when_the_model_is_no_alias(self) -> None:
        body = b'{"model":"m","prompt":"x",  "n":1}'
        client = self.client()
        client.request(b"POST", b"/v1/completions", body=body)
        self.assertEqual(self.upstream.last.body, body)

    def test_absolute_form_with_only_a_query(self) -> None:
        client = self.client()
        client.send(b"GET http://lb.example?x=1 HTTP/1.1\r\nHost: lb.example\r\n\r\n")
        self.assertTrue(self.upstream.last.uri.endswith(b":8002/?x=1")
                        or self.upstream.last.uri.endswith(b":8003/?x=1"),
                        self.upstream.last.uri)
