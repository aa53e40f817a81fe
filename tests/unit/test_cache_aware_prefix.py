"""
The cache-aware routing key (txlb._scheduling.prefix): what is rendered of every shape of
body, in which order, to which budget of characters and looks and how deep; how it is cut
and hashed as a keyed chain; and that no body -- however hostile -- raises or costs more
than the block budget.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from txlb._scheduling.prefix import (
    DEFAULT_BLOCK_CHARS,
    MAX_STEPS,
    STEPS_PER_CHAR,
    PrefixHasher,
    render,
)

SECRET = b"s" * 32
SYSTEM = "You are a careful assistant for the accounts team. " * 40  # ~2,000 characters


def chat(*turns: str, system: str = SYSTEM, **extra: Any) -> dict[str, Any]:
    messages: list[Any] = [{"role": "system", "content": system}]
    for n, text in enumerate(turns):
        messages.append({"role": "user" if n % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages, **extra}


def is_prefix(short: list[int], long: list[int]) -> bool:
    return long[:len(short)] == short


class RenderTests(SynchronousTestCase):
    """What a chat template renders first, in the order it renders it."""

    def text(self, body: dict[str, Any], model: str | None = "m") -> str:
        return render(body, model, 1 << 20)

    def test_model_then_tools_then_kwargs_then_messages(self) -> None:
        body = chat("hi", tools=[{"type": "function", "function": {"name": "lookup"}}],
                    chat_template_kwargs={"enable_thinking": False})
        text = self.text(body)
        places = [text.index(piece) for piece in
                  ("<|model|>m", "lookup", "enable_thinking", "<|system|>", SYSTEM[:20],
                   "<|user|>hi")]
        self.assertEqual(places, sorted(places))

    def test_the_model_after_the_routes_rewrite_is_rendered(self) -> None:
        self.assertIn("<|model|>target", self.text(chat("hi"), model="target"))
        self.assertNotEqual(self.text(chat("hi"), "a"), self.text(chat("hi"), "b"))

    def test_completions_prompt_string_strings_and_token_ids(self) -> None:
        self.assertIn("once upon", self.text({"prompt": "once upon"}))
        self.assertIn("one\ntwo\n", self.text({"prompt": ["one", "two"]}))
        self.assertIn("17 4 9 ", self.text({"prompt": [17, 4, 9]}))

    def test_responses_instructions_then_input(self) -> None:
        text = self.text({"instructions": "be brief",
                          "input": [{"role": "user", "content": "q?"}]})
        self.assertLess(text.index("be brief"), text.index("q?"))
        self.assertIn("plain", self.text({"input": "plain"}))

    def test_messages_api_system_then_messages(self) -> None:
        text = self.text({"system": [{"type": "text", "text": "house rules"}],
                          "messages": [{"role": "user", "content": "q?"}]})
        self.assertLess(text.index("house rules"), text.index("q?"))

    def test_text_parts_are_text_and_media_are_named_by_a_hash(self) -> None:
        image = "data:image/png;base64," + "A" * 1_000_000
        body = chat([{"type": "text", "text": "look:"},  # type: ignore[arg-type]
                     {"type": "image_url", "image_url": {"url": image}}])
        text = self.text(body)
        self.assertIn("look:", text)
        self.assertIn("<media:", text)
        self.assertNotIn("AAAA", text)  # the image's bytes are not the key
        self.assertLess(len(text), len(SYSTEM) + 200)

    def test_hostile_shapes_never_raise(self) -> None:
        deep: Any = "x"
        for _ in range(100_000):
            deep = [deep]
        bodies: list[Any] = [
            {}, {"messages": None}, {"messages": 7}, {"messages": "str"},
            {"messages": [1, None, "x", [], {"role": 5, "content": 3.5}]},
            {"messages": [{"content": {"weird": [1, 2]}}]},
            {"messages": [{"role": "user", "content": [None, 1, {"type": "x"}, "s"]}]},
            {"messages": [{"role": "user", "content": deep}]},
            {"tools": deep}, {"prompt": deep}, {"prompt": [True, 1.5, None, {"a": 1}]},
            {"prompt": list(range(3_000_000))}, {"input": {"a": deep}},
            {"messages": [{"role": "user", "content": "x"}] * 100_000},
            {"system": 12, "messages": []}, {"tools": {1: "non-string key"}},
            {"messages": [{"role": "user", "content": "\ud800 lone surrogate"}]},
        ]
        hasher = PrefixHasher(secret=SECRET)
        for body in bodies:
            chain, chars = hasher.key(body, "m")
            self.assertLessEqual(len(chain), hasher.max_blocks)
            self.assertLessEqual(chars, hasher.max_blocks * hasher.block_chars)


class Watched(Mapping[str, Any]):
    """A JSON object that counts every look into it (the renderer's work, without a clock)."""

    looks = 0

    def __init__(self, **fields: Any) -> None:
        self._fields = fields

    def __getitem__(self, key: str) -> Any:
        Watched.looks += 1
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        Watched.looks += 1
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


class WatchedText(str):
    """A JSON string that counts how often the renderer measures it."""

    __slots__ = ()

    def __len__(self) -> int:
        Watched.looks += 1
        return super().__len__()


class WorkBoundTests(SynchronousTestCase):
    """
    The renderer's work is bounded by its budget, not by the body: pieces that render
    nothing (empty strings, empty text parts, a media part's nested payload) cost too.
    Before, 4,000 messages of 4,096 empty parts (a 47 MiB body, under --max-body) took
    2.1 s of CPU for the key, five times the JSON parse.
    """

    def setUp(self) -> None:
        self.hasher = PrefixHasher(block_chars=16, max_blocks=16, secret=SECRET)
        self.budget = 16 * 16 * STEPS_PER_CHAR
        Watched.looks = 0

    def test_empty_text_parts_cost_their_look(self) -> None:
        body = {"messages": [{"role": "", "content": [Watched(text="")] * 4096}] * 4096}
        self.hasher.key(body, "m")
        self.assertLessEqual(Watched.looks, self.budget)

    def test_empty_strings_cost_their_look(self) -> None:
        body = {"messages": [{"role": "", "content": [WatchedText("")] * 4096}] * 4096}
        self.hasher.key(body, "m")
        self.assertLessEqual(Watched.looks, self.budget)

    def test_a_media_payload_is_looked_into_within_the_budget(self) -> None:
        payload = [[Watched(a="")] * 4096] * 64
        body = {"messages": [{"role": "user", "content": [{"image_url": payload}]}]}
        self.hasher.key(body, "m")
        self.assertLessEqual(Watched.looks, self.budget)

    def test_the_largest_block_option_keeps_the_bound(self) -> None:
        """--cache-block 65536 renders up to 16 MiB: the looks stay capped all the same."""
        hasher = PrefixHasher(block_chars=65536, secret=SECRET)
        body = {"messages": [{"role": "", "content": [Watched(text="")] * 100}] * 4096}
        hasher.key(body, "m")
        self.assertLessEqual(Watched.looks, MAX_STEPS)
        self.assertEqual(MAX_STEPS, DEFAULT_BLOCK_CHARS * 256 * STEPS_PER_CHAR)

    def test_a_real_conversation_is_not_cut_by_the_step_budget(self) -> None:
        """Real prompts render characters far faster than the budget counts steps."""
        hasher = PrefixHasher(secret=SECRET)
        turns = [f"turn {n}: what about invoice {n}?" for n in range(3000)]
        body = chat(*turns, tools=[{"type": "function", "function": {"name": "f"}}] * 50)
        chain, chars = hasher.key(body, "m")
        self.assertEqual(chars, hasher.max_blocks * hasher.block_chars)
        self.assertEqual(len(chain), hasher.max_blocks)


class ChainTests(SynchronousTestCase):
    """A chain of keyed block hashes: whole blocks only, prefix-closed, per-process key."""

    def setUp(self) -> None:
        self.hasher = PrefixHasher(secret=SECRET)

    def chain(self, body: dict[str, Any]) -> list[int]:
        return self.hasher.key(body, "m")[0]

    def test_only_whole_blocks_count(self) -> None:
        self.assertEqual(self.hasher.chain("x" * (DEFAULT_BLOCK_CHARS - 1)), [])
        self.assertEqual(len(self.hasher.chain("x" * (DEFAULT_BLOCK_CHARS * 3 + 10))), 3)

    def test_a_conversation_that_goes_on_extends_its_chain(self) -> None:
        first = self.chain(chat("What is the balance?"))
        later = self.chain(chat("What is the balance?", "It is 4.", "And last month? " * 30))
        self.assertGreaterEqual(len(first), 7)
        self.assertTrue(is_prefix(first, later))
        self.assertGreater(len(later), len(first))

    def test_a_different_system_prompt_shares_nothing(self) -> None:
        self.assertEqual(set(self.chain(chat("q", system="Other. " * 300)))
                         & set(self.chain(chat("q"))), set())

    def test_each_block_names_everything_before_it(self) -> None:
        """The same block text after a different beginning is a different hash."""
        block = "B" * DEFAULT_BLOCK_CHARS
        one = self.hasher.chain("A" * DEFAULT_BLOCK_CHARS + block)
        two = self.hasher.chain("C" * DEFAULT_BLOCK_CHARS + block)
        self.assertNotEqual(one[1], two[1])

    def test_a_repeated_image_is_a_repeated_prefix(self) -> None:
        def with_image(url: str) -> dict[str, Any]:
            return {"model": "m", "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]},
                {"role": "user", "content": "describe it " * 50}]}

        same = self.chain(with_image("https://x/cat.png"))
        self.assertEqual(same, self.chain(with_image("https://x/cat.png")))
        self.assertNotEqual(same[0], self.chain(with_image("https://x/dog.png"))[0])

    def test_keyed_two_secrets_hash_apart_one_secret_alike(self) -> None:
        body = chat("q")
        mine, again = PrefixHasher(secret=SECRET), PrefixHasher(secret=SECRET)
        other = PrefixHasher(secret=b"t" * 32)
        self.assertEqual(mine.key(body, "m"), again.key(body, "m"))
        self.assertEqual(set(mine.key(body, "m")[0]) & set(other.key(body, "m")[0]), set())
        # by default each process (each hasher) draws its own secret
        self.assertNotEqual(PrefixHasher().key(body, "m"), PrefixHasher().key(body, "m"))

    def test_an_8_mib_body_costs_a_bounded_number_of_blocks(self) -> None:
        body = json.loads(json.dumps(chat("x" * (8 << 20))))
        started = time.perf_counter()
        chain, chars = self.hasher.key(body, "m")
        took = time.perf_counter() - started
        self.assertEqual(len(chain), self.hasher.max_blocks)
        self.assertEqual(chars, self.hasher.max_blocks * self.hasher.block_chars)
        self.assertLess(took, 0.5)  # ~1 ms here; the point is it is not 8 MiB's worth

    def test_no_json_object_no_key(self) -> None:
        self.assertEqual(self.hasher.key(None, "m"), ([], 0))

    def test_nonsense_sizes_are_refused(self) -> None:
        for kwargs in ({"block_chars": 0}, {"max_blocks": 0}, {"secret": b""},
                       {"secret": b"k" * 65}):
            with self.assertRaises(ValueError):
                PrefixHasher(**kwargs)  # type: ignore[arg-type]


