"""
REVIEW (issue 19): reproductions of defects found in review.  Every test here FAILS on
main at 6d81217 and should pass once the defect is fixed; see each docstring.
"""

from __future__ import annotations

import hashlib


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


