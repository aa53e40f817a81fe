"""
Request -> an in-flight slot on one eligible backend.

The choice and the slot are taken in one synchronous call (:meth:`Router.pick`), so no
other request can run between "this backend has the fewest in flight" and "it now has one
more" -- the property that keeps a burst of N requests on B backends at ceil(N/B) each.
"""

from __future__ import annotations

from ._backend import Lease, Pool
from ._policies import IPolicy


class Router:
    """Filters the pool down to eligible backends and lets the policy choose among them."""

    def __init__(self, pool: Pool, policy: IPolicy) -> None:
        self.pool = pool
        self.policy = policy

    def pick(self) -> Lease | None:
        """An in-flight slot on the chosen backend, or ``None`` if no backend is eligible."""
        candidates = [backend for backend in self.pool if backend.eligible]
        if not candidates:
            return None
        return self.pool.acquire(self.policy.choose(candidates))
