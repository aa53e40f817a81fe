"""
One results page written by several benches: each owns a named section of it.

``bench/results/scale-out.md`` gathers the fleet-balance runs (``python -m bench.policies
--replicas``) and the fleet's cache index runs (``python -m bench.prefix --scale-out``);
each rewrites only its own section, between ``<!-- begin NAME -->`` and ``<!-- end NAME
-->``, so rerunning one keeps the other's figures.
"""

from __future__ import annotations

from pathlib import Path

#: the title ``bench/results/scale-out.md`` is made with, by whichever bench writes first
SCALE_OUT_TITLE = "Scale-out: several txlb replicas in front of one fleet (simulation)"


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- begin {name} -->", f"<!-- end {name} -->"


def replace_section(path: Path, name: str, text: str, title: str) -> None:
    """Put ``text`` as section ``name`` of the page at ``path`` (made with ``title``)."""
    begin, end = _markers(name)
    block = f"{begin}\n{text.rstrip()}\n{end}"
    page = path.read_text() if path.exists() else f"# {title}\n"
    start = page.find(begin)
    stop = page.find(end)
    if start >= 0 and stop > start:
        page = page[:start] + block + page[stop + len(end):]
    else:
        page = page.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)


def section(path: Path, name: str) -> str | None:
    """Section ``name`` of the page at ``path``, without its markers (None if absent)."""
    if not path.exists():
        return None
    page = path.read_text()
    begin, end = _markers(name)
    start, stop = page.find(begin), page.find(end)
    if start < 0 or stop < start:
        return None
    return page[start + len(begin):stop].strip("\n")
