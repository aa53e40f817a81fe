"""
REVIEW (issue 19): reproductions of defects found in review.  Every test here FAILS on
main at 6d81217 and should pass once the defect is fixed; see each docstring.
"""

from __future__ import annotations

import hashlib
import json

from txlb._records.summary import CAPTURE_LIMIT

from ..helpers import FakeResponse
from .test_budgets import ProxyTestCase, body_of, budget


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class LongStreamTests(ProxyTestCase):
    """
    The summary reads only the first CAPTURE_LIMIT (512 KiB) of an answer: a stream longer
    than that (~2,500 vLLM tokens) loses its final usage event, and is charged the
    estimate -- prompt + 256 without max_tokens -- whatever it generated.
    """

    def test_a_long_stream_is_charged_its_usage(self) -> None:
        self.build([budget(tokens_per_minute=100000)])
        self.post(json.dumps({"prompt": "x", "stream": True,
                              "stream_options": {"include_usage": True}}).encode())
        response = self.upstream.last.respond(FakeResponse(
            200, [(b"Content-Type", b"text/event-stream")]))
        chunk = b'data: {"choices": [{"text": "tok", "index": 0}]}\n\n'
        tokens = CAPTURE_LIMIT // len(chunk) + 10
        for _ in range(tokens):
            response.send(chunk)
        response.send(b'data: {"choices": [], "usage": {"prompt_tokens": 5, '
                      b'"completion_tokens": %d}}\n\ndata: [DONE]\n\n' % tokens)
        response.end()
        self.assertEqual(self.lb.budgets.charged, {"b": 5 + tokens})


class HugeHeaderKeyTests(ProxyTestCase):
    """
    key = "header:NAME" keeps the header's whole value in every bucket key (and every
    --workers spent message): MAX_KEYS (100,000) buckets of ~16 KB values is ~1.6 GB.
    """

    def test_a_bucket_key_is_bounded(self) -> None:
        self.build([budget(key="header:X-Team")])
        self.post(body_of(40, 1), headers=[(b"X-Team", b"t" * 10000)])
        keys = list(self.lb.budgets.levels._levels)  # type: ignore[attr-defined]
        self.assertEqual(len(keys), 1)
        self.assertLess(len(keys[0]), 200)


class AbortedStreamTests(ProxyTestCase):
    """
    A stream's usage comes in its last event: a client that sets no max_tokens and leaves
    just before the end is charged its estimate -- prompt + 256 -- however many tokens it
    was relayed (the same as a stream without include_usage).  txlb saw every delta.
    """

    def test_what_was_relayed_is_charged_at_least(self) -> None:
        self.build([budget(tokens_per_minute=100000)])
        client = self.post(json.dumps({"prompt": "x", "stream": True,
                                       "stream_options": {"include_usage": True}}).encode())
        response = self.upstream.last.respond(FakeResponse(
            200, [(b"Content-Type", b"text/event-stream")]))
        for _ in range(2000):
            response.send(b'data: {"choices": [{"text": "tok", "index": 0}]}\n\n')
        client.disconnect()
        self.assertGreaterEqual(self.lb.budgets.charged.get("b", 0), 2000)


class KeyChurnTests(ProxyTestCase):
    """
    Past MAX_KEYS buckets the least recently used one is dropped even when it is not full:
    a client that spent its day with its real key sends MAX_KEYS requests with made-up
    keys (each answered 401 by the backend, so each costs nothing and leaves a bucket
    behind) and its spent bucket is forgotten -- a whole new day.  (Shown with max_keys
    lowered to 10 instead of 100,000.)
    """

    def test_made_up_keys_do_not_refill_a_spent_budget(self) -> None:
        self.build([budget(key="token", tokens_per_minute=None, tokens_per_day=600)])
        self.lb.budgets.levels.max_keys = 10  # type: ignore[attr-defined]
        real = [(b"Authorization", b"Bearer sk-real")]
        self.post(body_of(400, 500), headers=real)
        self.answer({"prompt_tokens": 100, "completion_tokens": 500})
        self.assertEqual(self.post(body_of(40, 5), headers=real).response().status, 429)
        for n in range(10):
            self.post(body_of(40, 5), headers=[(b"Authorization", b"Bearer junk-%d" % n)])
            self.answer(status=401)
        forwarded = len(self.upstream.calls)
        self.post(body_of(40, 5), headers=real)
        self.assertEqual(len(self.upstream.calls), forwarded,
                         "forwarded: the spent day's bucket was forgotten")
