"""
Tests for txlb.testing (the simulated vLLM backend) and txlb.simtap (its twistd plugin).

Time is a task.Clock throughout, so every timing assertion is exact.  Two ways of talking
to the simulator are used: treq's StubTreq, which runs a real HTTP client against the
resource in memory (good for "what does a client see"), and a Site channel over a
StringTransport (good for byte-level checks, client disconnects and backpressure).
"""

from __future__ import annotations

import json
from typing import Any

from treq.testing import StubTreq
from twisted.application.internet import StreamServerEndpointService
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.error import ConnectionDone
from twisted.internet.protocol import Protocol, connectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python import usage
from twisted.python.failure import Failure
from twisted.trial import unittest
from twisted.web.http import HTTPChannel

from txlb import simtap
from txlb.testing import ReceivedRequest, SimulatedVLLM, filler_bytes, listen_simulated

URL = "http://sim.test"


def _chat(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hello there simulator"}],
    }
    body.update(extra)
    return body


def _raw_request(
    method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: sim.test"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


def _split_response(raw: bytes) -> tuple[bytes, list[bytes]]:
    """Split a chunked HTTP/1.1 response into its head and the list of body chunks."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    chunks = []
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        chunks.append(rest[:size])
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]
    return head, chunks


def _events(chunks: list[bytes]) -> list[Any]:
    """Decode SSE chunks, checking that each write carried exactly one event."""
    events: list[Any] = []
    for chunk in chunks:
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n"), chunk
        assert chunk.count(b"\n\n") == 1, chunk
        payload = chunk[len(b"data: ") : -2]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def _sim_timers(clock: Clock) -> list[Any]:
    """Pending timers of the simulator itself, leaving out HTTP channels' idle timeouts."""
    return [
        call
        for call in clock.getDelayedCalls()
        if not isinstance(getattr(call.func, "__self__", None), HTTPChannel)
    ]


class _Connection:
    """One client connection to a real Site channel, over a StringTransport."""

    def __init__(self, sim: SimulatedVLLM, transport: StringTransport | None = None) -> None:
        self.transport = transport if transport is not None else StringTransport()
        self.channel: HTTPChannel = sim.site().buildProtocol(None)
        self.channel.makeConnection(self.transport)

    def send(self, data: bytes) -> None:
        self.channel.dataReceived(data)

    def post(self, path: str, payload: Any, headers: dict[str, str] | None = None) -> None:
        self.send(_raw_request("POST", path, json.dumps(payload).encode(), headers))

    def disconnect(self) -> None:
        self.channel.connectionLost(Failure(ConnectionDone()))


class _Fixture(unittest.TestCase):
    def make(self, **kwargs: Any) -> SimulatedVLLM:
        self.clock = Clock()
        self.sim = SimulatedVLLM(self.clock, **kwargs)
        self.client = StubTreq(self.sim.resource())
        return self.sim

    def request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        headers: dict[str, str] | None = None,
        data: bytes | None = None,
    ) -> Any:
        """Start a request; returns its Deferred after pumping the in-memory connection."""
        if payload is not None:
            data = json.dumps(payload).encode()
        all_headers = {"Content-Type": "application/json"}
        all_headers.update(headers or {})
        d = self.client.request(method, URL + path, data=data, headers=all_headers)
        self.client.flush()
        return d

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.client.flush()

    def result(self, d: Any) -> tuple[int, Any, bytes]:
        """(status, response headers, body) of a response that must already be complete."""
        response = self.successResultOf(d)
        body_d = self.client.content(response)
        self.client.flush()
        return response.code, response.headers, self.successResultOf(body_d)

    def json_result(self, d: Any) -> tuple[int, Any]:
        code, headers, body = self.result(d)
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"application/json"])
        return code, json.loads(body)


