"""
A request's routing key for prefix (KV) caching: a chain of keyed block hashes.

An engine's prefix cache keys a block of prompt tokens by everything before it, so two
requests share cached work exactly as far as their rendered prompts agree from the first
character.  txlb has no tokenizer, so it renders what a chat template would render first --
the model, ``tools``, ``chat_template_kwargs``, then the conversation (chat ``messages``,
a completion's ``prompt``, a Responses call's ``instructions`` and ``input``, a Messages
call's ``system`` and ``messages``) -- cuts that text into blocks of
:data:`DEFAULT_BLOCK_CHARS` characters and hashes them as a chain::

    h_1 = H(block_1),  h_k = H(h_{k-1} || block_k)

so ``h_k`` names the whole prefix up to block ``k`` and "how much of this prompt does
backend B hold" is a walk of set lookups.  Only whole blocks count, as in vLLM: a prompt
shorter than one block has no key.

``H`` is BLAKE2b keyed with a secret drawn per process (:class:`PrefixHasher`), so a client
cannot craft a prompt whose hashes collide with another tenant's: nobody outside the process
can compute a block's name, and only a prompt that really begins with the same text shares
its blocks.

The work per request is bounded whatever the body: rendering stops after
``max_blocks * block_chars`` characters (the rest of a long prompt cannot change which
backend holds its beginning) or :data:`STEPS_PER_CHAR` looks per character of that budget
(so pieces that render nothing still cost; :data:`MAX_STEPS` at most, and no more than
the request's :class:`~txlb._scheduling.work.WorkBudget` grants), nesting deeper
than :data:`MAX_DEPTH` and lists longer than :data:`MAX_ITEMS` are cut, and a shape the
renderer does not know contributes its canonical JSON (within the same budget) or
nothing.  Nothing here raises on a hostile body.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

from txlb._scheduling.work import WorkBudget

#: Characters per block: about 64 tokens at the usual ~4 characters per token -- four of
#: vLLM's 16-token blocks, fine enough that a 1,000-token system prompt spans ~16 blocks.
DEFAULT_BLOCK_CHARS = 256
#: Blocks hashed at most per request: 256 x 256 characters = 64 KiB, ~16k tokens.
DEFAULT_MAX_BLOCKS = 256
#: How deep the renderer follows nested JSON before it stops looking.
MAX_DEPTH = 16
#: How many items of one list (messages, parts, tools ...) the renderer looks at.
MAX_ITEMS = 4096
#: Bytes of one media part (an image's URL or base64 data) that name it: enough to tell
#: images apart, never the cost of hashing a whole 8 MiB upload twice.
MEDIA_BYTES = 1 << 20
#: Pieces the renderer may look at per character of its budget (every string, part and
#: media node costs one, whatever it renders): a body of empty pieces -- 4,096 messages of
#: 4,096 empty parts -- renders nothing and would otherwise cost 16 million looks.
STEPS_PER_CHAR = 4
#: The most looks for any budget: what the default one allows.  A larger ``--cache-block``
#: renders more characters of a long prompt (few, long strings), never more pieces.
MAX_STEPS = STEPS_PER_CHAR * DEFAULT_BLOCK_CHARS * DEFAULT_MAX_BLOCKS

#: The media part types whose payload names them (OpenAI chat, Responses, Anthropic).
_MEDIA_KEYS = ("image_url", "input_audio", "input_image", "input_file", "file",
               "image", "audio", "video_url", "source")


class _Budget(Exception):
    """The character budget is spent: the rest of the prompt is not rendered."""


class _Renderer:
    """
    Collects rendered pieces until ``limit`` characters, or ``limit x STEPS_PER_CHAR``
    pieces looked at (:data:`MAX_STEPS` at most); then stops by raising.
    """

    def __init__(self, limit: int, media_key: bytes, steps: int | None = None) -> None:
        self.limit = limit
        self.size = 0
        self.steps = min(limit * STEPS_PER_CHAR, MAX_STEPS) if steps is None else steps
        self.pieces: list[str] = []
        self._media_key = media_key

    def text(self, piece: str) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise _Budget
        room = self.limit - self.size
        size = len(piece)
        if size >= room:
            self.pieces.append(piece[:room])
            self.size = self.limit
            raise _Budget
        self.pieces.append(piece)
        self.size += size

    def media(self, payload: object) -> None:
        """A media part: named by a keyed hash of its URL or data, never its bytes."""
        digest = hashlib.blake2b(key=self._media_key, digest_size=12)
        self._feed(digest, payload, 0)
        self.text(f"<media:{digest.hexdigest()}>")

    def _feed(self, digest: hashlib.blake2b, value: object, depth: int) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise _Budget
        if depth > MAX_DEPTH:
            return
        if isinstance(value, str):
            digest.update(value[:MEDIA_BYTES].encode("utf-8", "surrogatepass"))
            digest.update(b"\x00%d\x00" % len(value))
        elif isinstance(value, Mapping):
            for key in sorted(k for k in value if isinstance(k, str))[:MAX_ITEMS]:
                digest.update(key.encode("utf-8", "surrogatepass") + b"\x01")
                self._feed(digest, value[key], depth + 1)
        elif isinstance(value, list):
            for item in value[:MAX_ITEMS]:
                self._feed(digest, item, depth + 1)
        else:
            digest.update(repr(value).encode("ascii", "replace")[:64])

    def canonical(self, value: object, depth: int = 0) -> None:
        """Any JSON value, written canonically (sorted keys), depth- and width-capped."""
        if depth > MAX_DEPTH:
            return
        if isinstance(value, str):
            self.text(value)
        elif isinstance(value, bool) or value is None:
            self.text("true" if value is True else "false" if value is False else "null")
        elif isinstance(value, int | float):
            self.text(repr(value))
        elif isinstance(value, Mapping):
            self.text("{")
            for key in sorted(k for k in value if isinstance(k, str))[:MAX_ITEMS]:
                self.text(key)
                self.text(":")
                self.canonical(value[key], depth + 1)
                self.text(",")
            self.text("}")
        elif isinstance(value, list):
            self.text("[")
            for item in value[:MAX_ITEMS]:
                self.canonical(item, depth + 1)
                self.text(",")
            self.text("]")

    def content(self, content: object) -> None:
        """A message's content: a string, or a list of parts (text as text, media hashed)."""
        if isinstance(content, str):
            self.text(content)
        elif isinstance(content, list):
            for part in content[:MAX_ITEMS]:
                self.part(part)
        elif content is not None:
            self.canonical(content)

    def part(self, part: object) -> None:
        if isinstance(part, str):
            self.text(part)
            return
        if not isinstance(part, Mapping):
            self.canonical(part)
            return
        text = part.get("text")
        if isinstance(text, str):
            self.text(text)
            return
        for key in _MEDIA_KEYS:
            if key in part:
                self.media(part[key])
                return
        self.canonical(part)

    def messages(self, messages: object) -> None:
        if isinstance(messages, str):
            self.text(messages)
            return
        if not isinstance(messages, list):
            if messages is not None:
                self.canonical(messages)
            return
        for message in messages[:MAX_ITEMS]:
            if not isinstance(message, Mapping):
                self.canonical(message)
                continue
            role = message.get("role")
            self.text(f"\n<|{role if isinstance(role, str) else 'message'}|>")
            if "content" in message:
                self.content(message["content"])
            for key in ("tool_calls", "tool_call_id", "name"):  # rendered after, if present
                if key in message:
                    self.text(f"<{key}>")
                    self.canonical(message[key])
            if "content" not in message and message.get("type") is not None:
                self.canonical(message)  # a Responses input item: function_call, ...

    def prompt(self, prompt: object) -> None:
        """A completion's ``prompt``: a string, a list of strings, or token ids."""
        if isinstance(prompt, str):
            self.text(prompt)
        elif isinstance(prompt, list):
            for item in prompt[:MAX_ITEMS]:
                if isinstance(item, str):
                    self.text(item)
                    self.text("\n")
                elif isinstance(item, int) and not isinstance(item, bool):
                    self.text(f"{item} ")  # token ids: one number each
                else:
                    self.canonical(item)
        elif prompt is not None:
            self.canonical(prompt)


