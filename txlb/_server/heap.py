"""
The start-up heap, taken out of the garbage collector's reach.

CPython's cyclic collector walks every tracked object of the generation it collects, and a
full (oldest-generation) collection walks them all: twisted, klein, prometheus_client and
txlb's own start-up state are some 67,000 objects, and one such walk took 14-22 ms on the
benchmark machine -- while it runs, every stream waits.  A full collection comes when enough
objects have survived into the oldest generation, which happens most as requests end, so it
showed as a p99 chunk latency of 12 ms among streams still running while others finished.

What exists once the process has started lives as long as the process, so walking it finds
nothing to free.  ``gc.freeze()`` (Python 3.7+, what gunicorn's ``preload`` users and
Instagram's servers call) moves every tracked object into a permanent generation the
collector never walks; later objects are collected as before.  Only the processes txlb
owns do it (``twistd llmlb`` and its ``--workers``): an embedder's heap is the embedder's.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

from twisted.application.service import Service
from twisted.logger import Logger

log = Logger()


def freeze_heap(collect: Callable[[], object] = gc.collect,
                freeze: Callable[[], None] = gc.freeze,
                frozen: Callable[[], int] = gc.get_freeze_count) -> int:
    """
    Collect what start-up left as garbage (so it is not kept forever), then freeze the
    rest; the number of objects frozen.
    """
    collect()
    freeze()
    return frozen()


class FreezeHeapOnStart(Service):
    """Freeze the heap once the reactor runs, after every other service has started."""

    def __init__(self, reactor: Any, freeze: Callable[[], int] = freeze_heap) -> None:
        self._reactor = reactor
        self._freeze = freeze

    def startService(self) -> None:
        super().startService()
        self._reactor.callWhenRunning(self._frozen)

    def _frozen(self) -> None:
        count = self._freeze()
        log.debug("{count} start-up objects moved out of the garbage collector's reach",
                  count=count)
