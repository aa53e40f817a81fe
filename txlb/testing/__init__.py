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

The package's modules each do one job (:mod:`~txlb.testing.engine` the simulator itself,
:mod:`~txlb.testing.generation` a completion's timing and events,
:mod:`~txlb.testing.completion` vLLM's checks of a request, :mod:`~txlb.testing.wire` what
goes on the wire, :mod:`~txlb.testing.filler` the byte stream,
:mod:`~txlb.testing.resource` the HTTP side, :mod:`~txlb.testing.options` the options'
checks, :mod:`~txlb.testing.timers` the reactor's part they use); everything a user
imports is here.
"""

from __future__ import annotations

from txlb._kvcache import (
    BLOCK_TOKENS,
    CHARS_PER_TOKEN,
    CacheLease,
    PrefixCache,
    block_chain,
    count_tokens,
    render_prompt,
)
from txlb.testing.engine import SimulatedVLLM, listen_simulated
from txlb.testing.wire import ReceivedRequest, filler_bytes

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
