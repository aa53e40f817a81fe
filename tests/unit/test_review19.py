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


