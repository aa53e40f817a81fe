"""
"No module writes another's state", checked so that it stays true.

Backend, Lease and Pool state changes only through their methods, and so does the state of a
backend's parts (``backend.health``, ``backend.counts``...): their fields are private
(``_active``...) behind read-only properties, which mypy enforces for public names.  This test
walks every module of ``txlb/`` and fails on what mypy cannot see:

* an assignment, augmented assignment or ``del`` of a *private* attribute of any object
  other than ``self``/``cls`` (``backend._active -= 1``), or of an item of one
  (``backend._responses[200] += 1``: the container is that object's state too), whether
  written as an assignment, a ``for``/``with`` target or a ``setattr`` (``object.__setattr__``);
* outside ``txlb/_cluster``, an assignment to a backend's, a part's or a lease's state by its
  public name on an expression that names a backend or a lease anywhere along it
  (``self.backend.counts.active -= 1``, ``backend.health = ...``), in case a setter is ever
  added back;

and checks that Backend, its parts and Lease declare no new public mutable field.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import attrs
from twisted.trial.unittest import SynchronousTestCase

from txlb._cluster.backend import Backend
from txlb._cluster.backend_counts import Counts
from txlb._cluster.backend_engine import EngineReading
from txlb._cluster.backend_health import Health
from txlb._cluster.backend_models import ModelListing
from txlb._cluster.backend_pace import Pace
from txlb._cluster.backend_verdicts import Verdicts
from txlb._cluster.slots import Lease
from txlb._cluster.slow_start import SlowStart

TXLB = Path(__file__).resolve().parents[2] / "txlb"

#: Writes of another object's private attribute that are meant: (module, target) -> why.
ALLOWED: dict[tuple[str, str], str] = {
    ("_compat.py", "port._logger"):
        "the compatibility module is the one place that touches Twisted's private attributes",
    ("_server/reactor.py", "conn._corked"):
        "conn is self, typed Any to reach tcp.Connection's attributes",
}

#: A backend's parts, by the Backend field that holds each (set once, at construction).
PARTS = {"health": Health, "verdicts": Verdicts, "counts": Counts, "pace": Pace,
         "engine": EngineReading, "listing": ModelListing, "slow_start": SlowStart}

#: Public fields Backend, its parts and Lease may keep: those set at construction and
#: changed, if at all, only by their own methods for a reload (``respecified``); a
#: policy's own state lives in the policy, keyed by backend.
PUBLIC_FIELDS: dict[type, set[str]] = {
    Backend: {"spec", *PARTS},
    Lease: {"backend"},
    SlowStart: {"clock"},
    **{part: set() for part in PARTS.values() if part is not SlowStart},
}


def _state_names() -> frozenset[str]:
    """
    What a backend, a part or a lease exposes read-only: every property of theirs, and
    the Backend fields that hold the parts.
    """
    return frozenset(
        name for cls in PUBLIC_FIELDS for name, value in vars(cls).items()
        if isinstance(value, property)
    ) | frozenset(PARTS)


def _names_cluster_object(node: ast.expr) -> bool:
    """
    Whether ``node`` reads like a backend, a lease or a part of one: a name along it says
    backend or lease (``backend``, ``self.lease.backend``, ``self.backend(key).health``).
    """
    names = []
    spine: ast.expr | None = node
    while spine is not None:  # down the chain it is read from, not into its arguments
        if isinstance(spine, ast.Attribute):
            names.append(spine.attr)
            spine = spine.value
        elif isinstance(spine, (ast.Call, ast.Subscript)):
            spine = spine.func if isinstance(spine, ast.Call) else spine.value
        else:
            names.append(getattr(spine, "id", ""))
            spine = None
    return any("backend" in name.lower() or "lease" in name.lower() for name in names)


def _setattr_call(node: ast.Call) -> bool:
    """``setattr(x, "_a", v)``, also spelled ``object.__setattr__`` or ``builtins.setattr``."""
    func = node.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    return name in ("setattr", "delattr", "__setattr__", "__delattr__")


def _stored(target: ast.expr) -> Iterator[ast.Attribute]:
    """
    The attributes a target writes: ``a.b = ...`` writes ``a.b``, and an item write
    (``a.b[k] = ...``, ``del a.b[k]``) writes into the container ``a.b`` too.
    """
    for sub in ast.walk(target):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            yield sub
        elif isinstance(sub, ast.Subscript) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            container = sub.value
            while isinstance(container, ast.Subscript):
                container = container.value
            if isinstance(container, ast.Attribute):
                yield container


def _written(tree: ast.AST) -> Iterator[tuple[int, ast.Attribute]]:
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor,
                               ast.comprehension)):
            targets = [node.target]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            targets = [item.optional_vars for item in node.items
                       if item.optional_vars is not None]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (isinstance(node, ast.Call) and _setattr_call(node) and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            yield node.lineno, ast.Attribute(value=node.args[0], attr=node.args[1].value)
            continue
        for target in targets:
            for sub in _stored(target):
                yield sub.lineno, sub


def violations(module: str, source: str) -> list[str]:
    """Every write into another object's state in ``source`` (the module ``module``)."""
    found = []
    in_cluster = module.startswith("_cluster/")
    state = _state_names()
    for line, target in _written(ast.parse(source)):
        owner = target.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        text = ast.unparse(target)
        if target.attr.startswith("_") and not target.attr.startswith("__"):
            if (module, text) not in ALLOWED:
                found.append(f"txlb/{module}:{line}: writes {text}, another object's private "
                             "state")
        elif not in_cluster and target.attr in state and _names_cluster_object(owner):
            found.append(f"txlb/{module}:{line}: writes {text}: use the Pool's, Backend's "
                         "or Lease's method")
    return found


