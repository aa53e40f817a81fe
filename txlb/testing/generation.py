"""
One completion's life in the simulated vLLM, from admission to its last byte: the timing of
its tokens (time to first token, prefill of what the prefix cache did not hold, decode speed
as the batch changes) and the OpenAI-shaped events and bodies it writes.

It reads and frees what it needs of its simulator through :class:`Simulator`, so the engine
module (which makes generations) is the only one that knows the whole simulator.
"""

from __future__ import annotations

import socket
import struct
from typing import Any, Protocol

import attrs
from twisted.web.server import Request

from txlb._kvcache import CacheLease, PrefixCache, block_chain
from txlb.testing.timers import DelayedCall, SimClock
from txlb.testing.wire import dumps


class Simulator(Protocol):
    """What a generation reads of its simulator, and the slot it gives back to it."""

    ttft: float
    prefill_tokens_per_second: float
    cache: PrefixCache | None

    @property
    def _clock(self) -> SimClock: ...

    def _decode_speed(self) -> float: ...

    def _release(self, holder: Generation | Hung, completed: bool) -> None: ...


#: seconds between ``X-Sim-Reset-After``'s last token and the reset
RESET_DELAY = 0.05


@attrs.define(eq=False)
class Generation:
    """
    One accepted completion request, from admission to its last byte.

    States: ``waiting`` (queued behind ``max_num_seqs``), ``running`` (holds a slot and a
    timer), ``finished`` or ``aborted``.  Only ``running`` holds a timer, and nothing is
    written once the client has gone, because Twisted raises on ``finish`` after a
    disconnect.
    """

    sim: Simulator
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
    call: DelayedCall | None = None
    cache_lease: CacheLease | None = None
    cached_tokens: int = 0
    anchor_at: float = 0.0
    anchor_index: int = 0
    speed: float = 0.0
    #: a continuation's first token's number: the answer it continues had this many
    #: (:func:`~txlb.testing.completion.continued_from`)
    content_offset: int = 0
    #: ``X-Sim-Reset-After``: the answer's token after which the connection is reset
    reset_after: int | None = None

    @property
    def total(self) -> int:
        return self.reasoning_count + self.content_count

    def token(self, index: int) -> tuple[bool, str]:
        """Token ``index`` of this generation as ``(is_reasoning, text)``."""
        if index < self.reasoning_count:
            return True, f"reason{index} "
        return False, f"tok{index - self.reasoning_count + self.content_offset} "

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

    def client_left(self) -> None:
        """The client went away after the generation ended: nothing more is written."""
        self.client_gone = True

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
            if (self.reset_after is not None and self.stream
                    and self.emitted + self.content_offset == self.reset_after):
                self._reset()
                return
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
            body = dumps(self._full_response())
            self.request.setHeader(b"Content-Length", b"%d" % (len(body),))
            self._write(body)
        if not self.client_gone:
            self.request.finish()

    def _reset(self) -> None:
        """
        End the connection with a TCP RST (``SO_LINGER`` 0, then an abortive close): an
        engine's connection reset mid-answer.  No token comes meanwhile, and the close
        waits :data:`RESET_DELAY` so that what was written is sent first (a close drops
        what is still buffered).  The simulator frees the slot as for any client that
        went away.
        """
        transport = self.request.channel.transport
        if transport is None:
            return
        handle = getattr(transport, "getHandle", lambda: None)()
        if handle is not None:
            handle.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        abort = getattr(transport, "abortConnection", transport.loseConnection)

        def reset() -> None:
            self.call = None
            abort()

        self.call = self.sim._clock.callLater(RESET_DELAY, reset)

    def _write(self, data: bytes) -> None:
        if not self.client_gone:
            self.request.write(data)

    def _event(self, obj: dict[str, Any]) -> None:
        """One SSE event, in one ``write``, so relays can be tested event by event."""
        self._write(b"data: " + dumps(obj) + b"\n\n")

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
class Hung:
    """A request accepted while ``hang`` was set; it holds a slot until its client leaves."""

    request: Request
