"""
Making keys, and adding or revoking one in the keys file, as ``python -m txlb.keys`` and
the admin API (``POST /tenants/keys``, ``DELETE /tenants/keys/ID``) do.

The file is the operator's: it is edited as text, so its comments and layout stay -- an
added key is one ``[[keys]]`` entry appended, a revoked one is its ``[[keys]]`` entry cut
out -- and the result is parsed again before it replaces the file: an edit that would not
give exactly the keys intended (a file that writes its keys another way, as an inline
array) is refused, and the file is left as it was, for a hand edit.  The new file is
written beside the old one with mode 0600, flushed to disk and renamed over it, so a
reader (a reload, another replica) sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import os
import re
import secrets
import tempfile

from txlb._config.errors import ConfigError
from txlb._config.keys import TENANT_NAME, KeyEntry, KeysFile, parse_keys
from txlb._config.toml_file import loads, read_text

#: What every key txlb makes starts with: a secret scanner (or a person) can tell one.
KEY_PREFIX = "sk-txlb-"
_LABEL = re.compile(r"[\x20-\x7e]{0,64}")
_TABLE_LINE = re.compile(r"^\s*\[")


def new_key() -> str:
    """A new API key: 256 random bits, URL-safe, with :data:`KEY_PREFIX` (51 characters)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_entry(digest: str, tenant: str, label: str = "") -> str:
    """The ``[[keys]]`` entry of a key, as the keys file takes it (the digest, never the key)."""
    if not TENANT_NAME.fullmatch(tenant):
        raise ConfigError(f"tenant {tenant!r} is not a tenant name (1-64 letters, digits, "
                          "'_', '.', '-')")
    if not _LABEL.fullmatch(label):
        raise ConfigError("the label is not at most 64 printable ASCII characters")
    escaped = label.replace("\\", "\\\\").replace('"', '\\"')
    lines = ["[[keys]]", f'sha256 = "{digest}"', f'tenant = "{tenant}"']
    if label:
        lines.append(f'label = "{escaped}"')
    return "\n".join(lines) + "\n"


def add_key(path: str, digest: str, tenant: str, label: str = "") -> KeysFile:
    """Append the key of ``digest`` to the keys file at ``path``; the file as it is now."""
    text = read_text(path, "keys-file")
    before = _checked(path, text)
    if before.tenant(digest) is not None:
        raise ConfigError("that key is in the keys file already")
    separator = "" if not text or text.endswith("\n\n") else ("\n" if text.endswith("\n")
                                                             else "\n\n")
    edited = text + separator + key_entry(digest, tenant, label)
    after = _checked(path, edited)
    if len(after.keys) != len(before.keys) + 1 or after.tenant(digest) is None:
        raise ConfigError(f"{path} lists its keys in a way txlb does not edit; add the "
                          "entry by hand")
    _replace(path, edited)
    return after


def revoke_key(path: str, key_id: str) -> tuple[KeyEntry, KeysFile]:
    """
    Cut the key whose digest starts with ``key_id`` (8 hex digits at least, matching one
    key only) out of the keys file; the entry revoked and the file as it is now.
    """
    if not re.fullmatch(r"[0-9a-f]{8,64}", key_id):
        raise ConfigError("a key's id is 8 to 64 hex digits of its SHA-256, as the admin "
                          "API lists it")
    text = read_text(path, "keys-file")
    before = _checked(path, text)
    matches = [entry for entry in before.keys if entry.digest.startswith(key_id)]
    if not matches:
        raise LookupError(f"no key {key_id}")
    if len(matches) > 1:
        raise ConfigError(f"{len(matches)} keys start with {key_id}: give more digits")
    entry = matches[0]
    blocks = _blocks(text)
    kept = [block for block in blocks
            if not (block.lstrip().startswith("[[keys]]") and entry.digest in block)]
    edited = "".join(kept)
    after = _checked(path, edited)
    if len(after.keys) != len(before.keys) - 1 or after.tenant(entry.digest) is not None:
        raise ConfigError(f"{path} lists its keys in a way txlb does not edit; remove the "
                          "entry by hand")
    _replace(path, edited)
    return entry, after


def _blocks(text: str) -> list[str]:
    """``text`` cut before each line that opens a table (``[...]`` or ``[[...]]``)."""
    blocks: list[str] = []
    current: list[str] = []
    for line in text.splitlines(keepends=True):
        if _TABLE_LINE.match(line) and current:
            blocks.append("".join(current))
            current = []
        current.append(line)
    if current:
        blocks.append("".join(current))
    return blocks


def _checked(path: str, text: str) -> KeysFile:
    """``text`` parsed as the keys file (at ``path``) it is, or would become."""
    return parse_keys(path, loads(text, path, "keys-file"))


def _replace(path: str, text: str) -> None:
    """Write ``text`` to a file beside ``path`` (mode 0600), flush it, rename it over."""
    folder = os.path.dirname(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=".txlb-keys-")
    try:
        os.fchmod(descriptor, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