class WorkBudgetTests(SynchronousTestCase):
    """The renderer draws the pieces it looks at from the request's work budget."""

    def test_empty_pieces_cost_at_most_the_budget(self) -> None:
        from txlb._scheduling.work import STEPS, WorkBudget

        body = {"messages": [{"role": "user", "content": [{"text": ""}] * 64}] * 4096}
        budget = WorkBudget()
        PrefixHasher(secret=b"k" * 32).key(body, "m", budget)
        self.assertEqual(budget.steps, 0)  # 262,144 pieces; STEPS looked at, no more
        self.assertLess(STEPS, 4096 * 64)

    def test_an_ordinary_prompt_gives_back_what_it_did_not_use(self) -> None:
        from txlb._scheduling.work import STEPS, WorkBudget

        budget = WorkBudget()
        body = {"messages": [{"role": "user", "content": "hello " * 100}]}
        hasher = PrefixHasher(secret=b"k" * 32)
        self.assertEqual(hasher.key(body, "m", budget), hasher.key(body, "m"))
        self.assertGreater(budget.steps, STEPS - 10)


def nested(value: object, depth: int) -> object:
    """``value`` inside ``depth`` lists."""
    for _ in range(depth):
        value = [value]
    return value


class RenderBudgetTests(SynchronousTestCase):
    """What the hasher renders of a body: the budget of characters and looks, the depth."""

    def test_the_looks_allowed_are_four_per_character_of_the_budget(self) -> None:
        hasher = PrefixHasher(4, 8, SECRET)  # 32 characters, 128 looks
        self.assertEqual(hasher.render({"prompt": ["a"] * 20}, None),
                         "<|model|>\n<|prompt|>" + "a\n" * 6)
        # 125 empty parts and one more: the 128th look renders, the 129th does not
        body = {"messages": [{"role": "u", "content": [""] * 125 + ["X"]}]}
        self.assertEqual(hasher.render(body, None), "<|model|>\n<|u|>X")
        body = {"messages": [{"role": "u", "content": [""] * 126 + ["X"]}]}
        self.assertEqual(hasher.render(body, None), "<|model|>\n<|u|>")

    def test_a_media_part_costs_a_look_for_its_payload_and_one_for_its_name(self) -> None:
        hasher = PrefixHasher(4, 8, SECRET)  # 128 looks
        media = {"image_url": "u"}
        body = {"messages": [{"role": "u", "content": [""] * 124 + [media]}]}
        self.assertTrue(hasher.render(body, None).startswith("<|model|>\n<|u|><media:"))
        body = {"messages": [{"role": "u", "content": [""] * 125 + [media]}]}
        self.assertEqual(hasher.render(body, None), "<|model|>\n<|u|>")

    def test_a_media_name_is_96_bits(self) -> None:
        hasher = PrefixHasher(secret=SECRET)
        body = {"messages": [{"role": "u", "content": [{"image_url": "u"}]}]}
        self.assertRegex(hasher.render(body, None), r"^<\|model\|>\n<\|u\|><media:[0-9a-f]{24}>$")

    def test_json_is_rendered_sixteen_levels_deep_and_no_deeper(self) -> None:
        hasher = PrefixHasher(secret=SECRET)
        self.assertIn("deep", hasher.render({"tools": nested("deep", 16)}, None))
        self.assertNotIn("deeper", hasher.render({"tools": nested("deeper", 17)},
                                                 None))
        keyed: object = "deep"
        for _ in range(16):
            keyed = {"k": keyed}
        self.assertIn("deep", hasher.render({"tools": keyed}, None))
        self.assertNotIn("deep", hasher.render({"tools": {"k": keyed}}, None))

    def test_media_is_named_by_its_payload_sixteen_levels_deep_and_no_deeper(self) -> None:
        hasher = PrefixHasher(secret=SECRET)

        def name(payload: object) -> str:
            body = {"messages": [{"role": "user", "content": [{"image_url": payload}]}]}
            return hasher.render(body, None)

        self.assertNotEqual(name(nested("a", 16)), name(nested("b", 16)))
        self.assertEqual(name(nested("a", 17)), name(nested("b", 17)))
        one: object = "a"
        other: object = "b"
        for _ in range(16):
            one, other = {"k": one}, {"k": other}
        self.assertNotEqual(name(one), name(other))
        self.assertEqual(name({"k": one}), name({"k": other}))

    def test_the_smallest_blocks_and_secrets_are_allowed(self) -> None:
        self.assertEqual(len(PrefixHasher(1, 1, b"k").chain("abc")), 1)
        self.assertEqual(len(PrefixHasher(secret=b"k" * 64).chain("x" * 512)), 2)
        for bad in ({"block_chars": 0}, {"max_blocks": 0}, {"secret": b""},
                    {"secret": b"k" * 65}):
            self.assertRaises(ValueError, PrefixHasher, **bad)