def _modules() -> Iterator[tuple[str, str]]:
    for path in sorted(TXLB.rglob("*.py")):
        yield path.relative_to(TXLB).as_posix(), path.read_text(encoding="utf-8")


class StateOwnershipTests(SynchronousTestCase):
    def test_no_module_writes_another_objects_state(self) -> None:
        found = [v for module, source in _modules() for v in violations(module, source)]
        self.assertEqual(found, [])

    def test_every_allowance_is_still_needed(self) -> None:
        """An allowance whose write is gone must go too, or it would excuse the next one."""
        written = {
            (module, ast.unparse(target))
            for module, source in _modules()
            for _, target in _written(ast.parse(source))
        }
        self.assertEqual(set(ALLOWED) - written, set())

    def test_a_private_write_from_the_proxy_is_caught(self) -> None:
        source = (TXLB / "_proxy" / "resource.py").read_text(encoding="utf-8")
        self.assertEqual(violations("_proxy/resource.py", source), [])
        broken = source + "\n\ndef _release(backend):\n    backend._active -= 1\n"
        [found] = violations("_proxy/resource.py", broken)
        self.assertIn("writes backend._active, another object's private state", found)

    def test_private_writes_are_caught_however_written(self) -> None:
        for line in ("lease._released = True", "x.backend._healthy, y = False, 1",
                     "del pool._backends", "setattr(backend, '_draining', True)",
                     "pool._backends: dict = {}",
                     # writes into another object's private container
                     "backend._responses[200] += 1", "del pool._backends[key]",
                     "self.backend._responses[status] = 0", "pool._by_key[a][b] = None",
                     # other spellings of an assignment
                     "object.__setattr__(backend, '_active', 1)",
                     "builtins.setattr(backend, '_active', 1)",
                     "for backend._active in range(3): pass",
                     "with open(path) as lease._file: pass",
                     "[0 for backend._active in range(3)]"):
            self.assertEqual(len(violations("_admin/app.py", line + "\n")), 1, line)

    def test_a_public_state_write_outside_the_cluster_is_caught(self) -> None:
        for line in ("self.backend.counts.active -= 1", "lease.waited = 2.0",
                     "self.lease.backend.pace.last_byte = now", "backend.health.healthy = False",
                     # a part replaced whole, or reached through a call
                     "backend.health = Health()", "self.backend(key).engine.depth = 3.0",
                     "self.backends[0].counts.requests += 1"):
            [found] = violations("_proxy/exchange.py", line + "\n")
            self.assertIn("use the Pool's, Backend's or Lease's method", found)

    def test_own_state_and_unrelated_objects_are_left_alone(self) -> None:
        source = ("self._active = 1\ncls._count += 1\nrecord.backend = key\n"
                  "stats.requests += 1\nself.backend = backend\nself._counts[key] += 1\n"
                  "del self._waiting[0]\nobject.__setattr__(self, '_frozen', 1)\n"
                  "record.fields['x'] = 1\nbackends[key] = backend\n"
                  # a backend named in an index or an argument is not what is written
                  "tallies[backend.key].requests += 1\nrows(backend).active = 0\n")
        self.assertEqual(violations("_proxy/resource.py", source), [])

    def test_backend_part_and_lease_state_is_private(self) -> None:
        """A new field is private, with a read-only property, unless it is listed here."""
        for cls, allowed in PUBLIC_FIELDS.items():
            public = {field.name for field in attrs.fields(cls)
                      if not field.name.startswith("_")}
            self.assertEqual(public - allowed, set(), cls.__name__)

    def test_state_is_read_only_from_outside(self) -> None:
        from txlb._config import BackendSpec

        backend = Backend(BackendSpec("127.0.0.1", 8002))
        for part, name in (("counts", "active"), ("health", "healthy"), ("health", "draining"),
                           ("pace", "last_byte"), ("engine", "depth"),
                           ("verdicts", "errors_in_a_row"), ("listing", "names"),
                           ("slow_start", "up_since")):
            with self.assertRaises(AttributeError):
                setattr(getattr(backend, part), name, 1)

    def test_a_backend_keeps_its_parts(self) -> None:
        """A part is changed by its methods, never swapped for another (it is set once)."""
        from txlb._config import BackendSpec

        backend = Backend(BackendSpec("127.0.0.1", 8002))
        for name, part in PARTS.items():
            with self.assertRaises(AttributeError):
                setattr(backend, name, part())
