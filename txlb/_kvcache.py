"""
A model of vLLM's automatic prefix cache, and the prompt rendering it is keyed by.

Shared by the simulated vLLM (:class:`txlb.testing.SimulatedVLLM`) and the virtual-clock
engines of ``python -m bench.policies``, so that both -- and any benchmark that predicts
what they will cache -- agree on what a prompt is, how many tokens it has and which of them
an engine already holds.  Re-exported by :mod:`txlb.testing`; nothing in the balancer uses it.

There is no tokenizer.  A request is rendered to text as a chat template would lay it out
(:func:`render_prompt`), and every :data:`CHARS_PER_TOKEN` characters count as one token
(:func:`count_tokens`).  The text is cut into blocks of ``block_tokens * CHARS_PER_TOKEN``
characters; block ``k``'s key hashes block ``k``'s text together with block ``k - 1``'s key
(:func:`block_chain`), so a block matches only when everything before it matches too, as
vLLM's block hashes do.  Only whole blocks are keyed: a prompt's trailing partial block is
never cached.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "BLOCK_TOKENS",
    "CHARS_PER_TOKEN",
    "CacheLease",
    "PrefixCache",
    "block_chain",
    "count_tokens",
    "render_prompt",
]

CHARS_PER_TOKEN = 4
"""Characters counted as one token (a common rule of thumb for English text)."""

BLOCK_TOKENS = 16
"""vLLM's default KV-cache block size, in tokens."""

_MAX_DEPTH = 32
"""Nesting beyond this in a message's content is ignored rather than recursed into."""


def count_tokens(text: str) -> int:
    """A prompt's token count: one per :data:`CHARS_PER_TOKEN` characters, at least one."""
    return max(1, len(text) // CHARS_PER_TOKEN)


def block_chain(
    text: str, block_tokens: int = BLOCK_TOKENS, known: Sequence[int] = ()
) -> tuple[int, ...]:
    """
    The keys of ``text``'s whole blocks, each chained over every block before it.

    A 64-bit BLAKE2b of the previous key and the block's text: the same text gives the same
    keys in every process and every run (unlike ``hash()``), which keeps seeded benchmarks
    reproducible across worker processes.  About 0.6 µs per block.

    ``known`` is the chain already computed for a text that ``text`` extends (the previous
    turn of a conversation): its keys are reused and only the blocks after them hashed.
    It must be the chain of a prefix of ``text`` with the same ``block_tokens``.
    """
    if not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be a positive integer, got {block_tokens!r}")
    size = block_tokens * CHARS_PER_TOKEN
    whole = len(text) // size  # by characters, so the count agrees with count_tokens()
    start = min(len(known), whole)
    keys = list(known[:start])
    previous = keys[-1].to_bytes(8, "big") if keys else b""
    for i in range(start, whole):
        piece = text[i * size : (i + 1) * size].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + piece, digest_size=8).digest()
        keys.append(int.from_bytes(previous, "big"))
    return tuple(keys)


def render_prompt(body: Mapping[str, Any], chat: bool) -> str:
    """
    The text an engine would prefill for ``body``, as a chat template lays it out.

    Chat: ``tools`` and ``chat_template_kwargs`` first (as JSON, in the order given), then
    each message's role and content in order.  A content part stands for what it carries:
    a text part its text, an image its URL (or data URL), an audio part its data, so a
    repeated image is a repeated prefix.  Completions: the ``prompt`` (a list of strings or
    token ids is joined).  Anything of an unexpected type renders as nothing, and nesting
    deeper than a few levels is ignored, so a hostile body costs at most its own size.
    """
    out: list[str] = []
    if chat:
        for field in ("tools", "chat_template_kwargs"):
            value = body.get(field)
            if value is not None:
                out.append(_as_json(value))
        messages = body.get("messages")
        if isinstance(messages, list):
            for message in messages:
                if not isinstance(message, dict):
                    continue
                role = message.get("role")
                out.append(f"<|{role if isinstance(role, str) else ''}|>")
                _content(message.get("content"), out, 0)
                out.append("\n")
    else:
        _content(body.get("prompt"), out, 0)
    return "".join(out)


def _as_json(value: object) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return ""


def _content(value: object, out: list[str], depth: int) -> None:
    """Append what ``value`` (a message's content, or a prompt) renders as."""
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        if -(2**63) <= value < 2**63:  # a token id; a huge one would be slow to print
            out.append(f"{value} ")
    elif depth >= _MAX_DEPTH:
        return
    elif isinstance(value, list):
        for item in value:
            _content(item, out, depth + 1)
    elif isinstance(value, dict):
        _part(value, out, depth)


def _part(part: dict[str, Any], out: list[str], depth: int) -> None:
    """One OpenAI content part: text, image_url, input_audio (or a bare ``text``)."""
    kind = part.get("type")
    if kind == "image_url" or "image_url" in part:
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        out.append(f"<image:{url if isinstance(url, str) else ''}>")
    elif kind == "input_audio" or "input_audio" in part:
        audio = part.get("input_audio")
        data = audio.get("data") if isinstance(audio, dict) else audio
        out.append(f"<audio:{data if isinstance(data, str) else ''}>")
    else:
        _content(part.get("text"), out, depth + 1)