def render(body: Mapping[str, object], model: str | None, limit: int,
           media_key: bytes = b"", budget: WorkBudget | None = None) -> str:
    """
    What a chat template renders first, for ``body`` (the parsed JSON object), at most
    ``limit`` characters.  ``model`` is the model after any ``[[routes]]`` rewrite.  With a
    request's ``budget``, the pieces looked at are drawn from it (what is left unspent goes
    back); without one, ``limit x STEPS_PER_CHAR`` (:data:`MAX_STEPS` at most).
    """
    granted = None
    if budget is not None:
        granted = budget.draw(min(limit * STEPS_PER_CHAR, MAX_STEPS))
    out = _Renderer(limit, media_key, granted)
    try:
        out.text(f"<|model|>{model or ''}")
        for key in ("tools", "chat_template_kwargs"):
            if key in body:
                out.text(f"\n<|{key}|>")
                out.canonical(body[key])
        if "messages" in body:  # chat; Anthropic's messages after its ``system``
            if "system" in body:
                out.text("\n<|system|>")
                out.content(body["system"])
            out.messages(body["messages"])
        elif "prompt" in body:
            out.text("\n<|prompt|>")
            out.prompt(body["prompt"])
        elif "input" in body or "instructions" in body:
            if "instructions" in body:
                out.text("\n<|instructions|>")
                out.content(body["instructions"])
            out.text("\n<|input|>")
            out.messages(body.get("input"))
    except _Budget:
        pass
    except (RecursionError, TypeError, ValueError):  # a shape nobody foresaw: stop there
        pass
    if budget is not None and granted is not None:
        budget.steps += max(0, out.steps)  # the unspent steps go back
    return "".join(out.pieces)


