"""
Five named, seeded workloads of OpenAI chat requests, for benchmarking prefix-cache routing.

Each workload is a generator of :class:`PrefixRequest` (a chat-completions body and what the
request shares by design).  Lengths are in *tokens at 4 characters a token*, the rule the
simulated engines and txlb's ``cache-aware`` block size use; text is made of 3-character
hex words and a space, so ``N`` tokens are exactly ``4 N`` characters.  Every random draw
comes from ``random.Random(f"{name}-{seed}")`` (and sub-streams named after it), so the same
name, seed, size and scale give the same requests, byte for byte, on any machine.

``tenants``
    ``tenants`` tenants (default 48; 8--150 is the interesting range), each with its own
    system prompt of 800--6,000 tokens (log-uniform), chosen per request with Zipf(0.8)
    popularity; each request adds a user message of 20--200 tokens.  Prefixes: one per
    tenant, long.  This is the llm-d "150 tenants sharing 6k-token prefixes" shape.
``multiturn``
    Conversations of 3--12 turns under one shared 400-token application system prompt;
    user turns of 30--250 tokens, assistant turns (fixed text put into the history, not the
    engine's actual answer) of 60--200 tokens.  ``active`` conversations (default 64) are
    served round-robin, a finished one replaced by a new one, so the turns of one
    conversation are ``active`` requests apart and each turn's prompt extends the previous
    turn's prompt.
``agents``
    Three agent kinds with tool prompts of 4,000, 5,000 and 6,000 tokens (chosen 60/30/10 %)
    in the system message; each task starts with 50--150 tokens of task text and runs 1--5
    steps, each step appending an assistant tool call (40 tokens) and a tool result of
    100--400 tokens.  48 tasks active at once, round-robin, as in ``multiturn``.
``hot-burst``
    One 4,000-token prefix for everyone; requests come in bursts of ``burst`` (default 64)
    that arrive at the same instant (:attr:`PrefixRequest.burst` numbers them); each adds a
    user message of 20--100 tokens.  The case where pure prefix affinity piles everything
    onto one engine.
``unique``
    No shared prefixes: each request is one user message of 200--3,000 tokens (log-uniform)
    of fresh random text.  Cache-aware routing must behave exactly like least-conn here.

Every request asks for ``max_tokens`` drawn log-normal (median 32, capped at 128), streams,
and names ``model`` (default ``sim-model``).  ``scale`` multiplies every token length (the
real-engine runs use small prompts); ``tenants``/``active``/``burst`` change the counts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class PrefixRequest:
    """One request of a workload."""

    index: int
    body: dict[str, Any]
    #: tenant, conversation, agent kind or ``""`` (unique): what the request shares by design
    group: str
    #: tokens of the request's prompt that an earlier request of the same group already sent
    shared_tokens: int
    #: requests with the same burst number arrive at the same instant; -1: no burst
    burst: int = -1

    def prompt_chars(self) -> int:
        """Characters of every message's content (what prefill is charged on)."""
        return sum(len(m["content"]) for m in self.body["messages"])


@dataclass(frozen=True)
class Options:
    """What a workload run can change; the defaults are the published figures'."""

    seed: int = 1
    requests: int = 2000
    scale: float = 1.0
    model: str = "sim-model"
    tenants: int = 48
    active: int = 64
    burst: int = 64
    max_tokens_median: float = 32.0
    max_tokens_cap: int = 128
    extra: dict[str, Any] = field(default_factory=dict)


class _Text:
    """Seeded text: ``tokens(n)`` is exactly ``CHARS_PER_TOKEN * n`` characters."""

    def __init__(self, rng: random.Random, scale: float) -> None:
        self.rng = rng
        self.scale = scale

    def size(self, tokens: float) -> int:
        return max(1, round(tokens * self.scale))

    def tokens(self, n: int) -> str:
        digits = self.rng.randbytes((3 * n + 1) // 2).hex()
        return " ".join(digits[i:i + 3] for i in range(0, 3 * n, 3)) + " "

    def log_uniform(self, low: float, high: float) -> int:
        return self.size(math.exp(self.rng.uniform(math.log(low), math.log(high))))

    def uniform(self, low: int, high: int) -> int:
        return self.size(self.rng.randint(low, high))


def _max_tokens(rng: random.Random, options: Options) -> int:
    value = rng.lognormvariate(math.log(options.max_tokens_median), 0.6)
    return max(1, min(options.max_tokens_cap, round(value)))


def _body(options: Options, messages: list[dict[str, str]], rng: random.Random) -> dict[str, Any]:
    return {"model": options.model, "messages": messages, "stream": True,
            "max_tokens": _max_tokens(rng, options)}


def _chars_to_tokens(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"]) for m in messages) // CHARS_PER_TOKEN


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank + 1) ** s for rank in range(n)]


def tenants(options: Options) -> Iterator[PrefixRequest]:
    """Many tenants, each with its own long system prompt (see the module docstring)."""
    rng = random.Random(f"tenants-{options.seed}")
    text = _Text(rng, options.scale)
    prompts = [text.tokens(text.log_uniform(800, 6000)) for _ in range(options.tenants)]
    weights = _zipf_weights(options.tenants, 0.8)
    order = list(range(options.tenants))
    rng.shuffle(order)  # popularity does not follow prompt length
    seen: set[int] = set()
    for index in range(options.requests):
        tenant = order[rng.choices(range(options.tenants), weights)[0]]
        system = {"role": "system", "content": prompts[tenant]}
        user = {"role": "user", "content": text.tokens(text.uniform(20, 200))}
        shared = len(system["content"]) // CHARS_PER_TOKEN if tenant in seen else 0
        seen.add(tenant)
        yield PrefixRequest(index, _body(options, [system, user], rng), f"tenant-{tenant}",
                            shared)