class HealthAndModelsTests(_Fixture):
    def test_health_ok(self) -> None:
        self.make()
        code, headers, body = self.result(self.request("GET", "/health"))
        self.assertEqual((code, body), (200, b""))
        self.assertIsNone(headers.getRawHeaders(b"content-type"))

    def test_health_loading(self) -> None:
        self.make().loading = True
        self.assertEqual(self.result(self.request("GET", "/health"))[0], 503)
        self.sim.loading = False
        self.assertEqual(self.result(self.request("GET", "/health"))[0], 200)

    def test_engine_dead_behind_live_api_server(self) -> None:
        self.make().engine_dead = True
        self.assertEqual(self.result(self.request("GET", "/health"))[0], 503)
        code, models = self.json_result(self.request("GET", "/v1/models"))
        self.assertEqual(code, 200)
        self.assertEqual(models["data"][0]["id"], "sim-model")
        code, error = self.json_result(self.request("POST", "/v1/chat/completions", _chat()))
        self.assertEqual(code, 500)
        self.assertEqual(error["message"], "Engine is dead")
        self.assertEqual(error["object"], "error")
        self.assertEqual(self.sim.started, 0)

    def test_models_list(self) -> None:
        self.make(models=("m1", "m2"), max_model_len=2048)
        self.clock.advance(1234)
        code, body = self.json_result(self.request("GET", "/v1/models"))
        self.assertEqual(code, 200)
        self.assertEqual(body["object"], "list")
        self.assertEqual(
            body["data"][1],
            {
                "id": "m2",
                "object": "model",
                "created": 1234,
                "owned_by": "vllm",
                "root": "m2",
                "parent": None,
                "max_model_len": 2048,
            },
        )
        self.assertEqual([m["id"] for m in body["data"]], ["m1", "m2"])

    def test_requests_recorded(self) -> None:
        self.make()
        conn = _Connection(self.sim)
        conn.send(
            b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: sim\r\nX-Dup: a\r\nX-Dup: b\r\n"
            b"Content-Length: 2\r\n\r\n{]"
        )
        [received] = self.sim.requests
        self.assertIsInstance(received, ReceivedRequest)
        self.assertEqual(received.method, b"POST")
        self.assertEqual(received.path, b"/v1/completions?x=1")
        self.assertEqual(received.body, b"{]")
        self.assertEqual(received.header("x-dup"), [b"a", b"b"])
        self.assertEqual(received.header(b"HOST"), [b"sim"])
        self.assertIn((b"X-Dup", b"a"), received.headers)

    def test_unknown_path_and_method(self) -> None:
        self.make()
        code, body = self.json_result(self.request("GET", "/v1/nope"))
        self.assertEqual(code, 404)
        self.assertEqual(body["message"], "Not Found")
        self.assertEqual(body["type"], "NotFoundError")
        code, body = self.json_result(self.request("GET", "/v1/chat/completions"))
        self.assertEqual(code, 405)

    def test_constructor_validation(self) -> None:
        clock = Clock()
        self.assertRaises(ValueError, SimulatedVLLM, clock, tokens_per_second=0)
        self.assertRaises(ValueError, SimulatedVLLM, clock, max_num_seqs=0)
        self.assertRaises(ValueError, SimulatedVLLM, clock, ttft=-1)
        self.assertRaises(ValueError, SimulatedVLLM, clock, models=())
        self.assertEqual(SimulatedVLLM(clock, models=["a"]).models, ("a",))


class MetricsTests(_Fixture):
    def test_metrics_text(self) -> None:
        self.make(models=("m1", "m2"), max_num_seqs=2, ttft=1)
        for _ in range(3):
            self.request("POST", "/v1/chat/completions", _chat(model="m2"))
        code, headers, body = self.result(self.request("GET", "/metrics"))
        self.assertEqual(code, 200)
        [ctype] = headers.getRawHeaders(b"content-type")
        self.assertTrue(ctype.startswith(b"text/plain; version=0.0.4"))
        lines = body.decode().splitlines()
        self.assertIn('vllm:num_requests_running{model_name="m1"} 2.0', lines)
        self.assertIn('vllm:num_requests_waiting{model_name="m1"} 1.0', lines)
        self.assertIn("# TYPE vllm:num_requests_running gauge", lines)
        self.assertIn("# TYPE vllm:num_requests_waiting gauge", lines)
        self.assertIn(
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.", lines
        )


