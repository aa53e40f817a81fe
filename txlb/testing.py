"""
A simulated vLLM server, for testing code that talks to one (txlb itself, or anything an
embedder builds on it) without a GPU, a model, or real time passing.

It speaks the slice of vLLM's OpenAI-compatible HTTP API that a load balancer cares about:
``/health``, ``/v1/models``, ``/metrics``, ``/v1/chat/completions`` and ``/v1/completions``
(streaming and not), and it reproduces the behaviours that make LLM backends awkward to
balance: generations that take time, a ``max_num_seqs`` cap with a FIFO waiting queue, an
optional prefix cache whose hits shorten the prefill (``kv_cache_blocks``), a dead engine
behind a live API server, a server that accepts requests and never answers, and
clients that disconnect mid-generation.  Everything observable is exposed as plain
attributes, so a test can flip a switch and then assert on counters.

Every timer goes through the reactor given to :class:`SimulatedVLLM`, so tests pass a
:class:`twisted.internet.task.Clock` and move time by hand: nothing here sleeps or reads
the wall clock.

Typical use in a test::

    clock = Clock()
    sim = SimulatedVLLM(clock, tokens_per_second=4, ttft=0.5)
    client = StubTreq(sim.resource())      # or: listen_simulated(reactor, sim)
    ...
    clock.advance(1)
    assert sim.completed == 1

Choices worth knowing about (they are deliberate simplifications):

* Tokens are the words ``tok0 ``, ``tok1 ``, ... (each a word and a space); reasoning
  tokens, when thinking is on, are ``reason0 ``, ``reason1 ``, ...  A prompt's token count
  is its number of whitespace-separated words -- unless the prefix cache is on: then the
  request is rendered as a chat template would (:func:`render_prompt`) and every
  :data:`CHARS_PER_TOKEN` characters are a token (:func:`count_tokens`), so that a client
  or a benchmark can compute the same blocks (:func:`block_chain`) without a tokenizer.
* Token ``i`` of a generation (0-based, reasoning first) is emitted ``ttft + i /
  tokens_per_second`` seconds after the generation starts *running* (not after it was
  received: queued requests wait first).  The response is completed together with the
  last token, so a non-streamed answer of ``T`` tokens arrives ``ttft + (T - 1) /
  tokens_per_second`` seconds after it starts (``ttft`` when ``T`` is 0).  With
  ``prefill_tokens_per_second``, the prompt tokens not found in the prefix cache add their
  prefill time to ``ttft``; with ``batch_slowdown``, the interval to the next token follows
  the batch size at each token.
* The prefix cache (:class:`PrefixCache`) is vLLM's in miniature: whole blocks of
  ``block_tokens``, each keyed over its whole prefix, pinned while their request runs and
  evicted least recently used afterwards.  It never holds a request back: when every block
  is pinned, the rest of a new prompt is simply not cached.
* A streamed response's headers go out with its first event, at ``ttft``, as with vLLM,
  which sends nothing until the first token exists.  A queued request therefore sees no
  response bytes at all until it is admitted.
* Reasoning tokens are counted in ``usage.completion_tokens`` but do not count toward
  ``max_tokens``.
* The context check is vLLM's: ``prompt_tokens + max_tokens > max_model_len`` is a 400,
  and a generation without ``max_tokens`` stops (``finish_reason: "length"``) when the
  context is full.
* Requests are recorded as :class:`ReceivedRequest` (see :attr:`SimulatedVLLM.requests`)
  before anything else happens, including health checks and scrapes.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any, Protocol, cast

import attrs
from twisted.internet.interfaces import (
    IListeningPort,
    IPushProducer,
    IReactorTCP,
    IReactorTime,
)
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request, Site
from zope.interface import implementer

from txlb._kvcache import (
    BLOCK_TOKENS,
    CHARS_PER_TOKEN,
    CacheLease,
    PrefixCache,
    block_chain,
    count_tokens,
    render_prompt,
)

__all__ = [
    "BLOCK_TOKENS",
    "CHARS_PER_TOKEN",
    "CacheLease",
    "PrefixCache",
    "ReceivedRequest",
    "SimulatedVLLM",
    "block_chain",
    "count_tokens",
    "filler_bytes",
    "listen_simulated",
    "render_prompt",
]


class _DelayedCall(Protocol):
    """The part of ``IDelayedCall`` used here, as a structural type mypy can check."""

    def cancel(self) -> None: ...


class _Clock(Protocol):
    """
    The part of ``IReactorTime`` used here.

    zope interfaces declare methods without ``self``, which mypy cannot check without a
    plugin; going through a Protocol keeps this module type-checked either way.
    """

    def callLater(
        self, delay: float, callable: Callable[..., object], *args: object, **kw: object
    ) -> _DelayedCall: ...

    def seconds(self) -> float: ...


class _TCPReactor(Protocol):
    """The part of ``IReactorTCP`` used by :func:`listen_simulated`."""

    def listenTCP(
        self, port: int, factory: Site, backlog: int = ..., interface: str = ...
    ) -> IListeningPort: ...


_CONTROL_PATHS = (b"/health", b"/v1/models", b"/metrics")
_CHAT_PATH = b"/v1/chat/completions"
_COMPLETIONS_PATH = b"/v1/completions"
_BYTES_PATH = b"/sim/bytes"

_JSON = b"application/json"
_SSE = b"text/event-stream; charset=utf-8"
_PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"

_PATTERN = bytes(range(256))


def filler_bytes(n: int, offset: int = 0) -> bytes:
    """
    The bytes ``/sim/bytes`` sends at positions ``offset`` to ``offset + n``.

    The stream is ``bytes(range(256))`` repeated rather than a constant byte, so a test
    that compares what it received with ``filler_bytes(n)`` also catches data that was
    reordered, duplicated or dropped on the way, not just a wrong length.
    """
    if n <= 0:
        return b""
    start = offset % len(_PATTERN)
    repeats = (start + n) // len(_PATTERN) + 1
    return (_PATTERN * repeats)[start : start + n]


def _dumps(obj: object) -> bytes:
    """Compact JSON, as vLLM (pydantic) writes it, so byte-level tests see realistic data."""
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def _error_type(code: int) -> str:
    """vLLM-style error type names: ``BadRequestError``, ``NotFoundError``, ..."""
    try:
        phrase = HTTPStatus(code).phrase
    except ValueError:
        return "SimulatedError"
    name = "".join(word.capitalize() for word in phrase.replace("-", " ").split())
    return name if name.endswith("Error") else name + "Error"


def _error_body(code: int, message: str) -> bytes:
    """The error object vLLM's OpenAI server answers with."""
    return _dumps(
        {
            "object": "error",
            "message": message,
            "type": _error_type(code),
            "param": None,
            "code": code,
        }
    )


