"""
Tests for the prefix-cache model shared by the simulated vLLM and bench.policies
(txlb._kvcache, public through txlb.testing): the block keys, the prompt rendering, and the
cache's hits, pinning and LRU eviction.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial import unittest

from txlb.testing import (
    BLOCK_TOKENS,
    CHARS_PER_TOKEN,
    PrefixCache,
    block_chain,
    count_tokens,
    render_prompt,
)

BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN


def _text(blocks: int, tag: str = "a") -> str:
    """Exactly ``blocks`` whole blocks of text, distinct per ``tag``."""
    return "".join(f"{tag}{i:03d}".ljust(BLOCK_CHARS, ".") for i in range(blocks))


def _chain(blocks: int, tag: str = "a") -> tuple[int, ...]:
    return block_chain(_text(blocks, tag))


class BlockChainTests(unittest.TestCase):
    def test_whole_blocks_only(self) -> None:
        self.assertEqual(block_chain("x" * (BLOCK_CHARS - 1)), ())
        self.assertEqual(len(block_chain("x" * BLOCK_CHARS)), 1)
        self.assertEqual(len(block_chain("x" * (3 * BLOCK_CHARS + 5))), 3)
        self.assertEqual(len(block_chain("x" * 100, block_tokens=1)), 100 // CHARS_PER_TOKEN)

    def test_same_text_same_keys_and_a_prefix_shares_its_blocks(self) -> None:
        text = _text(5)
        self.assertEqual(block_chain(text), block_chain(text))
        self.assertEqual(block_chain(text + "tail" * 40)[:5], block_chain(text))

    def test_a_block_matches_only_with_its_whole_prefix(self) -> None:
        # Same second block, different first block: nothing is shared.
        one = block_chain("A" * BLOCK_CHARS + "same" * 16)
        two = block_chain("B" * BLOCK_CHARS + "same" * 16)
        self.assertEqual(len(one), 2)
        self.assertFalse(set(one) & set(two))
        # A change in block 2 keeps blocks 0-1 and changes every block from 2 on.
        base = _text(5)
        changed = base[: 2 * BLOCK_CHARS] + "Z" + base[2 * BLOCK_CHARS + 1 :]
        self.assertEqual(block_chain(changed)[:2], block_chain(base)[:2])
        self.assertFalse(set(block_chain(changed)[2:]) & set(block_chain(base)))

    def test_known_prefix_is_extended_not_rehashed(self) -> None:
        first = _text(3)
        later = first + _text(2, "b")
        self.assertEqual(block_chain(later, known=block_chain(first)), block_chain(later))
        # known longer than the text's own blocks is cut to them
        self.assertEqual(block_chain(first, known=block_chain(later)), block_chain(first))

    def test_non_ascii_is_cut_by_characters(self) -> None:
        text = "é" * BLOCK_CHARS * 2 + "\ud800" * BLOCK_CHARS  # a lone surrogate from JSON
        self.assertEqual(len(block_chain(text)), 3)
        self.assertEqual(count_tokens(text), 3 * BLOCK_TOKENS)

    def test_block_size_must_be_positive(self) -> None:
        for bad in (0, -16):
            self.assertRaises(ValueError, block_chain, "x" * 100, bad)

    def test_count_tokens(self) -> None:
        self.assertEqual(count_tokens(""), 1)
        self.assertEqual(count_tokens("abc"), 1)
        self.assertEqual(count_tokens("x" * 400), 400 // CHARS_PER_TOKEN)


class RenderPromptTests(unittest.TestCase):
    def test_chat_renders_tools_kwargs_then_messages_in_order(self) -> None:
        body = {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello"},
            ],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "chat_template_kwargs": {"enable_thinking": True},
        }
        text = render_prompt(body, chat=True)
        order = [
            text.index('"name":"f"'),
            text.index('"enable_thinking":true'),
            text.index("system"),
            text.index("be brief"),
            text.index("user"),
            text.index("hello"),
        ]
        self.assertEqual(order, sorted(order))

    def test_the_conversation_extends_its_earlier_turns(self) -> None:
        """A multi-turn conversation's next request starts with the last one's text."""
        turn = {"messages": [{"role": "system", "content": "S" * 300}]}
        turn["messages"].append({"role": "user", "content": "q1"})
        first = render_prompt(turn, chat=True)
        turn["messages"] += [
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"},
        ]
        self.assertTrue(render_prompt(turn, chat=True).startswith(first))

    def test_role_is_part_of_the_prefix(self) -> None:
        def as_role(role: str) -> str:
            return render_prompt({"messages": [{"role": role, "content": "x"}]}, chat=True)

        self.assertNotEqual(as_role("system"), as_role("user"))

    def test_multimodal_parts_stand_for_their_url_or_data(self) -> None:
        def with_image(url: str) -> str:
            content = [
                {"type": "text", "text": "look:"},
                {"type": "image_url", "image_url": {"url": url}},
            ]
            return render_prompt({"messages": [{"role": "user", "content": content}]}, True)

        self.assertEqual(with_image("http://x/cat.png"), with_image("http://x/cat.png"))
        self.assertNotEqual(with_image("http://x/cat.png"), with_image("http://x/dog.png"))
        self.assertIn("http://x/cat.png", with_image("http://x/cat.png"))
        audio = [{"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}}]
        self.assertIn(
            "UklGR", render_prompt({"messages": [{"role": "user", "content": audio}]}, True)
        )

    def test_completions_render_the_prompt(self) -> None:
        self.assertEqual(render_prompt({"prompt": "once upon"}, chat=False), "once upon")
        self.assertEqual(render_prompt({"prompt": ["a", "b"]}, chat=False), "ab")
        self.assertEqual(render_prompt({"prompt": [1, 2]}, chat=False), "1 2 ")

    def test_hostile_shapes_render_as_nothing_without_raising(self) -> None:
        deep: Any = "core"
        for _ in range(10_000):  # deeper than the stack
            deep = [deep]
        for body in (
            {"messages": "not a list"},
            {"messages": [None, 3, "x", {"role": 7, "content": {"text": 5}}]},
            {"messages": [{"role": "user", "content": deep}]},
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            {"messages": [{"role": "user", "content": [{"image_url": 12}, True, 1.5]}]},
            {"tools": float("nan"), "messages": []},
        ):
            self.assertIsInstance(render_prompt(body, chat=True), str)
        self.assertNotIn("core", render_prompt({"prompt": deep}, chat=False))
        self.assertEqual(render_prompt({"prompt": None}, chat=False), "")
        self.assertEqual(render_prompt({"prompt": [10**5000, 7]}, chat=False), "7 ")
        self.assertEqual(render_prompt({"prompt": {"x": 1}}, chat=False), "")

    def test_tools_json_is_rendered_as_given(self) -> None:
        tools = [{"b": 1, "a": 2}]
        self.assertIn(json.dumps(tools, separators=(",", ":")), render_prompt(
            {"tools": tools, "messages": []}, chat=True))


class PrefixCacheTests(unittest.TestCase):
    def test_repeated_prompt_hits_whole_blocks_but_not_its_last_token(self) -> None:
        cache = PrefixCache(blocks=16)
        chain = _chain(4)
        tokens = 4 * BLOCK_TOKENS + 5
        first = cache.acquire(chain, tokens)
        self.assertEqual(first.cached_tokens, 0)
        cache.release(first)
        second = cache.acquire(chain, tokens)
        self.assertEqual(second.cached_tokens, 4 * BLOCK_TOKENS)
        self.assertEqual((cache.queries, cache.hits), (2 * tokens, 4 * BLOCK_TOKENS))
        cache.release(second)
        # A prompt of exactly whole blocks: vLLM recomputes the last token, so the last
        # block is not a hit.
        exact = cache.acquire(chain, 4 * BLOCK_TOKENS)
        self.assertEqual(exact.cached_tokens, 3 * BLOCK_TOKENS)

    def test_hit_is_the_longest_cached_prefix(self) -> None:
        cache = PrefixCache(blocks=16)
        cache.release(cache.acquire(_chain(2), 2 * BLOCK_TOKENS + 1))
        longer = cache.acquire(_chain(5), 5 * BLOCK_TOKENS + 1)
        self.assertEqual(longer.cached_tokens, 2 * BLOCK_TOKENS)
        self.assertEqual(cache.acquire(_chain(5, "z"), 5 * BLOCK_TOKENS + 1).cached_tokens, 0)

    def test_match_changes_nothing(self) -> None:
        cache = PrefixCache(blocks=4)
        cache.release(cache.acquire(_chain(2), 40))
        self.assertEqual(cache.match(_chain(3), 60), 2 * BLOCK_TOKENS)
        self.assertEqual((cache.queries, cache.hits, cache.pinned), (40, 0, 0))

    def test_lru_eviction_order(self) -> None:
        cache = PrefixCache(blocks=4)
        a, b, c = _chain(2, "a"), _chain(2, "b"), _chain(2, "c")
        cache.release(cache.acquire(a, 40))
        cache.release(cache.acquire(b, 40))
        cache.release(cache.acquire(a, 40))  # a used again: b is now the least recent
        cache.release(cache.acquire(c, 40))  # room for c comes from b
        self.assertTrue(all(key in cache for key in a + c))
        self.assertFalse(any(key in cache for key in b))
        self.assertEqual(cache.resident, 4)

    def test_a_finished_prompt_loses_its_tail_first(self) -> None:
        cache = PrefixCache(blocks=3)
        long = _chain(3, "a")
        cache.release(cache.acquire(long, 3 * BLOCK_TOKENS + 1))
        cache.release(cache.acquire(_chain(1, "n"), BLOCK_TOKENS + 1))
        self.assertEqual(cache.match(long, 3 * BLOCK_TOKENS + 1), 2 * BLOCK_TOKENS)

    def test_pinned_blocks_are_never_evicted(self) -> None:
        cache = PrefixCache(blocks=2)
        running = cache.acquire(_chain(2, "a"), 40)
        self.assertEqual(cache.usage, 1.0)
        other = cache.acquire(_chain(2, "b"), 40)
        self.assertEqual(other.pinned, ())  # no room: not cached at all
        self.assertTrue(all(key in cache for key in _chain(2, "a")))
        self.assertEqual(cache.acquire(_chain(2, "a"), 40).cached_tokens, 2 * BLOCK_TOKENS)
        cache.release(other)
        cache.release(running)
        self.assertEqual(cache.usage, 1.0)  # the second holder still pins them
        self.assertEqual(cache.pinned, 2)

    def test_shared_blocks_stay_pinned_while_any_holder_runs(self) -> None:
        cache = PrefixCache(blocks=2)
        one = cache.acquire(_chain(2), 40)
        two = cache.acquire(_chain(2), 40)
        cache.release(one)
        cache.release(one)  # a second release of the same lease changes nothing
        self.assertEqual(cache.pinned, 2)
        self.assertEqual(cache.acquire(_chain(2, "b"), 40).pinned, ())
        cache.release(two)
        self.assertEqual((cache.pinned, cache.usage, cache.resident), (0, 0.0, 2))

    def test_partly_pinned_cache_caches_what_fits(self) -> None:
        cache = PrefixCache(blocks=3)
        running = cache.acquire(_chain(2, "a"), 40)
        lease = cache.acquire(_chain(3, "b"), 60)
        self.assertEqual(len(lease.pinned), 1)
        self.assertEqual(cache.usage, 1.0)
        cache.release(running)
        cache.release(lease)
        self.assertEqual(cache.usage, 0.0)

    def test_validation(self) -> None:
        for bad in (0, -1, 1.5, "3"):
            self.assertRaises(ValueError, PrefixCache, bad)
            self.assertRaises(ValueError, PrefixCache, 4, bad)
