"""
REVIEW (issue 19): reproductions of defects found in review.  Every test here FAILS on
main at 6d81217 and should pass once the defect is fixed; see each docstring.
"""

from __future__ import annotations

import hashlib

from .test_budgets import ProxyTestCase, body_of, budget


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


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