class NonStreamingTests(_Fixture):
    def test_chat_default_tokens_stop(self) -> None:
        self.make(ttft=0.5, tokens_per_second=4, default_tokens=3)
        d = self.request("POST", "/v1/chat/completions", _chat())
        self.assertEqual((self.sim.running, self.sim.started), (1, 1))
        # Tokens at 0.5, 0.75 and 1.0; the answer goes with the last one.
        self.advance(0.875)
        self.assertNoResult(d)
        self.advance(0.125)
        code, body = self.json_result(d)
        self.assertEqual(code, 200)
        self.assertEqual(body["id"], "chatcmpl-1")
        self.assertEqual(body["object"], "chat.completion")
        self.assertEqual(body["model"], "sim-model")
        [choice] = body["choices"]
        self.assertEqual(choice["message"]["role"], "assistant")
        self.assertEqual(choice["message"]["content"], "tok0 tok1 tok2 ")
        self.assertIsNone(choice["message"]["reasoning_content"])
        self.assertEqual(choice["finish_reason"], "stop")
        self.assertEqual(
            body["usage"],
            {
                "prompt_tokens": 3,
                "completion_tokens": 3,
                "total_tokens": 6,
                "prompt_tokens_details": None,
            },
        )
        self.assertEqual((self.sim.running, self.sim.completed, self.sim.aborted), (0, 1, 0))

    def test_content_length(self) -> None:
        self.make(ttft=0)
        conn = _Connection(self.sim)
        conn.post("/v1/chat/completions", _chat())
        self.clock.advance(1)
        head, _, body = conn.transport.value().partition(b"\r\n\r\n")
        head += b"\r\n"
        self.assertIn(b"\r\nContent-Length: %d\r\n" % (len(body),), head)
        self.assertIn(b"\r\nContent-Type: application/json\r\n", head)
        self.assertNotIn(b"chunked", head)
        self.assertEqual(json.loads(body)["object"], "chat.completion")

    def test_chat_max_tokens_length(self) -> None:
        self.make(ttft=0)
        for field in ("max_tokens", "max_completion_tokens"):
            d = self.request("POST", "/v1/chat/completions", _chat(**{field: 40}))
            self.advance(10)
            code, body = self.json_result(d)
            self.assertEqual(body["choices"][0]["finish_reason"], "length")
            self.assertEqual(body["usage"]["completion_tokens"], 40)
            self.assertTrue(body["choices"][0]["message"]["content"].endswith("tok39 "))

    def test_sim_tokens_header(self) -> None:
        self.make(ttft=0)
        d = self.request("POST", "/v1/chat/completions", _chat(), {"X-Sim-Tokens": "5"})
        self.advance(10)
        body = self.json_result(d)[1]
        self.assertEqual(body["usage"]["completion_tokens"], 5)
        self.assertEqual(body["choices"][0]["finish_reason"], "stop")
        d = self.request("POST", "/v1/chat/completions", _chat(max_tokens=2), {"X-Sim-Tokens": "5"})
        self.advance(10)
        body = self.json_result(d)[1]
        self.assertEqual(body["usage"]["completion_tokens"], 2)
        self.assertEqual(body["choices"][0]["finish_reason"], "length")

    def test_completions(self) -> None:
        self.make(ttft=0, default_tokens=2)
        d = self.request("POST", "/v1/completions", {"model": "sim-model", "prompt": "a b"})
        self.advance(1)
        code, body = self.json_result(d)
        self.assertEqual(code, 200)
        self.assertEqual(body["id"], "cmpl-1")
        self.assertEqual(body["object"], "text_completion")
        self.assertEqual(body["choices"][0]["text"], "tok0 tok1 ")
        self.assertEqual(body["choices"][0]["finish_reason"], "stop")
        self.assertEqual(body["usage"]["prompt_tokens"], 2)

    def test_thinking(self) -> None:
        self.make(ttft=0, reasoning_tokens=2)
        payload = _chat(max_tokens=3, chat_template_kwargs={"enable_thinking": True})
        d = self.request("POST", "/v1/chat/completions", payload)
        self.advance(10)
        message = self.json_result(d)[1]["choices"][0]["message"]
        self.assertEqual(message["reasoning_content"], "reason0 reason1 ")
        self.assertEqual(message["content"], "tok0 tok1 tok2 ")


class ErrorTests(_Fixture):
    def test_bad_json(self) -> None:
        self.make()
        code, body = self.json_result(
            self.request("POST", "/v1/chat/completions", data=b"{not json")
        )
        self.assertEqual(code, 400)
        self.assertEqual(body["object"], "error")
        self.assertEqual(body["type"], "BadRequestError")
        self.assertEqual(body["code"], 400)
        self.assertIsNone(body["param"])
        self.assertIn("JSON", body["message"])
        self.assertEqual(self.sim.started, 0)

    def test_unknown_model(self) -> None:
        self.make()
        code, body = self.json_result(
            self.request("POST", "/v1/chat/completions", _chat(model="gpt-9"))
        )
        self.assertEqual(code, 404)
        self.assertEqual(body["type"], "NotFoundError")
        self.assertEqual(body["message"], "The model `gpt-9` does not exist.")

    def test_max_tokens_over_context(self) -> None:
        self.make(max_model_len=100)
        code, body = self.json_result(
            self.request("POST", "/v1/chat/completions", _chat(max_tokens=500))
        )
        self.assertEqual(code, 400)
        self.assertEqual(
            body,
            {
                "object": "error",
                "message": "This model's maximum context length is 100 tokens. However, you "
                "requested 503 tokens (3 in the messages, 500 in the completion). Please "
                "reduce the length of the messages or completion.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
        )

    def test_invalid_max_tokens(self) -> None:
        self.make()
        code, body = self.json_result(
            self.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0})
        )
        self.assertEqual(code, 400)

    def test_forced_status(self) -> None:
        self.make()
        code, body = self.json_result(
            self.request("POST", "/v1/chat/completions", _chat(), {"X-Sim-Status": "503"})
        )
        self.assertEqual(code, 503)
        self.assertEqual(body["code"], 503)
        self.assertEqual(body["type"], "ServiceUnavailableError")
        self.assertEqual(self.sim.started, 0)


