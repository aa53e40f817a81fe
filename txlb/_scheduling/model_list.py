"""
``GET /v1/models`` answered from the pool: the models the healthy backends list, and the
aliases of ``[[routes]]``, in OpenAI's list shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from txlb._cluster.pool import Pool


def model_list(pool: Pool, aliases: Iterable[str],
               only: Sequence[str] | None = None) -> dict[str, object]:
    """
    The union over ``pool``'s healthy backends, and ``aliases``, in OpenAI's list shape (of
    the models in ``only``, when given: a tenant's).  An engine's own entry is kept as it
    listed it; its aliases are listed inside their model's entry, as the engine does.
    """
    entries: dict[str, dict[str, object]] = {}
    for backend in pool:
        if not backend.health.healthy:
            continue
        listed_aliases = backend.listing.aliases
        for model in backend.models or ():
            if model in listed_aliases:
                continue
            entry = backend.listing.entries.get(model) or {
                "id": model, "object": "model", "created": 0, "owned_by": "txlb"}
            entries.setdefault(model, dict(entry))
    for alias in aliases:
        entries.setdefault(alias, {"id": alias, "object": "model", "created": 0,
                                   "owned_by": "txlb"})
    names = sorted(entries) if only is None else sorted(set(entries) & set(only))
    return {"object": "list", "data": [entries[m] for m in names]}
