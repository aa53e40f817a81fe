"""
What the admin API does with tenants and keys (``--auth keys``): list the tenants (never a
key: each key by the first 8 hex digits of its SHA-256 and its label), make and add a key,
revoke one.  Adding and revoking edit the keys file (:mod:`txlb._config.keys_edit`: as
text, atomically, mode 0600) and then reload, as ``POST /reload`` does, so the change is in
force when the answer comes; a request admitted before keeps its tenant (a revoked key's
stream finishes).  With ``--shared-state`` a revoked key is also told to the fleet, whose
replicas refuse it within a second (:mod:`txlb._shared.fair`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from txlb._admin.answers import AdminError
from txlb._config.errors import ConfigError
from txlb._config.keys_edit import add_key, new_key, revoke_key

log = Logger()

#: The fields ``POST /tenants/keys`` takes.
ADD_FIELDS = ("tenant", "label")


class TenantKeys:
    """The tenants' listing and key changes, given where the keys file is and how to reload."""

    def __init__(self, listing: Callable[[], dict[str, object]],
                 keys_file: Callable[[], str | None],
                 reload: Callable[[], Deferred[int]] | None,
                 announce_revoked: Callable[[str], object] = lambda digest: None) -> None:
        self._listing = listing
        #: tells the fleet (``--shared-state``) a key's digest is revoked
        self._announce_revoked = announce_revoked
        self._keys_file = keys_file
        self._reload = reload

    def listing(self) -> dict[str, object]:
        """``GET /tenants``: each tenant, its keys' ids and labels, its fair-share counter."""
        return self._listing()

    def _path(self) -> str:
        path = self._keys_file()
        if path is None:
            raise AdminError(409, "tenants need --auth keys and a --keys-file")
        return path

    def add(self, fields: dict[str, Any]) -> Deferred[dict[str, object]]:
        """``POST /tenants/keys``: a new key for ``fields["tenant"]``, shown this once."""
        unknown = sorted(set(fields) - set(ADD_FIELDS))
        if unknown:
            raise AdminError(400, f"unknown field {unknown[0]!r}; a key takes "
                                  f"{', '.join(ADD_FIELDS)}")
        tenant, label = fields.get("tenant"), fields.get("label", "")
        if not isinstance(tenant, str) or not isinstance(label, str):
            raise AdminError(400, "'tenant' (and 'label', if given) must be strings")
        path = self._path()
        key = new_key()
        digest = hashlib.sha256(key.encode("ascii")).hexdigest()
        try:
            add_key(path, digest, tenant, label)
        except ConfigError as error:
            raise AdminError(400, str(error)) from None
        log.info("key {id} of tenant {tenant} added through the admin API", id=digest[:8],
                 tenant=tenant)
        return self._reloaded({"key": key, "id": digest[:8], "tenant": tenant,
                               "label": label})

    def revoke(self, key_id: str) -> Deferred[dict[str, object]]:
        """``DELETE /tenants/keys/ID``: the key whose digest starts with ``ID`` is revoked."""
        path = self._path()
        try:
            entry, _ = revoke_key(path, key_id.lower())
        except LookupError as error:
            raise AdminError(404, str(error)) from None
        except ConfigError as error:
            raise AdminError(400, str(error)) from None
        log.info("key {id} of tenant {tenant} revoked through the admin API",
                 id=entry.digest[:8], tenant=entry.tenant)
        self._announce_revoked(entry.digest)
        return self._reloaded({"revoked": entry.digest[:8], "tenant": entry.tenant,
                               "label": entry.label})

    def _reloaded(self, answer: dict[str, object]) -> Deferred[dict[str, object]]:
        """``answer`` once the reload that applies the edited file is done (or refused)."""
        if self._reload is None:
            return succeed({**answer, "reloaded": False})

        def applied(generation: int) -> dict[str, object]:
            return {**answer, "reloaded": True, "generation": generation}

        def refused(failure: Failure) -> dict[str, object]:
            failure.trap(ConfigError)
            # the file is edited: say so, and why the balancer runs the old keys still
            return {**answer, "reloaded": False, "reload_error": str(failure.value)}

        return self._reload().addCallbacks(applied, refused)