class _Odd(dict):
    """A message no JSON parser makes, whose lookups fail as ``error``."""

    def __init__(self, error: type[BaseException]) -> None:
        super().__init__(role="user")
        self.error = error

    def __contains__(self, key: object) -> bool:
        raise self.error("odd")


class BodyShapeTests(SynchronousTestCase):
    """How each shape of a body is rendered."""

    def setUp(self) -> None:
        self.hasher = PrefixHasher(secret=SECRET)

    def render(self, body: dict[str, Any]) -> str:
        return self.hasher.render(body, None)

    def test_json_literals(self) -> None:
        self.assertEqual(self.render({"tools": [True, False, None, 1.5]}),
                         "<|model|>\n<|tools|>[true,false,null,1.5,]")

    def test_content_that_is_neither_text_nor_parts_is_its_json(self) -> None:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": {"a": "b"}}]}
        self.assertEqual(self.render(body), "<|model|>\n<|user|>{a:b,}")
        body = {"messages": [{"role": "user", "content": None}]}
        self.assertEqual(self.render(body), "<|model|>\n<|user|>")

    def test_messages_that_are_not_a_list(self) -> None:
        self.assertEqual(self.render({"messages": {"x": "y"}}), "<|model|>{x:y,}")
        self.assertEqual(self.render({"messages": None}), "<|model|>")

    def test_a_message_that_is_not_an_object_does_not_end_the_conversation(self) -> None:
        body = {"messages": ["hello", {"role": "user", "content": "hi"}]}
        self.assertEqual(self.render(body), "<|model|>hello\n<|user|>hi")

    def test_a_responses_item_without_content_is_its_json(self) -> None:
        body = {"input": [{"type": "function_call", "name": "f"},
                          {"type": "message", "content": "c"}, {"role": "user"}]}
        self.assertEqual(self.render(body),
                         "<|model|>\n<|input|>\n<|message|><name>f{name:f,type:function_call,}"
                         "\n<|message|>c\n<|user|>")

    def test_a_prompt_of_token_ids_and_other_items(self) -> None:
        self.assertEqual(self.render({"prompt": [1, 2, True, {"a": 1}, "s"]}),
                         "<|model|>\n<|prompt|>1 2 true{a:1,}s\n")
        self.assertEqual(self.render({"prompt": {"a": 1}}), "<|model|>\n<|prompt|>{a:1,}")
        self.assertEqual(self.render({"prompt": None}), "<|model|>\n<|prompt|>")

    def test_only_the_first_4096_items_of_a_list_are_looked_at(self) -> None:
        hasher = PrefixHasher(4096, 4, SECRET)
        text = hasher.render({"prompt": [str(n % 10) for n in range(4097)]}, None)
        self.assertEqual(text.count("\n"), 4096 + 1)

    def test_media_is_named_by_its_first_mebibyte(self) -> None:
        def name(payload: str) -> str:
            body = {"messages": [{"role": "user", "content": [{"image_url": payload}]}]}
            return self.render(body)

        head = "x" * ((1 << 20) - 1)
        self.assertNotEqual(name(head + "a" + "z"), name(head + "b" + "z"))
        self.assertEqual(name(head + "a" + "y"), name(head + "a" + "z"))

    def test_a_shape_nobody_foresaw_stops_the_rendering_there(self) -> None:
        for error in (RecursionError, TypeError, ValueError):
            body = {"messages": [{"role": "user", "content": "hi"}, _Odd(error)]}
            self.assertEqual(self.render(body), "<|model|>\n<|user|>hi\n<|user|>")
