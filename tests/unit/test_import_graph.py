"""
No module imports another that imports it back, counted the strict way.

The graph is built from the source (``ast``), not from what Python happens to load: an
import under ``if TYPE_CHECKING:`` and an import inside a function are arrows too, since
hiding one there leaves the two modules as tangled as before -- only the error moves to
run time.  Every ``.py`` of ``txlb/`` and ``bench/`` is a node; an import of a package is
an arrow to its ``__init__.py``, and ``from package import name`` is an arrow to
``package/name.py`` when that is a module.  A circle is a strongly connected set of more
than one module (Tarjan's algorithm); the test names each with the imports that tie it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("txlb", "bench")


def modules() -> dict[str, Path]:
    """Every module of the measured packages, by dotted name."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(tree: ast.Module, name: str, is_package: bool) -> Iterator[tuple[str, int]]:
    """Every dotted name ``name``'s source imports, anywhere in it, with its line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            yield source, node.lineno
            for alias in node.names:
                yield f"{source}.{alias.name}", node.lineno


def graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}."""
    known = modules()
    arrows: dict[str, dict[str, int]] = {name: {} for name in known}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        for target, line in _imported(tree, name, path.name == "__init__.py"):
            # the longest known module the dotted name starts with
            parts = target.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts and ".".join(parts) != name:
                arrows[name].setdefault(".".join(parts), line)
    return arrows


def circles(arrows: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(arrows):
        if start in index:
            continue
        work = [(start, iter(sorted(arrows[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(arrows[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


class ImportGraphTests(SynchronousTestCase):

    def test_no_module_imports_another_that_imports_it_back(self) -> None:
        arrows = graph()
        described = []
        for members in circles(arrows):
            ties = [f"{a} -> {b} (line {arrows[a][b]})"
                    for a in members for b in members if b in arrows[a]]
            described.append(ties)
        self.assertEqual(described, [])

    def test_a_hidden_import_is_an_arrow(self) -> None:
        """The check sees what TYPE_CHECKING and function bodies hide (or it proves nothing)."""
        tree = ast.parse("from typing import TYPE_CHECKING\n"
                         "if TYPE_CHECKING:\n    from txlb._balancer import LoadBalancer\n"
                         "def f():\n    from . import sibling\n")
        found = {target for target, _ in _imported(tree, "txlb._x.y", False)}
        self.assertIn("txlb._balancer.LoadBalancer", found)
        self.assertIn("txlb._x.sibling", found)

    def test_a_circle_is_found(self) -> None:
        arrows = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
        self.assertEqual(circles(arrows), [["a", "b", "c"]])

    def test_the_graph_holds_the_package(self) -> None:
        arrows = graph()
        self.assertIn("txlb._reload", arrows["txlb._balancer"])
        self.assertGreater(sum(len(targets) for targets in arrows.values()), 100)