class StreamingTests(_Fixture):
    def test_chat_sse_over_time(self) -> None:
        self.make(ttft=0.5, tokens_per_second=4)
        conn = _Connection(self.sim)
        conn.post(
            "/v1/chat/completions",
            _chat(max_tokens=3, stream=True, stream_options={"include_usage": True}),
        )
        # Nothing at all, not even headers, before the first token.
        self.clock.advance(0.499)
        self.assertEqual(conn.transport.value(), b"")
        self.clock.advance(0.001)
        head, chunks = _split_response(conn.transport.value())
        self.assertIn(b"HTTP/1.1 200 OK", head)
        self.assertIn(b"Content-Type: text/event-stream", head)
        self.assertIn(b"Transfer-Encoding: chunked", head)
        events = _events(chunks)
        self.assertEqual(len(events), 2)
        self.assertEqual(events[0]["choices"][0]["delta"], {"role": "assistant", "content": ""})
        self.assertEqual(events[1]["choices"][0]["delta"], {"content": "tok0 "})
        self.clock.advance(0.25)
        events = _events(_split_response(conn.transport.value())[1])
        self.assertEqual(len(events), 3)
        self.assertEqual(events[2]["choices"][0]["delta"], {"content": "tok1 "})
        self.clock.advance(0.25)
        raw = conn.transport.value()
        self.assertTrue(raw.endswith(b"0\r\n\r\n"))
        events = _events(_split_response(raw)[1])
        for event in events[:-1]:
            self.assertEqual(event["id"], "chatcmpl-1")
            self.assertEqual(event["object"], "chat.completion.chunk")
            self.assertEqual(event["model"], "sim-model")
            self.assertIn("created", event)
        deltas = [e["choices"][0]["delta"] for e in events[1:4]]
        self.assertEqual(deltas, [{"content": f"tok{i} "} for i in range(3)])
        for event in events[:4]:
            self.assertIsNone(event["choices"][0]["finish_reason"])
        self.assertEqual(events[4]["choices"][0]["delta"], {})
        self.assertEqual(events[4]["choices"][0]["finish_reason"], "length")
        self.assertEqual(events[5]["choices"], [])
        self.assertEqual(
            events[5]["usage"],
            {
                "prompt_tokens": 3,
                "completion_tokens": 3,
                "total_tokens": 6,
                "prompt_tokens_details": None,
            },
        )
        self.assertEqual(events[6], "[DONE]")
        self.assertEqual(len(events), 7)
        self.assertEqual((self.sim.completed, self.sim.running), (1, 0))

    def test_no_usage_chunk_by_default(self) -> None:
        self.make(ttft=0)
        conn = _Connection(self.sim)
        conn.post("/v1/chat/completions", _chat(stream=True))
        self.clock.advance(10)
        events = _events(_split_response(conn.transport.value())[1])
        self.assertEqual(events[-2]["choices"][0]["finish_reason"], "stop")
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual(len(events), 16 + 3)
        self.assertNotIn("usage", events[-2])

    def test_thinking_stream(self) -> None:
        self.make(ttft=0, reasoning_tokens=2)
        conn = _Connection(self.sim)
        conn.post(
            "/v1/chat/completions",
            _chat(
                stream=True,
                max_tokens=2,
                chat_template_kwargs={"enable_thinking": True},
                stream_options={"include_usage": True},
            ),
        )
        self.clock.advance(10)
        events = _events(_split_response(conn.transport.value())[1])
        deltas = [e["choices"][0]["delta"] for e in events[1:5]]
        self.assertEqual(
            deltas,
            [
                {"reasoning_content": "reason0 "},
                {"reasoning_content": "reason1 "},
                {"content": "tok0 "},
                {"content": "tok1 "},
            ],
        )
        self.assertEqual(events[5]["choices"][0]["finish_reason"], "length")
        self.assertEqual(events[6]["usage"]["completion_tokens"], 4)

    def test_completions_stream(self) -> None:
        self.make(ttft=0, default_tokens=2)
        conn = _Connection(self.sim)
        conn.post(
            "/v1/completions",
            {"prompt": "a", "stream": True, "stream_options": {"include_usage": True}},
        )
        self.clock.advance(10)
        events = _events(_split_response(conn.transport.value())[1])
        self.assertEqual([e["object"] for e in events[:-1]], ["text_completion"] * 4)
        self.assertEqual(events[0]["id"], "cmpl-1")
        self.assertEqual([e["choices"][0]["text"] for e in events[:3]], ["tok0 ", "tok1 ", ""])
        self.assertEqual(events[2]["choices"][0]["finish_reason"], "stop")
        self.assertEqual(events[3]["usage"]["total_tokens"], 3)
        self.assertEqual(events[4], "[DONE]")

    def test_stream_through_http_client(self) -> None:
        """A real HTTP client sees the events arrive one interval apart."""
        self.make(ttft=1, tokens_per_second=2, default_tokens=2)
        d = self.request("POST", "/v1/chat/completions", _chat(stream=True))
        self.assertNoResult(d)
        self.advance(1)
        response = self.successResultOf(d)
        self.assertEqual(
            response.headers.getRawHeaders(b"content-type"), [b"text/event-stream; charset=utf-8"]
        )
        received: list[bytes] = []
        done = self.client.collect(response, received.append)
        self.client.flush()
        self.assertEqual(b"".join(received).count(b"data: "), 2)
        self.assertNoResult(done)
        self.advance(0.5)
        self.successResultOf(done)
        text = b"".join(received)
        self.assertEqual(text.count(b"data: "), 5)
        self.assertTrue(text.endswith(b"data: [DONE]\n\n"))


