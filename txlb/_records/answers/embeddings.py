"""
An embeddings answer (``/v1/embeddings``): how many vectors came back, and the prompt
tokens they took.  Not a completion: it has no texts, no finish and no stream.
"""

from __future__ import annotations

import attrs

from txlb._json_body import parse_json_object
from txlb._records.answers.completion import int_or_none, token_count


@attrs.frozen
class Embeddings:
    """What an embeddings answer said (``None``: it did not say)."""

    count: int | None = None
    prompt_tokens: int | None = None


def parse_embeddings(body: bytes) -> Embeddings:
    """An embeddings answer: how many vectors, and the prompt tokens they took."""
    answer = parse_json_object(body)
    count = prompt_tokens = None
    if answer is not None:
        data = answer.get("data")
        if isinstance(data, list):
            count = len(data)
        usage = answer.get("usage")
        if isinstance(usage, dict):
            prompt_tokens = token_count(int_or_none(usage.get("prompt_tokens")))
    return Embeddings(count=count, prompt_tokens=prompt_tokens)