@attrs.frozen(eq=False)
class CacheLease:
    """
    What one running sequence holds in a :class:`PrefixCache`, until released.

    :ivar cached_tokens: prompt tokens found in the cache (whole blocks), which the engine
        does not prefill again.
    :ivar pinned: the keys of the blocks this sequence holds; they cannot be evicted until
        :meth:`PrefixCache.release`.
    """

    cached_tokens: int
    pinned: tuple[int, ...]


@attrs.define(eq=False)
class PrefixCache:
    """
    vLLM's automatic prefix cache in miniature: ``blocks`` KV blocks of ``block_tokens``.

    A sequence that starts running calls :meth:`acquire` with its prompt's
    :func:`block_chain`: the longest run of leading blocks already cached is a hit (vLLM
    always recomputes a prompt's last token, so a hit covers at most ``tokens - 1``); those
    blocks and the prompt's other whole blocks are then pinned for the sequence, the new
    ones taking free room or evicting the least recently used unpinned block.  When every
    block is pinned, the rest of the prompt is simply not cached (vLLM would queue or
    preempt; here the cache never holds a request back).  :meth:`release` unpins them when
    the sequence ends; they stay cached, reusable, on the LRU list -- a released sequence's
    blocks go on it tail first, so its last block is evicted before its first, as in vLLM.

    Generated tokens are not cached, only the prompt.  Counters are vLLM's:
    :attr:`queries` and :attr:`hits` in tokens (``vllm:prefix_cache_queries`` and
    ``_hits``), :attr:`usage` the pinned fraction (``vllm:kv_cache_usage_perc``).
    """

    blocks: int = attrs.field()
    block_tokens: int = attrs.field(default=BLOCK_TOKENS)
    queries: int = attrs.field(default=0, init=False)
    hits: int = attrs.field(default=0, init=False)
    _pins: dict[int, int] = attrs.field(factory=dict, init=False, repr=False)
    _unpinned: OrderedDict[int, None] = attrs.field(factory=OrderedDict, init=False, repr=False)
    _leases: set[CacheLease] = attrs.field(factory=set, init=False, repr=False)

    @blocks.validator
    def _check_blocks(self, attribute: attrs.Attribute[int], value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"blocks must be a positive integer, got {value!r}")

    @block_tokens.validator
    def _check_block_tokens(self, attribute: attrs.Attribute[int], value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"block_tokens must be a positive integer, got {value!r}")

    @property
    def resident(self) -> int:
        """Blocks holding a cached prefix now, pinned or not (at most :attr:`blocks`)."""
        return len(self._pins) + len(self._unpinned)

    @property
    def pinned(self) -> int:
        """Blocks held by running sequences."""
        return len(self._pins)

    @property
    def usage(self) -> float:
        """Pinned blocks over all blocks, 0 to 1: what vLLM reports as KV-cache usage."""
        return len(self._pins) / self.blocks

    def __contains__(self, key: object) -> bool:
        return key in self._pins or key in self._unpinned

    def match(self, chain: Sequence[int], tokens: int) -> int:
        """Prompt tokens of ``chain`` cached now (whole blocks), without changing anything."""
        limit = max(0, tokens - 1) // self.block_tokens
        matched = 0
        for key in chain[:limit]:
            if key not in self:
                break
            matched += 1
        return matched * self.block_tokens

    def acquire(self, chain: Sequence[int], tokens: int) -> CacheLease:
        """
        A sequence of ``tokens`` prompt tokens whose whole blocks are ``chain`` starts.

        Counts the query and the hit, pins what is cached, and caches (and pins) the rest of
        the chain as far as unpinned room allows.
        """
        hit = self.match(chain, tokens)
        self.queries += tokens
        self.hits += hit
        pinned: list[int] = []
        for key in dict.fromkeys(chain):  # a prompt repeating a block pins it once
            if key in self._pins:
                self._pins[key] += 1
            elif key in self._unpinned:
                del self._unpinned[key]
                self._pins[key] = 1
            elif self.resident < self.blocks:
                self._pins[key] = 1
            elif self._unpinned:
                self._unpinned.popitem(last=False)
                self._pins[key] = 1
            else:
                break  # every block is pinned: the rest of the prompt is not cached
            pinned.append(key)
        lease = CacheLease(hit, tuple(pinned))
        self._leases.add(lease)
        return lease

    def release(self, lease: CacheLease) -> None:
        """
        The sequence holding ``lease`` ended: its blocks become evictable, tail first.

        Releasing a lease twice (or one from another cache) changes nothing, so a
        sequence's blocks cannot be unpinned from under another sequence sharing them.
        """
        if lease not in self._leases:
            return
        self._leases.discard(lease)
        for key in reversed(lease.pinned):
            count = self._pins[key]
            if count > 1:
                self._pins[key] = count - 1
            else:
                del self._pins[key]
                self._unpinned[key] = None