class SchedulingTests(_Fixture):
    def test_max_num_seqs_queue_fifo(self) -> None:
        self.make(max_num_seqs=2, ttft=1, tokens_per_second=1, default_tokens=1)
        conns = [_Connection(self.sim) for _ in range(5)]
        for conn in conns:
            conn.post("/v1/chat/completions", _chat())
        self.assertEqual((self.sim.running, self.sim.waiting, self.sim.started), (2, 3, 2))

        def answered() -> list[bool]:
            return [conn.transport.value().startswith(b"HTTP/1.1 200") for conn in conns]

        self.clock.advance(1)
        # The first two finished; the next two, in arrival order, started just now.
        self.assertEqual(answered(), [True, True, False, False, False])
        self.assertEqual((self.sim.running, self.sim.waiting, self.sim.started), (2, 1, 4))
        self.assertEqual(self.sim.completed, 2)
        self.clock.advance(1)
        self.assertEqual(answered(), [True, True, True, True, False])
        self.assertEqual((self.sim.running, self.sim.waiting), (1, 0))
        self.clock.advance(1)
        self.assertEqual((self.sim.running, self.sim.completed), (0, 5))
        ids = [json.loads(conn.transport.value().partition(b"\r\n\r\n")[2])["id"] for conn in conns]
        self.assertEqual(ids, [f"chatcmpl-{i}" for i in range(1, 6)])

    def test_clock_jump_delivers_everything_due(self) -> None:
        """Token times are absolute: one big advance completes a whole generation."""
        self.make(ttft=0.5, tokens_per_second=10, default_tokens=50)
        d = self.request("POST", "/v1/chat/completions", _chat())
        self.advance(0.5 + 49 / 10 - 0.01)
        self.assertNoResult(d)
        self.advance(0.01)
        self.assertEqual(self.json_result(d)[1]["usage"]["completion_tokens"], 50)


