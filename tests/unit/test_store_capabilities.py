"""
A store's optional parts (txlb._cluster.store_capabilities): each store declares which it
provides, and nothing in txlb asks a store what class it is.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

import txlb
from txlb._cluster.local_store import LocalStore
from txlb._cluster.pool import Pool
from txlb._cluster.shared_counts import SharedCounts
from txlb._cluster.store_capabilities import (
    IFleetPrefixIndex,
    IFleetPresence,
    IFleetSlotGate,
    IFleetWake,
    IPrefixSharing,
    ISharedRateTakes,
    ISlotGates,
    IStoreReport,
    IStoreService,
)
from txlb._shared.store import RedisStore
from txlb._workers.relay import WorkerRelay, WorkerStore

from .test_shared_state import SPEC, FakeRedis

CAPABILITIES = (IStoreService, IStoreReport, IFleetWake, ISlotGates, IPrefixSharing,
                IFleetPresence, ISharedRateTakes)


class DeclaredTests(SynchronousTestCase):
    def test_the_redis_store_provides_every_part(self) -> None:
        store = RedisStore(SPEC, Clock(), FakeRedis(), replica="host1")
        for capability in CAPABILITIES:
            self.assertTrue(verifyObject(capability, store), capability.__name__)
        self.assertTrue(verifyObject(IFleetSlotGate, store.slot_gate(lambda: None)))
        index = store.prefix_index(Pool(), lambda: None)
        self.assertTrue(verifyObject(IFleetPrefixIndex, index))

    def test_the_stores_of_one_process_and_of_a_worker_provide_none(self) -> None:
        shared = SharedCounts.create(1, 4)
        self.addCleanup(lambda: os.close(shared.fd))
        self.addCleanup(shared.close)
        relay = WorkerRelay(lambda message: None, Clock(), workers=1)
        for store in (LocalStore(), WorkerStore(shared, relay)):
            for capability in CAPABILITIES:
                self.assertFalse(capability.providedBy(store), capability.__name__)
                self.assertIsNone(capability(store, None))


def _named_store(node: ast.expr) -> str | None:
    """The name of a class named ``...Store`` that ``node`` (isinstance's second argument) is."""
    if isinstance(node, ast.Tuple):
        return next((name for name in map(_named_store, node.elts) if name), None)
    name = node.id if isinstance(node, ast.Name) else (
        node.attr if isinstance(node, ast.Attribute) else None)
    return name if name is not None and name.endswith("Store") else None


def store_class_checks(root: Path) -> list[str]:
    """Every ``isinstance(x, <a class named *Store>)`` (or ``issubclass``) under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
                name = _named_store(node.args[1])
                if name is not None:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {name}")
    return found


class NoClassChecksTests(SynchronousTestCase):
    def test_nothing_in_txlb_asks_a_store_its_class(self) -> None:
        """Ask the store for the part (``ISlotGates(store, None)``), never its class."""
        self.assertEqual(store_class_checks(Path(txlb.__file__).parent), [])

    def test_the_check_finds_one(self) -> None:
        root = Path(self.mktemp()) / "pkg"
        root.mkdir(parents=True)
        (root / "m.py").write_text(
            "if isinstance(store, RedisStore): pass\n"
            "if isinstance(s, (int, stores.EtcdStore)): pass\n"
            "if isinstance(levels, TokenLevels): pass\n")
        self.assertEqual(store_class_checks(root),
                         ["pkg/m.py:1: RedisStore", "pkg/m.py:2: EtcdStore"])