class PrefixHasher:
    """
    Turns a request body into its chain of block hashes, keyed with this process's secret.

    ``secret`` defaults to 32 random bytes drawn when the hasher is made: two processes
    name the same prefix differently, one process always alike.
    """

    def __init__(self, block_chars: int = DEFAULT_BLOCK_CHARS,
                 max_blocks: int = DEFAULT_MAX_BLOCKS, secret: bytes | None = None) -> None:
        if block_chars < 1 or max_blocks < 1:
            raise ValueError("block_chars and max_blocks must be positive")
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self._secret = secret if secret is not None else os.urandom(32)
        if not 1 <= len(self._secret) <= 64:
            raise ValueError("the secret must be 1 to 64 bytes (BLAKE2b's key)")
        self._media_key = hashlib.blake2b(self._secret, digest_size=32,
                                          person=b"txlb-media").digest()

    def render(self, body: Mapping[str, object], model: str | None,
               budget: WorkBudget | None = None) -> str:
        """The rendered prefix, capped at ``max_blocks`` whole blocks (and ``budget``)."""
        return render(body, model, self.block_chars * self.max_blocks, self._media_key,
                      budget)

    def chain(self, text: str) -> list[int]:
        """The chain of ``text``'s whole blocks: ``[h_1, ..., h_n]`` (64-bit each)."""
        size = self.block_chars
        whole = min(len(text) // size, self.max_blocks)
        hashes: list[int] = []
        previous = b""
        for k in range(whole):
            block = text[k * size:(k + 1) * size].encode("utf-8", "surrogatepass")
            previous = hashlib.blake2b(previous + block, key=self._secret,
                                       digest_size=8).digest()
            hashes.append(int.from_bytes(previous, "big"))
        return hashes

    def key(self, body: Mapping[str, object] | None, model: str | None,
            budget: WorkBudget | None = None) -> tuple[list[int], int]:
        """
        A body's chain and the number of characters rendered (0 for no JSON object), its
        rendering drawn from the request's ``budget`` when given.
        """
        if body is None:
            return [], 0
        text = self.render(body, model, budget)
        return self.chain(text), len(text)

