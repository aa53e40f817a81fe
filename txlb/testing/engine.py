"""
The simulated vLLM server itself: its options and switches, the counters tests read, the
routing of each request to its answer, and the ``max_num_seqs`` batch with its FIFO queue.
The other modules of :mod:`txlb.testing` each do one part of its work for it (a
generation's timing and events, a completion's checks, the byte stream, the HTTP side).
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Protocol, cast

import attrs
from twisted.internet.interfaces import IListeningPort, IReactorTCP, IReactorTime
from twisted.web.resource import IResource
from twisted.web.server import NOT_DONE_YET, Request, Site

from txlb._kvcache import BLOCK_TOKENS, PrefixCache
from txlb.testing.completion import BadRequest, count_words, parse_completion
from txlb.testing.filler import FillerProducer
from txlb.testing.generation import Generation, Hung
from txlb.testing.options import count, fraction, non_negative, positive, to_models
from txlb.testing.resource import QuietSite, SimResource
from txlb.testing.timers import SimClock
from txlb.testing.wire import (
    BYTES_PATH,
    CHAT_PATH,
    COMPLETIONS_PATH,
    CONTROL_PATHS,
    JSON,
    PROMETHEUS,
    SSE,
    TOKENIZE_PATH,
    ReceivedRequest,
    dumps,
    error_body,
)


class _TCPReactor(Protocol):
    """The part of ``IReactorTCP`` used by :func:`listen_simulated`."""

    def listenTCP(
        self, port: int, factory: Site, backlog: int = ..., interface: str = ...
    ) -> IListeningPort: ...


@attrs.define(eq=False)
class SimulatedVLLM:
    """
    A simulated vLLM OpenAI-compatible server.

    :param reactor: provides ``callLater``/``seconds`` for every timer; pass a
        :class:`~twisted.internet.task.Clock` in tests.
    :param models: served model names; the first one labels ``/metrics`` and is used when a
        request names no model.
    :param tokens_per_second: decode speed of each generation.
    :param ttft: time to first token, from the moment a generation starts running.
    :param max_num_seqs: how many generations run at once; the rest wait, FIFO.
    :param default_tokens: tokens generated when neither ``max_tokens`` nor ``X-Sim-Tokens``
        says otherwise (``finish_reason: "stop"``).
    :param max_model_len: context length, for the ``max_tokens`` check and ``/v1/models``.
    :param reasoning_tokens: reasoning tokens emitted first when a chat request has
        ``chat_template_kwargs.enable_thinking`` set.
    :param kv_cache_blocks: size of the prefix cache in blocks; 0 (the default) means no
        prefix cache, and prompts are counted in words as before.  With a cache, ``usage``
        carries ``prompt_tokens_details.cached_tokens`` (as vLLM with
        ``--enable-prompt-tokens-details``; in a stream only in the usage chunk
        ``stream_options.include_usage`` asks for), and ``/metrics``'
        ``vllm:kv_cache_usage_perc`` is the fraction of blocks pinned by running requests.
    :param block_tokens: tokens per block (vLLM's default, 16).
    :param prefill_tokens_per_second: prefill speed; time to first token is ``ttft`` plus
        the uncached prompt tokens over this.  0 (the default) or infinity: no prefill time.
    :param batch_slowdown: each generation decodes at ``tokens_per_second * (1 -
        batch_slowdown * running / max_num_seqs)``, so a full batch is slower per sequence
        (0, the default: no slowdown).

    ``/metrics`` also has ``vllm:prefix_cache_queries_total`` and ``_hits_total`` (prompt
    tokens looked up and found, 0 without a cache) and ``txlb_sim_peak_requests_running``,
    the simulator's own gauge of the most requests it ever ran at once (what a benchmark
    reads as the peak in flight on one backend).

    Switches tests flip:

    :ivar engine_dead: ``/health`` answers 503 and new completions 500 ("Engine is dead"),
        while ``/v1/models`` still answers 200, as a vLLM whose engine died behind a live
        API server does.  Generations already running carry on.
    :ivar loading: ``/health`` answers 503, as while weights load.  Only ``/health``
        reflects it: a balancer is expected to keep such a backend out of rotation.
    :ivar hang: every request except ``/health``, ``/v1/models`` and ``/metrics`` is
        accepted and never answered, for read-timeout tests.  Such a request counts in
        :attr:`running` (and takes a slot) until its client disconnects; clearing ``hang``
        does not release requests already hung.

    Counters tests read:

    :ivar started: generations that began running (hung requests included).
    :ivar completed: generations whose response was finished.
    :ivar aborted: requests whose client disconnected before the response was finished,
        whether they were waiting, running or hung.
    :ivar peak_running: the most requests that held a slot at once.
    :ivar cache: the :class:`PrefixCache` (its ``queries``, ``hits``, ``usage``), or None.
    :ivar requests: every request received, in order, as :class:`ReceivedRequest`.

    Per-request test controls, as request headers:

    * ``X-Sim-Tokens: N`` generates ``N`` tokens with ``finish_reason: "stop"``, unless
      ``max_tokens`` is smaller (then ``max_tokens`` and ``"length"``).
    * ``X-Sim-Status: CODE`` answers ``CODE`` at once with a vLLM-style error body, on any
      path except the three above (for failover tests).
    * ``X-Sim-Reset-After: N`` resets the connection (a TCP RST) once the answer's token
      ``N`` was written -- counted across a continuation, so a stream resumed elsewhere
      from token ``N`` on is not reset again.

    Precedence for those other paths: ``X-Sim-Status``, then ``hang``, then routing; a
    completion is then checked for valid JSON (400), a known model (404), ``engine_dead``
    (500) and its fields (400), in that order.
    """

    reactor: IReactorTime
    models: tuple[str, ...] = attrs.field(default=("sim-model",), converter=to_models)
    tokens_per_second: float = attrs.field(default=50.0, validator=positive)
    ttft: float = attrs.field(default=0.05, validator=non_negative)
    max_num_seqs: int = attrs.field(default=256, validator=positive)
    default_tokens: int = attrs.field(default=16, validator=non_negative)
    max_model_len: int = attrs.field(default=4096, validator=positive)
    reasoning_tokens: int = attrs.field(default=4, validator=non_negative)
    kv_cache_blocks: int = attrs.field(default=0, validator=count)
    block_tokens: int = attrs.field(default=BLOCK_TOKENS, validator=[count, positive])
    prefill_tokens_per_second: float = attrs.field(default=0.0, validator=non_negative)
    batch_slowdown: float = attrs.field(default=0.0, validator=fraction)

    engine_dead: bool = attrs.field(default=False, init=False)
    loading: bool = attrs.field(default=False, init=False)
    hang: bool = attrs.field(default=False, init=False)
    started: int = attrs.field(default=0, init=False)
    completed: int = attrs.field(default=0, init=False)
    aborted: int = attrs.field(default=0, init=False)
    peak_running: int = attrs.field(default=0, init=False)
    requests: list[ReceivedRequest] = attrs.field(factory=list, init=False, repr=False)
    cache: PrefixCache | None = attrs.field(default=None, init=False, repr=False)

    _slots: set[Generation | Hung] = attrs.field(factory=set, init=False, repr=False)
    _queue: deque[Generation] = attrs.field(factory=deque, init=False, repr=False)
    _next_id: int = attrs.field(default=0, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.kv_cache_blocks:
            self.cache = PrefixCache(self.kv_cache_blocks, self.block_tokens)

    @property
    def running(self) -> int:
        """Generations holding a slot right now (hung requests included)."""
        return len(self._slots)

    def _decode_speed(self) -> float:
        """Tokens/s of each generation with the batch as it is now."""
        return self.tokens_per_second * (
            1 - self.batch_slowdown * len(self._slots) / self.max_num_seqs
        )

    @property
    def waiting(self) -> int:
        """Generations queued behind ``max_num_seqs``."""
        return len(self._queue)

    @property
    def _clock(self) -> SimClock:
        return cast(SimClock, self.reactor)

    def resource(self) -> IResource:
        """A ``twisted.web`` resource serving the whole API; mount it at the root."""
        return cast(IResource, SimResource(self._render))

    def site(self) -> Site:
        """
        ``Site(self.resource())`` without access logging.

        The site's reactor is the simulator's, so that connection timeouts, like every
        other timer, follow a test's ``Clock``.
        """
        return QuietSite(self.resource(), reactor=self.reactor)

    # -- request handling ---------------------------------------------------------------

    def _render(self, request: Request) -> bytes | int:
        assert request.method is not None and request.uri is not None
        content = request.content
        body = b""
        if content is not None:
            content.seek(0)
            body = content.read()
        headers = [
            (name, value)
            for name, values in request.requestHeaders.getAllRawHeaders()
            for value in values
        ]
        self.requests.append(ReceivedRequest(request.method, request.uri, headers, body))
        request.defaultContentType = None

        path = request.path
        if path in CONTROL_PATHS:
            if request.method not in (b"GET", b"HEAD"):
                return self._error(request, 405, "Method Not Allowed")
            if path == b"/health":
                request.setResponseCode(503 if self.loading or self.engine_dead else 200)
                return b""
            if path == b"/v1/models":
                return self._json(request, 200, self._models_list())
            request.setHeader(b"Content-Type", PROMETHEUS)
            return self._metrics_text()

        forced = request.getHeader(b"x-sim-status")
        if forced is not None:
            try:
                code = int(forced)
                if not 100 <= code <= 599:
                    raise ValueError(code)
            except ValueError:
                return self._error(request, 400, f"Invalid X-Sim-Status: {forced!r}")
            return self._error(request, code, f"Simulated error (X-Sim-Status: {code})")

        if self.hang:
            hung = Hung(request)
            self._slots.add(hung)
            self.started += 1
            self.peak_running = max(self.peak_running, len(self._slots))
            request.notifyFinish().addErrback(lambda _: self._release(hung, completed=False))
            return NOT_DONE_YET

        if path in (CHAT_PATH, COMPLETIONS_PATH):
            if request.method != b"POST":
                return self._error(request, 405, "Method Not Allowed")
            return self._completion(request, body, chat=path == CHAT_PATH)
        if path == TOKENIZE_PATH:
            if request.method != b"POST":
                return self._error(request, 405, "Method Not Allowed")
            return self._tokenize(request, body)
        if path == BYTES_PATH:
            if request.method != b"GET":
                return self._error(request, 405, "Method Not Allowed")
            return self._bytes(request)
        return self._error(request, 404, "Not Found")

    def _tokenize(self, request: Request, body: bytes) -> bytes:
        """
        ``POST /tokenize`` as vLLM answers it (``count``, ``tokens``, ``max_model_len``):
        the words of its ``prompt`` (vLLM's field) or ``content`` (llama.cpp's).
        """
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError) as e:
            return self._error(request, 400, f"JSON decode error: {e}")
        if not isinstance(payload, dict):
            return self._error(request, 400, "The request body must be a JSON object.")
        text = payload.get("prompt", payload.get("content"))
        if not isinstance(text, str):
            return self._error(request, 400, "Field required: prompt (a string).")
        count = count_words(text)
        return self._json(request, 200, {"count": count, "tokens": list(range(count)),
                                         "max_model_len": self.max_model_len})

    def _json(self, request: Request, code: int, obj: object) -> bytes:
        request.setResponseCode(code)
        request.setHeader(b"Content-Type", JSON)
        return dumps(obj)

    def _error(self, request: Request, code: int, message: str) -> bytes:
        request.setResponseCode(code)
        request.setHeader(b"Content-Type", JSON)
        return error_body(code, message)

    def _models_list(self) -> dict[str, Any]:
        created = int(self._clock.seconds())
        return {
            "object": "list",
            "data": [
                {
                    "id": model,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": model,
                    "parent": None,
                    "max_model_len": self.max_model_len,
                }
                for model in self.models
            ],
        }

    def _metrics_text(self) -> bytes:
        label = self.models[0].replace("\\", "\\\\").replace('"', '\\"')
        cache = self.cache
        if cache is None:
            kv_usage = min(1.0, self.running / self.max_num_seqs)
            kv_help = "(simulated: running/max_num_seqs)"
        else:
            kv_usage = cache.usage
            kv_help = "(simulated: prefix blocks pinned by running requests/kv_cache_blocks)"
        lines = []
        for name, kind, help_text, value in (
            (
                "vllm:num_requests_running",
                "gauge",
                "Number of requests in model execution batches.",
                float(self.running),
            ),
            (
                "vllm:num_requests_waiting",
                "gauge",
                "Number of requests waiting to be processed.",
                float(self.waiting),
            ),
            (
                "vllm:kv_cache_usage_perc",
                "gauge",
                f"KV-cache usage. 1 means 100 percent usage {kv_help}.",
                kv_usage,
            ),
            (
                "vllm:prefix_cache_queries_total",
                "counter",
                "Prefix cache queries, in terms of number of queried tokens.",
                float(cache.queries if cache else 0),
            ),
            (
                "vllm:prefix_cache_hits_total",
                "counter",
                "Prefix cache hits, in terms of number of cached tokens.",
                float(cache.hits if cache else 0),
            ),
            (
                "txlb_sim_peak_requests_running",
                "gauge",
                "The simulator's own: most requests ever running at once.",
                float(self.peak_running),
            ),
        ):
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f'{name}{{model_name="{label}"}} {value!r}')
        return ("\n".join(lines) + "\n").encode("utf-8")

    def _completion(self, request: Request, body: bytes, chat: bool) -> bytes | int:
        try:
            generation = parse_completion(self, request, body, chat, self._take_id)
        except BadRequest as e:
            return self._error(request, e.code, e.message)
        if generation.stream:
            request.setHeader(b"Content-Type", SSE)
        else:
            request.setHeader(b"Content-Type", JSON)
        request.notifyFinish().addErrback(lambda _: self._client_gone(generation))
        self._queue.append(generation)
        self._pump()
        return NOT_DONE_YET

    def _take_id(self) -> int:
        """The next accepted completion's number."""
        self._next_id += 1
        return self._next_id

    def _bytes(self, request: Request) -> bytes | int:
        try:
            total = int(request.args[b"n"][0])
            chunk = int(request.args.get(b"chunk", [b"65536"])[0])
            if total < 0 or chunk < 1:
                raise ValueError(total, chunk)
        except (KeyError, IndexError, ValueError):
            return self._error(request, 400, "Usage: /sim/bytes?n=BYTES[&chunk=BYTES]")
        request.setHeader(b"Content-Type", b"application/octet-stream")
        FillerProducer(self._clock, request, total, chunk).start()
        return NOT_DONE_YET

    # -- scheduling ---------------------------------------------------------------------

    def _pump(self) -> None:
        """Start waiting generations, oldest first, while there are free slots."""
        while self._queue and len(self._slots) < self.max_num_seqs:
            generation = self._queue.popleft()
            self._slots.add(generation)
            self.started += 1
            self.peak_running = max(self.peak_running, len(self._slots))
            generation.start()

    def _release(self, holder: Generation | Hung, completed: bool) -> None:
        """Free ``holder``'s slot, count how it ended, and let the queue move."""
        if holder not in self._slots:
            return
        self._slots.discard(holder)
        if isinstance(holder, Generation) and holder.cache_lease is not None:
            assert self.cache is not None
            self.cache.release(holder.cache_lease)
        if completed:
            self.completed += 1
        else:
            self.aborted += 1
        self._pump()

    def _client_gone(self, generation: Generation) -> None:
        if generation.state == "waiting":
            self._queue.remove(generation)
            generation.abort()
            self.aborted += 1
        elif generation.state == "running":
            generation.abort()
            self._release(generation, completed=False)
        else:
            # Finished already (the disconnect raced the last write): nothing to free.
            generation.client_left()


def listen_simulated(
    reactor: IReactorTCP, sim: SimulatedVLLM, port: int = 0, interface: str = "127.0.0.1"
) -> IListeningPort:
    """
    Serve ``sim`` over TCP; ``port=0`` picks a free port (see ``getHost().port``).

    Loopback by default, since a simulator has no business being reachable from elsewhere.
    """
    return cast(_TCPReactor, reactor).listenTCP(port, sim.site(), interface=interface)