def _count_words(value: object, depth: int = 0) -> int:
    """
    A deterministic stand-in for tokenisation: whitespace-separated words.

    Accepts what OpenAI-style requests put in ``content``/``prompt``: a string, a list of
    content parts (``{"type": "text", "text": ...}``), a list of strings, or token ids.
    Nesting deeper than any real request has is not counted, so a hostile body cannot
    exhaust the stack.
    """
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, int) and not isinstance(value, bool):
        return 1
    if depth >= 32:
        return 0
    if isinstance(value, dict):
        return _count_words(value.get("text", ""), depth + 1)
    if isinstance(value, list):
        return sum(_count_words(item, depth + 1) for item in value)
    return 0


@attrs.frozen
class ReceivedRequest:
    """
    One HTTP request as the simulator saw it, so tests can check what a proxy forwarded.

    :ivar method: e.g. ``b"POST"``.
    :ivar path: the full request target including the query string, e.g.
        ``b"/sim/bytes?n=10"``.
    :ivar headers: every header line as ``(name, value)``; repeated headers are kept, in
        the order received within each name.  Names are as Twisted canonicalises them
        (``b"X-Forwarded-For"``), values are untouched.
    :ivar body: the request body.
    """

    method: bytes
    path: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes | str) -> list[bytes]:
        """All values of header ``name`` (case-insensitive), in order; empty if absent."""
        wanted = (name.encode("ascii") if isinstance(name, str) else name).lower()
        return [value for key, value in self.headers if key.lower() == wanted]

    def json(self) -> Any:
        """The body parsed as JSON (raises ``ValueError`` if it is not)."""
        return json.loads(self.body)


