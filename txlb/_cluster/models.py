"""
What a backend's ``/v1/models`` answer teaches: the names it serves, within bounds.

A backend's model list is the backend's to write, so it is read defensively: only so many
names, none too long (each is matched per request and listed in every 404), and the
``aliases`` of an entry only where they are non-empty strings.  :func:`learn` is pure; the
:class:`~txlb._cluster.pool.Pool` stores its result on the backend and says what was dropped.
"""

from __future__ import annotations

import attrs

#: The most model names (ids and aliases) learned from one backend, and their longest: a
#: backend's /v1/models may be 4 MiB, and every name is matched per request and listed in
#: every 404 (200,000 aliases made each 404 3 MB and each request 1 ms slower).
MAX_MODEL_NAMES = 1000
MAX_MODEL_NAME = 512


def aliases_of(entry: dict[str, object]) -> list[str]:
    """The ``aliases`` of one ``/v1/models`` entry: its non-empty strings, nothing else."""
    aliases = entry.get("aliases")
    if not isinstance(aliases, list):
        return []
    return [alias for alias in aliases if isinstance(alias, str) and alias]


@attrs.frozen
class Learned:
    """The entries kept (by id), every name served (ids and aliases), and how many were not."""

    entries: dict[str, dict[str, object]]
    names: tuple[str, ...]
    dropped: int


def learn(entries: list[dict[str, object]]) -> Learned:
    """
    The names a ``/v1/models`` answer serves -- each model's id and its ``aliases``
    (llama.cpp lists them; a client may ask for any) -- ids first, at most
    :data:`MAX_MODEL_NAMES` of at most :data:`MAX_MODEL_NAME` characters.
    """
    names: dict[str, None] = {}
    dropped = 0

    def keep(name: str) -> bool:
        nonlocal dropped
        if name in names:
            return True
        if len(name) > MAX_MODEL_NAME or len(names) >= MAX_MODEL_NAMES:
            dropped += 1
            return False
        names[name] = None
        return True

    kept = {}
    for entry in entries:
        if "id" in entry and keep(str(entry["id"])):
            kept[str(entry["id"])] = entry
    for model_id, entry in kept.items():
        aliases = aliases_of(entry)
        listed = [alias for alias in aliases if keep(alias)]
        if len(listed) < len(aliases):
            kept[model_id] = {**entry, "aliases": listed}  # what GET /v1/models shows
    return Learned(kept, tuple(names), dropped)
