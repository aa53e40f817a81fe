"""
The models a backend said it serves: :class:`ModelListing`, its ``/v1/models`` as learned.

:func:`txlb._cluster.models.learn` bounds what one answer teaches; this keeps the result
for the router (which backends serve a model, what ``GET /v1/models`` lists) until the
next answer replaces it.  A configured model list overrides it
(:attr:`txlb._cluster.backend.Backend.models`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from txlb._cluster.models import aliases_of


@attrs.define(eq=False)
class ModelListing:
    """One backend's learned model names and entries; read-only from outside."""

    #: every name served (ids and aliases); ``None`` until its ``/v1/models`` answered
    _names: tuple[str, ...] | None = None
    #: the ``/v1/models`` entries kept, by model id
    _entries: dict[str, dict[str, object]] = attrs.field(factory=dict)

    def learned(self, entries: dict[str, dict[str, object]], ids: tuple[str, ...]) -> None:
        """Its ``/v1/models`` answer: the entries kept and every name served."""
        self._entries = entries
        self._names = ids

    def shared(self) -> dict[str, Any]:
        """Its part of :data:`txlb._cluster.backend.SHARED_FIELDS`, JSON-ready."""
        names = self._names
        return {"learned_models": None if names is None else list(names),
                "model_entries": self._entries}

    def mirror(self, state: Mapping[str, Any]) -> None:
        """Take the supervisor's :meth:`shared` part."""
        names = state["learned_models"]
        self._names = None if names is None else tuple(names)
        self._entries = state["model_entries"]

    @property
    def names(self) -> tuple[str, ...] | None:
        return self._names

    @property
    def entries(self) -> dict[str, dict[str, object]]:
        return self._entries

    @property
    def aliases(self) -> frozenset[str]:
        """
        Names the backend's ``/v1/models`` lists as ``aliases`` of a model (llama.cpp's
        ``--alias``) that are not model ids themselves: served, but not entries of their own.
        """
        names = {alias for entry in self._entries.values() for alias in aliases_of(entry)}
        return frozenset(names - set(self._entries))