@attrs.define(eq=False)
class _Generation:
    """
    One accepted completion request, from admission to its last byte.

    States: ``waiting`` (queued behind ``max_num_seqs``), ``running`` (holds a slot and a
    timer), ``finished`` or ``aborted``.  Only ``running`` holds a timer, and nothing is
    written once the client has gone, because Twisted raises on ``finish`` after a
    disconnect.
    """

    sim: SimulatedVLLM
    request: Request
    chat: bool
    model: str
    stream: bool
    include_usage: bool
    prompt_tokens: int
    reasoning_count: int
    content_count: int
    finish_reason: str
    ident: str
    created: int
    prompt: str | None = None
    state: str = "waiting"
    started_at: float = 0.0
    emitted: int = 0
    client_gone: bool = False
    call: _DelayedCall | None = None
    cache_lease: CacheLease | None = None
    cached_tokens: int = 0
    anchor_at: float = 0.0
    anchor_index: int = 0
    speed: float = 0.0

    @property
    def total(self) -> int:
        return self.reasoning_count + self.content_count

    def token(self, index: int) -> tuple[bool, str]:
        """Token ``index`` of this generation as ``(is_reasoning, text)``."""
        if index < self.reasoning_count:
            return True, f"reason{index} "
        return False, f"tok{index - self.reasoning_count} "

    def start(self) -> None:
        """
        Join the batch: look the prompt up in the prefix cache, if there is one, and time
        the first token after ``ttft`` plus the prefill of what was not cached.
        """
        self.state = "running"
        self.started_at = self.sim._clock.seconds()
        cache = self.sim.cache
        if cache is not None and self.prompt is not None:
            self.cache_lease = cache.acquire(
                block_chain(self.prompt, cache.block_tokens), self.prompt_tokens
            )
            self.cached_tokens = self.cache_lease.cached_tokens
        self.anchor_at = self.started_at + self.sim.ttft
        rate = self.sim.prefill_tokens_per_second
        if 0 < rate < float("inf"):
            self.anchor_at += (self.prompt_tokens - self.cached_tokens) / rate
        self.speed = self.sim._decode_speed()
        self._schedule()

    def _schedule(self) -> None:
        """
        Arm the timer for the next token at its absolute time: token ``i`` is due at
        ``anchor_at + (i - anchor_index) / speed``, the first one at ``anchor_at``.

        Absolute rather than chained delays, so a late timer (a busy reactor, or a test
        that jumps a Clock forward by a whole generation) catches up instead of shifting
        every later token.  When the decode speed changed (``batch_slowdown`` and a batch
        that grew or shrank), the schedule is anchored again at the previous token.
        """
        clock = self.sim._clock
        speed = self.sim._decode_speed()
        if speed != self.speed:
            if self.emitted > 0:
                self.anchor_at += (self.emitted - 1 - self.anchor_index) / self.speed
                self.anchor_index = self.emitted - 1
            self.speed = speed
        due = self.anchor_at + (self.emitted - self.anchor_index) / self.speed
        self.call = clock.callLater(max(0.0, due - clock.seconds()), self._step)

    def abort(self) -> None:
        """The client went away: stop the timer; the simulator frees the slot."""
        self.client_gone = True
        if self.call is not None:
            self.call.cancel()
            self.call = None
        self.state = "aborted"

    def _step(self) -> None:
        self.call = None
        if self.stream and self.emitted == 0 and self.chat:
            self._event(self._chunk({"role": "assistant", "content": ""}, None))
        if self.emitted < self.total:
            if self.stream:
                reasoning, text = self.token(self.emitted)
                if not self.chat:
                    self._event(self._chunk(text, None))
                elif reasoning:
                    self._event(self._chunk({"reasoning_content": text}, None))
                else:
                    self._event(self._chunk({"content": text}, None))
            self.emitted += 1
        if self.emitted >= self.total:
            self._complete()
        else:
            self._schedule()

    def _complete(self) -> None:
        self.state = "finished"
        self.sim._release(self, completed=True)
        if self.client_gone:
            return
        if self.stream:
            if self.chat:
                self._event(self._chunk({}, self.finish_reason))
            else:
                self._event(self._chunk("", self.finish_reason))
            if self.include_usage:
                self._event(self._envelope([], usage=True))
            self._write(b"data: [DONE]\n\n")
        else:
            body = _dumps(self._full_response())
            self.request.setHeader(b"Content-Length", b"%d" % (len(body),))
            self._write(body)
        if not self.client_gone:
            self.request.finish()

    def _write(self, data: bytes) -> None:
        if not self.client_gone:
            self.request.write(data)

    def _event(self, obj: dict[str, Any]) -> None:
        """One SSE event, in one ``write``, so relays can be tested event by event."""
        self._write(b"data: " + _dumps(obj) + b"\n\n")

    def _usage(self) -> dict[str, Any]:
        completion = self.total
        details = None
        if self.sim.cache is not None:
            details = {"cached_tokens": self.cached_tokens}
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": details,
        }

    def _envelope(self, choices: list[dict[str, Any]], usage: bool = False) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if self.stream else "chat.completion"
        else:
            kind = "text_completion"
        obj: dict[str, Any] = {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage:
            obj["usage"] = self._usage()
        return obj

    def _chunk(self, delta: dict[str, Any] | str, finish_reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if isinstance(delta, str):
            choice["text"] = delta
        else:
            choice["delta"] = delta
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        if finish_reason is not None or not self.chat:
            choice["stop_reason"] = None
        return self._envelope([choice])

    def _full_response(self) -> dict[str, Any]:
        reasoning = "".join(self.token(i)[1] for i in range(self.reasoning_count))
        content = "".join(self.token(i)[1] for i in range(self.reasoning_count, self.total))
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {
                "role": "assistant",
                "content": content,
                "reasoning_content": reasoning if self.reasoning_count else None,
                "tool_calls": [],
            }
        else:
            choice["text"] = content
        choice.update(logprobs=None, finish_reason=self.finish_reason, stop_reason=None)
        obj = self._envelope([choice], usage=True)
        obj["prompt_logprobs"] = None
        return obj


@attrs.define(eq=False)
class _Hung:
    """A request accepted while ``hang`` was set; it holds a slot until its client leaves."""

    request: Request


@implementer(IPushProducer)
@attrs.define(eq=False)
class _FillerProducer:
    """
    Writes ``/sim/bytes`` one chunk per reactor turn while the consumer is not paused.

    A push producer rather than a pull producer because Twisted drives pull producers
    through the global cooperator, which would escape the injected reactor; and one chunk
    per turn, rather than a loop, so that even a transport that never pauses us (a test's
    ``StringTransport``) gets the stream in bounded steps.  Real transports pause us as soon
    as their buffer is full, which is what keeps the simulator's memory bounded when the
    client reads slowly.
    """

    clock: _Clock
    request: Request
    remaining: int
    chunk: int
    sent: int = 0
    paused: bool = False
    done: bool = False
    call: _DelayedCall | None = None

    def start(self) -> None:
        self.request.notifyFinish().addErrback(self._client_gone)
        self.request.registerProducer(self, True)
        self._schedule()

    def _schedule(self) -> None:
        if self.call is None and not self.paused and not self.done:
            self.call = self.clock.callLater(0, self._tick)

    def _cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()
            self.call = None

    def _tick(self) -> None:
        self.call = None
        if self.paused or self.done:
            return
        n = min(self.chunk, self.remaining)
        if n:
            data = filler_bytes(n, self.sent)
            self.sent += n
            self.remaining -= n
            self.request.write(data)  # may pause or even stop us, synchronously
        if self.done:
            return
        if self.remaining == 0:
            self.done = True
            self.request.unregisterProducer()
            self.request.finish()
        else:
            self._schedule()

    def _client_gone(self, reason: Failure) -> None:
        self.done = True
        self._cancel()

    # IPushProducer
    def pauseProducing(self) -> None:
        self.paused = True
        self._cancel()

    def resumeProducing(self) -> None:
        self.paused = False
        self._schedule()

    def stopProducing(self) -> None:
        self.done = True
        self._cancel()


class _SimResource(Resource):
    """Routes every request to its simulator; a leaf, so the whole path is ours."""

    isLeaf = True

    def __init__(self, sim: SimulatedVLLM) -> None:
        super().__init__()
        self._sim = sim

    def render(self, request: Request) -> bytes | int:
        return self._sim._render(request)


class _QuietSite(Site):
    """A Site that writes no access log: a test run should not log every request."""

    noisy = False

    def log(self, request: http.Request) -> None:
        pass


def _to_models(value: Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    models = tuple(value)
    if not models or not all(isinstance(m, str) and m for m in models):
        raise ValueError(f"models must be a non-empty sequence of names, got {value!r}")
    return models


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


def _fraction(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0 <= value < 1:
        raise ValueError(f"{attribute.name} must be in [0, 1), got {value!r}")


def _count(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be an integer >= 0, got {value!r}")


class _BadRequest(Exception):
    """An invalid completion request; carries the status and message to answer with."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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

    Precedence for those other paths: ``X-Sim-Status``, then ``hang``, then routing; a
    completion is then checked for valid JSON (400), a known model (404), ``engine_dead``
    (500) and its fields (400), in that order.
    """

    reactor: IReactorTime
    models: tuple[str, ...] = attrs.field(default=("sim-model",), converter=_to_models)
    tokens_per_second: float = attrs.field(default=50.0, validator=_positive)
    ttft: float = attrs.field(default=0.05, validator=_non_negative)
    max_num_seqs: int = attrs.field(default=256, validator=_positive)
    default_tokens: int = attrs.field(default=16, validator=_non_negative)
    max_model_len: int = attrs.field(default=4096, validator=_positive)
    reasoning_tokens: int = attrs.field(default=4, validator=_non_negative)
    kv_cache_blocks: int = attrs.field(default=0, validator=_count)
    block_tokens: int = attrs.field(default=BLOCK_TOKENS, validator=[_count, _positive])
    prefill_tokens_per_second: float = attrs.field(default=0.0, validator=_non_negative)
    batch_slowdown: float = attrs.field(default=0.0, validator=_fraction)

    engine_dead: bool = attrs.field(default=False, init=False)
    loading: bool = attrs.field(default=False, init=False)
    hang: bool = attrs.field(default=False, init=False)
    started: int = attrs.field(default=0, init=False)
    completed: int = attrs.field(default=0, init=False)
    aborted: int = attrs.field(default=0, init=False)
    peak_running: int = attrs.field(default=0, init=False)
    requests: list[ReceivedRequest] = attrs.field(factory=list, init=False, repr=False)
    cache: PrefixCache | None = attrs.field(default=None, init=False, repr=False)

    _slots: set[_Generation | _Hung] = attrs.field(factory=set, init=False, repr=False)
    _queue: deque[_Generation] = attrs.field(factory=deque, init=False, repr=False)
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
    def _clock(self) -> _Clock:
        return cast(_Clock, self.reactor)

    def resource(self) -> IResource:
        """A ``twisted.web`` resource serving the whole API; mount it at the root."""
        return cast(IResource, _SimResource(self))

    def site(self) -> Site:
        """
        ``Site(self.resource())`` without access logging.

        The site's reactor is the simulator's, so that connection timeouts, like every
        other timer, follow a test's ``Clock``.
        """
        return _QuietSite(self.resource(), reactor=self.reactor)

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
        if path in _CONTROL_PATHS:
            if request.method not in (b"GET", b"HEAD"):
                return self._error(request, 405, "Method Not Allowed")
            if path == b"/health":
                request.setResponseCode(503 if self.loading or self.engine_dead else 200)
                return b""
            if path == b"/v1/models":
                return self._json(request, 200, self._models_list())
            request.setHeader(b"Content-Type", _PROMETHEUS)
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
            hung = _Hung(request)
            self._slots.add(hung)
            self.started += 1
            self.peak_running = max(self.peak_running, len(self._slots))
            request.notifyFinish().addErrback(lambda _: self._release(hung, completed=False))
            return NOT_DONE_YET

        if path in (_CHAT_PATH, _COMPLETIONS_PATH):
            if request.method != b"POST":
                return self._error(request, 405, "Method Not Allowed")
            return self._completion(request, body, chat=path == _CHAT_PATH)
        if path == _BYTES_PATH:
            if request.method != b"GET":
                return self._error(request, 405, "Method Not Allowed")
            return self._bytes(request)
        return self._error(request, 404, "Not Found")

    def _json(self, request: Request, code: int, obj: object) -> bytes:
        request.setResponseCode(code)
        request.setHeader(b"Content-Type", _JSON)
        return _dumps(obj)

    def _error(self, request: Request, code: int, message: str) -> bytes:
        request.setResponseCode(code)
        request.setHeader(b"Content-Type", _JSON)
        return _error_body(code, message)

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
            generation = self._parse_completion(request, body, chat)
        except _BadRequest as e:
            return self._error(request, e.code, e.message)
        if generation.stream:
            request.setHeader(b"Content-Type", _SSE)
        else:
            request.setHeader(b"Content-Type", _JSON)
        request.notifyFinish().addErrback(lambda _: self._client_gone(generation))
        self._queue.append(generation)
        self._pump()
        return NOT_DONE_YET

    def _parse_completion(self, request: Request, body: bytes, chat: bool) -> _Generation:
        """Validate a completion request the way vLLM does, in the same order."""
        try:
            payload = json.loads(body)
        except ValueError as e:
            raise _BadRequest(400, f"JSON decode error: {e}") from None
        except RecursionError:
            raise _BadRequest(400, "JSON decode error: nested too deeply") from None
        if not isinstance(payload, dict):
            raise _BadRequest(400, "The request body must be a JSON object.")

        model = payload.get("model", self.models[0])
        if model not in self.models:
            raise _BadRequest(404, f"The model `{model}` does not exist.")
        if self.engine_dead:
            raise _BadRequest(500, "Engine is dead")

        if chat:
            messages = payload.get("messages")
            if not isinstance(messages, list):
                raise _BadRequest(400, "Field required: messages (a list).")
            prompt_tokens = sum(
                _count_words(m.get("content")) for m in messages if isinstance(m, dict)
            )
            max_tokens = payload.get("max_completion_tokens")
            if max_tokens is None:
                max_tokens = payload.get("max_tokens")
        else:
            if "prompt" not in payload:
                raise _BadRequest(400, "Field required: prompt.")
            prompt_tokens = _count_words(payload["prompt"])
            max_tokens = payload.get("max_tokens")
        prompt = None
        if self.cache is not None:
            prompt = render_prompt(payload, chat)
            prompt_tokens = count_tokens(prompt)

        if max_tokens is not None:
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
                raise _BadRequest(400, f"max_tokens must be an integer, got {max_tokens!r}.")
            if max_tokens < 1:
                raise _BadRequest(400, f"max_tokens must be at least 1, got {max_tokens}.")
        if prompt_tokens >= self.max_model_len:
            raise _BadRequest(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your request has {prompt_tokens} input tokens. "
                "Please reduce the length of the input messages.",
            )
        if max_tokens is not None and prompt_tokens + max_tokens > self.max_model_len:
            raise _BadRequest(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_tokens + max_tokens} tokens "
                f"({prompt_tokens} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.",
            )

        override = request.getHeader(b"x-sim-tokens")
        if override is not None:
            try:
                count = int(override)
                if count < 0:
                    raise ValueError(count)
            except ValueError:
                raise _BadRequest(400, f"Invalid X-Sim-Tokens: {override!r}") from None
            finish_reason = "stop"
            if max_tokens is not None and max_tokens < count:
                count, finish_reason = max_tokens, "length"
        elif max_tokens is not None:
            count, finish_reason = max_tokens, "length"
        else:
            count, finish_reason = self.default_tokens, "stop"
        available = self.max_model_len - prompt_tokens
        if count > available:
            count, finish_reason = available, "length"

        thinking = False
        if chat:
            kwargs = payload.get("chat_template_kwargs")
            thinking = isinstance(kwargs, dict) and kwargs.get("enable_thinking") is True
        stream = payload.get("stream") is True
        options = payload.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True

        self._next_id += 1
        return _Generation(
            sim=self,
            request=request,
            chat=chat,
            model=model,
            stream=stream,
            include_usage=stream and include_usage,
            prompt_tokens=prompt_tokens,
            reasoning_count=self.reasoning_tokens if thinking else 0,
            content_count=count,
            finish_reason=finish_reason,
            ident=f"{'chatcmpl' if chat else 'cmpl'}-{self._next_id}",
            created=int(self._clock.seconds()),
            prompt=prompt,
        )

    def _bytes(self, request: Request) -> bytes | int:
        try:
            total = int(request.args[b"n"][0])
            chunk = int(request.args.get(b"chunk", [b"65536"])[0])
            if total < 0 or chunk < 1:
                raise ValueError(total, chunk)
        except (KeyError, IndexError, ValueError):
            return self._error(request, 400, "Usage: /sim/bytes?n=BYTES[&chunk=BYTES]")
        request.setHeader(b"Content-Type", b"application/octet-stream")
        _FillerProducer(self._clock, request, total, chunk).start()
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

    def _release(self, holder: _Generation | _Hung, completed: bool) -> None:
        """Free ``holder``'s slot, count how it ended, and let the queue move."""
        if holder not in self._slots:
            return
        self._slots.discard(holder)
        if isinstance(holder, _Generation) and holder.cache_lease is not None:
            assert self.cache is not None
            self.cache.release(holder.cache_lease)
        if completed:
            self.completed += 1
        else:
            self.aborted += 1
        self._pump()

    def _client_gone(self, generation: _Generation) -> None:
        if generation.state == "waiting":
            self._queue.remove(generation)
            generation.abort()
            self.aborted += 1
        elif generation.state == "running":
            generation.abort()
            self._release(generation, completed=False)
        else:
            # Finished already (the disconnect raced the last write): nothing to free.
            generation.client_gone = True


def listen_simulated(
    reactor: IReactorTCP, sim: SimulatedVLLM, port: int = 0, interface: str = "127.0.0.1"
) -> IListeningPort:
    """
    Serve ``sim`` over TCP; ``port=0`` picks a free port (see ``getHost().port``).

    Loopback by default, since a simulator has no business being reachable from elsewhere.
    """
    return cast(_TCPReactor, reactor).listenTCP(port, sim.site(), interface=interface)
