"""
Passive outlier detection: what a backend's own answers say about its health.

The prober asks a backend how it is; this module listens to what it answers real
requests.  :func:`judge_answer` keeps the streak of 5xx answers (on the backend, through
its methods) and says when the streak is long and broad enough to eject it; the
:class:`~txlb._cluster.pool.Pool` then marks it down.  :func:`fleet_can_spare` is the one
guard every passive verdict (this one and the hung-backend detector's) passes first.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
from twisted.logger import Logger

from txlb._cluster.backend import Backend

log = Logger()

#: An ejected backend's cool-down grows with each ejection, up to this many base cool-downs.
MAX_COOLDOWN_FACTOR = 10


@attrs.frozen
class OutlierRule:
    """
    Passive outlier detection, as Envoy does it: ``consecutive_5xx`` answers of 5xx in a
    row eject a backend for ``base_cooldown`` seconds times the number of times it was
    ejected (capped at :data:`MAX_COOLDOWN_FACTOR`), and never more than half the fleet
    is out for this reason at once.  ``consecutive_5xx`` 0 disables it.
    """

    consecutive_5xx: int = 5
    base_cooldown: float = 30.0


def fleet_can_spare(backends: Iterable[Backend]) -> bool:
    """
    Whether one more backend may go out on a passive verdict: never more than half the
    fleet, since a fault shared by so many is more likely txlb's or the network's.
    """
    fleet = list(backends)
    down = sum(1 for b in fleet if not b.health.healthy)
    return (down + 1) * 2 <= len(fleet)


def judge_answer(rule: OutlierRule, backend: Backend, status: int, client: str | None,
                 fleet: Iterable[Backend], now: float) -> str | None:
    """
    Fold one answer of ``backend`` into its 5xx streak; return why it must go out now (it
    is then ejected until its cool-down ends), or ``None``.

    ``client`` is the key of the client who sent the request, or ``None`` when the request
    provoked the 5xx itself: such an answer neither counts nor resets the streak.  A streak
    ejects only once it spans two clients at least, so one client sending requests an
    engine chokes on cannot take a healthy backend out.
    """
    count = backend.verdicts.answered(status, client)
    if status < 500 or client is None:
        return None
    if not rule.consecutive_5xx or count < rule.consecutive_5xx:
        return None
    if len(backend.verdicts.streak_clients) < 2 or not backend.health.healthy:
        return None
    if not fleet_can_spare(fleet):
        if count == rule.consecutive_5xx:  # once per run of 5xx
            log.warn("backend {backend} answered {count} 5xx in a row but stays in: "
                     "half the fleet is already out", backend=backend.key, count=count)
        return None
    cooldown = rule.base_cooldown * min(backend.verdicts.outlier_ejections + 1, MAX_COOLDOWN_FACTOR)
    backend.ejected(now + cooldown)
    return (f"outlier: {count} 5xx answers in a row from "
            f"2 clients or more; ejected for {cooldown:g}s")
