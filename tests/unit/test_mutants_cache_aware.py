"""
The survivors of full mutation runs of ``--policy cache-aware``'s modules
(``_scheduling/policies/cache_aware``, ``_scheduling/prefix_index``, ``_scheduling/prefix``),
each pinned by the behaviour a user relies on.
"""

from __future__ import annotations