class DisconnectTests(_Fixture):
    def test_disconnect_while_running(self) -> None:
        self.make(max_num_seqs=1, ttft=0.5, tokens_per_second=4)
        first, second = _Connection(self.sim), _Connection(self.sim)
        first.post("/v1/chat/completions", _chat(stream=True))
        second.post("/v1/chat/completions", _chat(stream=True))
        self.clock.advance(0.75)
        self.assertEqual((self.sim.running, self.sim.waiting), (1, 1))
        written = first.transport.value()
        self.assertIn(b"tok1 ", written)
        first.disconnect()
        self.assertEqual((self.sim.aborted, self.sim.completed), (1, 0))
        # The slot went to the queued request at once.
        self.assertEqual((self.sim.running, self.sim.waiting, self.sim.started), (1, 0, 2))
        self.clock.advance(10)
        self.assertEqual(first.transport.value(), written)
        self.assertTrue(second.transport.value().endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"))
        self.assertEqual((self.sim.running, self.sim.completed, self.sim.aborted), (0, 1, 1))
        self.assertEqual(_sim_timers(self.clock), [])

    def test_disconnect_non_streaming(self) -> None:
        self.make(ttft=1)
        conn = _Connection(self.sim)
        conn.post("/v1/completions", {"prompt": "x"})
        self.clock.advance(0.5)
        self.assertEqual(len(_sim_timers(self.clock)), 1)
        conn.disconnect()
        self.assertEqual((self.sim.running, self.sim.aborted), (0, 1))
        self.assertEqual(_sim_timers(self.clock), [])
        self.clock.advance(10)
        self.assertEqual(conn.transport.value(), b"")
        self.assertEqual(self.sim.completed, 0)

    def test_disconnect_while_waiting(self) -> None:
        self.make(max_num_seqs=1, ttft=1, default_tokens=1)
        first, second, third = (_Connection(self.sim) for _ in range(3))
        for conn in (first, second, third):
            conn.post("/v1/chat/completions", _chat())
        self.assertEqual((self.sim.running, self.sim.waiting), (1, 2))
        second.disconnect()
        self.assertEqual((self.sim.running, self.sim.waiting, self.sim.aborted), (1, 1, 1))
        self.clock.advance(1)
        self.assertEqual(self.sim.started, 2)
        self.clock.advance(1)
        self.assertEqual(second.transport.value(), b"")
        self.assertIn(b"200 OK", third.transport.value())
        self.assertEqual((self.sim.completed, self.sim.aborted, self.sim.running), (2, 1, 0))

    def test_hang(self) -> None:
        self.make(ttft=0)
        self.sim.hang = True
        conn = _Connection(self.sim)
        conn.post("/v1/chat/completions", _chat())
        self.clock.advance(1000)
        self.assertEqual(conn.transport.value(), b"")
        self.assertEqual(self.sim.running, 1)
        self.assertEqual(self.result(self.request("GET", "/health"))[0], 200)
        metrics = self.result(self.request("GET", "/metrics"))[2]
        self.assertIn(b'vllm:num_requests_running{model_name="sim-model"} 1.0', metrics)
        conn.disconnect()
        self.assertEqual((self.sim.running, self.sim.aborted), (0, 1))


class _PausingTransport(StringTransport):
    """A transport that, like a real socket, pauses its producer when its buffer is full."""

    limit = 100_000

    def write(self, data: bytes) -> None:
        super().write(data)
        self._maybe_pause()

    def writeSequence(self, data: list[bytes]) -> None:
        super().writeSequence(data)
        self._maybe_pause()

    def _maybe_pause(self) -> None:
        if len(self.value()) > self.limit and self.producer is not None:
            self.producer.pauseProducing()

    def drain(self) -> bytes:
        """The client reads everything buffered; the transport resumes its producer."""
        data = self.value()
        self.clear()
        if self.producer is not None:
            self.producer.resumeProducing()
        return data


class BytesTests(_Fixture):
    def test_exact_bytes_through_http_client(self) -> None:
        self.make()
        n = 300_000
        d = self.request("GET", f"/sim/bytes?n={n}&chunk=65536")
        for _ in range(10):
            self.advance(0)
        code, headers, body = self.result(d)
        self.assertEqual(code, 200)
        self.assertEqual(headers.getRawHeaders(b"content-type"), [b"application/octet-stream"])
        self.assertEqual(len(body), n)
        self.assertEqual(body, filler_bytes(n))

    def test_chunks(self) -> None:
        self.make()
        conn = _Connection(self.sim)
        conn.send(_raw_request("GET", "/sim/bytes?n=2500&chunk=1000"))
        self.clock.advance(0)
        head, chunks = _split_response(conn.transport.value())
        self.assertIn(b"Transfer-Encoding: chunked", head)
        self.assertEqual([len(c) for c in chunks], [1000, 1000, 500])
        self.assertEqual(b"".join(chunks), filler_bytes(2500))
        self.assertEqual(filler_bytes(10, 250), bytes([250, 251, 252, 253, 254, 255, 0, 1, 2, 3]))

    def test_zero_bytes_and_bad_query(self) -> None:
        self.make()
        conn = _Connection(self.sim)
        conn.send(_raw_request("GET", "/sim/bytes?n=0"))
        self.clock.advance(0)
        self.assertTrue(conn.transport.value().endswith(b"\r\n\r\n0\r\n\r\n"))
        self.assertEqual(self.result(self.request("GET", "/sim/bytes?n=x"))[0], 400)

    def test_backpressure(self) -> None:
        self.make()
        transport = _PausingTransport()
        conn = _Connection(self.sim, transport)
        n = 2_000_000
        conn.send(_raw_request("GET", f"/sim/bytes?n={n}&chunk=65536"))
        received = b""
        rounds = 0
        while not received.endswith(b"\r\n0\r\n\r\n"):
            self.clock.advance(0)
            # Paused: the simulator buffers nothing beyond one chunk over the limit.
            self.assertLessEqual(len(transport.value()), transport.limit + 65536 + 100)
            self.clock.advance(0)
            self.assertLessEqual(len(transport.value()), transport.limit + 65536 + 100)
            received += transport.drain()
            rounds += 1
            self.assertLess(rounds, 100)
        self.assertGreater(rounds, 10)
        _, chunks = _split_response(received)
        self.assertEqual(b"".join(chunks), filler_bytes(n))

    def test_disconnect_stops_stream(self) -> None:
        self.make()
        transport = _PausingTransport()
        conn = _Connection(self.sim, transport)
        conn.send(_raw_request("GET", "/sim/bytes?n=10000000"))
        self.clock.advance(0)
        transport.drain()
        self.assertEqual(len(_sim_timers(self.clock)), 1)
        conn.disconnect()
        transport.clear()
        self.clock.advance(0)
        self.assertEqual(transport.value(), b"")
        self.assertEqual(_sim_timers(self.clock), [])


class _CollectAll(Protocol):
    def __init__(self) -> None:
        self.data = b""
        self.done: Deferred[bytes] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.data += data

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.done.callback(self.data)


class ListenTests(unittest.TestCase):
    def test_listen_simulated(self) -> Any:
        """Over real TCP; HTTP/1.0 so the server closes and leaves the reactor clean."""
        sim = SimulatedVLLM(Clock())
        port = listen_simulated(reactor, sim)
        self.addCleanup(port.stopListening)
        self.assertEqual(port.getHost().host, "127.0.0.1")
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
        proto = _CollectAll()

        def send(p: _CollectAll) -> Deferred[bytes]:
            assert p.transport is not None
            p.transport.write(b"GET /health HTTP/1.0\r\n\r\n")
            return p.done

        d = connectProtocol(endpoint, proto).addCallback(send)
        d.addCallback(lambda data: self.assertTrue(data.startswith(b"HTTP/1.0 200 OK\r\n")))
        return d


class SimTapTests(unittest.TestCase):
    def parse(self, *args: str) -> simtap.Options:
        options = simtap.Options()
        options.parseOptions(list(args))
        return options

    def test_defaults(self) -> None:
        options = self.parse()
        self.assertEqual(options["endpoint"], "tcp:8002:interface=127.0.0.1")
        sim = simtap.simulator_from_options(options, Clock())
        self.assertEqual(sim.models, ("sim-model",))
        self.assertEqual(
            (sim.tokens_per_second, sim.ttft, sim.max_num_seqs, sim.default_tokens),
            (50.0, 0.05, 256, 16),
        )

    def test_options_and_service(self) -> None:
        options = self.parse(
            "--port", "0", "--model", "m", "--model", "m2", "--tokens-per-second", "20",
            "--ttft", "0", "--max-num-seqs", "4", "--default-tokens", "8",
        )  # fmt: skip
        self.assertEqual(options["endpoint"], "tcp:0:interface=127.0.0.1")
        sim = simtap.simulator_from_options(options, Clock())
        self.assertEqual(sim.models, ("m", "m2"))
        self.assertEqual(
            (sim.tokens_per_second, sim.ttft, sim.max_num_seqs, sim.default_tokens),
            (20.0, 0.0, 4, 8),
        )
        service = simtap.makeService(options)
        self.assertIsInstance(service, StreamServerEndpointService)
        self.assertFalse(service.running)

    def test_endpoint_string(self) -> None:
        options = self.parse("--port", "tcp:9000:interface=0.0.0.0")
        self.assertEqual(options["endpoint"], "tcp:9000:interface=0.0.0.0")

    def test_bad_values(self) -> None:
        for args, option in [
            (("--tokens-per-second", "fast"), "tokens-per-second"),
            (("--tokens-per-second", "0"), "tokens-per-second"),
            (("--ttft", "-1"), "ttft"),
            (("--max-num-seqs", "0"), "max-num-seqs"),
            (("--max-num-seqs", "2.5"), "max-num-seqs"),
            (("--default-tokens", "x"), "default-tokens"),
            (("--port", "70000"), "port"),
            (("--port", "bogus:endpoint"), "port"),
        ]:
            e = self.assertRaises(usage.UsageError, self.parse, *args)
            self.assertIn(f"--{option}", str(e))


class ContinuationTests(_Fixture):
    """The simulator continues its own answer, as vLLM does with ``continue_final_message``."""

    def continued(self, payload: dict[str, Any], headers: dict[str, str] | None = None,
                  ) -> tuple[int, Any]:
        self.make(ttft=0.0, tokens_per_second=1000)
        d = self.request("POST", payload.pop("path", "/v1/chat/completions"), payload,
                         headers)
        self.advance(1)
        return self.json_result(d)

    def test_a_final_assistant_message_is_continued_from_its_last_token(self) -> None:
        code, body = self.continued(_chat(
            messages=[{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "tok0 tok1 tok2 "}],
            continue_final_message=True, add_generation_prompt=False), {"X-Sim-Tokens": "5"})
        self.assertEqual(code, 200)
        # X-Sim-Tokens is the whole answer's length: two more make five
        self.assertEqual(body["choices"][0]["message"]["content"], "tok3 tok4 ")
        self.assertEqual(body["usage"]["completion_tokens"], 2)
        self.assertEqual(body["usage"]["prompt_tokens"], 4)

    def test_max_tokens_counts_the_continuation_alone(self) -> None:
        code, body = self.continued(_chat(
            messages=[{"role": "assistant", "content": "tok0 tok1"}],
            continue_final_message=True, add_generation_prompt=False, max_tokens=3))
        self.assertEqual(body["choices"][0]["message"]["content"], "tok2 tok3 tok4 ")
        self.assertEqual(body["choices"][0]["finish_reason"], "length")

    def test_vllm_refuses_it_with_the_generation_prompt(self) -> None:
        code, body = self.continued(_chat(
            messages=[{"role": "assistant", "content": "tok0"}], continue_final_message=True))
        self.assertEqual(code, 400)
        self.assertIn("add_generation_prompt", json.dumps(body))

    def test_the_final_message_must_be_the_assistants(self) -> None:
        code, body = self.continued(_chat(continue_final_message=True,
                                          add_generation_prompt=False))
        self.assertEqual(code, 400)

    def test_other_text_continues_from_the_first_token(self) -> None:
        code, body = self.continued(_chat(
            messages=[{"role": "assistant", "content": "tokens tok9x"}],
            continue_final_message=True, add_generation_prompt=False, max_tokens=1))
        self.assertEqual(body["choices"][0]["message"]["content"], "tok0 ")

    def test_a_completions_prompt_is_continued(self) -> None:
        code, body = self.continued({"path": "/v1/completions", "model": "sim-model",
                                     "prompt": "say tok0 tok1 ", "max_tokens": 2})
        self.assertEqual(body["choices"][0]["text"], "tok2 tok3 ")

    def test_tokenize_counts_as_the_answers_are_counted(self) -> None:
        self.make()
        d = self.request("POST", "/tokenize", {"prompt": "tok0 tok1 tok2 "})
        code, body = self.json_result(d)
        self.assertEqual((code, body["count"], body["tokens"]), (200, 3, [0, 1, 2]))
        d = self.request("POST", "/tokenize", {"content": "a b"})
        self.assertEqual(self.json_result(d)[1]["count"], 2)
        d = self.request("POST", "/tokenize", {"prompt": 3})
        self.assertEqual(self.json_result(d)[0], 400)

    def test_reset_after_closes_the_connection_after_that_token(self) -> None:
        self.make(ttft=0.0, tokens_per_second=10)
        conn = _Connection(self.sim)
        conn.post("/v1/chat/completions", _chat(stream=True),
                  {"X-Sim-Tokens": "9", "X-Sim-Reset-After": "2"})
        self.clock.advance(1)
        self.assertFalse(conn.transport.disconnecting)  # what was written goes first
        self.clock.advance(0.05)
        events = _events(_split_response(conn.transport.value())[1])
        contents = [e["choices"][0]["delta"].get("content") for e in events]
        self.assertEqual(contents, ["", "tok0 ", "tok1 "])  # then the reset
        self.assertTrue(conn.transport.disconnecting)
        conn.disconnect()  # the connection's end reaches the simulator: no error
        self.assertEqual(self.sim.running, 0)

    def test_a_continuation_past_the_reset_is_not_reset(self) -> None:
        self.make(ttft=0.0, tokens_per_second=1000)
        d = self.request("POST", "/v1/chat/completions", _chat(
            messages=[{"role": "assistant", "content": "tok0 tok1"}],
            continue_final_message=True, add_generation_prompt=False),
            {"X-Sim-Tokens": "4", "X-Sim-Reset-After": "2"})
        self.advance(1)
        self.assertEqual(self.json_result(d)[1]["choices"][0]["message"]["content"],
                         "tok2 tok3 ")