def _round_robin(options: Options, active: int, rng: random.Random,
                 start: Callable[[int], tuple[str, list[dict[str, str]], int, int]],
                 step: Callable[[list[dict[str, str]]], list[dict[str, str]]],
                 ) -> Iterator[PrefixRequest]:
    """
    ``active`` sessions served in turn: ``start(n)`` opens session ``n`` (its group, first
    messages, number of requests, tokens of those messages earlier sessions already sent),
    ``step(messages)`` is what the next request appends.
    """
    slots: list[tuple[str, list[dict[str, str]], int] | None] = [None] * active
    opened = 0
    for index in range(options.requests):
        slot = index % active
        current = slots[slot]
        if current is None or current[2] == 0:
            group, messages, left, shared = start(opened)
            opened += 1
        else:
            group, previous, left = current
            shared = _chars_to_tokens(previous)
            messages = previous + step(previous)
        slots[slot] = (group, messages, left - 1)
        yield PrefixRequest(index, _body(options, list(messages), rng), group, shared)


def multiturn(options: Options) -> Iterator[PrefixRequest]:
    """Conversations whose every turn extends the last (see the module docstring)."""
    rng = random.Random(f"multiturn-{options.seed}")
    text = _Text(rng, options.scale)
    system = {"role": "system", "content": text.tokens(text.size(400))}

    def start(n: int) -> tuple[str, list[dict[str, str]], int, int]:
        user = {"role": "user", "content": text.tokens(text.uniform(30, 250))}
        shared = len(system["content"]) // CHARS_PER_TOKEN if n else 0
        return f"conversation-{n}", [system, user], rng.randint(3, 12), shared

    def step(previous: list[dict[str, str]]) -> list[dict[str, str]]:
        return [{"role": "assistant", "content": text.tokens(text.uniform(60, 200))},
                {"role": "user", "content": text.tokens(text.uniform(30, 250))}]

    yield from _round_robin(options, options.active, rng, start, step)


AGENT_TOOL_TOKENS = (4000, 5000, 6000)
AGENT_SHARES = (0.6, 0.3, 0.1)


def agents(options: Options) -> Iterator[PrefixRequest]:
    """Agents: a long shared tool prompt, short task text, a few steps each (see above)."""
    rng = random.Random(f"agents-{options.seed}")
    text = _Text(rng, options.scale)
    tools = [text.tokens(text.size(n)) for n in AGENT_TOOL_TOKENS]

    seen: set[int] = set()

    def start(n: int) -> tuple[str, list[dict[str, str]], int, int]:
        kind = rng.choices(range(len(tools)), AGENT_SHARES)[0]
        task = {"role": "user", "content": text.tokens(text.uniform(50, 150))}
        shared = len(tools[kind]) // CHARS_PER_TOKEN if kind in seen else 0
        seen.add(kind)
        return (f"agent-{kind}", [{"role": "system", "content": tools[kind]}, task],
                rng.randint(1, 5), shared)

    def step(previous: list[dict[str, str]]) -> list[dict[str, str]]:
        return [{"role": "assistant", "content": text.tokens(text.size(40))},
                {"role": "user", "content": text.tokens(text.uniform(100, 400))}]

    yield from _round_robin(options, 48, rng, start, step)


def hot_burst(options: Options) -> Iterator[PrefixRequest]:
    """One prefix for everyone, in bursts that arrive at once (see the module docstring)."""
    rng = random.Random(f"hot-burst-{options.seed}")
    text = _Text(rng, options.scale)
    system = {"role": "system", "content": text.tokens(text.size(4000))}
    shared_tokens = len(system["content"]) // CHARS_PER_TOKEN
    for index in range(options.requests):
        user = {"role": "user", "content": text.tokens(text.uniform(20, 100))}
        yield PrefixRequest(index, _body(options, [system, user], rng), "hot",
                            shared_tokens if index else 0, burst=index // options.burst)


def unique(options: Options) -> Iterator[PrefixRequest]:
    """No shared prefixes at all (see the module docstring)."""
    rng = random.Random(f"unique-{options.seed}")
    text = _Text(rng, options.scale)
    for index in range(options.requests):
        user = {"role": "user", "content": text.tokens(text.log_uniform(200, 3000))}
        yield PrefixRequest(index, _body(options, [user], rng), "", 0)


WORKLOADS: dict[str, Callable[[Options], Iterator[PrefixRequest]]] = {
    "tenants": tenants,
    "multiturn": multiturn,
    "agents": agents,
    "hot-burst": hot_burst,
    "unique": unique,
}

#: The workloads whose requests share prefixes by design (the oracle target applies there).
SHARED_PREFIX = ("tenants", "multiturn", "agents", "hot-burst")


def generate(name: str, options: Options | None = None) -> Iterator[PrefixRequest]:
    """The requests of workload ``name``; ``KeyError`` names the known ones."""
    try:
        make = WORKLOADS[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None
    return make(options or Options())
